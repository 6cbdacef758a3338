"""`shoal up` as a user runs it: a real process on the session's Ray, driven with curl and the CLI.

The first test is the README's walk-through: a job submitted with ``curl`` trains to
SUCCEEDED with a falling loss, and ``shoal status``/``shoal logs``, the metrics, events and
checkpoints endpoints all show it. The second kills the control plane (``kill -9``) while a
job trains and starts it again on the same home and database: the job's detached runner
is found again by name, so the job ends SUCCEEDED with one placement and every step once.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

import httpx
import pytest
import torch
import yaml

from shoal.service.nodeprocs import kill_session
from shoal.service.settings import DEFAULT_DEVICES
from shoal.workers.reference import train_reference
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from tests.integration.conftest import SHOAL, STOP_TIMEOUT_S, ShoalUp, ray_env, wait_until

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mlp-digits.yaml"
JOB_TIMEOUT_S = 120.0
Json = dict[str, Any]
StartShoal = Callable[[Path, str], ShoalUp]


def admin_token(shoal: ShoalUp) -> str:
    mode = stat.S_IMODE(shoal.token_path.stat().st_mode)
    assert mode == 0o600, f"{shoal.token_path} has mode {mode:o}, not 600"
    return shoal.token_path.read_text().strip()


def curl_submit(shoal: ShoalUp, token: str, spec: Json, tmp_path: Path) -> Json:
    """POST the spec with the real curl binary, as the README shows; the created job."""
    body = tmp_path / f"{spec['name']}.json"
    body.write_text(json.dumps(spec))
    answer = subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "30",
            "-X",
            "POST",
            f"{shoal.url}/api/v1/jobs",
            "-H",
            f"Authorization: Bearer {token}",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{body}",
            "-w",
            "\n%{http_code}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert answer.returncode == 0, f"curl failed: {answer.stderr}"
    text, _, code = answer.stdout.rpartition("\n")
    assert code == "201", f"POST /jobs answered {code}: {text}"
    job: Json = json.loads(text)
    # QUEUED as made; RUNNING where the controller placed it before the answer read it back.
    assert job["state"] in ("QUEUED", "RUNNING") and job["name"] == spec["name"], job
    return job


class Api:
    """GETs against the running Shoal, as the admin."""

    def __init__(self, shoal: ShoalUp, token: str) -> None:
        self.shoal = shoal
        self.headers = {"Authorization": f"Bearer {token}"}

    def get(self, path: str, **params: Any) -> Json:
        response = httpx.get(
            f"{self.shoal.url}/api/v1{path}", headers=self.headers, params=params, timeout=30.0
        )
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text}"
        answer: Json = response.json()
        return answer

    def job(self, job_id: str) -> Json:
        return self.get(f"/jobs/{job_id}")

    def cancel(self, job_id: str) -> Json:
        """Cancel the job and wait until it has ended: the job, CANCELLED."""
        response = httpx.post(
            f"{self.shoal.url}/api/v1/jobs/{job_id}/cancel", headers=self.headers, timeout=30.0
        )
        assert response.status_code == 200, (
            f"cancel {job_id}: {response.status_code} {response.text}"
        )
        ended: Json = wait_until(
            lambda: (job := self.job(job_id))["state"] == "CANCELLED" and job,
            JOB_TIMEOUT_S,
            f"job {job_id} to be cancelled",
            on_timeout=lambda: self.report(job_id),
        )
        return ended

    def items(self, job_id: str, what: str, **params: Any) -> list[Json]:
        items: list[Json] = self.get(f"/jobs/{job_id}/{what}", **params)["items"]
        return items

    def events(self, job_id: str) -> list[Json]:
        """Every event of the job, page after page."""
        rows: list[Json] = []
        while page := self.items(job_id, "events", since_id=rows[-1]["id"] if rows else 0):
            rows += page
        return rows

    def metrics(self, job_id: str) -> list[Json]:
        """Every metric row of the job, page after page."""
        rows: list[Json] = []
        while page := self.items(job_id, "metrics", since_step=rows[-1]["step"] if rows else -1):
            rows += page
        return rows

    def wait_state(self, job_id: str, done: Callable[[Json], bool], what: str) -> Json:
        def check() -> Json | None:
            job = self.job(job_id)
            if job["state"] in {"FAILED", "CANCELLED"}:
                pytest.fail(f"job {job_id} ended {job['state']}\n{self.report(job_id)}")
            return job if done(job) else None

        found: Json = wait_until(check, JOB_TIMEOUT_S, what, on_timeout=lambda: self.report(job_id))
        return found

    def report(self, job_id: str) -> str:
        """The job's state and events and the control plane's last log lines: what a failed
        wait shows."""
        job = self.job(job_id)
        events = "\n".join(f"  {e['kind']}: {e['message']}" for e in self.events(job_id))
        return (
            f"job {job_id}: {job['state']} at step {job['step']}, attempt {job['attempt']},"
            f" error {job['error']!r}\nevents:\n{events}\n{self.shoal.tail()}"
        )


def api_processes(shoal: ShoalUp) -> list[int]:
    """The processes of ``shoal``'s process group serving the API on their own."""
    assert shoal.process is not None
    listing = subprocess.run(
        ["ps", "-ww", "-A", "-o", "pid=,pgid=,args="], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.split(maxsplit=2) for line in listing.splitlines()]
    group = str(shoal.process.pid)
    return [int(pid) for pid, pgid, args in rows if pgid == group and "spawn_main" in args]


def state_changes(events: list[Json]) -> list[tuple[str | None, str]]:
    return [(e["data"]["from"], e["data"]["to"]) for e in events if e["kind"] == "state"]


def shoal_cli(*args: str, url: str, token: str, home: Path) -> str:
    """Run the ``shoal`` command with SHOAL_URL/SHOAL_TOKEN; its stdout (exit code 0 asserted)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    # An empty home: the CLI can only have found the server through the two variables.
    env.update(SHOAL_URL=url, SHOAL_TOKEN=token, SHOAL_HOME=str(home))
    done = subprocess.run(
        [str(SHOAL), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 0, f"shoal {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def example_spec(**overrides: Any) -> Json:
    spec: Json = yaml.safe_load(EXAMPLE.read_text())
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_job_submitted_with_curl_trains_and_shows_everywhere(
    shoal_up: StartShoal, empty_database: str, runner_reaper: list[str], tmp_path: Path
) -> None:
    shoal = shoal_up(tmp_path / "home", empty_database)
    token = admin_token(shoal)
    api = Api(shoal, token)
    spec = example_spec()
    submitted = curl_submit(shoal, token, spec, tmp_path)
    job_id = submitted["id"]
    runner_reaper.append(job_id)

    job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")
    steps = spec["steps"]
    assert job["step"] == steps and job["error"] is None and job["attempt"] == 1
    assert len(job["devices"]) == spec["resources"]["max_devices"] == 2
    bounds = [tuple(stage["blocks"]) for stage in job["partition"]]
    assert bounds[0][0] == 0 and bounds[-1][1] == job["num_blocks"] and len(bounds) == 2
    assert bounds[0][1] == bounds[1][0]

    metrics = api.items(job_id, "metrics")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    losses = [m["loss"] for m in metrics]
    assert mean(losses[-5:]) < mean(losses[:5]), f"loss did not fall: {losses[:5]} .. {losses[-5:]}"
    assert job["last_loss"] == losses[-1]
    assert all(m["samples_per_s"] > 0 and len(m["stages"]) == 2 for m in metrics)

    events = api.events(job_id)
    assert state_changes(events) == [
        (None, "QUEUED"),
        ("QUEUED", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    kinds = [e["kind"] for e in events]
    assert kinds.count("placement") == 1
    every = spec["checkpoint"]["every_steps"]
    written = [e["data"]["step"] for e in events if e["kind"] == "checkpoint"]
    assert written == list(range(every, steps + 1, every))

    checkpoints = api.items(job_id, "checkpoints")
    keep = spec["checkpoint"]["keep"]
    assert [c["step"] for c in checkpoints] == written[-keep:]
    stored = tmp_path / "home" / "checkpoints" / job_id
    assert all(c["nbytes"] > 0 and (stored / c["name"]).is_dir() for c in checkpoints)

    cli_home = tmp_path / "cli-home"
    cli_home.mkdir()
    shown = shoal_cli("status", job_id, url=shoal.url, token=token, home=cli_home)
    assert "SUCCEEDED" in shown and f"{steps}/{steps}" in shown
    assert f"{losses[-1]:.4g}" in shown and f"latest at step {steps}" in shown
    listed = shoal_cli("status", url=shoal.url, token=token, home=cli_home)
    row = next((line for line in listed.splitlines() if job_id in line), None)
    assert row is not None, f"job {job_id} missing from `shoal status`:\n{listed}"
    assert "SUCCEEDED" in row and f"{steps}/{steps}" in row and f"{losses[-1]:.4g}" in row
    logged = shoal_cli("logs", job_id, url=shoal.url, token=token, home=cli_home)
    assert f"step 1/{steps} loss {losses[0]:.4f}" in logged
    assert f"step {steps}/{steps} loss {losses[-1]:.4f}" in logged
    assert "placement:" in logged and "checkpoint:" in logged
    assert logged.count("state:") == 3


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_four_stages_train_exactly_like_one_through_the_api(
    shoal_up: StartShoal, empty_database: str, runner_reaper: list[str], tmp_path: Path
) -> None:
    """The exactness promise, end to end: the same job cut into 4 pipeline stages on 4 Ray
    actors and run on 1 gives bitwise the same loss curve (pipeline-only on CPU accumulates
    micro-batch gradients in the same order as one process). The API is served by two
    processes of its own (SHOAL_API_WORKERS), the controller by `shoal up`'s."""
    shoal = shoal_up(tmp_path / "home", empty_database, SHOAL_API_WORKERS="2")
    assert len(api_processes(shoal)) == 2
    token = admin_token(shoal)
    api = Api(shoal, token)
    steps = 12
    curves, norms, jobs = {}, {}, {}
    for stages in (4, 1):
        spec = example_spec(
            name=f"mlp-digits-{stages}-stages",
            steps=steps,
            parallelism={"stages": stages, "replicas": 1, "schedule": "1f1b"},
            resources={"min_devices": 1, "max_devices": 4},
            checkpoint={"every_steps": 6},
        )
        job_id = curl_submit(shoal, token, spec, tmp_path)["id"]
        runner_reaper.append(job_id)
        jobs[stages] = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "success")
        metrics = api.items(job_id, "metrics")
        curves[stages] = [m["loss"] for m in metrics]
        norms[stages] = [m["grad_norm"] for m in metrics]

    assert len(curves[4]) == steps and curves[4] == curves[1]
    # The norm sums per-stage squares in another order: equal to rounding, not bitwise.
    assert norms[4] == pytest.approx(norms[1], rel=1e-5)
    four = jobs[4]
    assert [tuple(p["blocks"]) for p in four["partition"]] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert len(set(four["devices"])) == 4
    times = four["stage_times"]
    assert sorted(t["stage"] for t in times) == [0, 1, 2, 3]
    assert all(t["compute_s"] > 0 and t["idle_s"] >= 0 for t in times)
    assert {t["device_id"] for t in times} == set(four["devices"])


def local_ray_sessions(shoal: ShoalUp) -> set[int]:
    """The sessions of the ``ray start`` processes of the local cluster ``shoal`` runs (each
    node leads one; its raylet, GCS and workers run in it), found by the cluster's address."""
    address = ray_env(shoal)["RAY_ADDRESS"]
    port = address.rpartition(":")[2]
    listing = subprocess.run(
        ["ps", "-ww", "-A", "-o", "pid=,args="], capture_output=True, text=True, check=True
    ).stdout
    rows = [line.split(maxsplit=1) for line in listing.splitlines()]
    ours = {f"--port={port}", f"--address={address}"}
    found = {int(pid) for pid, args in rows if "ray start" in args and ours & set(args.split())}
    assert found, f"no `ray start` process of the local cluster at {address}"
    return found


def running_in(sessions: set[int]) -> list[str]:
    """The live processes (pid, session, command) of ``sessions``."""
    listing = subprocess.run(
        ["ps", "-ww", "-A", "-o", "pid=,sess=,stat=,args="],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split(maxsplit=3) for line in listing.splitlines()]
    return [
        f"{pid} (session {sid}): {args}"
        for pid, sid, state, args in rows
        if int(sid) in sessions and not state.startswith("Z")
    ]


def digits_reference_losses(spec: Json) -> list[float]:
    """The losses of ``spec`` (the digits example) trained in one plain process, on one
    thread as each stage worker of a CPU device computes (another thread count sums in
    another order: over a thousand Adam steps, the losses drift apart by ~1e-4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_reference(
            ModelRef("mlp", None, spec["model"]["config"]),
            DataRef("digits", None, spec["data"]["config"]),
            OptimizerConf(spec["optimizer"]["name"], spec["optimizer"]["lr"]),
            batch_size=spec["batch_size"],
            micro_batches=spec["micro_batches"],
            steps=spec["steps"],
            seed=spec["seed"],
        ).losses
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(720)  # each wait below is bounded (2 starts of 180 s, 2 jobs waits of 120 s)
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_restarted_shoal_up_adopts_its_local_ray_and_the_running_job(
    shoal_cluster: Callable[[Path, str, str], ShoalUp], database_url: str, tmp_path: Path
) -> None:
    """`shoal up` with its own local Ray (the default devices), SIGKILLed mid-job: its Ray
    nodes are processes of their own and keep training. The restarted `shoal up` on the
    same home and database must not train the job a second time beside them: the job ends
    SUCCEEDED with one placement, every step once, the losses of one plain process; and
    once it stops, nothing of any local cluster it started is left running."""
    home = tmp_path / "home"
    first = shoal_cluster(home, database_url, DEFAULT_DEVICES)
    sessions = local_ray_sessions(first)
    try:
        token = admin_token(first)
        # Long enough to be training still while the second control plane starts.
        spec = example_spec(name="mlp-digits-long", steps=1500, checkpoint={"every_steps": 100})
        job_id = curl_submit(first, token, spec, tmp_path)["id"]
        running = Api(first, token).wait_state(
            job_id, lambda j: j["state"] == "RUNNING" and j["step"] > 0, "the job to train"
        )
        first.kill9()
        assert running["step"] < spec["steps"], "the job ended before the control plane died"

        second = shoal_cluster(home, database_url, DEFAULT_DEVICES)
        sessions |= local_ray_sessions(second)
        api = Api(second, token)
        job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")

        report = api.report(job_id)
        assert job["attempt"] == 1 and job["step"] == spec["steps"], report
        assert job["error"] is None, report
        events = api.events(job_id)
        assert [e["kind"] for e in events].count("placement") == 1, f"two runners:\n{report}"
        assert state_changes(events) == [
            (None, "QUEUED"),
            ("QUEUED", "RUNNING"),
            ("RUNNING", "SUCCEEDED"),
        ], report
        metrics = api.metrics(job_id)
        assert [m["step"] for m in metrics] == list(range(1, spec["steps"] + 1)), report
        losses = [m["loss"] for m in metrics]
        assert losses == pytest.approx(digits_reference_losses(spec), rel=1e-5, abs=1e-6)

        second.stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := running_in(sessions)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], "left running after `shoal up` stopped:\n" + "\n".join(left)
    finally:
        for session in sessions:  # whatever a failure above left of either cluster
            kill_session(session, time.monotonic() + STOP_TIMEOUT_S)
