"""``shoal bench step``: one job's steps through Shoal's engine against a plain PyTorch loop.

Both train the same blocks (``build_blocks``, same seed) on the same batches with the same
micro-batches, gradient accumulation and one optimizer per block: the ``workers.reference``
step, which the engine reproduces exactly. The plain loop is that step in this process on
the device; Shoal runs it through ``workers.pipeline.runner.Trainer`` with a ``RayGroup`` of
StageWorker actors, once without and once with in-memory copies (``keep_copies``), so the
bench shows what the engine costs over plain PyTorch and what the copies cost on top.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from typing import Any

import ray
import torch

from shoal.scheduler.devices import Device
from shoal.service.bench.hardware import device_name, machine_with
from shoal.service.bench.pipeline import RUNNER_THREADS, busy_fractions, ray_session, threads
from shoal.service.bench.report import (
    BenchError,
    Progress,
    median_step_s,
    median_throughput,
    stage_bounds,
)
from shoal.service.bench.step_settings import (
    StepSettings,
    copies_overhead,
    step_result,
    step_seconds,
)
from shoal.workers.blocks import Block
from shoal.workers.host_memory import retain_freed_memory
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.snapshot import (
    DataRef,
    JobSnapshot,
    ModelRef,
    OptimizerConf,
    RunnerEvent,
    RunStatus,
    StagePlan,
    StepMetrics,
)
from shoal.workers.zoo.data import loss_fn, make_data
from shoal.workers.zoo.models import build_blocks

STEP_PHASES = ("plain PyTorch loop", "starting Ray", "shoal", "shoal, keeping copies")

POLL_S = 0.001
"""How often the driver asks the runner for new step metrics: the resolution of Shoal's
step-boundary clock, small against any step worth timing."""


def refs(s: StepSettings) -> tuple[ModelRef, DataRef, OptimizerConf]:
    model = ModelRef(s.model, None, dict(s.shape.model))
    data = DataRef(s.dataset, None, dict(s.shape.data))
    return model, data, OptimizerConf(s.optimizer, s.lr)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work: a CUDA clock read before it would time launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step_times(s: StepSettings) -> tuple[list[float], list[float]]:
    """Seconds and loss of each step of a plain PyTorch loop on ``s.device``, the
    ``workers.reference`` step exactly: micro-batches summed into the gradient, the loss read
    once per step, the gradient norm measured, every block's optimizer stepped. On a CPU it
    runs one thread, as a Shoal virtual device runs its stage (``workers.pipeline.stage``)."""
    model, data, opt = refs(s)
    source = make_data(data, s.seed)
    modules = build_blocks(model, source.meta, s.seed, range(s.num_blocks))
    device = torch.device(s.device)
    blocks = [Block(i, m, opt) for i, m in enumerate(modules)]
    for block in blocks:
        block.to(device)
    params = [p for block in blocks for p in block.module.parameters()]
    loss = loss_fn(source.meta.task)
    batch, micro_batches = s.shape.batch, s.shape.micro_batches
    rows = batch // micro_batches
    times, losses = [], []
    with threads(1 if device.type == "cpu" else None):
        for step in range(s.timed_steps):
            _sync(device)
            started = time.perf_counter()
            inputs, targets = source.batch(step, batch)
            inputs, targets = inputs.to(device), targets.to(device)
            total = torch.zeros((), dtype=torch.float64, device=device)
            for j in range(micro_batches):
                out = inputs[j * rows : (j + 1) * rows]
                for block in blocks:
                    out = block.module(out)
                part = loss(out, targets[j * rows : (j + 1) * rows]) * (rows / batch)
                part.backward()  # type: ignore[no-untyped-call]
                total += part.detach().double()  # read once per step: a read syncs a GPU
            torch.nn.utils.clip_grad_norm_(params, math.inf)
            for block in blocks:
                block.step()
            _sync(device)
            times.append(time.perf_counter() - started)
            losses.append(float(total))
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


def _watch(trainer: Trainer, stop: threading.Event, arrivals: list[float]) -> None:
    """Note when each step's metrics appear, until ``stop`` (then one last look)."""
    cursor = 0
    while True:
        last = stop.is_set()
        report = trainer.report(cursor)
        now = time.perf_counter()
        arrivals.extend(now for _ in report.metrics)
        cursor = report.cursor
        if last:
            return
        time.sleep(POLL_S)


def shoal_step_times(
    s: StepSettings, plans: tuple[StagePlan, ...], keep_copies: bool
) -> tuple[list[float], list[StepMetrics], list[RunnerEvent]]:
    """Each step's wall seconds between step boundaries, seen from outside the runner (so
    all it does between steps counts, copies included), and the engine's own metrics and
    events."""
    model, data, opt = refs(s)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-step-") as root:
        snapshot = JobSnapshot(
            job_id=f"bench-step-{os.getpid()}",
            attempt=1,
            model=model,
            data=data,
            optimizer=opt,
            batch_size=s.shape.batch,
            micro_batches=s.shape.micro_batches,
            steps=s.timed_steps,
            seed=s.seed,
            schedule=s.schedule,
            recompute=False,
            stages=plans,
            num_blocks=s.num_blocks,
            checkpoint_root=root,
            checkpoint_every=0,
            checkpoint_keep=1,
            keep_copies=keep_copies,
        )
        trainer = Trainer(snapshot, RayGroup)
        arrivals: list[float] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(trainer, stop, arrivals), daemon=True)
        started = time.perf_counter()
        watcher.start()
        try:
            with threads(RUNNER_THREADS):
                status = trainer.run()
        finally:
            stop.set()
            watcher.join()
        report = trainer.report(0)
        if status is not RunStatus.SUCCEEDED:
            raise BenchError(f"the Shoal run (keep_copies={keep_copies}) failed: {report.error}")
        return step_seconds(started, arrivals), list(report.metrics), list(report.events)


def _notes(s: StepSettings) -> list[str]:
    notes = [
        "Shoal's step seconds are wall time between step boundaries as the driver sees them"
        " (polled every millisecond); engine_timed_samples_per_s are the engine's own step"
        " timer, which may leave out work between steps"
    ]
    if s.device == "cpu":
        notes.append(
            "the plain loop runs one thread (torch.set_numthreads(1)): a Shoal virtual CPU"
            " device runs its stage single-threaded"
        )
    else:
        notes.append("the plain loop synchronizes CUDA before reading the clock")
    return notes


def run_step(s: StepSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Measure everything ``shoal bench step`` reports; see ``step_settings.step_result``."""
    started = time.perf_counter()
    retain_freed_memory()  # the plain loop's allocator as Shoal's workers' (workers.host_memory)
    device = torch.device(s.device)
    phases = iter(STEP_PHASES)
    progress(next(phases))
    plain, plain_losses = plain_step_times(s)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the plain loop's cached memory, for Shoal's workers
    progress(next(phases))
    with ray_session(s.stages) as node_id:
        on = devices(s, node_id)
        bounds = stage_bounds(s.num_blocks, s.stages)
        plans = tuple(StagePlan(i, r, on[i]) for i, r in enumerate(bounds))
        progress(next(phases))
        shoal, metrics, _ = shoal_step_times(s, plans, keep_copies=False)
        progress(next(phases))
        copies, copies_metrics, copies_events = shoal_step_times(s, plans, keep_copies=True)
    # How often the engine chose to copy, and what it measured them to cost (its last word).
    cadence = [e.data for e in copies_events if e.kind == "copies"]

    def rate(times: list[float]) -> float:
        return median_throughput(times, s.shape.batch, s.warmup, s.repeats)

    def engine_rate(ms: list[StepMetrics]) -> float:
        return rate([m.step_time_s for m in ms])

    return step_result(
        s,
        plain=rate(plain),
        shoal=rate(shoal),
        shoal_copies=rate(copies),
        copies_overhead=copies_overhead(shoal, copies, s.warmup),
        stage_busy=busy_fractions(metrics, s.warmup),
        device=device_name(device),
        machine=machine_with(device),
        notes=_notes(s),
        started=started,
        extra={
            "plain_step_s": median_step_s(plain, s.warmup, s.repeats),
            "shoal_step_s": median_step_s(shoal, s.warmup, s.repeats),
            "shoal_copies_step_s": median_step_s(copies, s.warmup, s.repeats),
            "timed_s": {"shoal": sum(shoal[s.warmup :]), "shoal_copies": sum(copies[s.warmup :])},
            "engine_timed_samples_per_s": {
                "shoal": engine_rate(metrics),
                "shoal_copies": engine_rate(copies_metrics),
            },
            "copies_stage_busy": busy_fractions(copies_metrics, s.warmup),
            "copy_interval_steps": cadence[-1]["interval"] if cadence else 1,
            "copies_engine_overhead": cadence[-1]["overhead"] if cadence else None,
            "copies_engine_copy_s": cadence[-1]["copy_s"] if cadence else None,
            "loss_max_abs_diff": max(
                abs(m.loss - want)
                for ms in (metrics, copies_metrics)
                for m, want in zip(ms, plain_losses, strict=True)
            ),
        },
    )
