"""A device that fails Shoal's own use of it (the warm-up as a worker starts on it, the
benchmark that measures it: no model code) is set aside, not taken for a model's bug: the
stage is lost on that device (the job is placed again without it) and a
``device_set_aside`` event says which device and why, so the control plane drains it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.workers import device_speed
from shoal.workers.device_fault import DeviceFault, own_use
from shoal.workers.device_memory import measure_overhead
from shoal.workers.pipeline import stage
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.timing import StepTimer
from shoal.workers.pipeline.worker_group import DeviceSetAside
from shoal.workers.snapshot import RunStatus
from tests.factories import job

pytestmark = pytest.mark.unit

CUDA_ERROR = "CUDA error: unspecified launch failure"


def test_an_error_in_shoals_own_use_of_a_device_is_its_fault_and_crosses_processes() -> None:
    with pytest.raises(DeviceFault) as caught, own_use(torch.device("cuda", 1), "measured it"):
        raise RuntimeError(CUDA_ERROR)
    fault = pickle.loads(pickle.dumps(caught.value))
    assert (fault.device, fault.what) == ("cuda:1", "measured it")
    assert fault.reason == f"RuntimeError: {CUDA_ERROR}"
    lost = pickle.loads(pickle.dumps(DeviceSetAside(1, "n1-gpu-1", "why")))
    assert type(lost) is DeviceSetAside and (lost.stage, lost.device_id) == (1, "n1-gpu-1")


def _assert_set_aside(trainer: Trainer, device_id: str, what: str) -> None:
    report = trainer.report(0)
    assert report.status is RunStatus.LOST, report.error
    assert report.lost_devices == (device_id,), report.lost_devices
    (said,) = [e for e in report.events if e.kind == "device_set_aside"]
    assert said.data["device_id"] == device_id
    assert said.message == (
        f"device {device_id} was set aside: its worker failed as it {what}"
        f" (RuntimeError: {CUDA_ERROR})"
    )
    assert not report.metrics  # nothing trained


def test_a_device_whose_benchmark_fails_is_set_aside_and_the_job_lost_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second stage's device fails as it is measured (``shoal bench``'s matmul)."""
    real = StepTimer
    built: list[float] = []

    def timer(device: torch.device, slowdown: float) -> Any:
        built.append(slowdown)
        if len(built) == 2:
            raise RuntimeError(CUDA_ERROR)
        return real(device, slowdown)

    monkeypatch.setattr(device_speed, "StepTimer", timer)
    snap = job(tmp_path, [(0, 2), (2, 4)])
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.LOST
    _assert_set_aside(trainer, snap.stages[1].device.id, "measured it")


def test_a_device_a_worker_cannot_start_on_is_set_aside_and_the_job_lost_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second stage's worker fails its device's warm-up (on a GPU, its first CUDA
    calls), before the model is built."""
    real = measure_overhead
    started: list[torch.device] = []

    def overhead(device: torch.device) -> Any:
        started.append(device)
        if len(started) == 2:
            with own_use(device, "started on it"):
                raise RuntimeError(CUDA_ERROR)
        return real(device)

    monkeypatch.setattr(stage, "measure_overhead", overhead)
    snap = job(tmp_path, [(0, 2), (2, 4)])
    trainer = Trainer(snap, LocalGroup)
    assert trainer.run() is RunStatus.LOST
    _assert_set_aside(trainer, snap.stages[1].device.id, "started on it")
