"""A job's model out of Shoal: ``GET /jobs/{id}/model`` and ``shoal export`` give one
safetensors file that loads into the same model built in plain PyTorch, with the
parameters of the run (a two-stage pipeline) equal to the single-process reference's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load

from shoal.api.app import create_app
from shoal.service.cli import cli
from shoal.service.db.models import Job
from shoal.service.server import serving
from shoal.service.snapshots import build_snapshot
from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.model_file import FORMAT
from shoal.workers.zoo.whole import build_model
from tests.api.conftest import Api
from tests.api.trained import JOBS, trained
from tests.factories import device, job_spec
from tests.workers.runs import reference


def test_the_model_loads_into_the_plain_pytorch_model_with_the_runs_parameters(api: Api) -> None:
    job_id, spec = trained(api)
    r = api.client.get(f"{JOBS}/{job_id}/model", headers=api.token("alice"))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert f"{job_id}-step-20.safetensors" in r.headers["content-disposition"]
    model = build_model(spec["model"], spec["data"])
    model.load_state_dict(load(r.content))  # strict: every name, nothing else
    with api.factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        snap = build_snapshot(
            job, [device()], [(0, job.num_blocks)], checkpoint_root="-", allowed_factories=()
        )
    expected = {
        f"{block.index}.{name}": tensor
        for block in reference(snap).blocks
        for name, tensor in block.module.state_dict().items()
    }
    actual = model.state_dict()
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.allclose(actual[name], tensor, rtol=1e-5, atol=1e-6), name


def test_a_step_picks_its_checkpoint_and_the_metadata_says_what_the_file_is(
    api: Api, tmp_path: Path
) -> None:
    job_id, spec = trained(api)
    r = api.client.get(f"{JOBS}/{job_id}/model?step=10", headers=api.token("alice"))
    assert r.status_code == 200, r.text
    path = tmp_path / "model.safetensors"
    path.write_bytes(r.content)
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        names = set(file.keys())
    assert metadata["format"] == FORMAT and metadata["job_id"] == job_id
    assert metadata["step"] == "10"
    # The sections as accepted: the spec's, with the defaults it left out filled in.
    model, data = json.loads(metadata["model"]), json.loads(metadata["data"])
    assert model["builtin"] == spec["model"]["builtin"]
    assert spec["model"]["config"].items() <= model["config"].items()
    assert data["builtin"] == spec["data"]["builtin"]
    build_model(model, data).load_state_dict(load(r.content))
    _, blocks = CheckpointStore(api.settings.resolved_checkpoint_root).read(job_id, 10)
    stored = {f"{i}.{n}": t for i, s in blocks.items() for n, t in s["module"].items()}
    assert names == set(stored)
    tensors = load(r.content)
    assert all(torch.equal(tensors[n], t) for n, t in stored.items())


def test_a_missing_step_another_users_job_and_a_job_without_checkpoints_are_refused(
    api: Api,
) -> None:
    job_id, _ = trained(api)
    alice = api.token("alice")
    r = api.client.get(f"{JOBS}/{job_id}/model?step=7", headers=alice)
    assert r.status_code == 404
    assert (
        r.json()["detail"] == f"job {job_id} has no checkpoint at step 7; its checkpoints: [10, 20]"
    )
    r = api.client.get(f"{JOBS}/{job_id}/model", headers=api.token("bob"))
    assert r.status_code == 404 and r.json()["detail"] == f"no job '{job_id}'"
    fresh = api.client.post(JOBS, json=job_spec(), headers=alice).json()["id"]
    r = api.client.get(f"{JOBS}/{fresh}/model", headers=alice)
    assert r.status_code == 409 and "has no checkpoint yet" in r.json()["detail"]
    r = api.client.get(f"{JOBS}/{job_id}/model?step=-1", headers=alice)
    assert r.status_code == 422 and "step" in r.text


@pytest.fixture
def url(api: Api) -> Any:
    """The API on a real socket, for the CLI."""
    with serving(create_app(api.settings, api.factory)) as served:
        yield served


def test_shoal_export_writes_the_file_whole(
    api: Api, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, spec = trained(api)
    monkeypatch.setenv("SHOAL_URL", url)
    monkeypatch.setenv("SHOAL_TOKEN", api.token("alice")["Authorization"].split()[1])
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["export", job_id])
    assert result.exit_code == 0, result.output
    default = tmp_path / f"{job_id}-step-20.safetensors"
    assert f"wrote {default.name}" in result.output
    model = build_model(spec["model"], spec["data"])
    model.load_state_dict(load(default.read_bytes()))
    out = tmp_path / "out" / "m.safetensors"
    result = CliRunner().invoke(cli, ["export", job_id, "--step", "10", "-o", str(out)])
    assert result.exit_code == 2 and "-o/--output" in result.output  # no such folder
    out.parent.mkdir()
    result = CliRunner().invoke(cli, ["export", job_id, "--step", "10", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with safe_open(str(out), framework="pt") as file:
        assert file.metadata()["step"] == "10"
    result = CliRunner().invoke(cli, ["export", job_id, "--step", "3", "-o", str(out)])
    assert result.exit_code == 1 and "its checkpoints: [10, 20]" in result.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.safetensors"]  # no part left
