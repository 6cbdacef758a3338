"""How the runner hands out a job's steps: several per call, and the next call early.

**Several steps per call.** Each hand-out is a round trip through the runner (its Ray
calls, the results read back), during which the workers wait: measured on 2 CPU cores, a
tiny model's 2-stage step took 13.2-13.8 ms handed out one per call against 8.5-10.4 ms
several per call (4 interleaved pairs). Where the boundaries between steps need nothing of
the runner (no checkpoint, policy ask, copy or request due), the runner hands a worker
several steps at once (which rows of which batches: the workers draw them); the worker runs
them back to back. The math is the same steps in the same order. What a stretch of steps
costs: a cancel, suspend or relayout request waits for the call to end, and the metrics
come in per call, so a call is kept to about ``CALL_S`` seconds of steps.

**The next call early.** Handing the next call out before collecting the last lets every
worker start it the moment it ends the last one. It costs the runner's work for that call
(handing it out, collecting results) at a time the workers compute.
A CPU virtual device keeps one core busy; when such devices number the cores of the
runner's machine, that work takes a core from a stage. Measured on 2 cores: a tiny model's
step on 2 one-thread stages, 12 ms overlapped against 10 ms not; on 1 stage, where the
runner has a core to itself, 2.3 ms against 3.5 ms (``shoal bench step --size tiny``). GPU
workers leave their cores idle while the device computes.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.scheduler.devices import Device

CALL_S = 1.0
"""About how long one call's steps may take: about the longest a request waits for a
boundary (twice that where the next call was handed out early). At 2 s, a node added to a
job in ``shoal bench elastic`` waited 12-13 s to be used against 8-9 s before calls
carried several steps (3 runs each)."""


def leaves_a_core(devices: Sequence[Device], cores: int) -> bool:
    """Whether a job on ``devices`` leaves the runner's machine (``cores`` cores) a core
    its workers do not keep busy. CPU devices are counted over every node, conservatively:
    the runner may share a node with any of them."""
    return sum(not d.gpu for d in devices) < cores


def steps_per_call(step_s: float | None, until_boundary: int, *, call_s: float = CALL_S) -> int:
    """How many steps to hand out in one call: as many as fit in ``call_s`` seconds at
    ``step_s`` each (the last step's time; None before any: one), and no more than
    ``until_boundary``, the steps up to and including the next one after which the runner
    has work at the boundary (a checkpoint, a policy ask, the end of the run). Never fewer
    than one."""
    if until_boundary < 1:
        raise ValueError(f"until_boundary must be >= 1, not {until_boundary}")
    if step_s is None:
        return 1
    by_time = int(call_s / step_s) if step_s > 0 else until_boundary
    return max(1, min(by_time, until_boundary))
