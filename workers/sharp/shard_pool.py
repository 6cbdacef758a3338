"""The SHARP executor's devices: one ``ShardWorker`` per device, behind one seam.

``LocalPool`` runs each worker in this process on a thread of its own (unit tests, no Ray);
``RayPool`` runs each as a ShardWorker actor on its device (``workers.launch``). Both run a
worker's calls one at a time in submission order and different workers' calls at once, and
both pass the same contract: ``submit`` returns a ``Call``, ``wait`` returns the calls that
have finished, ``result`` gives a call's value or raises ``ShardFailed`` (the worker's method
raised), ``HostLost`` (the worker, its device or its node is gone) or ``InputLost`` (the
call's input, another task's outputs, was lost with the node that held it). A shard task's
(``forward``, ``backward``) value is its ``TaskResult``; its tensors for the model's next task
are ``outputs``, a handle to pass to that task's ``submit``, even before the task has run: on
Ray an object reference, so activations and gradients go from worker to worker and never
through the executor, and the next task waits for them on its worker's queue.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle
from ray.exceptions import (
    ActorUnschedulableError,
    GetTimeoutError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
    TaskCancelledError,
)

from shoal.scheduler.devices import Device
from shoal.scheduler.types import DeviceId
from shoal.workers import launch
from shoal.workers.sharp.shard_worker import PAIRED_METHODS, ShardFailed, ShardWorker

log = logging.getLogger(__name__)


class HostLost(RuntimeError):
    """A device's worker is gone with every shard it held."""

    def __init__(self, device_id: str, reason: str) -> None:
        super().__init__(f"device {device_id} was lost: {reason}")
        self.device_id = device_id
        self.reason = reason


class InputLost(RuntimeError):
    """A call's input (another call's outputs) was lost with the node that held it."""

    def __init__(self, device_id: str) -> None:
        super().__init__(
            f"a task's input for device {device_id} was lost with the node that held it"
        )
        self.device_id = device_id
        self.reason = "a task's input was lost with the node that held it"


class PoolTimeout(TimeoutError):
    """No call finished in time."""


NODE_CHECK_S = 10.0
"""How long ``RayPool.wait`` waits with no call ending before it asks Ray whether the nodes
of the devices it waits for, or whose outputs other calls take, are alive. After a node's
SIGKILL, Ray 2.60 was seen to leave calls pending for good: calls of the lost device's
worker (no error came), and a call waiting on a surviving worker's queue for its input,
the lost device's outputs (its raylet pulling them from the dead node), which blocks that
worker's later calls. A device whose node has been found gone for this long is lost: its
unfinished calls end ``HostLost``, and the calls waiting for its outputs are cancelled
(``InputLost``), so the surviving worker's later calls run. (By then Ray has failed the
calls whose input was never made: cancelling those, still in the submitting process, was
seen to leave a gap in the worker's call order, which ends every call queued there 30 s
later.)"""


@dataclass(frozen=True, eq=False)
class Call:
    """One submitted call; ``host`` is the worker's position in the pool."""

    host: int
    method: str


class HostPool(Protocol):
    devices: list[Device]

    def submit(self, host: int, method: str, *args: Any) -> Call:
        """``method`` on ``host``, after the calls submitted there before (its task queue)."""
        ...

    def submit_after(self, host: int, after: Call, method: str, *args: Any) -> Call:
        """``method`` (one of ``BESIDE``) on ``host`` beside its task queue, once ``after``,
        a call of that queue, has ended: a copy is handed over once the call that starts
        it is done, without queuing ahead of the tasks after that. Where ``after`` failed
        (or never ran) this does not run: its result is ``after``'s error."""
        ...

    def submit_run(self, host: int, tasks: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Call]:
        """Shard tasks (``(method, args)``) to run on ``host`` one after another, as one
        call of its worker where that saves the pool a call's overhead per task (Ray's:
        ``ShardWorker.run``): a call per task, in order."""
        ...

    def wait(self, calls: Sequence[Call], timeout: float) -> list[Call]:
        """The calls of ``calls`` that have finished, once at least one has."""
        ...

    def result(self, call: Call) -> Any:
        """A finished call's value, or its error (``ShardFailed``, ``HostLost``)."""
        ...

    def outputs(self, call: Call) -> Any:
        """A shard task's outputs, as an argument for the model's next task: that task
        runs once they are there (``InputLost`` if they never come)."""
        ...

    def give_up(self, host: int, reason: str) -> None:
        """Take ``host`` for lost (its worker hung, ``giving_up``, or never answered): its
        worker is stopped, and each of its calls not read yet ends ``HostLost`` with
        ``reason``."""
        ...

    def shutdown(self) -> None: ...


PoolFactory = Callable[[Sequence[Device], Mapping[DeviceId, int]], "HostPool"]
"""How a SHARP runner gets its pool: devices and each one's budget in bytes."""


Waiter = Callable[[Sequence[Call], float], list[Call]]
"""A ``HostPool.wait``, or one that does more while it waits (``stalls.await_saying``)."""


def await_all(
    pool: HostPool, calls: Sequence[Call], timeout: float, wait: Waiter | None = None
) -> list[Any]:
    """The values of ``calls``, in their order, once every one has finished (the first
    error raised: ``HostPool.result``'s), waited for by ``wait`` (``pool.wait``)."""
    pending, values = list(calls), {}
    while pending:
        for call in (wait or pool.wait)(pending, timeout):
            values[call] = pool.result(call)
            pending.remove(call)
    return [values[c] for c in calls]


def giving_up(pool: HostPool, wait: Waiter | None = None) -> Waiter:
    """``wait`` (``pool.wait``) for the executor's waits on calls its models need (a gather,
    a move, a recovery): where none of the calls has ended within the timeout, their devices
    are given up as hung (``give_up_hung``) and the calls end ``HostLost``, a loss the
    models recover from, where a ``PoolTimeout`` would fail the executor with every model."""

    def waiting(pending: Sequence[Call], timeout: float) -> list[Call]:
        try:
            return (wait or pool.wait)(pending, timeout)
        except PoolTimeout:
            give_up_hung(pool, sorted({c.host for c in pending}), timeout)
            return pool.wait(pending, timeout)  # they have ended now

    return waiting


def give_up_hung(pool: HostPool, hosts: Sequence[int], timeout: float) -> None:
    """Give up each device of ``hosts``, none of whose calls has ended for ``timeout`` s, as
    hung (``HostPool.give_up``): its calls end ``HostLost`` saying so."""
    why = f"none of its calls ended for {timeout:g} s: its worker hangs"
    for host in hosts:
        log.warning("SHARP: device %s given up: %s", pool.devices[host].id, why)
        pool.give_up(host, why)


@dataclass(frozen=True, eq=False)
class _Local(Call):
    future: Future[Any]


@dataclass(frozen=True)
class _Later:
    """A local task's outputs, as another task's argument: taken once the task is done."""

    future: Future[Any]


class LocalPool:
    """Every device's worker in this process, each on a thread of its own and one for its
    calls ``BESIDE`` the tasks, as ``RayPool``'s. The task threads take turns
    computing: they share torch's global RNG (blocks are initialised under a seed,
    recomputation replays the RNG state), which two at once would interleave."""

    def __init__(self, devices: Sequence[Device], budgets: Mapping[DeviceId, int]) -> None:
        self.devices = list(devices)
        self._workers = [ShardWorker(d, budgets[d.id]) for d in devices]
        self._threads = [ThreadPoolExecutor(1, f"shard-{d.id}") for d in devices]
        self._beside = [ThreadPoolExecutor(1, f"shard-{d.id}-copies") for d in devices]
        self._turn = threading.Lock()
        self._under_way: list[list[Future[Any]]] = [[] for _ in devices]
        self._given_up: dict[int, str] = {}
        """Hosts taken for lost (``give_up``), and why: a thread hung there stays hung."""

    def submit(self, host: int, method: str, *args: Any) -> Call:
        return self._local(
            host, method, self._threads[host].submit(self._call, host, method, *args)
        )

    def submit_after(self, host: int, after: Call, method: str, *args: Any) -> Call:
        first = _own(after, _Local).future
        future = self._beside[host].submit(self._call_after, first, host, method, *args)
        return self._local(host, method, future)

    def _local(self, host: int, method: str, running: Future[Any]) -> Call:
        # The call's own future, which its thread's ends unless ``give_up`` ended it first.
        future: Future[Any] = Future()
        running.add_done_callback(lambda done: _settle(future, done))
        self._under_way[host] = [f for f in self._under_way[host] if not f.done()] + [future]
        if host in self._given_up:  # as a stopped Ray worker's call: it ends at once
            self._end_under_way(host)
        return _Local(host, method, future)

    def submit_run(self, host: int, tasks: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Call]:
        return [self.submit(host, method, *args) for method, args in tasks]  # no per-call cost

    def _call(self, host: int, method: str, *args: Any) -> Any:
        # Inputs first, outside the turn: the task that makes them may be waiting for it.
        values = [self._resolve(host, a) if isinstance(a, _Later) else a for a in args]
        with self._turn:
            return self._workers[host].call(method, *values)

    def _call_after(self, first: Future[Any], host: int, method: str, *args: Any) -> Any:
        error = first.exception()  # once it has ended
        if error is not None:
            raise error
        return self._workers[host].call(method, *args)

    def _resolve(self, host: int, later: _Later) -> Any:
        try:
            return later.future.result()[0]
        except Exception:  # the task that was to make them failed (and says why itself)
            raise InputLost(self.devices[host].id) from None

    def wait(self, calls: Sequence[Call], timeout: float) -> list[Call]:
        by_future = {_own(c, _Local).future: c for c in calls}
        done, _ = wait_futures(by_future, timeout=timeout, return_when=FIRST_COMPLETED)
        if not done and calls:
            raise PoolTimeout(f"no shard task finished within {timeout:g} s")
        return [by_future[f] for f in done]

    def result(self, call: Call) -> Any:
        if call.host in self._given_up:  # as a stopped Ray worker's: even one it had ended
            raise HostLost(self.devices[call.host].id, self._given_up[call.host])
        value = _own(call, _Local).future.result(timeout=0)
        return value[1] if call.method in PAIRED_METHODS else value

    def outputs(self, call: Call) -> Any:
        return _Later(_own(call, _Local).future)

    def give_up(self, host: int, reason: str) -> None:
        # Its calls end now, as a killed Ray worker's do (a thread still in one is left).
        self._given_up[host] = reason
        self._end_under_way(host)

    def _end_under_way(self, host: int) -> None:
        for future in self._under_way[host]:
            with contextlib.suppress(InvalidStateError):  # it ended meanwhile
                future.set_exception(HostLost(self.devices[host].id, self._given_up[host]))

    def shutdown(self) -> None:
        for host in range(len(self.devices)):
            for thread in (self._threads[host], self._beside[host]):
                thread.shutdown(wait=host not in self._given_up, cancel_futures=True)


def _settle(future: Future[Any], done: Future[Any]) -> None:
    """End ``future`` as ``done`` ended, unless it has ended already (given up)."""
    with contextlib.suppress(InvalidStateError):
        try:
            value = done.result()
        except Exception as exc:  # its error, or CancelledError (the pool shut down)
            future.set_exception(exc)
        else:
            future.set_result(value)


@dataclass(frozen=True, eq=False)
class _Remote(Call):
    ref: Any
    outputs: Any = None


class RayPool:
    """One ShardWorker actor per device, on the device's node."""

    def __init__(self, devices: Sequence[Device], budgets: Mapping[DeviceId, int]) -> None:
        self.devices = list(devices)
        self._actors: list[ActorHandle[Any]] = [
            launch.start_shard_worker(d, budgets[d.id]) for d in devices
        ]
        self._made_by: dict[Any, int] = {}
        """Outputs handed out as another call's input (``outputs``), by the host making them."""
        self._takers: dict[Any, int] = {}
        """Calls taking another host's outputs, by that host, until their result is read."""
        self._gone_since: dict[int, float] = {}
        """Hosts whose node Ray has found gone, since when (``NODE_CHECK_S``)."""
        self._gone: set[int] = set()
        """Hosts found gone for ``NODE_CHECK_S``: their unfinished calls end ``HostLost``."""
        self._given_up: dict[int, str] = {}
        """Hosts taken for lost (``give_up``), and why: their calls end ``HostLost``."""

    def submit(self, host: int, method: str, *args: Any) -> Call:
        call: Any = self._actors[host].call
        if method not in PAIRED_METHODS:
            remote = _Remote(host, method, call.remote(method, *args))
        else:
            refs: Any = call.options(num_returns=2).remote(method, *args)
            remote = _Remote(host, method, refs[1], refs[0])
        self._note_inputs(host, args, remote)
        return remote

    def submit_after(self, host: int, after: Call, method: str, *args: Any) -> Call:
        # Ray runs it once ``after``'s result is there, and fails it with ``after``'s error.
        beside: Any = self._actors[host].call.options(concurrency_group=launch.COPIES_GROUP)
        return _Remote(host, method, beside.remote(method, *args, after=_own(after, _Remote).ref))

    def submit_run(self, host: int, tasks: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Call]:
        if len(tasks) == 1:
            ((method, args),) = tasks
            return [self.submit(host, method, *args)]
        arity = [(method, len(args)) for method, args in tasks]
        flat = [arg for _, args in tasks for arg in args]  # top level: Ray resolves refs there
        run: Any = self._actors[host].run
        refs: Any = run.options(num_returns=2 * len(tasks)).remote(arity, *flat)
        calls = [_Remote(host, m, refs[2 * i + 1], refs[2 * i]) for i, (m, _) in enumerate(arity)]
        self._note_inputs(host, flat, calls[0])  # cancelling one call cancels the run
        return list(calls)

    def _note_inputs(self, host: int, args: Sequence[Any], remote: _Remote) -> None:
        """Where ``remote`` takes the outputs of another host's task (the model's task before
        it), that host is one it waits for (``_check_nodes``)."""
        for arg in args:
            maker = self._made_by.pop(arg, host) if isinstance(arg, ray.ObjectRef) else host
            if maker != host:
                self._takers[remote.ref] = maker

    def wait(self, calls: Sequence[Call], timeout: float) -> list[Call]:
        given_up = [c for c in calls if c.host in self._given_up]
        if given_up:
            return given_up
        by_ref = {_own(c, _Remote).ref: c for c in calls}
        end = time.monotonic() + timeout
        while True:
            # Once a round: a large result (a copy, a gathered state) is fetched from its
            # worker's node meanwhile, so the loop blocks instead of spinning until it is.
            left = max(0.0, end - time.monotonic())
            done, _ = ray.wait(list(by_ref), num_returns=1, timeout=min(left, NODE_CHECK_S))
            if done or not calls or left <= NODE_CHECK_S:
                break
            self._check_nodes({c.host for c in calls})
            done = [r for r, c in by_ref.items() if c.host in self._gone]
            if done:
                break
        if not done and calls:
            raise PoolTimeout(f"no shard task finished within {timeout:g} s")
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        return [by_ref[r] for r in {*ready, *done}]

    def _check_nodes(self, waited: set[int]) -> None:
        """Hosts whose node was found gone at least ``NODE_CHECK_S`` ago, among ``waited``
        and those whose outputs calls take, are ``_gone``; the calls waiting for their
        outputs are cancelled (one its worker has not started ends ``InputLost``)."""
        now, alive = time.monotonic(), launch.alive_nodes()
        for host in (waited | set(self._takers.values())) - self._gone:
            if self.devices[host].node_id in alive:
                continue
            if now - self._gone_since.setdefault(host, now) < NODE_CHECK_S:
                continue
            self._gone.add(host)
            for ref in [r for r, maker in self._takers.items() if maker == host]:
                del self._takers[ref]
                ray.cancel(ref)

    def result(self, call: Call) -> Any:
        remote = _own(call, _Remote)
        self._takers.pop(remote.ref, None)
        device = self.devices[remote.host].id
        if remote.host in self._given_up:
            raise HostLost(device, self._given_up[remote.host])
        try:
            value = ray.get(remote.ref, timeout=0)
        except GetTimeoutError:  # unfinished: its node is gone (``_check_nodes``)
            if remote.host not in self._gone:
                raise
            raise HostLost(device, "its node is gone") from None
        except TaskCancelledError:  # waiting for a lost device's outputs (``_check_nodes``)
            raise InputLost(device) from None
        except RayTaskError as exc:  # its own error, or that of the call it was to follow
            if isinstance(exc.cause, ShardFailed):
                raise exc.cause from None
            if isinstance(exc.cause, TaskCancelledError):
                raise InputLost(device) from None
            if isinstance(exc.cause, RayActorError):
                raise self._actor_error(remote, exc.cause) from None
            if isinstance(exc.cause, ObjectLostError):
                raise self._lost_object(remote) from None
            raise
        except ObjectLostError:
            raise self._lost_object(remote) from None
        except RayActorError as exc:
            raise self._actor_error(remote, exc) from None
        except ActorUnschedulableError:
            raise HostLost(device, "its node is gone or cannot host it") from None
        if isinstance(value, ShardFailed):  # a task of a run (``ShardWorker.run``) raised
            raise value
        return value

    def outputs(self, call: Call) -> Any:
        remote = _own(call, _Remote)
        self._made_by[remote.outputs] = remote.host
        return remote.outputs

    def give_up(self, host: int, reason: str) -> None:
        self._given_up[host] = reason
        launch.kill_worker(self._actors[host])

    def _actor_error(self, call: _Remote, exc: RayActorError) -> HostLost | InputLost:
        """The call's worker died, or the one whose task was to make its input did."""
        device = self.devices[call.host].id
        if exc.actor_id is not None and exc.actor_id != self._actors[call.host]._actor_id.hex():
            return InputLost(device)
        return HostLost(device, "its node was preempted" if exc.preempted else "its worker died")

    def _lost_object(self, call: _Remote) -> HostLost | InputLost:
        """An object the call needs is gone: its own result, lost with its worker's node
        (``HostLost``), or, its worker alive, an input that was on another node."""
        device = self.devices[call.host].id
        try:
            ray.get(self._actors[call.host].call.remote("pid"), timeout=30)
        except (RayActorError, ActorUnschedulableError, ObjectLostError, GetTimeoutError):
            return HostLost(device, "its node is gone, and the call's result with it")
        return InputLost(device)

    def shutdown(self) -> None:
        for actor in self._actors:
            launch.kill_worker(actor)


def _own(call: Call, kind: type[Any]) -> Any:
    if not isinstance(call, kind):
        raise TypeError(f"a {type(call).__name__} is not a call of this pool")
    return call
