"""A run's log as the control plane polls it: items after a cursor, the step they reached,
how the run ended."""

from __future__ import annotations

import threading

from shoal.workers.run_log import RunLog
from shoal.workers.snapshot import RunnerEvent, RunStatus, StepMetrics


def metrics(step: int) -> StepMetrics:
    return StepMetrics(step, loss=1.0 / step, samples_per_s=10.0, step_time_s=0.1, stages=())


def test_a_report_holds_what_came_after_its_cursor_and_the_step_reached() -> None:
    log = RunLog()
    placed = RunnerEvent("placement", 0, "1 stage")
    log.record(placed)
    log.record(metrics(1))
    first = log.report(0)
    assert (first.cursor, first.step, first.status) == (2, 1, RunStatus.RUNNING)
    assert first.events == (placed,) and first.metrics == (metrics(1),)
    log.record(metrics(2))
    later = log.report(first.cursor)
    assert later.metrics == (metrics(2),) and later.events == () and later.step == 2
    assert log.last_metrics() == metrics(2)


def test_a_resumed_run_reports_its_checkpoint_step_before_any_metrics() -> None:
    log = RunLog()
    assert log.last_metrics() is None
    log.resumed_at(40)
    assert log.step == 40 and log.report(0).step == 40 and log.report(0).metrics == ()


def test_an_ended_run_says_how_and_a_later_failure_does_not_overwrite_it() -> None:
    log = RunLog()
    assert log.end(RunStatus.LOST, "its node died", ("gpu-1",)) is RunStatus.LOST
    log.fail_if_running("the executor failed")
    report = log.report(0)
    assert (report.status, report.error, report.lost_devices) == (
        RunStatus.LOST,
        "its node died",
        ("gpu-1",),
    )
    running = RunLog()
    running.fail_if_running("the executor failed")
    assert (running.status, running.report(0).error) == (RunStatus.FAILED, "the executor failed")


def test_reports_read_beside_the_recording_thread_are_each_one_moment() -> None:
    log = RunLog()

    def train() -> None:
        for step in range(1, 2001):
            log.record(metrics(step))

    writer = threading.Thread(target=train)
    writer.start()
    seen: list[tuple[int, int, int]] = []
    while writer.is_alive():
        report = log.report(0)
        last = report.metrics[-1].step if report.metrics else 0
        seen.append((report.cursor, report.step, last))
    writer.join(timeout=30)
    # The cursor counts the items read, and the step is the last of them.
    assert all(cursor == step == last for cursor, step, last in seen), seen[:5]
