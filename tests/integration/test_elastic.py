"""The elastic runtime through the API, on a local multi-node Ray that `shoal up` starts.

A straggler: of three devices on two Ray nodes, the second node's is emulated 4x slower
(``SHOAL_DEVICES``). The job starts on an even cut (nothing is measured yet), its stages
measure their compute, the policy moves blocks off the slow device, and the job still
trains exactly like one process.
"""

from __future__ import annotations

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
