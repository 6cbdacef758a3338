"""The control plane's one Ray adapter: read the node inventory, start/poll/stop runners.

The controller talks to a ``Cluster`` (a protocol), so its logic is tested against the same
contract whether runners live on Ray or not. Every Ray call here has a timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from shoal.scheduler.devices import Device, NodeInfo
from shoal.scheduler.types import JobId
from shoal.workers.snapshot import JobSnapshot, RunnerReport, StagePlan
from shoal.workers.uploaded_code import JobCode

if TYPE_CHECKING:
    from shoal.workers.pipeline.worker_group import GroupFactory
    from shoal.workers.sharp.shard_pool import PoolFactory


class RunnerGone(RuntimeError):
    """The job's runner is dead or absent; the message says why."""


class ClusterUnavailable(RuntimeError):
    """Ray did not answer in time; the controller retries on its next tick."""


class Cluster(Protocol):
    def nodes(self) -> list[NodeInfo]: ...

    def start_runner(self, snapshot: JobSnapshot) -> None: ...

    def poll(self, job_id: JobId, cursor: int) -> RunnerReport: ...

    def cancel(self, job_id: JobId) -> None: ...

    def suspend(self, job_id: JobId) -> None:
        """Ask the job's runner to checkpoint at its next step boundary and stop there."""
        ...

    def relayout(
        self, job_id: JobId, plans: Sequence[StagePlan], split: Sequence[int], since: Sequence[str]
    ) -> None:
        """Ask the job's runner to move to ``plans`` at its next step boundary, planned
        while the job was on the devices ``since`` (on others by then, it drops the move)."""
        ...

    def stop_runner(self, job_id: JobId) -> None: ...

    # A sweep's SHARP executor ("pool"): its trials are trained together on its devices.

    def start_pool(
        self, sweep_id: str, devices: Sequence[Device], policy: str, code: JobCode | None
    ) -> None:
        """Start the sweep's executor on ``devices`` (with the sweep's uploaded ``code``)
        unless it runs already."""
        ...

    def has_pool(self, sweep_id: str) -> bool: ...

    def add_trial(self, sweep_id: str, snapshot: JobSnapshot) -> None: ...

    def poll_trial(self, sweep_id: str, job_id: JobId, cursor: int) -> RunnerReport: ...

    def cancel_trial(self, sweep_id: str, job_id: JobId) -> None: ...

    def suspend_trial(self, sweep_id: str, job_id: JobId) -> None:
        """Ask the executor to checkpoint the trial at its next step boundary and end it."""
        ...

    def lost_pool_devices(self, sweep_id: str) -> set[str]:
        """The devices the sweep's executor found lost (it trains on the others)."""
        ...

    def close_pool(self, sweep_id: str) -> None:
        """No more trials: the executor ends once its trials have (and is then stopped)."""
        ...


POLL_TIMEOUT_S = 5.0
"""The longest a poll of a job's runner waits (at most the Ray timeout): runners
answer polls on a thread of their own within milliseconds, and the controller polls every
running job in turn each tick, so an actor that does not answer (``service.silence``)
must not hold up every other job for the whole Ray timeout, tick after tick. A poll that
times out loses nothing: the next one reads from the same cursor."""


class RayCluster:
    """``Cluster`` on a Ray cluster: connects once, then drives runners by name."""

    def __init__(self, address: str | None, *, timeout_s: float) -> None:
        self._ray = connect_ray(address)
        self._timeout_s = timeout_s
        self._poll_s = min(POLL_TIMEOUT_S, timeout_s)

    def nodes(self) -> list[NodeInfo]:
        # Ray keeps drain requests (node id -> deadline) apart from the node table; Ray
        # Train's own preemption watcher reads them through the same call.
        draining = self._ray._private.state.state.get_draining_nodes()
        return [
            NodeInfo(
                node_id=str(node["NodeID"]),
                alive=bool(node["Alive"]),
                resources=dict(node.get("Resources") or {}),
                labels=dict(node.get("Labels") or {}),
                draining=str(node["NodeID"]) in draining,
            )
            for node in self._ray.nodes()
        ]

    def start_runner(self, snapshot: JobSnapshot) -> None:
        from shoal.workers.actors import start_runner

        start_runner(snapshot)

    def _ask(
        self, handle: Any, what: str, method: str, *args: Any, timeout_s: float | None = None
    ) -> Any:
        """Call ``method`` of the actor ``handle`` (``what`` names it in errors) and wait
        ``timeout_s`` at most (default: the Ray timeout)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        if handle is None:
            raise RunnerGone(f"{what} is gone (no live actor with its name)")
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        try:
            return self._ray.get(getattr(handle, method).remote(*args), timeout=wait_s)
        except RayActorError as exc:
            raise RunnerGone(f"{what} died: {_first_line(exc)}") from None
        except GetTimeoutError:
            raise ClusterUnavailable(
                f"{what} did not answer {method} within {wait_s:g} s"
            ) from None

    def _call(self, job_id: JobId, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        from shoal.workers.actors import find_runner

        runner = find_runner(job_id)
        return self._ask(runner, f"runner of job {job_id}", method, *args, timeout_s=timeout_s)

    def poll(self, job_id: JobId, cursor: int) -> RunnerReport:
        report: RunnerReport = self._call(job_id, "poll", cursor, timeout_s=self._poll_s)
        return report

    def cancel(self, job_id: JobId) -> None:
        self._call(job_id, "cancel")

    def suspend(self, job_id: JobId) -> None:
        self._call(job_id, "suspend")

    def relayout(
        self, job_id: JobId, plans: Sequence[StagePlan], split: Sequence[int], since: Sequence[str]
    ) -> None:
        self._call(job_id, "relayout", tuple(plans), tuple(split), tuple(since))

    def stop_runner(self, job_id: JobId) -> None:
        from shoal.workers.actors import kill_runner

        kill_runner(job_id)

    def start_pool(
        self, sweep_id: str, devices: Sequence[Device], policy: str, code: JobCode | None
    ) -> None:
        from shoal.workers.actors import start_pool

        start_pool(sweep_id, devices, policy, code)

    def has_pool(self, sweep_id: str) -> bool:
        from shoal.workers.actors import find_pool

        return find_pool(sweep_id) is not None

    def _pool_call(self, sweep_id: str, method: str, *args: Any) -> Any:
        from shoal.workers.actors import find_pool

        return self._ask(find_pool(sweep_id), f"the executor of sweep {sweep_id}", method, *args)

    def add_trial(self, sweep_id: str, snapshot: JobSnapshot) -> None:
        self._pool_call(sweep_id, "add", snapshot)

    def poll_trial(self, sweep_id: str, job_id: JobId, cursor: int) -> RunnerReport:
        report: RunnerReport = self._pool_call(sweep_id, "poll", job_id, cursor)
        return report

    def cancel_trial(self, sweep_id: str, job_id: JobId) -> None:
        self._pool_call(sweep_id, "cancel", job_id)

    def suspend_trial(self, sweep_id: str, job_id: JobId) -> None:
        self._pool_call(sweep_id, "suspend", job_id)

    def lost_pool_devices(self, sweep_id: str) -> set[str]:
        return set(self._pool_call(sweep_id, "lost_devices"))

    def close_pool(self, sweep_id: str) -> None:
        from shoal.workers.actors import kill_pool

        try:
            self._pool_call(sweep_id, "close")
        except RunnerGone:
            return
        kill_pool(sweep_id)


_CONNECTING = threading.Lock()


def connect_ray(address: str | None) -> Any:
    """Join the Ray cluster at ``address`` (``auto``: the one on this machine) unless this
    process has; the ``ray`` module."""
    import ray

    from shoal.workers.actors import RUNNER_NAMESPACE

    with _CONNECTING:
        if not ray.is_initialized():
            ray.init(
                address=address or "auto",
                namespace=RUNNER_NAMESPACE,
                log_to_driver=False,
                configure_logging=False,
            )
    return ray


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class InProcessCluster:
    """``Cluster`` whose runners are threads of this process, on in-process stages.

    The same runner code drives ``workers.pipeline.group.LocalGroup`` instead of Ray actors: the
    controller's contract tests run against it and against ``RayCluster`` alike.
    """

    def __init__(
        self,
        nodes: Sequence[NodeInfo],
        make_pool: PoolFactory | None = None,
        make_group: GroupFactory | None = None,
    ) -> None:
        from shoal.workers.pipeline.job_runner import JobRunner
        from shoal.workers.pipeline.local_group import LocalGroup
        from shoal.workers.sharp.shard_pool import LocalPool

        self._nodes = list(nodes)
        self._make_pool: PoolFactory = make_pool or LocalPool
        """The sweeps' executors' device workers: threads of this process."""
        self._make_group: GroupFactory = make_group or LocalGroup
        """The jobs' stage workers: in this process."""
        self._runners: dict[JobId, JobRunner] = {}
        self._pools: dict[str, Any] = {}
        self._lock = threading.Lock()

    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def start_runner(self, snapshot: JobSnapshot) -> None:
        from shoal.workers.pipeline.job_runner import JobRunner

        with self._lock:
            if snapshot.job_id in self._runners:
                return  # like a named actor: never two runners for one job
            self._runners[snapshot.job_id] = JobRunner(snapshot, self._make_group)  # trains on

    def _runner(self, job_id: JobId) -> Any:
        with self._lock:
            runner = self._runners.get(job_id)
        if runner is None:
            raise RunnerGone(f"runner of job {job_id} is gone (no runner in this process)")
        return runner

    def poll(self, job_id: JobId, cursor: int) -> RunnerReport:
        report: RunnerReport = self._runner(job_id).poll(cursor)
        return report

    def cancel(self, job_id: JobId) -> None:
        self._runner(job_id).cancel()

    def suspend(self, job_id: JobId) -> None:
        self._runner(job_id).suspend()

    def relayout(
        self, job_id: JobId, plans: Sequence[StagePlan], split: Sequence[int], since: Sequence[str]
    ) -> None:
        self._runner(job_id).relayout(plans, split, since)

    def start_pool(
        self, sweep_id: str, devices: Sequence[Device], policy: str, code: JobCode | None
    ) -> None:
        """Uploaded ``code`` is not shipped: threads of this process cannot import it apart
        (its factories fail the trials that name them)."""
        from shoal.workers.sharp.sweep_executor import SweepExecutor

        with self._lock:
            if sweep_id in self._pools:
                return
            self._pools[sweep_id] = SweepExecutor(devices, self._make_pool, policy)  # trains on

    def has_pool(self, sweep_id: str) -> bool:
        with self._lock:
            return sweep_id in self._pools

    def _pool(self, sweep_id: str) -> Any:
        with self._lock:
            pool = self._pools.get(sweep_id)
        if pool is None:
            raise RunnerGone(f"the executor of sweep {sweep_id} is gone (none in this process)")
        return pool

    def add_trial(self, sweep_id: str, snapshot: JobSnapshot) -> None:
        self._pool(sweep_id).add(snapshot)

    def poll_trial(self, sweep_id: str, job_id: JobId, cursor: int) -> RunnerReport:
        report: RunnerReport = self._pool(sweep_id).poll(job_id, cursor)
        return report

    def cancel_trial(self, sweep_id: str, job_id: JobId) -> None:
        self._pool(sweep_id).cancel(job_id)

    def suspend_trial(self, sweep_id: str, job_id: JobId) -> None:
        self._pool(sweep_id).suspend(job_id)

    def lost_pool_devices(self, sweep_id: str) -> set[str]:
        return set(self._pool(sweep_id).lost_devices())

    def close_pool(self, sweep_id: str) -> None:
        with self._lock:
            pool = self._pools.pop(sweep_id, None)
        if pool is not None:
            pool.close()

    def stop_runner(self, job_id: JobId) -> None:
        """Forget the runner (it stops at its next step boundary), like killing the actor."""
        with self._lock:
            runner = self._runners.pop(job_id, None)
        if runner is not None:
            runner.cancel()
            runner.wait(60)
