"""A device's measured speed (``workers.device_speed``): the fastest of a few trials, so one
trial the process was interrupted in does not make a fast device read slow."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shoal.workers import device_speed
from shoal.workers.device_speed import measure_gflops
from shoal.workers.pipeline.timing import StepTimer


@dataclass
class Lap:
    compute_s: float


@pytest.mark.unit
def test_a_devices_speed_is_its_fastest_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    laps = iter([0.5, 0.01, 0.02])  # the first trial interrupted for half a second

    class Timer(StepTimer):
        def lap(self) -> Lap:  # type: ignore[override]
            super().lap()
            return Lap(next(laps))

    monkeypatch.setattr(device_speed, "StepTimer", Timer)
    monkeypatch.setattr(device_speed, "_SPEED_SIZE", 64)
    flops = 2 * 64**3 * device_speed._SPEED_REPEATS
    assert measure_gflops(torch.device("cpu")) == pytest.approx(flops / 0.01 / 1e9)
