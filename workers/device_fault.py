"""A device that fails Shoal's own use of it: the warm-up a worker starting on it runs, or
the benchmark that measures it. No model code runs in either, so the error is the device's
(a failing GPU, whose CUDA calls raise), not a model's bug, and the device is set aside:
the job or sweep goes on without it, and the control plane drains it, saying why. A
device no worker started on in time is lost too, but not drained (``not_started_event``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shoal.workers.error_text import one_line
from shoal.workers.snapshot import RunnerEvent


class DeviceFault(RuntimeError):
    """Shoal's own use of ``device`` (a torch device name, such as ``cuda:1``) raised."""

    def __init__(self, device: str, what: str, reason: str) -> None:
        super().__init__(f"{device} failed as its worker {what}: {reason}")
        self.device = device
        self.what = what
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (DeviceFault, (self.device, self.what, self.reason))

    @property
    def why(self) -> str:
        """Why the device is set aside, as its ``device_set_aside`` event says."""
        return f"its worker failed as it {self.what} ({self.reason})"


@contextmanager
def own_use(device: torch.device, what: str) -> Iterator[None]:
    """Any error raised inside, as the ``DeviceFault`` of ``device``; ``what`` says what
    the worker did with it ("started on it", "measured it")."""
    try:
        yield
    except Exception as exc:
        raise DeviceFault(str(device), what, one_line(exc)) from exc


def not_started_event(device_id: str, why: str, step: int) -> RunnerEvent:
    """The event that says no worker started on device ``device_id`` in time, and why (its
    device held by something else, say: not the device's fault); the control plane leaves
    the device out of new placements for a while (``service.setbacks``)."""
    message = f"the worker on device {device_id} did not start: {why}"
    return RunnerEvent("worker_not_started", step, message, {"device_id": device_id, "reason": why})


def set_aside_event(device_id: str, why: str, step: int) -> RunnerEvent:
    """The event that says device ``device_id`` was set aside and why; the control plane
    drains the device with its message (``service.reports``)."""
    message = f"device {device_id} was set aside: {why}"
    return RunnerEvent("device_set_aside", step, message, {"device_id": device_id, "reason": why})
