"""The checkpoint store: round trips, atomic visibility, corruption detection, retention."""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from shoal.scheduler.devices import Device
from shoal.workers import checkpoints
from shoal.workers.blocks import Block
from shoal.workers.checkpoints import MANIFEST, CheckpointError, CheckpointStore
from shoal.workers.snapshot import OptimizerConf, StagePlan

pytestmark = pytest.mark.unit

ADAM = OptimizerConf("adamw", 0.01, {"betas": (0.9, 0.99)})
DEVICE = Device("abcd1234-cpu-0", "abcd1234" * 4, 0, "cpu", 2048, gpu=False)


def trained_blocks(count: int = 4) -> list[Block]:
    torch.manual_seed(0)
    blocks = [Block(i, nn.Linear(3, 3), ADAM) for i in range(count)]
    x = torch.randn(2, 3)
    for block in blocks:
        x = block.module(x)
    x.sum().backward()
    for block in blocks:
        block.step()
    return blocks


def states(blocks: list[Block]) -> dict[int, dict[str, Any]]:
    return {block.index: block.state() for block in blocks}


def assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    else:
        assert a == b


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    """A store in a local directory, and one at an fsspec URL (an in-memory file system,
    standing for an object store: no rename, no fsync)."""
    if request.param == "local":
        yield CheckpointStore(tmp_path / "ckpt")
        return
    root = f"memory://ckpt-{uuid.uuid4().hex}"
    yield CheckpointStore(root)
    if files(root).exists(root):
        files(root).rm(root, recursive=True)


def files(path: str) -> Any:
    return fsspec.core.url_to_fs(path)[0]


def join(*parts: str) -> str:
    return "/".join(parts)


def names(path: str) -> list[str]:
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in files(path).ls(path, detail=False))


def read(path: str) -> bytes:
    data: bytes = files(path).cat_file(path)
    return data


def write(path: str, data: bytes) -> None:
    with fsspec.open(path, "wb") as file:
        file.write(data)


def test_round_trip(store: CheckpointStore) -> None:
    blocks = trained_blocks()
    layout = {"stages": [[0, 2], [2, 4]], "seed": 7, "model": {"builtin": "mlp", "hidden": 3}}
    info = store.write("job-1", 42, states(blocks), layout)
    assert info.step == 42 and info.job_id == "job-1"
    assert info.path == join(store.root, "job-1", "step-00000042")
    assert names(info.path) == [
        *(f"block-0000{i}.pt" for i in range(4)),
        MANIFEST,
    ]
    manifest, read = store.read("job-1", 42)
    assert manifest["layout"] == layout and manifest["step"] == 42
    assert manifest["job_id"] == "job-1" and manifest["created_at"] == info.created_at
    assert info.nbytes == sum(f["bytes"] for f in manifest["files"].values()) > 0
    assert_same_state(read, states(blocks))


def test_states_restore_into_blocks_under_another_partition(store: CheckpointStore) -> None:
    # Written by two stages of two blocks, read back by one stage holding all four.
    blocks = trained_blocks()
    store.write("job", 5, states(blocks[:2]) | states(blocks[2:]), {"stages": [[0, 2], [2, 4]]})
    _, read = store.read("job", 5)
    fresh = [Block(i, nn.Linear(3, 3), ADAM) for i in range(4)]
    for block in fresh:
        block.load(read[block.index])
    assert_same_state(states(fresh), states(blocks))


def test_a_layout_may_hold_the_workers_dataclasses(store: CheckpointStore) -> None:
    plan = StagePlan(0, (0, 4), DEVICE)
    store.write("job", 1, states(trained_blocks(1)), {"stages": [plan]})
    manifest, _ = store.read("job", 1)
    assert manifest["layout"]["stages"][0]["device"]["kind"] == "cpu"
    assert manifest["layout"]["stages"][0]["blocks"] == [0, 4]


def test_a_layout_that_is_not_json_is_refused_before_writing(store: CheckpointStore) -> None:
    with pytest.raises(ValueError, match="cannot be stored as JSON"):
        store.write("job", 1, states(trained_blocks(1)), {"x": object()})
    assert store.list("job") == []


def test_listing_orders_by_step_and_latest_is_the_newest(store: CheckpointStore) -> None:
    assert store.list("job") == [] and store.latest("job") is None
    one = states(trained_blocks(1))
    for step in (30, 4, 100_000_000):
        store.write("job", step, one, {})
    assert [info.step for info in store.list("job")] == [4, 30, 100_000_000]
    latest = store.latest("job")
    assert latest is not None and latest.step == 100_000_000
    assert store.list("other-job") == []


def test_rewriting_a_step_replaces_it(store: CheckpointStore) -> None:
    store.write("job", 3, states(trained_blocks(2)), {"attempt": 1})
    store.write("job", 3, states(trained_blocks(1)), {"attempt": 2})
    manifest, read = store.read("job", 3)
    assert manifest["layout"] == {"attempt": 2} and list(read) == [0]
    assert names(join(store.root, "job")) == ["step-00000003"]


def test_debris_of_a_crashed_write_is_never_listed(store: CheckpointStore) -> None:
    store.write("job", 1, states(trained_blocks(1)), {})
    job_dir = join(store.root, "job")
    # A write that died before its rename: everything but the rename done.
    crashed = join(job_dir, ".tmp-step-00000002-0123456789abcdef")
    files(crashed).makedirs(crashed, exist_ok=True)
    write(join(crashed, "block-00000.pt"), b"partial")
    write(join(crashed, MANIFEST), b"{}")
    # A step directory without a manifest (not made by this store, or half moved in).
    files(job_dir).makedirs(join(job_dir, "step-00000003"), exist_ok=True)
    write(join(job_dir, "step-00000003", "block-00000.pt"), b"x")
    assert [info.step for info in store.list("job")] == [1]
    with pytest.raises(CheckpointError, match=r"no complete checkpoint at step 3; .*\[1\]"):
        store.read("job", 3)


def test_a_checkpoint_appears_only_with_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    seen: list[list[int]] = []
    fsync_dir = checkpoints._fsync_dir

    def watching(path: str) -> None:
        seen.append([info.step for info in store.list("job")])
        fsync_dir(path)

    monkeypatch.setattr(checkpoints, "_fsync_dir", watching)
    store.write("job", 7, states(trained_blocks(2)), {})
    # Every fsync of a directory before the rename sees nothing; the last, after it, sees it.
    assert len(seen) >= 2 and seen[:-1] == [[]] * (len(seen) - 1) and seen[-1] == [7]


def test_in_an_object_store_a_checkpoint_appears_only_with_its_manifest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No rename there: block files move into place first, the manifest last; a rewrite
    hides the old checkpoint (its manifest first) before the new one moves in."""
    root = f"memory://ckpt-{uuid.uuid4().hex}"
    store = CheckpointStore(root)
    store.write("job", 7, states(trained_blocks(1)), {"attempt": 1})
    fs = files(root)
    seen: list[tuple[str, list[int]]] = []
    move = fs.mv

    def watching(source: str, target: str, **kwargs: Any) -> None:
        seen.append((target.rsplit("/", 1)[-1], [i.step for i in store.list("job")]))
        move(source, target, **kwargs)

    monkeypatch.setattr(fs, "mv", watching)
    store.write("job", 7, states(trained_blocks(2)), {"attempt": 2})
    assert seen == [("block-00000.pt", []), ("block-00001.pt", []), (MANIFEST, [])]
    manifest, blocks = store.read("job", 7)
    assert manifest["layout"] == {"attempt": 2} and sorted(blocks) == [0, 1]
    fs.rm(root, recursive=True)


def test_a_failing_write_leaves_nothing_behind(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write("job", 1, states(trained_blocks(1)), {})

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.write("job", 2, states(trained_blocks(1)), {})
    assert names(join(store.root, "job")) == ["step-00000001"]


def test_an_unreadable_manifest_is_skipped_in_listings(store: CheckpointStore) -> None:
    one = states(trained_blocks(1))
    store.write("job", 1, one, {})
    bad = store.write("job", 2, one, {})
    write(join(bad.path, MANIFEST), b"{not json")
    assert [info.step for info in store.list("job")] == [1]
    with pytest.raises(CheckpointError, match=r"manifest\.json is corrupt"):
        store.read("job", 2)


def test_a_flipped_byte_is_detected(store: CheckpointStore) -> None:
    info = store.write("job", 1, states(trained_blocks(2)), {})
    target = join(info.path, "block-00001.pt")
    data = bytearray(read(target))
    data[len(data) // 2] ^= 0x01
    write(target, bytes(data))
    with pytest.raises(CheckpointError, match=r"block-00001\.pt does not match its checksum"):
        store.read("job", 1)


def test_a_truncated_file_is_detected(store: CheckpointStore) -> None:
    info = store.write("job", 1, states(trained_blocks(2)), {})
    target = join(info.path, "block-00000.pt")
    data = read(target)
    size = len(data)
    write(target, data[:-10])
    with pytest.raises(CheckpointError, match=rf"\({size - 10} bytes, expected {size}\)"):
        store.read("job", 1)


def test_a_missing_block_file_is_detected(store: CheckpointStore) -> None:
    info = store.write("job", 1, states(trained_blocks(2)), {})
    files(info.path).rm_file(join(info.path, "block-00001.pt"))
    with pytest.raises(CheckpointError, match="is missing"):
        store.read("job", 1)


def test_a_manifest_cannot_point_outside_its_checkpoint(store: CheckpointStore) -> None:
    info = store.write("job", 1, states(trained_blocks(1)), {})
    path = join(info.path, MANIFEST)
    manifest = json.loads(read(path))
    manifest["files"]["../../../etc/passwd"] = {"sha256": "0", "bytes": 1}
    write(path, json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="not a block file"):
        store.read("job", 1)


def test_a_newer_format_is_refused(store: CheckpointStore) -> None:
    info = store.write("job", 1, states(trained_blocks(1)), {})
    path = join(info.path, MANIFEST)
    write(path, json.dumps(json.loads(read(path)) | {"format_version": 99}).encode())
    with pytest.raises(CheckpointError, match="format version 99"):
        store.read("job", 1)


def test_retention_keeps_the_newest(store: CheckpointStore) -> None:
    one = states(trained_blocks(1))
    for step in (10, 20, 30, 40):
        store.write("job", step, one, {})
    assert store.retain("job", 2) == [10, 20]
    assert [info.step for info in store.list("job")] == [30, 40]
    assert names(join(store.root, "job")) == ["step-00000030", "step-00000040"]
    assert store.retain("job", 5) == []
    assert store.retain("job", 3) == []  # more kept than there are: none deleted
    assert store.retain("job", 0) == [30, 40]
    assert store.list("job") == []
    with pytest.raises(ValueError, match=r"keep \(-1\) must be >= 0"):
        store.retain("job", -1)


@pytest.mark.parametrize(
    "job_id", ["", ".", "..", "../x", "a/b", "/abs", ".hidden", "a\\b", "a\0b", "job\n"]
)
def test_job_ids_that_could_escape_the_root_are_refused(
    store: CheckpointStore, job_id: str
) -> None:
    with pytest.raises(ValueError, match="cannot name a checkpoint directory"):
        store.write(job_id, 1, states(trained_blocks(1)), {})
    with pytest.raises(ValueError, match="cannot name a checkpoint directory"):
        store.list(job_id)
    assert not files(store.root).exists(store.root)


@pytest.mark.parametrize(("step", "blocks"), [(-1, {0: {}}), (1, {}), (1, {-2: {}})])
def test_bad_steps_and_block_indices_are_refused(
    store: CheckpointStore, step: int, blocks: dict[int, dict[str, Any]]
) -> None:
    with pytest.raises(ValueError, match="needs a step >= 0"):
        store.write("job", step, blocks, {})


@pytest.mark.unit
def test_checkpoints_are_private_to_the_services_user(tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual umask: everyone could read what it does not restrict
    try:
        root = tmp_path / "state" / "checkpoints"
        store = CheckpointStore(root)
        store.write("job-1", 3, states(trained_blocks(2)), {"stages": []})
    finally:
        os.umask(old)
    step = root / "job-1" / "step-00000003"
    made = [tmp_path / "state", root, root / "job-1", step]
    assert {str(d): stat.S_IMODE(d.stat().st_mode) for d in made} == dict.fromkeys(
        map(str, made), 0o700
    )
    files = sorted(step.iterdir())
    assert len(files) == 3  # two blocks and the manifest
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o600 for f in files}
