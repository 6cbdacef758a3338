"""Whether the runner may hand out a job's next step while its workers run the last one.

Handing the next step out early lets every worker start it the moment it ends the last one,
instead of after a round trip through the runner. It costs the runner's work for that step
(drawing the batch, handing it out, collecting results) at a time the workers compute. A
CPU virtual device keeps one core busy; when such devices number the cores of the runner's
machine, that work takes a core from a stage. Measured on 2 cores: a tiny model's step on
2 one-thread stages, 12 ms overlapped against 10 ms not; on 1 stage, where the runner has a
core to itself, 2.3 ms against 3.5 ms (``shoal bench step --size tiny``). GPU workers leave
their cores idle while the device computes.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.devices import Device


def leaves_a_core(devices: Sequence[Device], cores: int) -> bool:
    """Whether a job on ``devices`` leaves the runner's machine (``cores`` cores) a core
    its workers do not keep busy. CPU devices are counted over every node, conservatively:
    the runner may share a node with any of them."""
    return sum(not d.gpu for d in devices) < cores
