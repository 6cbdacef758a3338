"""The SHARP executor's wait for its devices' calls, said aloud when it lasts.

A call can keep a model waiting for a long time: a device whose node went silent until Ray
or the pool (``shard_pool.NODE_CHECK_S``) gives it up, an input on its way from a node
killed mid-transfer, a worker busy with a large copy. While no call ends the executor
dispatches nothing, and the sweep's page would show its trials as running with nothing
said. Each ``STALL_S`` with no call ended, every model whose calls it waits for gets a
``stalled`` event naming them (and the executor's log a line): what the trial waits for,
where, and for how long; in its dispatch loop, and in a recovery's waits. A device none of
whose calls has ended for the task timeout is given up as hung (``shard_pool.give_up_hung``):
in the dispatch loop as ``scheduler.silence`` finds it, in a recovery's wait once it times
out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.scheduler.devices import Device
from shoal.workers.sharp.models import ModelRun
from shoal.workers.sharp.shard_pool import Call, HostPool, PoolTimeout, await_all, giving_up
from shoal.workers.snapshot import RunnerEvent

STALL_S = 60.0
"""How long the executor waits with no call ended before its models say so (again)."""

log = logging.getLogger(__name__)


def wait_saying(
    pool: HostPool,
    waiting: Mapping[Call, ModelRun | None],
    timeout: float,
    devices: Sequence[Device],
) -> list[Call]:
    """The calls of ``waiting`` (each with the model it is for, if any) that have ended
    (``HostPool.wait``), once one has, within ``timeout`` s (``PoolTimeout`` else); each
    ``STALL_S`` s before, the models waiting say so (``stalled``)."""
    waited = 0.0
    while True:
        wait_s = min(STALL_S, timeout - waited)
        try:
            return pool.wait(list(waiting), wait_s)
        except PoolTimeout:
            waited += wait_s
            if waited >= timeout:
                raise PoolTimeout(f"no shard task finished within {timeout:g} s") from None
        _say(waiting, waited, devices)


def await_saying(
    pool: HostPool,
    calls: Sequence[Call],
    model: ModelRun,
    timeout: float,
    devices: Sequence[Device],
) -> list[Any]:
    """``await_all`` of ``model``'s ``calls`` (a recovery's: re-homing its shards, taking
    the states on their way), which ``model`` says it waits for as ``wait_saying`` does,
    giving up the devices of calls none of which has ended within ``timeout`` as hung
    (``shard_pool.giving_up``)."""

    def wait(pending: Sequence[Call], wait_s: float) -> list[Call]:
        return wait_saying(pool, dict.fromkeys(pending, model), wait_s, devices)

    return await_all(pool, calls, timeout, giving_up(pool, wait))


def _say(waiting: Mapping[Call, ModelRun | None], waited: float, devices: Sequence[Device]) -> None:
    """Each model of ``waiting`` says which of its calls have not ended in ``waited`` s."""
    by_job: dict[str, tuple[ModelRun, dict[tuple[str, str], None]]] = {}
    for call, model in waiting.items():
        if model is not None:
            _, named = by_job.setdefault(model.snap.job_id, (model, {}))
            named[(call.method, devices[call.host].id)] = None
    for model, named in by_job.values():
        where = ", ".join(f"{method} on {device}" for method, device in named)
        message = f"SHARP: no call has ended for {waited:.0f} s; waiting for {where}"
        log.warning("%s: %s", model.snap.job_id, message, extra={"job_id": model.snap.job_id})
        rows = [{"method": method, "device_id": device} for method, device in named]
        model.record(
            RunnerEvent("stalled", model.step, message, {"waited_s": waited, "calls": rows})
        )
