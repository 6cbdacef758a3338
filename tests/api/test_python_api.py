"""``import shoal``: jobs and sweeps from Python over a real server socket, with the CLI's
errors; a trained job's metrics, events, checkpoints and model."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

import shoal
from shoal.api.app import create_app
from shoal.service.server import serving
from shoal.workers.zoo.whole import build_model
from tests.api.conftest import Api
from tests.api.trained import trained
from tests.factories import job_spec, sweep_spec


@pytest.fixture
def client(api: Api) -> Iterator[shoal.Client]:
    with serving(create_app(api.settings, api.factory)) as url:
        token = api.token("alice")["Authorization"].split()[1]
        with shoal.Client(url, token) as c:
            yield c


def test_a_job_is_submitted_waited_for_and_cancelled(client: shoal.Client, tmp_path: Path) -> None:
    job = client.submit(job_spec(name="from-python"))
    assert job.get()["state"] == "QUEUED" and job.get()["name"] == "from-python"
    with pytest.raises(TimeoutError, match=r"still QUEUED after 0\.2 s"):
        job.wait(timeout_s=0.2, poll_s=0.05)
    job.cancel()
    assert job.wait(timeout_s=10, poll_s=0.05)["state"] == "CANCELLED"
    assert [e["kind"] for e in job.events()].count("state") >= 2
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(job_spec(name="from-a-file")))
    listed = client.jobs()
    assert client.submit(spec_file).get()["name"] == "from-a-file"
    assert len(client.jobs()) == len(listed) + 1
    assert [j["state"] for j in client.jobs("CANCELLED")] == ["CANCELLED"]


def test_refusals_are_the_clis_errors(client: shoal.Client, tmp_path: Path) -> None:
    with pytest.raises(shoal.ApiError) as missing:
        client.job("deadbeef").get()
    assert missing.value.status == 404 and missing.value.message == "no job 'deadbeef'"
    with pytest.raises(shoal.ApiError) as invalid:
        client.submit(job_spec(steps=0))
    assert invalid.value.status == 422 and "steps" in invalid.value.message
    bad = tmp_path / "job.toml"
    bad.write_text("steps = 3")
    with pytest.raises(ValueError, match=r"unknown extension '\.toml'"):
        client.submit(bad)
    broken = tmp_path / "job.yaml"
    broken.write_text("name: x\nsteps: [3\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(broken))}:3:1: invalid YAML"):
        client.submit(broken)


def test_a_trained_jobs_metrics_checkpoints_and_model(
    api: Api, client: shoal.Client, tmp_path: Path
) -> None:
    job_id, spec = trained(api)
    job = client.job(job_id)
    metrics = job.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert [c["step"] for c in job.checkpoints()] == [10, 20]
    assert "checkpoint" in {e["kind"] for e in job.events()}
    path = job.export(tmp_path / "model.safetensors", step=10)
    model = build_model(spec["model"], spec["data"])
    model.load_state_dict(load_file(path))


def test_a_sweep_is_started_read_and_cancelled(client: shoal.Client) -> None:
    sweep = client.sweep(sweep_spec())
    assert sweep.get()["state"] == "QUEUED"  # no controller here starts it
    assert sweep.best_trial() is None
    sweep.cancel()
    assert sweep.wait(timeout_s=10, poll_s=0.05)["state"] == "CANCELLED"
