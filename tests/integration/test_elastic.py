"""The elastic runtime through the API, on a local multi-node Ray that `shoal up` starts.

A straggler: of three devices on two Ray nodes, the second node's is emulated 4x slower
(``SHOAL_DEVICES``). The job starts on an even cut (nothing is measured yet), its stages
measure their compute, the policy moves blocks off the slow device, and the job still
trains exactly like one process. A node killed mid-run (SIGKILL of its every process): the
job recovers in place from the in-memory copies, its losses still those of one process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ShoalUp
from tests.integration.test_shoal_up import Api, admin_token, curl_submit
from workers.reference import train_reference
from workers.snapshot import DataRef, ModelRef, OptimizerConf

pytestmark = pytest.mark.integration

Json = dict[str, Any]
DEVICES = "2xcpu:2048,1xcpu-slow:2048:slowdown=4"

SPEC: Json = {
    "name": "straggler",
    "model": {"builtin": "mlp", "config": {"hidden": 512, "layers": 5}},
    "data": {"builtin": "synthetic-regression", "config": {"features": 64, "outputs": 8}},
    "optimizer": {"name": "sgd", "lr": 0.01},
    "batch_size": 64,
    "micro_batches": 8,
    "steps": 24,
    "seed": 3,
    "parallelism": {"stages": 3, "replicas": 1, "schedule": "1f1b"},
    "resources": {"min_devices": 3, "max_devices": 3},
    "elastic": {"repartition": True, "check_every_steps": 4, "min_gain": 0.1},
    "checkpoint": {"every_steps": 8, "keep": 2},
}


def held(partition: list[Json], device_id: str) -> int:
    return sum(r["blocks"][1] - r["blocks"][0] for r in partition if r["device_id"] == device_id)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_straggler_loses_blocks_and_the_losses_stay_exact(
    shoal_cluster: Callable[[Path, str, str], ShoalUp], database_url: str, tmp_path: Path
) -> None:
    shoal = shoal_cluster(tmp_path / "home", database_url, DEVICES)
    token = admin_token(shoal)
    api = Api(shoal, token)
    devices = api.get("/devices")["items"]
    assert len({d["node_id"] for d in devices}) == 2
    (slow,) = [d["id"] for d in devices if d["kind"] == "cpu-slow"]

    job_id = curl_submit(shoal, token, SPEC, tmp_path)["id"]
    job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")

    events = api.items(job_id, "events")
    moves = [e for e in events if e["kind"] == "repartition"]
    assert moves, [e["message"] for e in events]
    first = moves[0]["data"]
    assert held(first["to"], slow) < held(first["from"], slow) == 2
    assert min(first["speeds"], key=first["speeds"].get) == slow
    assert first["predicted_gain"] >= 0.1 and first["migration_s"] > 0
    assert f"device {slow} computes at" in moves[0]["message"]
    assert job["partition"] == moves[-1]["data"]["to"]
    results = [e["data"] for e in events if e["kind"] == "repartition_result"]
    assert results and results[0]["measured_gain"] > 0, results

    reference = train_reference(
        ModelRef("mlp", None, SPEC["model"]["config"]),
        DataRef("synthetic-regression", None, SPEC["data"]["config"]),
        OptimizerConf("sgd", 0.01),
        batch_size=SPEC["batch_size"],
        micro_batches=SPEC["micro_batches"],
        steps=SPEC["steps"],
        seed=SPEC["seed"],
    )
    losses = [m["loss"] for m in api.items(job_id, "metrics")]
    assert losses == pytest.approx(reference.losses, rel=1e-5, abs=1e-6)


def kill_node(kind: str) -> None:
    """SIGKILL the local Ray node declaring device kind ``kind``, and everything it started
    (its session): a machine gone without notice."""
    listing = subprocess.run(
        ["ps", "-ww", "-A", "-o", "pid=,sess=,args="], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.split(maxsplit=2) for line in listing.splitlines()]
    (node,) = [
        int(pid) for pid, _, args in rows if "ray start" in args and f"device-kind={kind}," in args
    ]
    for pid, session, _ in rows:
        if int(session) == node:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_node_killed_mid_run_is_recovered_in_place_and_the_losses_stay_exact(
    shoal_cluster: Callable[[Path, str, str], ShoalUp], database_url: str, tmp_path: Path
) -> None:
    shoal = shoal_cluster(tmp_path / "home", database_url, "1xcpu-a:2048,1xcpu-b:2048")
    token = admin_token(shoal)
    api = Api(shoal, token)
    spec = {
        **SPEC,
        "name": "preempted",
        "model": {"builtin": "mlp", "config": {"hidden": 64, "layers": 3}},
        "steps": 60,
        "parallelism": {"stages": 2, "replicas": 1, "schedule": "1f1b"},
        "resources": {"min_devices": 1, "max_devices": 2},
        "elastic": {"repartition": False, "keep_copies": True},
        "checkpoint": {"every_steps": 1000, "keep": 1},  # recovered from memory, not disk
    }
    job_id = curl_submit(shoal, token, spec, tmp_path)["id"]
    api.wait_state(job_id, lambda j: j["step"] >= 10, "ten steps")
    kill_node("cpu-b")
    job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")

    events = api.items(job_id, "events")
    (lost,) = [e for e in events if e["kind"] == "device_lost"]
    assert lost["data"]["steps_replayed"] <= 1
    (back,) = [e for e in events if e["kind"] == "recovered"]
    (gone,) = lost["data"]["devices"]
    assert gone not in {row["device_id"] for row in back["data"]["to"]}
    assert job["attempt"] == 1 and gone not in job["devices"]
    states = [(e["data"]["from"], e["data"]["to"]) for e in events if e["kind"] == "state"]
    assert ("RUNNING", "RECOVERING") in states and ("RECOVERING", "RUNNING") in states
    metrics = api.items(job_id, "metrics")
    assert [m["step"] for m in metrics] == list(range(1, 61))
    reference = train_reference(
        ModelRef("mlp", None, spec["model"]["config"]),
        DataRef("synthetic-regression", None, spec["data"]["config"]),
        OptimizerConf("sgd", 0.01),
        batch_size=spec["batch_size"],
        micro_batches=spec["micro_batches"],
        steps=60,
        seed=spec["seed"],
    )
    assert [m["loss"] for m in metrics] == pytest.approx(reference.losses, rel=1e-5, abs=1e-6)
