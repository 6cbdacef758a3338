"""A spec with uploaded code is checked in a Ray worker process of its own, under limits:
what the code says when it fails is the spec's 422 message, a check that runs too long or
allocates too much is stopped, and none of it is imported by the process that asked."""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import pytest

from shoal.service.cluster import connect_ray
from shoal.service.code_archive import pack_directory
from shoal.service.code_checks import CodeChecks
from shoal.service.code_store import CodeStore
from shoal.service.spec_errors import SpecError
from shoal.service.specs import validate_job_spec
from tests.factories import job_spec

pytestmark = pytest.mark.integration

CHECKY = """import os
import time
from pathlib import Path

from torch import nn


def mlp(config, meta):
    if config.get("fail"):
        raise ValueError("width must be even, got 7")
    if config.get("sleep_s"):
        time.sleep(config["sleep_s"])
    if config.get("hog_mb"):
        bytearray(config["hog_mb"] * 2**20)  # not a tensor: traced on the meta device
    Path(config["pid_file"]).write_text(str(os.getpid()))
    return [nn.Linear(meta.input_shape[0], 8), nn.Linear(8, meta.targets)]
"""


@pytest.fixture
def uploaded(tmp_path: Path, ray_address: str) -> tuple[CodeChecks, str]:
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "checky.py").write_text(CHECKY)
    store = CodeStore(tmp_path / "code", 10**6)
    digest = store.put(pack_directory(folder)).digest
    checks = CodeChecks(store, partial(connect_ray, ray_address), 60.0, 512 * 2**20)
    return checks, digest


def spec(digest: str, **config: object) -> dict[str, object]:
    return job_spec(
        name="checky",
        code=digest,
        model={"factory": "code:checky:mlp", "config": config},
        data={"builtin": "digits", "config": {"images": False}},
    )


def test_a_spec_with_code_is_traced_in_a_ray_worker_never_here(
    uploaded: tuple[CodeChecks, str], tmp_path: Path
) -> None:
    checks, digest = uploaded
    pid_file = tmp_path / "built-by"
    accepted = validate_job_spec(spec(digest, pid_file=str(pid_file)), [], checks)
    assert accepted.num_blocks == 2 and accepted.costs is not None
    assert int(pid_file.read_text()) != os.getpid()
    assert "checky" not in sys.modules


def test_what_the_code_raises_is_the_specs_error(uploaded: tuple[CodeChecks, str]) -> None:
    checks, digest = uploaded
    with pytest.raises(SpecError) as failed:
        validate_job_spec(spec(digest, fail=True, pid_file="-"), [], checks)
    assert failed.value.errors[0][0] == "model.factory"
    assert "width must be even, got 7" in failed.value.errors[0][1]


def test_a_check_past_its_time_or_memory_is_stopped(
    uploaded: tuple[CodeChecks, str], tmp_path: Path
) -> None:
    checks, digest = uploaded
    hurried = CodeChecks(checks.store, checks.connect, timeout_s=8.0, memory_bytes=2**30)
    with pytest.raises(SpecError) as slow:
        validate_job_spec(spec(digest, sleep_s=60, pid_file="-"), [], hurried)
    assert slow.value.errors == [
        (
            "code",
            "checking the code took over 8 s (SHOAL_CODE_CHECK_TIMEOUT_S): does building the"
            " model or its data do more than build them?",
        )
    ]
    with pytest.raises(SpecError) as greedy:
        validate_job_spec(spec(digest, hog_mb=2048, pid_file="-"), [], checks)
    field, message = greedy.value.errors[0]
    assert field == "model.factory" and "MemoryError" in message, greedy.value.errors
