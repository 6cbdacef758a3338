"""A device whose worker answers but errs as it is measured (a failing GPU: its CUDA calls
raise), or fails its warm-up as the worker starts there, is set aside by the SHARP
executor, as a device gone is: the models train on the devices left, exactly as alone, and
the first placed says which device and why (before, the executor failed with every model;
a worker that could not start was a device lost, never drained)."""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.scheduler.devices import Device
from shoal.scheduler.types import DeviceId
from shoal.workers.device_fault import own_use
from shoal.workers.sharp import shard_host
from shoal.workers.sharp.runner import DEFAULT_TASK_TIMEOUT_S, SharpTrainer
from shoal.workers.sharp.shard_pool import LocalPool, _Local
from shoal.workers.sharp.shard_worker import DeviceFailed, ShardFailed
from shoal.workers.snapshot import RunnerEvent, RunStatus
from tests.workers.sharp.test_sharp_runner import (
    assert_alone,
    budget_for_shards,
    devices,
    failed_call,
    model,
)

FAILING_HOST = 1
CUDA_ERROR = "CUDA error: unspecified launch failure"


class RecordingPool(LocalPool):
    """A LocalPool that records each call's host and method."""

    def __init__(self, devices: Sequence[Device], budgets: Mapping[DeviceId, int]) -> None:
        super().__init__(devices, budgets)
        self.calls: list[tuple[int, str]] = []

    def submit(self, host: int, method: str, *args: Any) -> Any:
        self.calls.append((host, method))
        return super().submit(host, method, *args)

    def asked_of_the_failing_device(self) -> list[str]:
        return [method for host, method in self.calls if host == FAILING_HOST]


class FailingDevicePool(RecordingPool):
    """A RecordingPool whose second device's worker errs as it measures its device's speed
    (every other call there works)."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if host == FAILING_HOST and method == "measure_speed":
            self.calls.append((host, method))
            error = ShardFailed(self.devices[host].id, method, CUDA_ERROR)
            return failed_call(host, method, error)
        return super().submit(host, method, *args)


class SilentDevicePool(RecordingPool):
    """A RecordingPool whose second device's worker never answers (it was never granted
    its device: held by something else)."""

    def submit(self, host: int, method: str, *args: Any) -> Any:
        if host == FAILING_HOST:
            self.calls.append((host, method))
            return _Local(host, method, Future())  # never done
        return super().submit(host, method, *args)


def train_beside_a_failing_device(
    tmp_path: Path,
    pool_class: type[RecordingPool],
    trades: bool,
    kind: str = "device_set_aside",
    task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
) -> tuple[RecordingPool, str, list[RunnerEvent]]:
    """Two models trained by a SHARP executor on two devices, the second of which fails
    (``pool_class``'s pool): both SUCCEEDED, each exactly as alone; the pool, the failing
    device's id and the models' events of ``kind`` (which say why)."""
    snaps = [model(tmp_path, name, seed=i, steps=3) for i, name in enumerate("ab")]
    pool = devices()
    budgets = {d.id: budget_for_shards(snaps[0], 3) for d in pool}
    made: list[RecordingPool] = []

    def make_pool(devices: Sequence[Device], budgets: Mapping[DeviceId, int]) -> LocalPool:
        made.append(pool_class(devices, budgets))
        return made[-1]

    trainer = SharpTrainer(
        snaps, pool, make_pool, budgets=budgets, trades=trades, task_timeout_s=task_timeout_s
    )
    statuses = trainer.run()
    reports = {s.job_id: trainer.report(s.job_id, 0) for s in snaps}
    assert statuses == {"a": RunStatus.SUCCEEDED, "b": RunStatus.SUCCEEDED}, reports
    for snap in snaps:
        assert_alone(snap, [m.loss for m in reports[snap.job_id].metrics])
    speeds = [
        e.data["device_id"] for r in reports.values() for e in r.events if e.kind == "device_speed"
    ]
    assert speeds == [pool[0].id], speeds  # none said of the failing device
    said = [e for r in reports.values() for e in r.events if e.kind == kind]
    failing = pool[FAILING_HOST].id
    assert [e.data["device_id"] for e in said] == [failing], said
    others = {"device_set_aside", "worker_not_started"} - {kind}
    assert not [e for r in reports.values() for e in r.events if e.kind in others], reports
    return made[0], failing, said


@pytest.mark.unit
@pytest.mark.parametrize("trades", [True, False])
def test_a_device_that_fails_as_it_is_measured_is_set_aside_and_the_models_train_exactly(
    tmp_path: Path, trades: bool
) -> None:
    """Measured before placing, whether models trade places or not: nothing is asked of
    the failing device after it."""
    made, failing, said = train_beside_a_failing_device(tmp_path, FailingDevicePool, trades)
    assert said[0].message == (
        f"device {failing} was set aside: its worker failed to measure it"
        f" (measure_speed: {CUDA_ERROR})"
    )
    asked = made.asked_of_the_failing_device()
    assert asked == ["overhead", "measure_speed"], asked  # no shard, no task


@pytest.mark.unit
@pytest.mark.parametrize("trades", [True, False])
def test_a_device_a_worker_cannot_start_on_is_set_aside_and_the_models_train_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trades: bool
) -> None:
    """The second device's worker fails its warm-up (on a GPU, its first CUDA calls): the
    worker answers every call with that fault, and the executor sets the device aside."""
    real = shard_host.measure_overhead
    started: list[torch.device] = []

    def overhead(device: torch.device) -> Any:
        started.append(device)
        if len(started) == FAILING_HOST + 1:
            with own_use(device, "started on it"):
                raise RuntimeError(CUDA_ERROR)
        return real(device)

    monkeypatch.setattr(shard_host, "measure_overhead", overhead)
    made, failing, said = train_beside_a_failing_device(tmp_path, RecordingPool, trades)
    assert said[0].message == (
        f"device {failing} was set aside: its worker failed as it started on it"
        f" (RuntimeError: {CUDA_ERROR})"
    )
    asked = made.asked_of_the_failing_device()
    assert asked == ["overhead"], asked  # nothing more: no benchmark, no shard, no task


@pytest.mark.unit
def test_a_device_whose_worker_never_answers_is_lost_not_set_aside_and_said_not_started(
    tmp_path: Path,
) -> None:
    """The second device's worker never answers its first call (its device held by
    something else): after the task timeout the executor goes on without the device, the
    models train exactly on the other, and the first says the worker did not start (the
    control plane leaves the device alone a while; not the device's fault, so not drained).
    Before, the executor failed with every model."""
    made, failing, said = train_beside_a_failing_device(
        tmp_path, SilentDevicePool, trades=True, kind="worker_not_started", task_timeout_s=5.0
    )
    assert said[0].message == (
        f"the worker on device {failing} did not start: its worker did not answer within 5 s"
    )
    asked = made.asked_of_the_failing_device()
    assert asked == ["overhead"], asked  # nothing more: no benchmark, no shard, no task


@pytest.mark.unit
def test_a_device_failure_crosses_processes_as_itself() -> None:
    """A RayPool raises the cause of Ray's task error: it must still say the device failed."""
    failed = pickle.loads(pickle.dumps(DeviceFailed("n1-gpu-0", "overhead", "why")))
    assert type(failed) is DeviceFailed
    assert (failed.device_id, failed.method, failed.reason) == ("n1-gpu-0", "overhead", "why")


@pytest.mark.unit
def test_a_benchmark_that_raises_on_the_device_is_the_devices_fault_in_the_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmark itself raising in the worker (not a failed call, as above): the
    worker answers ``DeviceFailed`` and the event says what the worker did."""
    real = shard_host.measure_gflops
    measured: list[torch.device] = []

    def gflops(device: torch.device, slowdown: float) -> float:
        measured.append(device)
        if len(measured) == FAILING_HOST + 1:
            with own_use(device, "measured it"):
                raise RuntimeError(CUDA_ERROR)
        return real(device, slowdown)

    monkeypatch.setattr(shard_host, "measure_gflops", gflops)
    made, failing, said = train_beside_a_failing_device(tmp_path, RecordingPool, trades=True)
    assert said[0].message == (
        f"device {failing} was set aside: its worker failed as it measured it"
        f" (RuntimeError: {CUDA_ERROR})"
    )
    asked = made.asked_of_the_failing_device()
    assert asked == ["overhead", "measure_speed"], asked
