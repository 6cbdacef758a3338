"""A sweep through the CLI and the API on a local 2-node Ray that `shoal up` starts: its
trials' models are larger than one device's memory budget, so the sweep's SHARP executor
alternates their shards on the two devices; one device's node is killed mid-sweep and the
trials go on on the other; ASHA prunes; every trial's losses are those of its run alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from shoal.workers.reference import train_reference
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from tests.integration.conftest import ShoalUp, wait_until
from tests.integration.test_elastic import stop_node
from tests.integration.test_shoal_up import Api, admin_token, shoal_cli

pytestmark = pytest.mark.integration

Json = dict[str, Any]
MODEL = {"hidden": 768, "layers": 6}  # ~7 MB per block with Adam, ~48 MB in all
SWEEP: Json = {
    "name": "sharp-sweep",
    "base": {
        "name": "trial",
        "model": {"builtin": "mlp", "config": MODEL},
        "data": {"builtin": "synthetic-regression", "config": {"features": 64, "outputs": 8}},
        "optimizer": {"name": "adam", "lr": 0.001},
        "batch_size": 32,
        "micro_batches": 2,
        "steps": 16,
        "seed": 4,
        "checkpoint": {"every_steps": 1000, "keep": 1},
    },
    "space": {"optimizer.lr": {"type": "log_uniform", "low": 1e-5, "high": 0.05}},
    "algorithm": "random",
    "seed": 11,
    "max_trials": 8,
    "max_concurrent": 4,
    "executor": "sharp",
    "devices": 2,
    "objective": {"metric": "loss", "direction": "minimize", "every_steps": 4},
    "early_stopping": {"rule": "asha", "min_steps": 4, "reduction_factor": 2},
    "retention": {"keep_best": 2},
}


@pytest.mark.timeout(600)  # ~70 s alone on 2 cores; the waits below fail first, telling why
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_sweep_of_models_larger_than_a_device_runs_on_shared_devices_and_prunes(
    shoal_cluster: Callable[[Path, str, str], ShoalUp], database_url: str, tmp_path: Path
) -> None:
    shoal = shoal_cluster(tmp_path / "home", database_url, "1xcpu-a:40,1xcpu-b:40")
    token = admin_token(shoal)
    api = Api(shoal, token)
    spec_file = tmp_path / "sweep.yaml"
    spec_file.write_text(yaml.safe_dump(SWEEP))
    out = shoal_cli("sweep", str(spec_file), "--json", url=shoal.url, token=token, home=tmp_path)
    sweep_id = json.loads(out)["id"]

    def ended() -> Json | None:
        sweep: Json = api.get(f"/sweeps/{sweep_id}")
        return sweep if sweep["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    def training() -> bool:
        trials = api.get(f"/sweeps/{sweep_id}")["trials"]
        return any(api.job(t["job_id"])["step"] >= 4 for t in trials)

    def where() -> str:
        """Each trial's state, step and latest events, and the control plane's log."""
        lines = []
        for t in api.get(f"/sweeps/{sweep_id}")["trials"]:
            job = api.job(t["job_id"])
            events = [f"{e['kind']}: {e['message']}" for e in api.events(job["id"])]
            lines.append(f"trial {t['number']} {t['state']} step {job['step']}: {events[-3:]}")
        return "\n".join(lines) + "\n" + shoal.tail(120)

    wait_until(training, 150, "a trial to train", on_timeout=where)
    stop_node(shoal, "cpu-b", graceful=False)  # a spot machine gone without notice, mid-sweep
    sweep = wait_until(ended, 330, "the sweep to end", on_timeout=where)
    assert sweep["state"] == "SUCCEEDED", sweep
    trials = sweep["trials"]
    states = [t["state"] for t in trials]
    why = [(t["state"], api.job(t["job_id"])["error"]) for t in trials]
    assert len(trials) == 8 and "PRUNED" in states, why
    assert set(states) <= {"SUCCEEDED", "PRUNED"}, why
    budget = 40 * 2**20
    pool = {d["id"] for d in api.get("/devices")["items"]}
    recoveries = 0
    for trial in trials:
        job = api.job(trial["job_id"])
        assert job["spec"]["optimizer"]["lr"] == trial["params"]["optimizer.lr"]
        (placement,) = [e for e in api.events(job["id"]) if e["kind"] == "placement"]
        assert placement["data"]["executor"] == "sharp"
        shards = placement["data"]["stages"]
        assert len(shards) >= 2 and sum(s["bytes"] for s in shards) > budget
        assert {s["device_id"] for s in shards} <= pool
        lost = [e for e in api.events(job["id"]) if e["kind"] == "device_lost"]
        recoveries += len(lost)
        assert all(e["data"]["steps_replayed"] <= e["data"]["most_replayed"] for e in lost), [
            e["message"] for e in lost
        ]
        losses = [m["loss"] for m in api.items(job["id"], "metrics")]
        alone = train_reference(
            ModelRef("mlp", None, MODEL),
            DataRef("synthetic-regression", None, SWEEP["base"]["data"]["config"]),
            OptimizerConf("adam", trial["params"]["optimizer.lr"]),
            batch_size=32,
            micro_batches=2,
            steps=len(losses),
            seed=4,
        ).losses
        assert losses == pytest.approx(alone, rel=1e-5, abs=1e-6)
        if trial["state"] == "SUCCEEDED":
            assert len(losses) == 16 and trial["objective"] == losses[-1]
    assert recoveries >= 1  # trials with shards on the lost device rolled back and went on
    kept = [t for t in trials if t["checkpoints_kept"]]
    assert [t["number"] for t in kept] == sorted(
        t["number"]
        for t in sorted(
            (t for t in trials if t["state"] == "SUCCEEDED"), key=lambda t: t["objective"]
        )[:2]
    )
    assert sweep["best"]["number"] in {t["number"] for t in kept}
    devices = api.get("/devices")["items"]
    assert all(d["job_id"] is None for d in devices)  # the sweep's executor let them go
