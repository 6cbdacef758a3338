"""The worker group's contract: what a runner calls on the group of its stage workers, and
the errors a group raises. ``workers.pipeline.group`` has the doc of how a group works;
``LocalGroup`` (in-process, ``workers.pipeline.local_group``) and ``RayGroup`` (Ray actors,
``workers.pipeline.group``) keep it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shoal.workers.device_fault import not_started_event, set_aside_event
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.snapshot import RunnerEvent, StagePlan


class StageLost(RuntimeError):
    """A stage's worker is gone (process, node or device lost); its blocks are lost with it."""

    def __init__(self, stage: int, device_id: str, reason: str) -> None:
        super().__init__(f"stage {stage} on device {device_id} was lost: {reason}")
        self.stage = stage
        self.device_id = device_id
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Raised by a worker (its node going down, its device failing): keep the fields.
        return (type(self), (self.stage, self.device_id, self.reason))

    def event(self, step: int) -> RunnerEvent | None:
        """What the control plane is told of the device beyond its loss, if anything."""
        return None


class DeviceSetAside(StageLost):
    """A stage's device failed Shoal's own use of it (``workers.device_fault``): lost, and
    set aside so that nothing is placed on it again until an admin ends its drain."""

    def event(self, step: int) -> RunnerEvent:
        return set_aside_event(self.device_id, self.reason, step)


class WorkerNotStarted(StageLost):
    """A stage's worker was not built within the group's start timeout: its device held by
    something else, its node not answering, or its blocks slow to build. Lost, and the
    control plane places nothing new on the device for a while (``service.setbacks``)."""

    def event(self, step: int) -> RunnerEvent:
        return not_started_event(self.device_id, self.reason, step)


class GroupTimeout(TimeoutError):
    """The stages did not answer in time."""


@dataclass(frozen=True, eq=False)
class Handle:
    """The pending result of one submitted call; ``stage`` is the worker's position."""

    stage: int
    method: str


class WorkerGroup(Protocol):
    groups_replicas: bool
    """Whether each stage's replicas sum their gradients in a process group of their own,
    which lets them shard their state (``workers.pipeline.sharding``); the in-process group
    sums whole replicas itself."""

    def submit(self, stage: int, method: str, *args: Any) -> Handle: ...

    def all_reduce(self, workers: Sequence[int]) -> list[Handle]:
        """Sum the block gradients of ``workers`` (replicas of one stage, in replica order)
        into each of them; one handle per worker, its value the seconds spent."""
        ...

    def connect(self) -> str | None:
        """Link the neighbouring stages of every replica where they are not linked yet;
        None when they exchange activations peer to peer, else why the runner relays them."""
        ...

    def disconnect(self) -> None:
        """Forget the links: a step failed and its stages closed theirs."""
        ...

    def get(self, handles: Sequence[Handle], timeout: float) -> list[Any]:
        """The handles' values, in order; if some failed, raises one of their errors."""
        ...

    def prepare(self, plans: Sequence[StagePlan]) -> bool:
        """Start, without waiting, the workers a later ``regroup`` to ``plans`` would start
        (those on devices the group has no worker on), so that it finds them built; stop
        workers prepared earlier for other plans. Whether they are all built, or failed to
        start (the regroup reports it), or have taken too long (the regroup times out)."""
        ...

    def regroup(self, plans: Sequence[StagePlan], keep: Mapping[int, int]) -> None:
        """Become the group of ``plans``: position ``new`` is the old worker ``keep[new]``
        where given, a new worker (blocks freshly built, to be loaded) otherwise: one
        ``prepare``d for its plan, or started now. Old workers not kept stay alive, answering
        what was submitted to them, until ``retire``. Where the workers are not all built,
        the group stays as it was (the new ones stopped) and raises ``StageLost`` for a new
        one that could not start or was not built in time (its device's loss), else what
        stopped them (a kept worker lost, ``GroupTimeout``)."""
        ...

    def retire(self) -> None:
        """Stop the workers the last ``regroup`` left out."""
        ...

    def shutdown(self) -> None: ...


GroupFactory = Callable[[Sequence[StagePlan], StageSetup], WorkerGroup]
"""How a runner gets a group for its plans: ``LocalGroup`` or ``RayGroup`` themselves."""


H = TypeVar("H", bound=Handle)


def own(handle: Handle, kind: type[H]) -> H:
    if not isinstance(handle, kind):
        raise TypeError(f"a {type(handle).__name__} is not a handle of this group")
    return handle


def wait_ready(group: WorkerGroup, plans: Sequence[StagePlan], timeout: float) -> None:
    """Wait until every stage is built; a stage that could not build raises StageFailed."""
    group.get([group.submit(i, "nbytes") for i in range(len(plans))], timeout)
