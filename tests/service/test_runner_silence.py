"""A job's runner that answers none of the controller's polls is taken for lost in time.

A runner answers its polls on a thread of its own, while it trains; one that never answers
(its actor never started, its process wedged) must not keep its job RUNNING forever. Past
``runner_silence_s`` of unanswered polls in a row the controller stops it and resumes the
job from its latest checkpoint on a new one, as after a runner that died
(``service.silence``, ``service.controller``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.service.auth import Principal
from shoal.service.cluster import (
    POLL_TIMEOUT_S,
    Cluster,
    ClusterUnavailable,
    InProcessCluster,
)
from shoal.service.controller import Controller, ControllerConfig
from shoal.service.db.models import JobEvent
from shoal.service.db.session import SessionFactory
from shoal.service.jobs import request_cancel
from shoal.service.setbacks import MAX_RESTARTS
from shoal.service.silence import Silences
from shoal.workers.snapshot import RunnerReport
from tests.service.test_controller import (
    NODES,
    TwoDeviceRay,
    events,
    job,
    owner,
    reconcile_until,
    submit,
)

SILENCE_S = 1.0
"""The in-process runners' silence: they answer at once once made."""
RAY_SILENCE_S = 15.0
"""On Ray a new runner's actor takes seconds to start on a loaded 2-core machine (its polls
wait meanwhile): with 1 s, the real runner that replaced the wedged one was itself taken
for lost three times in a CI run."""


def controller_of(
    factory: SessionFactory, cluster: Cluster, tmp_path: Path, silence_s: float = SILENCE_S
) -> Controller:
    config = ControllerConfig(checkpoint_root=str(tmp_path / "ckpt"), runner_silence_s=silence_s)
    return Controller(factory, cluster, config)


@pytest.mark.unit
def test_silences_count_from_the_first_unanswered_poll_and_start_again_after_an_answer() -> None:
    now = [0.0]
    silences = Silences(10.0, clock=lambda: now[0])
    assert silences.unanswered("a") is None
    now[0] = 9.0
    assert silences.unanswered("a") is None
    silences.answered("a")  # an answer: the count starts again
    now[0] = 12.0
    assert silences.unanswered("a") is None and silences.unanswered("b") is None
    now[0] = 22.5
    assert silences.unanswered("a") == 10.5  # 12.0 to 22.5
    assert silences.unanswered("a") is None  # reported once: counted afresh from here
    assert silences.unanswered("b") == 10.5
    with pytest.raises(ValueError, match="limit_s"):
        Silences(0.0)


class Mute(InProcessCluster):
    """In-process runners whose polls go unanswered while their job is in ``mute`` (as a
    Ray call that times out)."""

    def __init__(self) -> None:
        super().__init__(NODES)
        self.mute: set[str] = set()

    def poll(self, job_id: str, cursor: int) -> RunnerReport:
        if job_id in self.mute:
            raise ClusterUnavailable(f"runner of job {job_id} did not answer poll within 1 s")
        return super().poll(job_id, cursor)


@pytest.mark.integration
def test_a_runner_that_never_answers_fails_its_job_after_its_restarts_saying_why(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    cluster = Mute()
    controller = controller_of(session_factory, cluster, tmp_path)
    job_id = submit(session_factory, owner(session_factory), steps=100_000)
    cluster.mute.add(job_id)
    started = time.monotonic()
    reconcile_until(
        controller,
        lambda: job(session_factory, job_id).state == "FAILED",
        timeout=60,
        what=lambda: [(e.kind, e.message) for e in events(session_factory, job_id)],
    )
    # Each runner was given the whole silence before it was taken for lost.
    assert time.monotonic() - started >= (MAX_RESTARTS + 1) * SILENCE_S
    history = events(session_factory, job_id)
    lost = [e for e in history if e.kind == "runner_lost"]
    assert len(lost) == MAX_RESTARTS, lost  # the last silence failed the job instead
    assert all("did not answer poll" in why for why in recovering(history)), history
    error = job(session_factory, job_id).error or ""
    assert "no answer for" in error and "times without the job passing step 0" in error


def recovering(history: list[JobEvent]) -> list[str]:
    """Why the job turned RECOVERING, each time."""
    return [e.message for e in history if e.kind == "state" and e.data["to"] == "RECOVERING"]


class Wedged:
    """An actor under a job's runner name that answers no poll (a runner wedged from its
    start): the controller finds it by name, as it finds a runner."""

    def poll(self, cursor: int) -> None:
        time.sleep(3600)


@pytest.fixture
def wedge(ray_address: str) -> Iterator[Callable[[str], None]]:
    """Give a job, before its runner starts, a ``Wedged`` actor under the runner's name;
    whatever of them is left is killed at the end."""
    import ray

    from shoal.workers.actors import RUNNER_NAMESPACE, runner_name

    handles: list[Any] = []

    def start(job_id: str) -> None:
        actor: Any = ray.remote(num_cpus=0)(Wedged)
        options = {"name": runner_name(job_id), "namespace": RUNNER_NAMESPACE}
        handles.append(actor.options(**options, lifetime="detached").remote())

    yield start
    for handle in handles:
        ray.kill(handle)


@pytest.mark.integration
def test_a_wedged_runner_on_ray_is_stopped_and_its_job_resumes_on_a_new_one(
    session_factory: SessionFactory,
    ray_address: str,
    wedge: Callable[[str], None],
    tmp_path: Path,
) -> None:
    """On Ray: the job's runner name is held by an actor that never answers a poll. After
    the silence the controller kills it, starts a real runner, and the job trains."""
    cluster = TwoDeviceRay(ray_address, timeout_s=0.5)
    controller = controller_of(session_factory, cluster, tmp_path, RAY_SILENCE_S)
    who: Principal = owner(session_factory)
    job_id = submit(session_factory, who, steps=100_000)  # ends only when cancelled
    wedge(job_id)

    def trains_again() -> bool:
        row = job(session_factory, job_id)
        lost = [e for e in events(session_factory, job_id) if e.kind == "runner_lost"]
        return bool(lost) and row.state == "RUNNING" and row.step > 2

    reconcile_until(
        controller,
        trains_again,
        timeout=RAY_SILENCE_S + 90,
        what=lambda: [(e.kind, e.message) for e in events(session_factory, job_id)],
    )
    history = events(session_factory, job_id)
    (lost,) = [e for e in history if e.kind == "runner_lost"]
    (why,) = recovering(history)
    assert "did not answer poll" in why and "no answer for" in why, why
    assert lost.data["step"] == 0 and job(session_factory, job_id).attempt == 2
    request_cancel(session_factory, who, job_id)
    reconcile_until(controller, lambda: job(session_factory, job_id).state == "CANCELLED")


@pytest.mark.integration
def test_a_wedged_runner_holds_up_each_tick_for_the_poll_timeout_not_the_ray_timeout(
    session_factory: SessionFactory, ray_address: str, wedge: Callable[[str], None], tmp_path: Path
) -> None:
    """The controller polls every job in turn: a runner that does not answer costs each
    tick ``POLL_TIMEOUT_S``, not the 30 s of every other Ray call."""
    config = ControllerConfig(checkpoint_root=str(tmp_path / "ckpt"))  # silence: 300 s
    controller = Controller(session_factory, TwoDeviceRay(ray_address, timeout_s=30), config)
    job_id = submit(session_factory, owner(session_factory), steps=100_000)
    wedge(job_id)
    controller.reconcile_once()  # placed: its runner is the wedged actor
    assert job(session_factory, job_id).state == "RUNNING"
    began = time.monotonic()
    controller.reconcile_once()
    took = time.monotonic() - began
    assert POLL_TIMEOUT_S <= took < POLL_TIMEOUT_S + 10, took
    assert job(session_factory, job_id).state == "RUNNING"  # 300 s of silence not reached
