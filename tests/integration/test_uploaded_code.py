"""Code of one's own, as the README's user sends it: a small model in a folder of theirs,
uploaded with a job from the CLI and from Python on a running ``shoal up``, checked and
trained in Ray workers (never in the control plane's process), watched, exported and loaded
in plain PyTorch with the same parameters as a single-process run."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

import shoal
from shoal.workers.reference import ReferenceResult, train_reference
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.uploaded_code import local_code
from shoal.workers.zoo.whole import build_model
from tests.integration.conftest import SHOAL, ShoalUp
from tests.integration.test_elastic import stop_node
from tests.integration.test_shoal_up import (
    Api,
    StartShoal,
    admin_token,
    api_processes,
    shoal_cli,
)

pytestmark = pytest.mark.integration

TINYNETS = '''"""A user's own model: an MLP whose every build leaves a mark naming its process."""
import os
from pathlib import Path

from torch import nn


def mlp(config, meta):
    Path(config["marks"], str(os.getpid())).touch()
    width = config["width"]
    return [
        nn.Sequential(nn.Linear(meta.input_shape[0], width), nn.Tanh()),
        nn.Linear(width, meta.targets),
    ]
'''
STEPS = 12


def code_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "my-code"
    folder.mkdir()
    (folder / "tinynets.py").write_text(TINYNETS)
    return folder


def own_spec(name: str, marks: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"factory": "code:tinynets:mlp", "config": {"width": 24, "marks": str(marks)}},
        "data": {"builtin": "digits", "config": {"images": False}},
        "optimizer": {"name": "adam", "lr": 0.01},
        "batch_size": 32,
        "micro_batches": 2,
        "steps": STEPS,
        "parallelism": {"stages": 2, "replicas": 1},
        "resources": {"min_devices": 1, "max_devices": 2},
        "checkpoint": {"every_steps": 6, "keep": 2},
    }


def create_token(up: ShoalUp, database_url: str, *args: str) -> str:
    """``shoal token create`` as the operator runs it, on the server's database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_HOME=str(up.home), SHOAL_DATABASE_URL=database_url)
    done = subprocess.run(
        [str(SHOAL), "token", "create", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"shoal token create {args}: {done.stderr}"
    return done.stdout.strip()


def reference_run(spec: dict[str, Any], folder: Path) -> ReferenceResult:
    """The spec trained in one process, its code imported from ``folder`` as on the workers."""
    with local_code(folder):
        return train_reference(
            ModelRef(None, spec["model"]["factory"], spec["model"]["config"]),
            DataRef("digits", None, spec["data"]["config"]),
            OptimizerConf("adam", spec["optimizer"]["lr"], {}),
            batch_size=spec["batch_size"],
            micro_batches=spec["micro_batches"],
            steps=spec["steps"],
            seed=0,
        )


def reference_model(spec: dict[str, Any], folder: Path) -> dict[str, torch.Tensor]:
    """The parameters one process gets training the spec."""
    return {
        f"{block.index}.{name}": tensor
        for block in reference_run(spec, folder).blocks
        for name, tensor in block.module.state_dict().items()
    }


def assert_loads_as_trained(exported: Path, spec: dict[str, Any], folder: Path) -> None:
    model = build_model(spec["model"], spec["data"], code=folder)
    model.load_state_dict(load_file(exported))  # strict: every name, nothing else
    expected = reference_model(spec, folder)
    actual = model.state_dict()
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.allclose(actual[name], tensor, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_users_own_model_trains_from_the_cli_and_python_and_loads_in_plain_pytorch(
    shoal_up: StartShoal, empty_database: str, runner_reaper: list[str], tmp_path: Path
) -> None:
    # The API in processes of its own: each joins Ray for its first check of code.
    up = shoal_up(tmp_path / "home", empty_database, SHOAL_API_WORKERS="2")
    api_pids = api_processes(up)
    assert len(api_pids) == 2
    assert up.process is not None
    marks = tmp_path / "marks"
    marks.mkdir()
    folder = code_folder(tmp_path)
    carol = create_token(up, empty_database, "--user", "carol", "--code")
    dave = create_token(up, empty_database, "--user", "dave")
    spec_file = tmp_path / "own.yaml"
    spec_file.write_text(yaml.safe_dump(own_spec("own-cli", marks)))
    cli_home = tmp_path / "cli-home"
    cli_home.mkdir()

    # Without the permission: a 403 that names it, and nothing of the code ran.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_URL=up.url, SHOAL_TOKEN=dave, SHOAL_HOME=str(cli_home))
    refused = subprocess.run(
        [str(SHOAL), "submit", str(spec_file), "--code", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert refused.returncode != 0 and "lacks the code permission" in refused.stderr, refused
    assert not list(marks.iterdir())

    # From the CLI: upload, train, watch, export.
    answer = shoal_cli(
        "submit", str(spec_file), "--code", str(folder), "--json",
        url=up.url, token=carol, home=cli_home,
    )  # fmt: skip
    job_id = json.loads(answer)["id"]
    runner_reaper.append(job_id)
    api = Api(up, admin_token(up))
    job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the uploaded model to train")
    assert job["step"] == STEPS and len(job["partition"]) == 2 and job["num_blocks"] == 2
    assert job["spec"]["code"].startswith("sha256:")
    logged = shoal_cli("logs", job_id, url=up.url, token=carol, home=cli_home)
    assert f"step {STEPS}/{STEPS}" in logged
    exported = tmp_path / "own.safetensors"
    shoal_cli("export", job_id, "-o", str(exported), url=up.url, token=carol, home=cli_home)

    # The code ran (its check, the runner's count, both stages) only outside the processes
    # that serve the API and run the controller.
    built_in = {int(p.name) for p in marks.iterdir()}
    assert len(built_in) >= 2, built_in
    assert not built_in & {up.process.pid, *api_pids}, (built_in, api_pids)
    assert_loads_as_trained(exported, own_spec("own-cli", marks), folder)

    # From Python: the same, with the same folder (the same digest: kept once).
    with shoal.Client(up.url, carol) as client:
        own = client.submit(own_spec("own-python", marks), code=folder)
        runner_reaper.append(own.id)
        done = own.wait(timeout_s=120)
        assert done["state"] == "SUCCEEDED", done
        assert done["spec"]["code"] == job["spec"]["code"]
        assert [m["step"] for m in own.metrics()] == list(range(1, STEPS + 1))
        path = own.export(tmp_path / "own-python.safetensors")
    assert_loads_as_trained(path, own_spec("own-python", marks), folder)
    assert len(list((tmp_path / "home" / "code").glob("*.zip"))) == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_sweep_of_a_users_own_model_trains_its_trials_under_sharp(
    shoal_up: StartShoal, empty_database: str, runner_reaper: list[str], tmp_path: Path
) -> None:
    """SHARP with uploaded code: the sweep's executor and its shard workers run with it, and
    each trial's model is the single-process run's."""
    up = shoal_up(tmp_path / "home", empty_database)
    marks = tmp_path / "marks"
    marks.mkdir()
    folder = code_folder(tmp_path)
    erin = create_token(up, empty_database, "--user", "erin", "--code")
    base = own_spec("own-trial", marks)
    base["parallelism"] = {"stages": 1, "replicas": 1}
    base["resources"] = {"min_devices": 1, "max_devices": 1}
    sweep_spec = {
        "name": "own-sweep",
        "base": base,
        "space": {"optimizer.lr": {"type": "categorical", "choices": [0.01, 0.02]}},
        "algorithm": "grid",
        "max_trials": 2,
        "max_concurrent": 2,
        "executor": "sharp",
        "devices": 2,
        "objective": {"metric": "loss", "direction": "minimize", "every_steps": 6},
        "early_stopping": {"rule": "none"},
    }
    with shoal.Client(up.url, erin) as client:
        sweep = client.sweep(sweep_spec, code=folder)
        ended = sweep.wait(timeout_s=180)
        assert ended["state"] == "SUCCEEDED", ended
        trials = ended["trials"]
        assert len(trials) == 2 and all(t["state"] == "SUCCEEDED" for t in trials), trials
        for trial in trials:
            runner_reaper.append(trial["job_id"])
            job = client.job(trial["job_id"])
            path = job.export(tmp_path / f"trial-{trial['number']}.safetensors")
            spec = dict(base, optimizer={"name": "adam", "lr": trial["params"]["optimizer.lr"]})
            assert_loads_as_trained(path, spec, folder)
    assert up.process is not None and up.process.pid not in {int(p.name) for p in marks.iterdir()}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_node_lost_under_a_users_own_model_is_recovered_in_place_exactly(
    shoal_cluster: Callable[[Path, str, str], ShoalUp], database_url: str, tmp_path: Path
) -> None:
    """Recovery with uploaded code: the stage worker that replaces the lost one is started
    mid-run by the job's runner, with the code the runner was started with."""
    up = shoal_cluster(tmp_path / "home", database_url, "1xcpu-a:2048,1xcpu-b:2048")
    marks = tmp_path / "marks"
    marks.mkdir()
    folder = code_folder(tmp_path)
    spec = own_spec("own-preempted", marks)
    spec["steps"] = 600  # its steps take a few ms: fewer could all end before the kill lands
    spec["elastic"] = {"repartition": False, "keep_copies": True}
    spec["checkpoint"] = {"every_steps": 1000, "keep": 1}  # recovered from memory
    api = Api(up, admin_token(up))
    with shoal.Client(up.url, admin_token(up)) as client:
        job = client.submit(spec, code=folder)
    api.wait_state(job.id, lambda j: j["step"] >= 10, "ten steps")
    stop_node(up, "cpu-b", graceful=False)
    api.wait_state(job.id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")
    kinds = [e["kind"] for e in api.events(job.id)]
    assert "device_lost" in kinds and "recovered" in kinds, kinds
    metrics = api.metrics(job.id)
    assert [m["step"] for m in metrics] == list(range(1, spec["steps"] + 1))
    reference = reference_run(spec, folder)
    losses = [m["loss"] for m in metrics]
    assert losses == pytest.approx(reference.losses, rel=1e-5, abs=1e-6)
