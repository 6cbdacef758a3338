"""A ``ShardHost`` behind named calls with typed errors: what the SHARP executor's pool
calls (``workers.sharp.shard_pool``), in-process or as the ShardWorker Ray actor
(``workers.launch``). A device that fails Shoal's own use of it (``workers.device_fault``:
the warm-up as the worker starts there, the speed benchmark) answers with
``DeviceFailed``, which the executor sets the device aside for (``workers.sharp.measuring``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from shoal.scheduler.devices import Device
from shoal.workers.device_fault import DeviceFault
from shoal.workers.error_text import one_line
from shoal.workers.sharp.shard_host import ShardHost

PAIRED_METHODS = frozenset({"forward", "backward", "give"})
"""The methods whose value is a pair: what goes on to another call (``HostPool.outputs``:
a task's ``Outputs``, a ``Handover``) and what the executor reads (``HostPool.result``)."""

TASKS = frozenset({"forward", "backward"})
"""The shard tasks: the methods a ``run`` strings together."""


SHARD_METHODS = frozenset(
    {"add", "copy", "copied", "drop", "give", "take", "held", "overhead", "measure_speed",
     "forward", "backward", "pid"}
)  # fmt: skip
"""The ``ShardHost`` methods the executor may call."""

TIMED = frozenset({"add", "take"})
"""The methods sent with the wall clock at their sending as their last argument, whose
value comes with the seconds they cost the worker, as ``(value, seconds)``: from when the
call was sent, or when the worker's call before it ended if later, to its end. Those
seconds hold the wait for the call's inputs (a hand-over's bytes coming from another
worker) where the worker had nothing else to do: what holding a shard costs its device,
a move's cost (``workers.sharp.homes.Homes.held``)."""

BESIDE = frozenset({"copied"})
"""The methods a worker runs beside its tasks (Ray: in the ``copies`` concurrency group, a
thread of its own; ``LocalPool``: a second thread per worker), so that handing over a copy
never queues ahead of a task. Everything else runs one call at a time, in submission order
(the copies are made there, ``copy``, and a task's ``record``)."""


class ShardFailed(RuntimeError):
    """A shard host's method raised: which device, which call, and the error in one line."""

    def __init__(self, device_id: str, method: str, reason: str) -> None:
        super().__init__(f"device {device_id} failed in {method}: {reason}")
        self.device_id = device_id
        self.method = method
        self.reason = reason

    def __reduce__(self) -> tuple[type[ShardFailed], tuple[str, str, str]]:
        return (type(self), (self.device_id, self.method, self.reason))


class DeviceFailed(ShardFailed):
    """The device itself failed Shoal's own use of it, no model code involved
    (``DeviceFault``); ``reason`` says why it is set aside."""


class ShardWorker:
    """A ``ShardHost`` behind named calls with typed errors: the same object runs in-process
    and as the ShardWorker Ray actor (``workers.launch``)."""

    def __init__(self, device: Device, budget_bytes: int) -> None:
        self._device_id = device.id
        self._host: ShardHost | DeviceFault
        try:
            self._host = ShardHost(device, budget_bytes)
        except DeviceFault as exc:
            # Kept and raised by every call: a Ray actor whose constructor raises only says
            # that it died (a device lost), and the executor must know to set it aside.
            self._host = exc
        self._ended = 0.0
        """When the last call in the worker's order (not one beside it) ended, wall clock."""

    @property
    def host(self) -> ShardHost:
        """The host itself (in-process use); raises the device's fault if it failed to start."""
        if isinstance(self._host, DeviceFault):
            raise self._host
        return self._host

    def call(self, method: str, *args: Any, after: Any = None) -> Any:
        """``method`` of the host; ``after``, unused, is the value of the call it was to
        follow (``HostPool.submit_after``: Ray passes it once that call has ended)."""
        if isinstance(self._host, DeviceFault):
            raise DeviceFailed(self._device_id, method, self._host.why)
        if method not in SHARD_METHODS:
            raise ShardFailed(self._device_id, method, f"no such method {method!r}")
        sent = 0.0
        if method in TIMED:
            args, sent = args[:-1], args[-1]
        started = time.time()
        try:
            value = getattr(self._host, method)(*args)
        except DeviceFault as exc:
            raise DeviceFailed(self._device_id, method, exc.why) from exc
        except Exception as exc:  # a boundary: every host error leaves as ShardFailed
            raise ShardFailed(self._device_id, method, one_line(exc)) from exc
        finally:
            ended, waited_from = time.time(), max(sent, self._ended)
            if method not in BESIDE:
                self._ended = ended
        if method in TASKS:  # (outputs, TaskResult): where its worker's time went
            idle_s = max(0.0, started - waited_from) if waited_from > 0 else 0.0
            value = (value[0], replace(value[1], host_s=ended - started, idle_s=idle_s))
        return (value, ended - waited_from) if method in TIMED else value

    def run(self, arity: Sequence[tuple[str, int]], *args: Any) -> tuple[Any, ...]:
        """Shard tasks one after another in one call, ``arity`` naming each task's method and
        how many of ``args`` are its own: every task's pair (outputs, result) in one flat
        tuple. A task that raises ends the run: its result and those of the tasks after it
        (which would need its outputs) are its ``ShardFailed``, returned, not raised, so
        that the tasks before it keep theirs."""
        values: list[Any] = []
        failed: ShardFailed | None = None
        for method, count in arity:
            mine, args = args[:count], args[count:]
            if method not in TASKS:
                failed = failed or ShardFailed(self._device_id, method, "not a shard task")
            if failed is None:
                try:
                    values.extend(self.call(method, *mine))
                    continue
                except ShardFailed as exc:
                    failed = exc
            values.extend((None, failed))
        return tuple(values)
