"""``shoal bench step``'s copies in alternate windows of one job: where the windows fall, that
the job copies in the copying ones only and still trains as the reference, and the cost
read from them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from shoal.service.bench.copy_windows import (
    AlternateCopies,
    CopyWindows,
    Window,
    window_seconds,
    windowed_overhead,
)
from shoal.workers.pipeline.local_group import LocalGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.snapshot import RunStatus
from tests.factories import job
from tests.workers.runs import assert_matches_reference, metrics

pytestmark = pytest.mark.unit


def test_windows_open_once_the_interval_is_decided_and_hold_whole_intervals() -> None:
    windows = CopyWindows(after=2, steps=5)
    windows.copied(0, 1, decided=False)  # a job's first copies: before the windows
    windows.copied(2, 1, decided=False)  # the interval still a guess
    windows.copied(3, 3)  # decided: the first copying window opens here
    assert windows.windows == [] and windows.closed(4) is None  # the job copies as it would
    windows.copied(6, 3)  # two intervals (6 steps) reach 5: closed, and as many paused
    assert windows.windows == [Window(3, 9, True), Window(9, 15, False)]
    assert windows.closed(6) == Window(3, 9, True)  # no copy before its end
    assert windows.closed(9) == Window(9, 15, False) and windows.closed(15) is None
    windows.copied(15, 7)  # one interval of 7 is enough
    assert windows.windows[2:] == [Window(15, 22, True), Window(22, 29, False)]
    assert windows.pairs(28) == [(Window(3, 9, True), Window(9, 15, False))]
    assert len(windows.pairs(29)) == 2
    # The runner's waits for the copies before a boundary: kept at a copying window's end.
    for step, waited in ((9, 0.5), (15, 0.25), (22, 0.125), (29, 1.0)):
        windows.confirmed(step, waited)
    assert windows.tails == {9: 0.5, 22: 0.125}
    with pytest.raises(ValueError, match="at least one step"):
        CopyWindows(after=0, steps=0)


def test_the_cost_is_the_copying_windows_time_the_paused_ones_do_not_take() -> None:
    pairs = [(Window(1, 3, True), Window(3, 5, False)), (Window(5, 6, True), Window(6, 7, False))]
    times = [9.0, 1.5, 1.5, 1.0, 1.0, 3.0, 2.0]  # step 1 is times[0]: before the windows
    assert window_seconds(times, pairs) == [(3.0, 2.0), (3.0, 2.0)]
    assert windowed_overhead(window_seconds(times, pairs)) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no pair"):
        windowed_overhead([])


class Snapshots(LocalGroup):
    """A LocalGroup that notes in ``copied`` the step of every copy worker 0 is asked to
    start."""

    def __init__(self, copied: list[int], *args: Any) -> None:
        self.copied = copied
        super().__init__(*args)

    def submit(self, stage: int, method: str, *args: Any) -> Any:
        if method == "snapshot" and stage == 0:
            self.copied.append(args[0])
        return super().submit(stage, method, *args)


def test_a_job_copies_in_its_copying_windows_only_and_trains_as_the_reference(
    tmp_path: Path,
) -> None:
    # A budget of the whole training time: a copy at every step, decided from the start.
    snap = job(tmp_path, [(0, 2), (2, 4)], steps=16, keep_copies=True, copy_budget=1.0)
    windows = CopyWindows(after=2, steps=3)
    copied: list[int] = []
    trainer = Trainer(
        snap,
        functools.partial(Snapshots, copied),
        copies=functools.partial(AlternateCopies, windows=windows),
    )
    assert trainer.run() is RunStatus.SUCCEEDED, trainer.report(0).error
    # Copies at 0 and 1 as the job takes them; then windows of 3 steps from step 2, copying
    # and paused in turn; the run ends in the third copying window.
    assert copied == [0, 1, 2, 3, 4, 8, 9, 10, 14, 15]
    assert windows.windows == [
        Window(2, 5, True),
        Window(5, 8, False),
        Window(8, 11, True),
        Window(11, 14, False),
    ]
    # The runner waited at each copying window's end for its copies (before the paused one).
    assert set(windows.tails) == {5, 11}, windows.tails
    assert all(0 <= waited < 60 for waited in windows.tails.values()), windows.tails
    assert_matches_reference(snap, metrics(trainer))
