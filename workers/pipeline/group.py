"""The worker group: the seam between the runner and the stages it drives.

A group holds one ``StageWorker`` per stage plan, addressed by the plan's position in the
list the group was built from (with one replica per stage, the stage index; with data
parallelism, ``workers.pipeline.runner`` lays replicas out replica-major). The runner calls
``submit(worker, method, *args)`` and gets a ``Handle``; a handle may be passed as an
argument of a later submit, which is how stage s's forward output becomes stage s+1's
input without the runner seeing it. ``get`` waits for handles and raises typed errors:
``StageFailed`` (a stage method raised; a call fed by a failed handle fails the same way),
``StageLost`` (the worker is gone), ``GroupTimeout``.

Ordering: each stage runs its calls in submission order. ``LocalGroup`` runs each call at
submit time; ``RayGroup`` relies on Ray's actor task order: a synchronous, single-threaded
actor without task retries runs the tasks of one submitter in submission order, a task
waiting for its arguments holding back the later ones (Ray 2.60 docs, "Actor Task
Execution Order", ray-core/actors/task-orders). So the runner, the only submitter, submits
every stage's actions in a dependency-respecting global order
(``scheduler.schedules.submission_order``) and the per-stage orders are exactly the
schedule.

Peer to peer: ``connect`` links every two neighbouring stages of each replica
(``workers.pipeline.transport``: a socket on CPU, NCCL on GPU), forming only the links that are
missing (after a start, a relayout, a recovery or a failed step) and closing those whose
pair is gone; a worker's ``step`` call then runs its whole step against its neighbours
(``workers.pipeline.step_program``). ``LocalGroup`` has no links: its runner relays every
activation, the reference the peer-to-peer path is tested against. A failed step's links
are broken (each stage closes its links when it fails), so ``disconnect`` forgets them.

Data parallelism: ``all_reduce(workers)`` sums the accumulated block gradients of the given
workers (the replicas of one stage, in replica order) into each of them, through
``workers.pipeline.collective``: in-process in ``LocalGroup``, over one gloo process group per
stage, formed when the group starts, in ``RayGroup``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import (
    ActorUnavailableError,
    ActorUnschedulableError,
    GetTimeoutError,
    ObjectLostError,
    RayActorError,
    RayError,
    RayTaskError,
)

from shoal.workers import launch
from shoal.workers.pipeline.awaited import Awaited
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.stage_worker import COPIES, MOOT, LinkFailed, StageFailed
from shoal.workers.pipeline.worker_group import (
    GroupTimeout,
    Handle,
    StageLost,
    WorkerNotStarted,
    own,
    wait_ready,
)
from shoal.workers.snapshot import StagePlan

CANNOT_HOST = "its node is gone or cannot host it"
"""Why a stage is lost when Ray cannot place its worker or lost an object with its node."""

LATE_CHECK_S = 2.0
"""How long a regroup whose workers timed out gives each new one to say it is built."""

NEW_NODE_S = 10.0
"""How long a worker Ray refuses a place on its node is started again (``RayGroup``)."""

NEW_NODE_RETRY_S = 0.5


BLAME_WAIT_S = 30.0
"""How long a failed step waits for its other calls to end, to blame the right stage: a
worker killed with its process is reported lost within ~0.1 s, a lost node's within
~15 s (measured, Ray 2.60)."""


@dataclass(frozen=True, eq=False)
class _Ref(Handle):
    ref: ray.ObjectRef[Any]


@dataclass
class _Prepared:
    """A worker started ahead of a regroup to ``plan`` (``RayGroup.prepare``), and the
    answer that says it is built."""

    plan: StagePlan
    actor: ActorHandle[Any]
    built: ray.ObjectRef[Any]
    since: float

    def built_or_failed(self) -> bool:
        ready, _ = ray.wait([self.built], timeout=0)
        return bool(ready)


class RayGroup:
    """One StageWorker actor per stage; handles are object refs, passed actor to actor."""

    groups_replicas = True

    def __init__(
        self, plans: Sequence[StagePlan], setup: StageSetup, *, start_timeout_s: float = 300.0
    ) -> None:
        self._plans = list(plans)
        self._setup = setup
        self._start_timeout_s = start_timeout_s
        self._actors: list[ActorHandle[Any]] = []
        self._parked: list[ActorHandle[Any]] = []
        self._prepared: dict[str, _Prepared] = {}
        """Workers started ahead of a regroup (``prepare``), by device id."""
        self._shut = False
        # Formed links, by the (lower, upper) actor pair they join; the names are unique.
        self._links: dict[tuple[str, str], str] = {}
        self._link_count = 0
        self._device_keys: dict[str, str] = {}
        try:
            try:
                self._start_ready(dict(enumerate(self._plans)), {})
            except GroupTimeout:
                late = self._late(dict(enumerate(self._plans)))
                if late:
                    raise self._not_started(self._plans[late[0]]) from None
                raise
            self._form_collectives(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _form_collectives(self, timeout: float) -> None:
        """One process group per replicated stage: replica 0 hosts, all replicas join; a
        stage no longer replicated leaves the group it had (a step would still sum in it)."""
        stages = _replicas_by_stage(self._plans)
        replicated = [ws for ws in stages if len(ws) > 1]
        self.get([self.submit(ws[0], "collective_leave") for ws in stages if len(ws) == 1], timeout)
        if not replicated:
            return
        hosts = self.get([self.submit(ws[0], "collective_host") for ws in replicated], timeout)
        joins = [
            self.submit(w, "collective_join", address, port, rank, len(ws), self._plans[w].index)
            for ws, (address, port) in zip(replicated, hosts, strict=True)
            for rank, w in enumerate(ws)
        ]
        self.get(joins, timeout)

    def _start_ready(
        self, plans: Mapping[int, StagePlan], kept: Mapping[int, ActorHandle[Any]]
    ) -> None:
        """Start workers for ``plans`` beside the ``kept`` ones (both by position) and wait
        until every worker is built. A worker refused a place on its node is started again
        for up to ``NEW_NODE_S`` while its node is alive: a node that has just joined is in
        Ray's cluster table, where devices are found, a moment before every node's
        scheduler knows it. The wait is what is left of the start timeout of the youngest
        new worker (one ``prepare``d long ago has had most of it: a move does not stall the
        job a whole timeout again for it), ``LATE_CHECK_S`` at least."""
        now = time.monotonic()
        deadline = now + NEW_NODE_S
        started = {w: self._take_prepared(p) for w, p in plans.items()}
        self._actors = [kept[w] if w in kept else started[w][0] for w in range(len(self._plans))]
        youngest = max((since for _, since in started.values()), default=now)
        wait = max(LATE_CHECK_S, self._start_timeout_s - (now - youngest))
        while True:
            try:
                wait_ready(self, self._plans, wait)
                return
            except StageLost as exc:
                refused = [w for w, p in plans.items() if p.device.id == exc.device_id]
                if (
                    exc.reason != CANNOT_HOST
                    or not refused
                    or time.monotonic() > deadline
                    or not launch.node_alive(plans[refused[0]].device.node_id)
                ):
                    raise
            time.sleep(NEW_NODE_RETRY_S)
            for w in refused:
                launch.kill_worker(self._actors[w])
                self._actors[w] = launch.start_stage_worker(plans[w], self._setup)
            wait = max(wait, self._start_timeout_s)  # started again now

    def _take_prepared(self, plan: StagePlan) -> tuple[ActorHandle[Any], float]:
        """The worker ``prepare`` started for ``plan``, else one started now; and when."""
        prepared = self._prepared.pop(plan.device.id, None)
        if prepared is not None and prepared.plan == plan:
            return prepared.actor, prepared.since
        if prepared is not None:
            launch.kill_worker(prepared.actor)
        return launch.start_stage_worker(plan, self._setup), time.monotonic()

    def prepare(self, plans: Sequence[StagePlan]) -> bool:
        have = {p.device.id for p in self._plans}
        wanted = {p.device.id: p for p in plans if p.device.id not in have}
        self._drop_prepared(wanted)
        for device_id, plan in wanted.items():
            if device_id not in self._prepared:
                actor = launch.start_stage_worker(plan, self._setup)
                built: ray.ObjectRef[Any] = actor.call.remote("nbytes")
                self._prepared[device_id] = _Prepared(plan, actor, built, time.monotonic())
        pending = [p for p in self._prepared.values() if not p.built_or_failed()]
        late = time.monotonic() - self._start_timeout_s
        return all(p.since < late for p in pending)

    def _drop_prepared(self, wanted: Mapping[str, StagePlan] | None = None) -> None:
        """Stop the prepared workers that are not for ``wanted`` (plans by device id)."""
        for device_id, prepared in list(self._prepared.items()):
            if (wanted or {}).get(device_id) != prepared.plan:
                launch.kill_worker(prepared.actor)
                del self._prepared[device_id]

    def regroup(self, plans: Sequence[StagePlan], keep: Mapping[int, int]) -> None:
        old, parked, was = self._actors, list(self._parked), self._plans
        self._parked += [a for i, a in enumerate(old) if i not in set(keep.values())]
        self._plans = list(plans)
        started = {w: p for w, p in enumerate(plans) if w not in keep}
        try:
            self._start_ready(started, {w: old[i] for w, i in keep.items()})
        except (GroupTimeout, StageLost) as exc:
            # The group is as it was (the new workers stopped), so that a recovery asks the
            # workers it had; a new worker not started in time is its device's loss.
            formed = self._actors is not old  # else no new worker was started
            late = self._late(started) if formed and isinstance(exc, GroupTimeout) else []
            for w in started if formed else ():
                launch.kill_worker(self._actors[w])
            self._actors, self._parked, self._plans = old, parked, was
            if late:
                raise self._not_started(plans[late[0]]) from None
            raise
        finally:
            self._drop_prepared()  # workers prepared for other plans free their devices
        self._form_collectives(self._start_timeout_s)

    def _not_started(self, plan: StagePlan) -> WorkerNotStarted:
        reason = (
            f"its worker did not start within {self._start_timeout_s:g} s; the device may be"
            " held by something else, its node not answering, or its blocks slow to build"
        )
        return WorkerNotStarted(plan.index, plan.device.id, reason)

    def _late(self, started: Mapping[int, StagePlan]) -> list[int]:
        """The ``started`` workers (by position) not built yet: each answers at once if it is."""
        calls = {w: own(self.submit(w, "nbytes"), _Ref).ref for w in started}
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=LATE_CHECK_S)
        return [w for w, ref in calls.items() if ref not in ready]

    def connect(self) -> str | None:
        pairs = _neighbours(self._plans)
        unlinkable = _mixed_pair(self._plans, pairs) or self._shared_gpu(pairs)
        if unlinkable is not None:
            return unlinkable
        ids = [a._actor_id.hex() for a in self._actors]
        wanted = {w: (ids[w], ids[w + 1]) for w in pairs}
        new = [w for w in pairs if wanted[w] not in self._links]
        if not new and len(self._links) == len(wanted):
            return None
        links = {key: self._links[key] for key in wanted.values() if key in self._links}
        for w in new:
            self._link_count += 1
            links[wanted[w]] = f"link-{self._link_count}"
        self._links = {}  # believed formed only once every join answered

        def name(w: int) -> str | None:
            return links[wanted[w]] if w in wanted else None

        timeout = self._start_timeout_s
        keeps = [
            self.submit(w, "link_keep", {-1: name(w - 1), 1: name(w)})
            for w in range(len(self._actors))
        ]
        hosts = [self.submit(w, "link_host", 1, name(w)) for w in new]
        where = self.get([*keeps, *hosts], timeout)[len(keeps) :]
        joins = []
        # Ascending: a worker joins its link below before its link above, so the pairs
        # form from stage 0 up (a host's join waits for the other end).
        for w, (address, port) in zip(new, where, strict=True):
            joins.append(self.submit(w, "link_join", 1, name(w), address, port))
            joins.append(self.submit(w + 1, "link_join", -1, name(w), address, port))
        self.get(joins, timeout)
        self._links = links
        return None

    def _shared_gpu(self, pairs: Sequence[int]) -> str | None:
        """Why neighbours cannot link, if two of them share one GPU (NCCL refuses two
        ranks on one device); None otherwise."""
        gpus = sorted({w for p in pairs for w in (p, p + 1) if self._plans[w].device.gpu})
        ids = {w: self._actors[w]._actor_id.hex() for w in gpus}
        unknown = [w for w in gpus if ids[w] not in self._device_keys]
        found = self.get([self.submit(w, "device_key") for w in unknown], self._start_timeout_s)
        self._device_keys.update({ids[w]: k for w, k in zip(unknown, found, strict=True)})
        keys = {w: self._device_keys[i] for w, i in ids.items()}
        for w in pairs:
            if w in keys and keys[w] == keys.get(w + 1):
                a, b = self._plans[w].device.id, self._plans[w + 1].device.id
                return f"devices {a} and {b} are one GPU, which NCCL cannot link to itself"
        return None

    def disconnect(self) -> None:
        self._links = {}

    def retire(self) -> None:
        parked, self._parked = self._parked, []
        for actor in parked:
            launch.kill_worker(actor)

    def submit(self, stage: int, method: str, *args: Any) -> Handle:
        # A call waits for another call's result itself (``awaited``), not Ray before it
        # runs: a wait that a loss makes moot then ends when the loss is surveyed.
        refs = [Awaited(a.ref) if isinstance(a, _Ref) else a for a in args]
        call: Any = self._actors[stage].call
        if method in COPIES:
            call = call.options(concurrency_group=launch.COPIES_GROUP)
        elif method == MOOT:
            call = call.options(concurrency_group=launch.MOOT_GROUP)
        return _Ref(stage, method, call.remote(method, *refs))

    def all_reduce(self, workers: Sequence[int]) -> list[Handle]:
        # Each replica's call runs after its backwards (actor order) and meets the others in
        # their stage's process group.
        return [self.submit(w, "all_reduce") for w in workers]

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        refs = [own(h, _Ref) for h in handles]
        if self._shut and refs:
            plan = self._plans[refs[0].stage]
            raise StageLost(plan.index, plan.device.id, "the group was shut down")
        try:
            return list(ray.get([h.ref for h in refs], timeout=timeout))
        except GetTimeoutError:
            stages = sorted({h.stage for h in refs})
            raise GroupTimeout(
                f"stages {stages} did not answer within {timeout:g} s; a device may be"
                " overloaded or unreachable"
            ) from None
        except (RayTaskError, RayActorError, ActorUnschedulableError, ObjectLostError) as exc:
            error = self._typed(exc, refs)
            if isinstance(error, LinkFailed):
                error = self._blame(refs)
            raise error from None

    def _typed(self, exc: RayError, waited: Sequence[_Ref]) -> Exception:
        """The group's error for a failed call among ``waited``."""
        if isinstance(exc, RayTaskError):
            # A call fed by a failed or lost call fails with that call's error as its cause.
            if isinstance(exc.cause, (StageFailed, StageLost)):
                return exc.cause
            if isinstance(exc.cause, RayActorError):
                return self._lost(exc.cause, waited)
            if not isinstance(exc.cause, ObjectLostError):
                return exc
        if isinstance(exc, RayActorError):
            return self._lost(exc, waited)
        # Unschedulable, or an object a call returned or took lost with its node (a call
        # whose worker died returns no object: it cannot be rebuilt).
        plan = self._plans[_failed_stage(waited)]
        return StageLost(plan.index, plan.device.id, CANNOT_HOST)

    def _blame(self, waited: Sequence[_Ref]) -> Exception:
        """A transfer between neighbours failed, and a stage that fails closes its links,
        so the neighbours of the cause fail too: wait (``BLAME_WAIT_S`` at most) for every
        call to end, and blame a lost worker, else a stage's own error, else the neighbour
        that a stage could not reach (lost without Ray noticing yet)."""
        ray.wait([h.ref for h in waited], num_returns=len(waited), timeout=BLAME_WAIT_S)
        own: Exception | None = None
        unreachable: StageLost | None = None
        collective: LinkFailed | None = None
        for handle in waited:
            try:
                ray.get(handle.ref, timeout=0)
            except GetTimeoutError:
                continue
            except (RayTaskError, RayActorError, ActorUnschedulableError, ObjectLostError) as exc:
                error = self._typed(exc, [handle])
                if isinstance(error, StageLost):
                    return error
                if isinstance(error, LinkFailed) and error.peer is None:
                    collective = collective or error
                elif isinstance(error, LinkFailed):
                    unreachable = unreachable or self._unreachable(handle.stage, error)
                elif own is None:
                    own = error
        blamed = own or unreachable or collective
        if blamed is None:  # pragma: no cover - a LinkFailed led here
            raise RuntimeError("no failed call among the waited ones")
        return blamed

    def _unreachable(self, worker: int, error: LinkFailed) -> StageLost:
        plan = self._plans[worker + (error.peer or 0)]
        return StageLost(
            plan.index,
            plan.device.id,
            f"its neighbour, stage {error.stage}, lost the link to it ({error.reason})",
        )

    def _lost(self, exc: RayActorError, waited: Sequence[_Ref]) -> StageLost:
        # The error names the dead actor (``_actor_id`` is the only handle-side id to match
        # it with); when it names none, the first failed call we waited on is to blame.
        ids = [a._actor_id.hex() for a in self._actors]
        worker = ids.index(exc.actor_id) if exc.actor_id in ids else _failed_stage(waited)
        if exc.preempted:
            reason = "its node was preempted"
        elif isinstance(exc, ActorUnavailableError):
            reason = "its worker is unreachable (node lost or overloaded)"
        else:
            reason = "its worker died"
        plan = self._plans[worker]
        return StageLost(plan.index, plan.device.id, reason)

    def shutdown(self) -> None:
        # Calls fail as StageLost from now on, as in LocalGroup, by the group's own record:
        # ray.kill is asynchronous, and a killed actor may still answer a call submitted
        # right after it (measured: 4 times in 15).
        self._shut = True
        self._drop_prepared()
        for actor in [*self._actors, *self._parked]:
            launch.kill_worker(actor)


def _neighbours(plans: Sequence[StagePlan]) -> list[int]:
    """Positions ``w`` whose worker ``w + 1`` is the next stage of the same replica."""
    return [
        w
        for w, (a, b) in enumerate(pairwise(plans))
        if a.replica == b.replica and b.index == a.index + 1
    ]


def _mixed_pair(plans: Sequence[StagePlan], pairs: Sequence[int]) -> str | None:
    """Why neighbours cannot link, if a GPU stage neighbours a CPU one (a link is NCCL
    between GPUs, a socket between CPUs); None otherwise."""
    for w in pairs:
        a, b = plans[w].device, plans[w + 1].device
        if a.gpu != b.gpu:
            kinds = ("a GPU" if a.gpu else "a CPU", "a GPU" if b.gpu else "a CPU")
            return f"device {a.id} is {kinds[0]} and {b.id} {kinds[1]}, which no link joins"
    return None


def _replicas_by_stage(plans: Sequence[StagePlan]) -> list[list[int]]:
    """Worker positions of each stage's replicas, in replica order, stages in index order."""
    by_stage: dict[int, list[tuple[int, int]]] = {}
    for position, plan in enumerate(plans):
        by_stage.setdefault(plan.index, []).append((plan.replica, position))
    return [[w for _, w in sorted(by_stage[s])] for s in sorted(by_stage)]


def _failed_stage(waited: Sequence[_Ref]) -> int:
    """The stage of the first call in ``waited`` that has failed (the first call if none)."""
    for handle in waited:
        try:
            ray.get(handle.ref, timeout=0)
        except GetTimeoutError:
            continue
        except RayError:
            return handle.stage
    return waited[0].stage
