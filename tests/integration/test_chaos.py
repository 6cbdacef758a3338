"""Faults the service must ride out, end to end on `shoal up` with PostgreSQL.

The database server restarting under a running job: the job ends SUCCEEDED with the loss
curve of an undisturbed run of the same spec, every step stored once, and a submission made
while the database was down is acknowledged once it is back, never lost, never doubled.

Then every fault at once, in a random order (the seed is printed; ``SHOAL_CHAOS_SEED``
replays one): on a multi-node local Ray that outlives the control plane, as a KubeRay cluster
does, two pipeline jobs and a SHARP sweep train while a node is SIGKILLed, a node gets Ray's
drain notice, the control plane is SIGKILLed and started again, and PostgreSQL restarts.
Once the last fault is ridden out the two pipeline jobs, still training, are cancelled
(training them to their end would add minutes and test nothing more): every step they
trained is stored once with the loss of their plain single-process run. Every other job
and every trial ends SUCCEEDED with its plain run's losses, each step stored once; every
acknowledged submission exists exactly once. The node faults strike a
node holding the most of the jobs' and the sweep's devices.

Each fault alone, with its own finer assertions, is tested where it lives: a node SIGKILLed
or drained mid-run (test_elastic.py), the control plane SIGKILLed and restarted
(test_shoal_up.py), a device lost under a sweep (test_sweeps.py), a sweep leaving a
draining or lost node (tests/service/test_sweeper.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from shoal.service.client import ShoalClient
from shoal.service.devicespec import parse_devices
from shoal.service.localray import RAY_ENV, LocalRay
from tests.integration.conftest import ShoalUp, ray_cli, started_shoals, wait_until
from tests.integration.test_elastic import SPEC, Json, assert_exact
from tests.integration.test_shoal_up import Api, StartShoal, admin_token, example_spec

pytestmark = pytest.mark.integration


def restart_postgres() -> None:
    """Restart the machine's PostgreSQL server: every connection is cut, then it is back."""
    (version,) = os.listdir("/etc/postgresql")
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.skipif(not Path("/etc/postgresql").is_dir(), reason="no local PostgreSQL server")
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_database_restart_mid_run_loses_nothing(
    shoal_up: StartShoal, empty_database: str, runner_reaper: list[str], tmp_path: Path
) -> None:
    shoal = shoal_up(tmp_path / "home", empty_database)
    token = admin_token(shoal)
    api = Api(shoal, token)
    steps = 200
    spec = example_spec(name="through-a-restart", steps=steps, checkpoint={"every_steps": 50})
    with ShoalClient(shoal.url, token) as client:
        job_id = client.submit_job(spec, idempotency_key="chaos-1")["id"]
        runner_reaper.append(job_id)
        api.wait_state(job_id, lambda j: j["step"] >= 5, "the job to train")

        # A submission while the server restarts: the client retries a 503 (its key makes
        # that safe); it must end acknowledged, once.
        late: dict[str, object] = {}
        during = threading.Thread(
            target=lambda: late.update(
                client.submit_job(example_spec(name="late", steps=5), idempotency_key="chaos-2")
            )
        )
        restarting = threading.Thread(target=restart_postgres)
        restarting.start()
        during.start()
        restarting.join(150)
        during.join(60)
    assert late.get("name") == "late", "a submission made during the restart was lost"
    runner_reaper.append(str(late["id"]))
    job = api.wait_state(job_id, lambda j: j["state"] == "SUCCEEDED", "the job to succeed")
    assert job["step"] == steps and job["attempt"] == 1 and job["error"] is None
    metrics = api.items(job_id, "metrics")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))

    # The same spec, undisturbed: the same curve, bitwise.
    ref = httpx.post(
        f"{shoal.url}/api/v1/jobs",
        json={**spec, "name": "undisturbed"},
        headers=api.headers,
        timeout=30,
    ).json()["id"]
    runner_reaper.append(ref)
    api.wait_state(ref, lambda j: j["state"] == "SUCCEEDED", "the reference to succeed")
    assert [m["loss"] for m in metrics] == [m["loss"] for m in api.items(ref, "metrics")]
    names = [j["name"] for j in api.get("/jobs", limit=50)["items"]]
    assert sorted(names) == ["late", "through-a-restart", "undisturbed"]
    wait_until(lambda: api.job(str(late["id"]))["state"] == "SUCCEEDED", 120, "the late job")


CHAOS_NODES = "1xcpu-a:2048,2xcpu-b:2048,2xcpu-c:2048"
"""The head (cpu-a: the runners and the sweep's executor live there; a spot notice never
comes for it) and two nodes of two devices that faults may hit: room for two 2-stage jobs
and the sweep. A node lost is replaced by a new one (cpu-d, cpu-e), as an autoscaler would."""
FAULTS = ("kill a node", "drain a node", "kill the control plane", "restart the database")
CHAOS_TIMEOUT_S = 240.0
"""The longest wait for any one thing (a job's progress, a fault's outcome, the end)."""
PROGRESS_STEPS = 5
"""Steps every running job must train between faults: the service works again."""
PIPELINE_STEPS = 20_000
"""The pipeline jobs' length: still training when the last fault has been ridden out (on the
2-core machine they trained 660-4,000 steps by then); they are cancelled then, so their
length costs nothing. Each step they trained is checked against a plain run in the test's
process, so their model is small: a plain step ~8 ms timed alone on that machine (~20 ms at
hidden 256), ~12 ms inside the test."""
ACTIVE = ("RUNNING", "RECOVERING")
RIDDEN = ("device_lost", "recovered", "relayout", "resize", "suspended", "resumed")
"""The job events that tell how a job rode out a fault (printed per job at the end)."""


def chaos_job(name: str, seed: int, steps: int) -> Json:
    return {
        **SPEC,
        "name": name,
        "model": {"builtin": "mlp", "config": {"hidden": 64, "layers": 4}},
        "batch_size": 256,
        "steps": steps,
        "seed": seed,
        "parallelism": {"stages": 2, "replicas": 1, "schedule": "1f1b"},
        "resources": {"min_devices": 1, "max_devices": 2},
        "elastic": {"repartition": False, "keep_copies": True},
        "checkpoint": {"every_steps": 50, "keep": 2},
    }


CHAOS_SWEEP: Json = {
    "name": "chaos-sweep",
    "base": {
        **chaos_job("trial", 4, 400),
        "model": {"builtin": "mlp", "config": {"hidden": 64, "layers": 3}},
        "batch_size": 64,
        "parallelism": {"stages": 1, "replicas": 1, "schedule": "1f1b"},
        "resources": {"min_devices": 1, "max_devices": 1},
    },
    "space": {"optimizer.lr": {"type": "log_uniform", "low": 1e-4, "high": 0.05}},
    "algorithm": "random",
    "seed": 7,
    "max_trials": 8,
    "max_concurrent": 2,
    "executor": "sharp",
    "devices": 1,
    "early_stopping": {"rule": "none"},
}


class Chaos:
    """The faults of one run, on a local Ray cluster the test owns and a control plane
    (``shoal up --ray-address``) it may kill and start again; what happened, for failures."""

    def __init__(self, ray: LocalRay, start: Callable[[], ShoalUp], seed: int) -> None:
        self.ray, self.start, self.seed = ray, start, seed
        self.shoal = start()
        self.token = admin_token(self.shoal)
        self.api = Api(self.shoal, self.token)
        self.rng = random.Random(seed)
        self.began = time.monotonic()
        self.log: list[str] = []  # what was done, each at its second of the run
        self.acknowledged: dict[str, str] = {}  # job id -> name, of every 2xx submission
        self._joined = 0
        with ShoalClient(self.shoal.url, self.token) as client:
            self.sweep_id = str(client.submit_sweep(CHAOS_SWEEP, idempotency_key="sweep")["id"])

    def note(self, what: str) -> None:
        self.log.append(f"{time.monotonic() - self.began:.0f}s: {what}")

    def under_way(self, names: Sequence[str]) -> list[str]:
        """Which of the jobs ``names`` and the sweep have not ended yet."""
        jobs = [j["name"] for j in self.jobs() if j["name"] in names and j["state"] != "SUCCEEDED"]
        sweep = self.api.get(f"/sweeps/{self.sweep_id}")["state"]
        return [*jobs, "sweep"] if sweep != "SUCCEEDED" else jobs

    def trials(self) -> set[str]:
        """The job ids of the sweep's trials (active or not)."""
        return {t["job_id"] for t in self.api.get(f"/sweeps/{self.sweep_id}")["trials"]}

    def submit(self, spec: Json, key: str) -> str:
        with ShoalClient(self.shoal.url, self.token) as client:
            job = client.submit_job(spec, idempotency_key=key)
        self.acknowledged[str(job["id"])] = spec["name"]
        return str(job["id"])

    def jobs(self) -> list[Json]:
        items: list[Json] = self.api.get("/jobs", limit=100)["items"]
        return items

    def where(self) -> str:
        """The seed, the faults so far, the sweep's state, every job's state, step, devices
        and last events, and the control plane's log."""
        lines = [f"seed {self.seed} (SHOAL_CHAOS_SEED replays it); faults: {self.log}"]
        try:
            sweep = self.api.get(f"/sweeps/{self.sweep_id}")
            lines.append(f"sweep {sweep['state']}: {sweep['error']}")
            for job in self.jobs():
                events = [f"{e['kind']}: {e['message']}" for e in self.api.events(job["id"])]
                lines.append(
                    f"{job['name']} {job['state']} step {job['step']}/{job['steps']}"
                    f" on {job['devices']}: {events[-4:]}"
                )
        except (AssertionError, httpx.HTTPError) as exc:
            lines.append(f"(the API did not answer: {exc})")
        return "\n".join(lines) + "\n" + self.shoal.tail(120)

    def wait(self, condition: Callable[[], Any], what: str) -> Any:
        return wait_until(condition, CHAOS_TIMEOUT_S, what, on_timeout=self.where)

    def progress(self, names: Sequence[str]) -> None:
        """Wait until each of the jobs ``names`` not yet ended has trained PROGRESS_STEPS
        more steps (or ended SUCCEEDED); fail at once if one FAILED or was CANCELLED."""
        start = {j["name"]: j["step"] for j in self.jobs()}

        def moved() -> bool:
            by_name = {j["name"]: j for j in self.jobs()}
            bad = [j for j in by_name.values() if j["state"] in ("FAILED", "CANCELLED")]
            if bad:
                pytest.fail(
                    f"{bad[0]['name']} ended {bad[0]['state']}: {bad[0]['error']}\n" + self.where()
                )
            return all(
                by_name[n]["state"] == "SUCCEEDED"
                or by_name[n]["step"] >= start[n] + PROGRESS_STEPS
                for n in names
            )

        self.wait(moved, f"{', '.join(names)} to train {PROGRESS_STEPS} more steps")
        self.note(f"{PROGRESS_STEPS} more steps")

    def target(self, names: Sequence[str]) -> tuple[str, str]:
        """A random device, not the head's, of a running job among ``names`` or of the
        sweep, on a node holding as many of them as any: (what it strikes, device)."""
        devices = {d["id"]: d for d in self.devices()}
        jobs, trials = self.jobs(), self.trials()
        struck: dict[str, set[str]] = {}  # node -> the pipelines and the sweep it holds
        held = []
        for job in jobs:
            if job["state"] not in ACTIVE or not (job["name"] in names or job["id"] in trials):
                continue
            what = "the sweep" if job["id"] in trials else job["name"]
            for device_id in job["devices"]:
                if devices[device_id]["kind"] != "cpu-a":
                    struck.setdefault(devices[device_id]["node_id"], set()).add(what)
                    held.append(device_id)
        assert held, f"no running job holds a device a fault may hit\n{self.where()}"
        most = max(len(s) for s in struck.values())
        device_id = self.rng.choice(
            sorted(d for d in held if len(struck[devices[d]["node_id"]]) == most)
        )
        return " and ".join(sorted(struck[devices[device_id]["node_id"]])), device_id

    def replace_node(self) -> None:
        """A new machine joins, as the autoscaler sends one for a lost node."""
        self._joined += 1
        self.ray.add_node(parse_devices(f"2xcpu-{chr(ord('c') + self._joined)}:2048")[0])

    def kill_node(self, names: Sequence[str]) -> None:
        what, device_id = self.target(names)
        kind = self.device(device_id)["kind"]
        self.note(f"SIGKILL node {kind} (holding devices of {what})")
        self.ray.kill_node(self.ray.kinds.index(kind))
        self.replace_node()

    def drain_node(self, names: Sequence[str]) -> None:
        """Ray's drain notice (a spot preemption) for a node holding a running job's device:
        the jobs leave it at a step boundary (to free devices, or checkpointed to wait
        QUEUED), and so do the sweep's trials, checkpointed, with their executor; then it
        goes (the notice's deadline) and a new node joins."""
        what, device_id = self.target(names)
        node_id = self.device(device_id)["node_id"]
        on_node = {d["id"]: d["kind"] for d in self.devices() if d["node_id"] == node_id}
        self.note(f"drain node of {sorted(on_node)} (holding devices of {what})")
        ray_cli(
            self.shoal,
            "drain-node",
            f"--node-id={node_id}",
            "--reason=DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message=spot notice",
            "--deadline-remaining-seconds=120",
        )

        def left() -> bool:
            held = {d for j in self.jobs() if j["state"] in ACTIVE for d in j["devices"]}
            return not held & set(on_node)

        self.wait(left, f"every job to leave the drained node's {sorted(on_node)}")
        self.ray.kill_node(self.ray.kinds.index(on_node[device_id]))  # the notice's deadline
        self.replace_node()

    def kill_control_plane(self, late: Json) -> None:
        """SIGKILL `shoal up` just after it acknowledged a submission; start it again."""
        self.submit(late, "before-the-kill")
        self.note("SIGKILL the control plane")
        self.shoal.kill9()
        self.shoal = self.start()
        self.api.shoal = self.shoal

    def restart_database(self, late: Json) -> None:
        """Restart PostgreSQL while a submission is under way: the client retries the 503s
        (its Idempotency-Key makes that safe) and must end acknowledged."""
        self.note("restart PostgreSQL")
        during = threading.Thread(target=self.submit, args=(late, "during-the-restart"))
        restarting = threading.Thread(target=restart_postgres)
        restarting.start()
        during.start()
        restarting.join(150)
        during.join(60)
        assert late["name"] in self.acknowledged.values(), (
            f"a submission during the restart was not acknowledged\n{self.where()}"
        )

    def cancel(self, names: Sequence[str]) -> None:
        """Cancel the jobs ``names`` and wait until each has ended (one that ended on its
        own meanwhile may have SUCCEEDED)."""
        for job in self.jobs():
            if job["name"] in names and job["state"] in ACTIVE:
                response = httpx.post(
                    f"{self.shoal.url}/api/v1/jobs/{job['id']}/cancel",
                    headers=self.api.headers,
                    timeout=30.0,
                )
                assert response.status_code in (200, 409), (
                    f"cancel {job['name']}: {response.status_code} {response.text}\n" + self.where()
                )
        self.note(f"cancel {', '.join(names)}")
        self.wait(
            lambda: all(
                j["state"] in ("CANCELLED", "SUCCEEDED") for j in self.jobs() if j["name"] in names
            ),
            f"{', '.join(names)} to end cancelled",
        )

    def devices(self) -> list[Json]:
        items: list[Json] = self.api.get("/devices")["items"]
        return items

    def device(self, device_id: str) -> Json:
        found: Json = next(d for d in self.devices() if d["id"] == device_id)
        return found


@pytest.mark.timeout(900)  # 2.5-3 min on 2 cores; each wait below fails first, telling why
@pytest.mark.skipif(not Path("/etc/postgresql").is_dir(), reason="no local PostgreSQL server")
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_every_fault_at_once_leaves_every_job_exact_and_every_submission_once(
    empty_database: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("SHOAL_CHAOS_SEED") or random.SystemRandom().randrange(10_000))
    home = tmp_path / "home"
    home.mkdir()
    with (
        LocalRay(parse_devices(CHAOS_NODES), tmp_path / "ray") as ray,
        started_shoals() as started,
    ):
        ray.write_env(home / RAY_ENV)  # for `ray drain-node`

        def start() -> ShoalUp:
            log = tmp_path / "shoal-up.log"
            shoal = ShoalUp(home, empty_database, ray.address, log, env=ray.client_env)
            started.append(shoal)
            return shoal.start()

        chaos = Chaos(ray, start, seed)
        sweep_id = chaos.sweep_id
        chaos.wait(
            lambda: any(
                t["state"] == "RUNNING" for t in chaos.api.get(f"/sweeps/{sweep_id}")["trials"]
            ),
            "the sweep's trials to run",
        )
        names = ["pipeline-a", "pipeline-b"]
        for seed_of_job, name in enumerate(names, start=5):
            chaos.submit(chaos_job(name, seed_of_job, PIPELINE_STEPS), f"submit-{name}")
        chaos.progress(names)

        faults = chaos.rng.sample(FAULTS, len(FAULTS))
        under_way: dict[str, list[str]] = {}  # what each fault struck
        for fault in faults:
            under_way[fault] = chaos.under_way(names)
            assert set(names) & set(under_way[fault]), (
                f"the jobs ended before the fault '{fault}': lengthen them\n{chaos.where()}"
            )
            if fault == "kill a node":
                chaos.kill_node(names)
            elif fault == "drain a node":
                chaos.drain_node(names)
            elif fault == "kill the control plane":
                chaos.kill_control_plane(chaos_job("acknowledged-then-killed", 8, 20))
            else:
                chaos.restart_database(chaos_job("during-the-restart", 9, 20))
            chaos.progress(names)
        assert "sweep" in under_way[faults[0]], chaos.where()
        chaos.cancel(names)

        def ended() -> bool:
            jobs = chaos.jobs()
            sweep = chaos.api.get(f"/sweeps/{sweep_id}")
            return sweep["state"] == "SUCCEEDED" and all(
                j["state"] == "SUCCEEDED" or (j["name"] in names and j["state"] == "CANCELLED")
                for j in jobs
            )

        chaos.wait(ended, "every job and the sweep to succeed")
        chaos.note("every job and the sweep ended")
        api = chaos.api
        sweep = api.get(f"/sweeps/{sweep_id}")
        trials = {t["job_id"]: t for t in sweep["trials"]}
        jobs = chaos.jobs()
        # Every acknowledged submission exists once; nothing else was created.
        assert sorted(j["id"] for j in jobs) == sorted([*chaos.acknowledged, *trials])
        for job in jobs:
            spec = job["spec"]
            if job["id"] in trials:
                assert trials[job["id"]]["params"]["optimizer.lr"] == spec["optimizer"]["lr"]
            if job["state"] == "SUCCEEDED":
                assert job["step"] == spec["steps"], (job["name"], job["step"])
            # A cancelled pipeline: the steps it trained (plain SGD: a prefix of its run).
            assert_exact(api, job["id"], {**spec, "steps": job["step"]})
            events = api.events(job["id"])
            # A lost device costs at most the steps since the last checkpoint (both stages'
            # devices on one node: their in-memory copies went with it), or, recovered in
            # place, at most the steps since the latest copy the runner confirmed held.
            lost = [e for e in events if e["kind"] == "device_lost"]
            every = spec["checkpoint"]["every_steps"]
            most = [e["data"].get("most_replayed", every - 1) for e in lost]
            counts = [e["data"]["steps_replayed"] for e in lost]
            assert all(n <= m for n, m in zip(counts, most, strict=True)), chaos.where()
            kinds = [e["kind"] for e in events]
            # No job ran twice: the restarted control plane adopted every runner (none was
            # lost: they live on the head), and a job was placed again only after a loss or
            # a suspension.
            assert "runner_lost" not in kinds, chaos.where()
            again = kinds.count("device_lost") + kinds.count("suspended")
            assert kinds.count("placement") <= 1 + again, (job["name"], kinds)
            survived = {k: kinds.count(k) for k in RIDDEN if k in kinds}
            replayed = sum(e["data"]["steps_replayed"] for e in lost)
            print(
                f"{job['name']}: {job['step']} steps, {survived}, {replayed} steps replayed,"
                f" exact (checked by {time.monotonic() - chaos.began:.0f}s)"
            )
        chaos.note("every job checked")
        print(f"chaos seed {seed}: the faults {chaos.log}; what was under way at each: {under_way}")
