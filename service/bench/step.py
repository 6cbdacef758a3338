"""``shoal bench step``: one job's steps through Shoal's engine against a plain PyTorch loop.

Both train the same blocks (``build_blocks``, same seed) on the same batches with the same
micro-batches, gradient accumulation and one optimizer per block: the ``workers.reference``
step, which the engine reproduces exactly. The plain loop is that step in this process on
the device; Shoal runs it through ``workers.pipeline.runner.Trainer`` with a ``RayGroup`` of
StageWorker actors, once without in-memory copies (``keep_copies``), what the engine costs
over plain PyTorch, and once with them in alternate windows of its steps
(``copy_windows``), what the copies cost on top.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from shoal.scheduler.copies import LONGEST_INTERVAL
from shoal.scheduler.devices import Device
from shoal.scheduler.mfu import DevicePeak, gpu_kind, peak_flops, step_flops
from shoal.service.bench.copy_windows import (
    AlternateCopies,
    CopyWindows,
    Window,
    window_seconds,
    windowed_overhead,
)
from shoal.service.bench.hardware import device_name, machine_with
from shoal.service.bench.pipeline import RUNNER_THREADS, busy_fractions, ray_session, threads
from shoal.service.bench.plain_loop import PlainLoop, refs, sync
from shoal.service.bench.report import (
    BenchError,
    Progress,
    bench_job,
    median_step_s,
    median_throughput,
    round_phases,
    stage_bounds,
)
from shoal.service.bench.step_settings import StepSettings, step_result, step_seconds
from shoal.workers.device_speed import measure_gflops
from shoal.workers.host_memory import retain_freed_memory
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.recovery import Copies
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.profiler import trace_costs
from shoal.workers.snapshot import (
    RunnerEvent,
    RunStatus,
    StagePlan,
    StepMetrics,
)

STEP_PHASES = ("plain PyTorch loop", "starting Ray", "shoal", "shoal, keeping copies")

POLL_S = 0.001
"""How often the driver asks the runner for new step metrics: the resolution of Shoal's
step-boundary clock, small against any step worth timing."""


def plain_step_times(s: StepSettings) -> tuple[list[float], list[float]]:
    """Seconds and loss of each step of a plain PyTorch loop on ``s.device``
    (``plain_loop.PlainLoop``). On a CPU it runs one thread, as a Shoal virtual device runs
    its stage (``workers.pipeline.stage``)."""
    loop = PlainLoop(s)
    times, losses = [], []
    with threads(1 if loop.device.type == "cpu" else None):
        for step in range(s.timed_steps):
            sync(loop.device)
            started = time.perf_counter()
            loss = loop.step(step)
            sync(loop.device)
            times.append(time.perf_counter() - started)
            losses.append(loss)
    return times, losses


def devices(s: StepSettings, node_id: str) -> list[Device]:
    """The ``s.stages`` devices Shoal runs on: virtual CPU devices, or this node's GPUs."""
    if s.device == "cpu":
        return [
            Device(f"{node_id[:8]}-cpu-{i}", node_id, i, "cpu", 8192, gpu=False)
            for i in range(s.stages)
        ]
    gpus = ray.available_resources().get("GPU", 0.0)  # type: ignore[no-untyped-call]
    if gpus < s.stages:
        raise BenchError(
            f"Ray sees {gpus:g} free GPUs, the bench needs {s.stages} (one per stage);"
            " lower --stages, or free the GPUs"
        )
    memory_mb = torch.cuda.get_device_properties(0).total_memory // 2**20
    return [
        Device(f"{node_id[:8]}-gpu-{i}", node_id, i, "gpu", memory_mb, gpu=True)
        for i in range(s.stages)
    ]


def _watch(
    trainer: Trainer, stop: threading.Event, arrivals: list[float], enough: Callable[[int], bool]
) -> None:
    """Note when each step's metrics appear, until ``stop`` (then one last look); cancel the
    run once ``enough`` of its steps are seen."""
    cursor = 0
    while True:
        last = stop.is_set()
        report = trainer.report(cursor)
        now = time.perf_counter()
        arrivals.extend(now for _ in report.metrics)
        cursor = report.cursor
        if last:
            return
        if enough(len(arrivals)):
            trainer.cancel()
        time.sleep(POLL_S)


DECIDING_STEPS = 10
"""Room for a job's first copies to be measured and its interval decided: the windows open
only then (``copy_windows``)."""


def copies_steps(s: StepSettings) -> int:
    """The most steps the run with copies takes: room for ``s.repeats`` pairs of windows
    after the warmup and the interval's decision, a window being whole intervals between
    copies (as the job chose them, ``LONGEST_INTERVAL`` at most) of at least ``s.steps``
    steps. It stops once they are done."""
    return s.warmup + DECIDING_STEPS + 2 * s.repeats * (s.steps + LONGEST_INTERVAL)


def shoal_step_times(
    s: StepSettings, plans: tuple[StagePlan, ...], windows: CopyWindows | None = None
) -> tuple[list[float], list[StepMetrics], list[RunnerEvent]]:
    """Each step's wall seconds between step boundaries, seen from outside the runner (so
    all it does between steps counts, copies included), and the engine's own metrics and
    events. With ``windows`` the job keeps in-memory copies, in alternate windows of its
    steps, and stops once ``s.repeats`` pairs of them are done."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-step-") as root:
        snapshot = bench_job(
            "bench-step",
            refs(s),
            root,
            batch_size=s.shape.batch,
            micro_batches=s.shape.micro_batches,
            steps=s.timed_steps if windows is None else copies_steps(s),
            seed=s.seed,
            schedule=s.schedule,
            stages=plans,
            num_blocks=s.num_blocks,
            keep_copies=windows is not None,
        )
        copies = Copies if windows is None else functools.partial(AlternateCopies, windows=windows)
        trainer = Trainer(snapshot, RayGroup, copies=copies)

        def enough(seen: int) -> bool:
            return windows is not None and len(windows.pairs(seen)) >= s.repeats

        arrivals: list[float] = []
        stop = threading.Event()
        watcher = threading.Thread(
            target=_watch, args=(trainer, stop, arrivals, enough), daemon=True
        )
        started = time.perf_counter()
        watcher.start()
        try:
            with threads(RUNNER_THREADS):
                status = trainer.run()
        finally:
            stop.set()
            watcher.join()
        report = trainer.report(0)
        stopped = status is RunStatus.CANCELLED and enough(len(report.metrics))
        if status is not RunStatus.SUCCEEDED and not stopped:
            kept = "with" if windows is not None else "without"
            raise BenchError(f"the Shoal run {kept} copies failed: {report.error}")
        return step_seconds(started, arrivals), list(report.metrics), list(report.events)


def _notes(s: StepSettings) -> list[str]:
    notes = [
        "Shoal's step seconds are wall time between step boundaries as the driver sees them"
        " (polled every millisecond); engine_timed_samples_per_s are the engine's own step"
        " timer, which may leave out work between steps",
        "the run with copies takes them in alternate windows of its steps (copy_windows):"
        " copies_overhead and its samples/s are its copying windows' against its paused ones",
    ]
    if s.device == "cpu":
        notes.append(
            "the plain loop runs one thread (torch.set_numthreads(1)): a Shoal virtual CPU"
            " device runs its stage single-threaded"
        )
    else:
        notes.append("the plain loop synchronizes CUDA before reading the clock")
    return notes


@dataclass(frozen=True)
class _Round:
    """Each contender's step seconds in one round, and the engine's own word on its runs."""

    plain: list[float]
    plain_losses: list[float]
    shoal: list[float]
    metrics: list[StepMetrics]
    copies: list[float]
    copies_metrics: list[StepMetrics]
    copies_events: list[RunnerEvent]
    windows: CopyWindows

    def pairs(self) -> list[tuple[Window, Window]]:
        """The run with copies' pairs of windows, copying and paused, done within it."""
        return self.windows.pairs(len(self.copies))

    def window_seconds(self) -> list[tuple[float, float]]:
        """Each pair's seconds: the copying window's, the paused one's."""
        return window_seconds(self.copies, self.pairs())

    def window_steps(self) -> int:
        """The steps in the copying windows (as many as in the paused ones)."""
        return sum(c.end - c.start for c, _ in self.pairs())

    def tails(self) -> list[float]:
        """Each pair's tail: the seconds the copying window's copies ran into the paused one
        (``CopyWindows.tails``)."""
        return [self.windows.tails[c.end] for c, _ in self.pairs()]


def _measure_round(s: StepSettings, phase: Callable[[], None]) -> _Round:
    """The plain loop (without Ray's processes beside it), then Shoal without copies and with
    them in alternate windows, on a Ray started for them (``phase`` is called as each
    starts)."""
    phase()
    plain, plain_losses = plain_step_times(s)
    if s.device == "cuda":
        torch.cuda.empty_cache()  # the plain loop's cached memory, for Shoal's workers
    phase()
    with ray_session(s.stages) as node_id:
        on = devices(s, node_id)
        bounds = stage_bounds(s.num_blocks, s.stages)
        plans = tuple(StagePlan(i, r, on[i]) for i, r in enumerate(bounds))
        phase()
        shoal, metrics, _ = shoal_step_times(s, plans)
        phase()
        windows = CopyWindows(after=s.warmup, steps=s.steps)
        copies, copies_metrics, copies_events = shoal_step_times(s, plans, windows)
    if not windows.pairs(len(copies)):
        raise BenchError(
            f"the run with copies ended ({len(copies)} steps) before a copying window and the"
            f" paused one after it: its copies came every {_cadence(copies_events)['interval']}"
            " steps;"
            " raise --steps or --repeats"
        )
    return _Round(
        plain, plain_losses, shoal, metrics, copies, copies_metrics, copies_events, windows
    )


def _cadence(events: Sequence[RunnerEvent]) -> dict[str, Any]:
    """How often the job chose to copy and what it measured a copy to cost: its last word
    (``copies`` events; none said yet: every step)."""
    said = [e.data for e in events if e.kind == "copies"]
    return said[-1] if said else {"interval": 1, "overhead": None, "copy_s": None}


def _peak(device: torch.device) -> tuple[float, float | None]:
    """The device's measured float32 GFLOP/s and its peak FLOP/s as a job's MFU takes it
    (``scheduler.mfu``: a listed GPU's data-sheet figure, else the measurement)."""
    with threads(1 if device.type == "cpu" else None):  # one thread, as a virtual device
        gflops = measure_gflops(device)
    kind = gpu_kind(device_name(device)) if device.type == "cuda" else None
    peak = peak_flops(DevicePeak(kind or "cpu", device.type == "cuda", gflops), "fp32")
    return gflops, peak


def _step_flops(s: StepSettings) -> float:
    """The model's traced FLOPs in one step, as a job's MFU counts them."""
    model, data, opt = refs(s)
    rows = s.shape.batch // s.shape.micro_batches
    costs = trace_costs(model, data, micro_batch_size=rows, optimizer=opt.name)
    return step_flops(costs, s.shape.micro_batches)


def _round_view(s: StepSettings, r: _Round) -> dict[str, Any]:
    """One round's figures, as the result lists them under ``rounds``."""
    plain, shoal = (
        median_throughput(times, s.shape.batch, s.warmup, s.repeats) for times in (r.plain, r.shoal)
    )
    seconds, tails = r.window_seconds(), r.tails()
    cadence = _cadence(r.copies_events)
    return {
        "plain_samples_per_s": plain,
        "shoal_samples_per_s": shoal,
        "shoal_copies_samples_per_s": s.shape.batch * r.window_steps() / sum(c for c, _ in seconds),
        "shoal_over_plain": shoal / plain,
        "copies_overhead": windowed_overhead(seconds),
        # Each pair of windows: its steps, the copying window's ms and the paused one's, and
        # the ms its last copy ran into the paused one (the runner's wait for it there).
        "copy_windows": [
            {
                "steps": w.end - w.start,
                "copying_ms": 1000 * c,
                "paused_ms": 1000 * p,
                "tail_ms": 1000 * tail,
            }
            for (w, _), (c, p), tail in zip(r.pairs(), seconds, tails, strict=True)
        ],
        "copies_tail_share": sum(tails) / sum(p for _, p in seconds),
        # How often the engine chose to copy, and what it measured them to cost (its last word).
        "copy_interval_steps": cadence["interval"],
        "copies_engine_overhead": cadence["overhead"],
        "copies_engine_copy_s": cadence["copy_s"],
        # Where the copies' cost lands: each step's wall ms without and with copies, and the
        # ms the copy before it took (the stages' most), warmup steps included.
        "step_ms": _ms(r.shoal),
        "copies_step_ms": _ms(r.copies),
        "copy_ms": _ms([max((t.copy_s for t in m.stages), default=0.0) for m in r.copies_metrics]),
    }


def _mean_steps(r: _Round, *, copying: bool) -> float:
    """The mean step of the run with copies in its copying windows, or its paused ones."""
    return sum(c if copying else p for c, p in r.window_seconds()) / r.window_steps()


def _ms(seconds: Sequence[float]) -> list[float]:
    return [round(1000 * s, 3) for s in seconds]


def run_step(s: StepSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Measure everything ``shoal bench step`` reports; see ``step_settings.step_result``.

    The contenders run in ``s.rounds`` rounds, each once per round, and every figure is the
    median over the rounds of that round's (a ratio taken within its round), so a machine
    whose speed drifts between minutes compares runs made side by side."""
    started = time.perf_counter()
    retain_freed_memory()  # the plain loop's allocator as Shoal's workers' (workers.host_memory)
    device = torch.device(s.device)
    labels = iter(round_phases(STEP_PHASES, s.rounds))
    rounds = [_measure_round(s, lambda: progress(next(labels))) for _ in range(s.rounds)]
    views = [_round_view(s, r) for r in rounds]

    def median(key: str) -> Any:
        return statistics.median(v[key] for v in views)

    def step_s(times: Callable[[_Round], list[float]]) -> float:
        return statistics.median(median_step_s(times(r), s.warmup, s.repeats) for r in rounds)

    def engine_rate(ms: Callable[[_Round], list[StepMetrics]]) -> float:
        return statistics.median(
            median_throughput([m.step_time_s for m in ms(r)], s.shape.batch, s.warmup, s.repeats)
            for r in rounds
        )

    def timed(r: _Round) -> list[StepMetrics]:
        return r.metrics[s.warmup :]

    def copies_timed(r: _Round) -> list[StepMetrics]:
        return r.copies_metrics[s.warmup :]

    gflops, peak = _peak(device)
    flops = _step_flops(s)
    rates = {
        "plain": median("plain_samples_per_s"),
        "shoal": median("shoal_samples_per_s"),
        "shoal_copies": median("shoal_copies_samples_per_s"),
    }
    last = views[-1]
    return step_result(
        s,
        plain=rates["plain"],
        shoal=rates["shoal"],
        shoal_copies=rates["shoal_copies"],
        shoal_over_plain=median("shoal_over_plain"),
        copies_overhead=median("copies_overhead"),
        stage_busy=busy_fractions([m for r in rounds for m in timed(r)], 0),
        rounds=views,
        device=device_name(device),
        machine=machine_with(device),
        notes=_notes(s),
        started=started,
        extra={
            "plain_step_s": step_s(lambda r: r.plain),
            "shoal_step_s": step_s(lambda r: r.shoal),
            # The run with copies: its mean step in the copying windows and in the paused ones.
            "shoal_copies_step_s": statistics.median(_mean_steps(r, copying=True) for r in rounds),
            "shoal_paused_step_s": statistics.median(_mean_steps(r, copying=False) for r in rounds),
            # What the paused windows may hold of the copies' cost (``copy_windows``).
            "copies_tail_share": median("copies_tail_share"),
            "timed_s": {
                "shoal": sum(sum(r.shoal[s.warmup :]) for r in rounds),
                "shoal_copies": sum(c for r in rounds for c, _ in r.window_seconds()),
                "shoal_copies_paused": sum(p for r in rounds for _, p in r.window_seconds()),
            },
            "engine_timed_samples_per_s": {
                "shoal": engine_rate(lambda r: r.metrics),
                "shoal_copies": engine_rate(lambda r: r.copies_metrics),
            },
            "copies_stage_busy": busy_fractions([m for r in rounds for m in copies_timed(r)], 0),
            "copy_interval_steps": last["copy_interval_steps"],
            "copies_engine_overhead": last["copies_engine_overhead"],
            "copies_engine_copy_s": last["copies_engine_copy_s"],
            "step_flops": flops,
            "device_gflops": gflops,
            "peak_tflops": peak / 1e12 if peak else None,
            "mfu": {
                name: flops * rate / s.shape.batch / peak if peak else None
                for name, rate in rates.items()
            },
            "loss_max_abs_diff": max(
                abs(m.loss - want)
                for r in rounds
                for ms in (r.metrics, r.copies_metrics)  # the run with copies runs on longer
                for m, want in zip(ms[: len(r.plain_losses)], r.plain_losses, strict=True)
            ),
        },
    )
