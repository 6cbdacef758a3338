"""One sweep's or job's fault is its own: the controller's loop, and other users' jobs, go on.

End to end through the controller on a real database (SQLite and PostgreSQL) with in-process
runners: sweeps of every algorithm run past their search space while another user's jobs
are placed, and a sweep or job whose step raises ends FAILED with the reason, alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.scheduler.devices import DEVICE_RESOURCE, NodeInfo
from shoal.service.auth import Principal
from shoal.service.cluster import InProcessCluster
from shoal.service.controller import Controller
from shoal.service.db.models import Job, Sweep, User
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.jobs import submit_job
from shoal.service.specs import validate_job_spec
from shoal.service.sweeps import list_trials, submit_sweep, trial_state
from shoal.service.sweepspec import validate_sweep_spec
from shoal.workers.snapshot import RunnerReport
from tests.factories import job_spec, sweep_spec
from tests.service.test_controller import NODES, make_controller

pytestmark = pytest.mark.integration

FOUR = [NodeInfo("e" * 56, True, {DEVICE_RESOURCE: 4.0}, NODES[0].labels)]
SHORT = {**sweep_spec()["base"], "steps": 6}
CHOICE = {"batch_size": {"type": "categorical", "choices": [16, 32]}}


def user(factory: SessionFactory, name: str) -> Principal:
    with transaction(factory) as session:
        row = User(name=name)
        session.add(row)
        session.flush()
        return Principal(row.id, row.name, False)


def job_state(factory: SessionFactory, job_id: str) -> tuple[str, str | None]:
    with factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.state, job.error


def sweep_state(factory: SessionFactory, sweep_id: str) -> dict[str, Any]:
    with factory() as session:
        sweep = session.get(Sweep, sweep_id)
        assert sweep is not None
        trials = [(t.number, trial_state(t), t.params) for t in list_trials(session, sweep_id)]
        return {"state": sweep.state, "error": sweep.error, "trials": trials}


def tick_until(
    controller: Controller, done: Callable[[], bool], what: Callable[[], object], timeout: float
) -> None:
    """Reconcile until ``done``; every tick must complete (``last_tick`` moves), as
    ``/readyz`` requires. On a timeout, say what was waited for."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f} s: {what()}"
        before = controller.last_tick
        controller.reconcile_once()
        assert controller.last_tick != before, f"a tick did not complete: {what()}"
        time.sleep(0.02)  # runners are threads: give them the GIL between ticks


def submit_sweeps(factory: SessionFactory, who: Principal) -> dict[str, str]:
    """A sweep of each algorithm that runs past its space, on either executor."""
    specs = {
        "grid, fewer points than max_trials": dict(
            algorithm="grid", space=CHOICE, max_trials=5, executor="sharp", devices=1
        ),
        "grid of one point": dict(
            algorithm="grid",
            space={"batch_size": {"type": "categorical", "choices": [32]}},
            max_trials=3,
            executor="jobs",
        ),
        "random over two points": dict(
            algorithm="random", space=CHOICE, max_trials=3, executor="sharp", devices=1
        ),
        "tpe over two points": dict(algorithm="tpe", space=CHOICE, max_trials=3, executor="jobs"),
    }
    return {
        what: submit_sweep(
            factory,
            who,
            validate_sweep_spec(
                sweep_spec(name=f"s{i}", base=SHORT, early_stopping={"rule": "none"}, **overrides),
                [],
            ),
        )[0].id
        for i, (what, overrides) in enumerate(specs.items())
    }


def submit(factory: SessionFactory, who: Principal, **overrides: object) -> str:
    return submit_job(factory, who, validate_job_spec(job_spec(**overrides), []))[0].id


def test_sweeps_of_every_algorithm_run_to_exhaustion_while_others_jobs_are_placed(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    alice, bob = user(session_factory, "alice"), user(session_factory, "bob")
    controller = make_controller(session_factory, InProcessCluster(FOUR), tmp_path)
    sweeps = submit_sweeps(session_factory, alice)
    first = submit(session_factory, bob, steps=400)

    def report() -> object:
        return {
            "sweeps": {what: sweep_state(session_factory, s) for what, s in sweeps.items()},
            "bob": [job_state(session_factory, j) for j in bobs],
        }

    def sweeps_ended() -> bool:
        return all(
            sweep_state(session_factory, s)["state"] in ("SUCCEEDED", "FAILED")
            for s in sweeps.values()
        )

    bobs = [first]
    tick_until(controller, sweeps_ended, report, timeout=200)
    # The first grid point told ended grid sweeps on the old code; keep ticking past the end.
    for _ in range(5):
        controller.reconcile_once()
    bobs.append(submit(session_factory, bob, steps=4))
    tick_until(
        controller,
        lambda: all(job_state(session_factory, j)[0] == "SUCCEEDED" for j in bobs),
        report,
        timeout=120,
    )
    ended = {what: sweep_state(session_factory, s) for what, s in sweeps.items()}
    for what, sweep in ended.items():
        assert sweep["state"] == "SUCCEEDED", (what, sweep)
        assert all(state == "SUCCEEDED" for _, state, _ in sweep["trials"]), (what, sweep)
    grid = ended["grid, fewer points than max_trials"]["trials"]
    assert sorted(p["batch_size"] for _, _, p in grid) == [16, 32]
    assert len(ended["grid of one point"]["trials"]) == 1


class Faulty(InProcessCluster):
    """In-process runners, but polling the jobs in ``broken`` raises a bug's error."""

    def __init__(self) -> None:
        super().__init__(FOUR)
        self.broken: set[str] = set()

    def poll(self, job_id: str, cursor: int) -> RunnerReport:
        if job_id in self.broken:
            raise ValueError(f"report of {job_id} does not parse")
        return super().poll(job_id, cursor)


def test_a_sweep_or_job_whose_step_fails_ends_failed_alone(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    alice, bob = user(session_factory, "alice"), user(session_factory, "bob")
    cluster = Faulty()
    controller = make_controller(session_factory, cluster, tmp_path)
    bad_sweep = submit_sweep(
        session_factory, alice, validate_sweep_spec(sweep_spec(base=SHORT, devices=1), [])
    )[0].id
    bad_queued = submit(session_factory, alice, name="queued-then-corrupt")
    bad_running = submit(session_factory, alice, name="running-then-broken", steps=100_000)
    with transaction(session_factory) as session:
        # Rows a newer or older version wrote: their specs no longer validate.
        sweep = session.get(Sweep, bad_sweep)
        job = session.get(Job, bad_queued)
        assert sweep is not None and job is not None
        sweep.spec = {**sweep.spec, "algorithm": "annealing"}
        job.spec = {**job.spec, "batch_size": "many"}
    tick_until(
        controller,
        lambda: job_state(session_factory, bad_running)[0] == "RUNNING",
        lambda: job_state(session_factory, bad_running),
        timeout=60,
    )
    cluster.broken.add(bad_running)
    good = submit(session_factory, bob, steps=4)
    tick_until(
        controller,
        lambda: job_state(session_factory, good)[0] == "SUCCEEDED",
        lambda: {
            "good": job_state(session_factory, good),
            "sweep": sweep_state(session_factory, bad_sweep),
            "queued": job_state(session_factory, bad_queued),
            "running": job_state(session_factory, bad_running),
        },
        timeout=120,
    )
    sweep = sweep_state(session_factory, bad_sweep)
    assert sweep["state"] == "FAILED" and "ValidationError" in sweep["error"], sweep
    for job_id, error in ((bad_queued, "ValidationError"), (bad_running, "does not parse")):
        state, message = job_state(session_factory, job_id)
        assert state == "FAILED" and message is not None and error in message, (state, message)
