"""The StageWorker: a ``Stage`` behind the worker-group seam, named calls in, typed errors out.

The same object runs in-process (``LocalGroup``) and as the StageWorker Ray actor
(``workers.launch``), so both groups report a stage's own errors identically: a stage
method's error leaves as ``StageFailed`` (``LinkFailed`` when a transfer with a
neighbour failed), naming the stage, the call and the cause in one line; a device that
fails Shoal's own use of it (``workers.device_fault``) as ``DeviceSetAside``, a lost stage.
"""

from __future__ import annotations

from typing import Any

from shoal.workers.device_fault import DeviceFault
from shoal.workers.error_text import one_line
from shoal.workers.pipeline.awaited import Awaited, Disconnected, Moot
from shoal.workers.pipeline.stage import Stage
from shoal.workers.pipeline.stage_blocks import stage_devices
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.transport import LinkError
from shoal.workers.pipeline.worker_group import DeviceSetAside, StageLost
from shoal.workers.snapshot import StagePlan

STAGE_METHODS = frozenset(
    {
        "forward",
        "forward_loss",
        "backward",
        "grad_norms",
        "apply_step",
        "state",
        "unshard",
        "load",
        "export",
        "adopt",
        "snapshot",
        "device_overhead",
        "shipment",
        "hold",
        "saved_steps",
        "rollback",
        "export_copy",
        "nbytes",
        "pid",
        "measure_speed",
        "collective_host",
        "collective_join",
        "step",
        "steps",
        "link_keep",
        "link_host",
        "link_join",
        "link_names",
        "collective_leave",
        "device_key",
        "all_reduce",
    }
)
"""The ``Stage`` methods a worker group may call."""

COPIES = frozenset({"shipment", "hold"})
"""The methods a worker runs beside its training calls (Ray: in the ``copies`` concurrency
group, a thread of its own), so that handing out and keeping in-memory copies never
queues ahead of a step. Everything else runs one call at a time, in submission order."""

MOOT = "moot"
"""The call that tells a worker a loss is being surveyed (Ray: in a concurrency group of
its own, so it never waits behind another call): every call still waiting for another
call's result gives it up (``_opened``)."""


class StageFailed(RuntimeError):
    """A stage method raised: which stage, which call, and the error in one line."""

    def __init__(self, stage: int, method: str, reason: str) -> None:
        super().__init__(f"stage {stage} failed in {method}: {reason}")
        self.stage = stage
        self.method = method
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Crosses process boundaries inside Ray's error objects; keep the typed fields.
        return (StageFailed, (self.stage, self.method, self.reason))


class LinkFailed(StageFailed):
    """A stage's transfer with its neighbour at offset ``peer`` failed: the neighbour may
    be lost, or gave up on the step itself (it closes its links when it fails). ``peer``
    None: the stage's data-parallel all-reduce failed (a replica lost or failed)."""

    def __init__(self, stage: int, method: str, reason: str, peer: int | None) -> None:
        super().__init__(stage, method, reason)
        self.peer = peer

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (LinkFailed, (self.stage, self.method, self.reason, self.peer))


class StageWorker:
    """A ``Stage`` behind the worker-group seam: named calls in, typed errors out."""

    def __init__(self, plan: StagePlan, setup: StageSetup) -> None:
        self.plan = plan
        self._moots = 0
        """``MOOT`` calls so far: each says a loss is surveyed, and moots the results this
        worker's calls were still waiting for (``_opened``)."""
        self._stage: Stage | StageFailed | StageLost
        try:
            self._stage = Stage(plan, setup)
        except DeviceFault as exc:
            self._stage = set_aside(plan, exc)
        except Exception as exc:  # anything the model or factory raises, reported as typed
            # Kept and raised by every call: a Ray actor whose constructor raises only says
            # that it died, and the group must say why.
            self._stage = StageFailed(plan.index, "build", one_line(exc))

    @property
    def stage(self) -> Stage:
        """The stage itself (in-process use); raises the build error if it failed to build."""
        if not isinstance(self._stage, Stage):
            raise self._stage
        return self._stage

    def call(self, method: str, *args: Any) -> Any:
        if not isinstance(self._stage, Stage):
            raise self._stage
        stage = self._stage
        if method == MOOT:
            self._moots += 1
            return None
        if method not in STAGE_METHODS:
            raise StageFailed(stage.index, method, f"no such stage method {method!r}")
        # Outside the boundary below: an awaited call's error leaves as that call raised it.
        args = tuple(self._opened(method, a) for a in args)
        try:
            return getattr(stage, method)(*args)
        except LinkError as exc:
            raise LinkFailed(stage.index, method, one_line(exc), exc.peer) from exc
        except DeviceFault as exc:
            raise set_aside(self.plan, exc) from exc
        except Exception as exc:  # a boundary: every stage error leaves as StageFailed
            raise StageFailed(stage.index, method, one_line(exc)) from exc

    def _opened(self, method: str, arg: Any) -> Any:
        """``arg``, or the result it awaits (``Awaited``: another call's, such as a copy on
        its way to a ``hold`` or an activation relayed to a training call), given up once a
        loss is surveyed: the survey answers without it, the recovery takes fresh copies and
        rolls the step back, and their calls queue behind this one."""
        if not isinstance(arg, Awaited):
            return arg
        moots = self._moots

        def moot() -> str | None:
            if self._moots == moots:
                return None
            return "gave up waiting for another call's result: a loss was surveyed meanwhile"

        try:
            return arg.result(moot)
        except Moot as exc:
            raise StageFailed(self.plan.index, method, str(exc)) from None
        except Disconnected as exc:
            raise StageLost(self.plan.index, self.plan.device.id, str(exc)) from None


def set_aside(plan: StagePlan, fault: DeviceFault) -> DeviceSetAside:
    """The stage lost with the device of its group that failed, known by its torch name
    (the stage's own where names do not tell them apart, as virtual CPU devices')."""
    names = [str(d) for d in stage_devices(plan)]
    one = names.count(fault.device) == 1
    device = plan.group[names.index(fault.device)] if one else plan.device
    return DeviceSetAside(plan.index, device.id, fault.why)
