"""``shoal bench pipeline``: single-process PyTorch against Shoal's engine on the same model.

Every contender trains the same MLP on the same batches with the same micro-batching and
gradient accumulation (the ``workers.reference`` contract), so they do the same math; only
where it runs differs. Shoal runs through the real engine
(``workers.pipeline.runner.Trainer`` with a ``RayGroup`` of StageWorker actors on virtual CPU
devices, one thread each); the peer is ``torch.distributed.pipelining``
(``service.bench.peer``). Every process keeps its freed host
memory as Shoal's workers do (``workers.host_memory``), so the allocator is not what differs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch

from shoal.scheduler.devices import DEVICE_RESOURCE, LABEL_KIND, LABEL_MEMORY_MB, Device
from shoal.service.bench import peer
from shoal.service.bench.report import (
    BenchError,
    PipelineRound,
    PipelineSettings,
    Progress,
    bench_job,
    pipeline_result,
    round_phases,
    round_samples_per_s,
    stage_bounds,
)
from shoal.workers.blocks import Block
from shoal.workers.host_memory import retain_freed_memory
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.snapshot import (
    RunStatus,
    StagePlan,
    StepMetrics,
)
from shoal.workers.zoo.data import loss_fn, make_data
from shoal.workers.zoo.models import build_blocks

BENCH_NAMESPACE = "shoal-bench"

PIPELINE_PHASES = (
    "single process, all cores",
    "single process, one thread",
    "one thread per device, side by side",
    "starting Ray",
    "shoal, 2 stages",
    "shoal overhead, tiny model",
    "torch.distributed.pipelining",
)
"""The phases of one round."""


RUNNER_THREADS = 1
"""Torch threads of the runner in a bench (and of the SHARP executor in ``bench.sharp``), as
in a job: Ray starts the runner actor with
OMP_NUM_THREADS=1. With the driver's default (every core), the runner's idle OpenMP threads
spin after each batch it draws and take cores from the stages: measured 18.7 ms against
8.8 ms for a tiny model's step (2 stages, 8 micro-batches, 2 cores)."""


@contextmanager
def threads(count: int | None) -> Iterator[None]:
    """Run the body with ``count`` intra-op threads (None: leave them), then restore them."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def ray_session(devices: int) -> Iterator[str]:
    """This process's Ray (reused if already connected), with ``devices`` virtual devices;
    yields the node id. A head started here takes free ports and is shut down after."""
    if ray.is_initialized():
        have = ray.available_resources().get(  # type: ignore[no-untyped-call]
            DEVICE_RESOURCE, 0.0
        )
        if have < devices:
            raise BenchError(
                f"the connected Ray has {have:g} free {DEVICE_RESOURCE} resources, the bench"
                f" needs {devices}; run it outside a Shoal cluster, or free some devices"
            )
        yield ray.get_runtime_context().get_node_id()
        return
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 1,
        resources={DEVICE_RESOURCE: devices},
        labels={LABEL_KIND: "cpu", LABEL_MEMORY_MB: "8192"},
        include_dashboard=False,
        namespace=BENCH_NAMESPACE,
        log_to_driver=False,
    )
    try:
        yield ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


def single_process_step_times(s: PipelineSettings, threads: int) -> list[float]:
    """Seconds of each step of a plain PyTorch run with ``threads`` threads (the reference)."""
    model, data, opt = s.refs()
    source = make_data(data, s.seed, ())
    modules = build_blocks(model, source.meta, s.seed, range(s.num_blocks))
    blocks = [Block(i, m, opt) for i, m in enumerate(modules)]
    loss = loss_fn(source.meta.task)
    rows = s.batch_size // s.micro_batches
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for step in range(s.timed_steps):
            started = time.perf_counter()
            inputs, targets = source.batch(step, s.batch_size)
            for j in range(s.micro_batches):
                out = inputs[j * rows : (j + 1) * rows]
                for block in blocks:
                    out = block.module(out)
                part = loss(out, targets[j * rows : (j + 1) * rows]) * (rows / s.batch_size)
                part.backward()  # type: ignore[no-untyped-call]
            for block in blocks:
                block.step()
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return times


def _contender(fields: dict[str, Any], start: Any, out: str) -> None:
    s = PipelineSettings(**fields)
    retain_freed_memory()
    start.wait()
    Path(out).write_text(json.dumps(single_process_step_times(s, 1)))


def side_by_side_step_times(s: PipelineSettings) -> list[list[float]]:
    """Each step's seconds of ``s.stages`` one-thread plain runs of the whole model, one per
    process, started together: what one device does while the others also compute. On a
    CPU the virtual devices share memory bandwidth and caches, so this is the single-device
    speed the pipeline's stages can actually have; GPUs do not slow each other this way."""
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(s.stages)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-side-") as tmp:
        outs = [str(Path(tmp) / f"{i}.json") for i in range(s.stages)]
        runs = [spawn.Process(target=_contender, args=(asdict(s), start, o)) for o in outs]
        for run in runs:
            run.start()
        for run in runs:
            run.join()
        failed = [r.exitcode for r in runs if r.exitcode != 0]
        if failed:
            raise BenchError(f"a side-by-side run exited with {failed[0]}")
        return [json.loads(Path(o).read_text()) for o in outs]


def shoal_step_times(s: PipelineSettings, node_id: str, steps: int) -> list[StepMetrics]:
    """Each step's metrics from Shoal's engine: ``s.stages`` StageWorkers, one per device."""
    devices = [
        Device(f"{node_id[:8]}-cpu-{i}", node_id, i, "cpu", 8192, gpu=False)
        for i in range(s.stages)
    ]
    plans = tuple(
        StagePlan(i, r, devices[i]) for i, r in enumerate(stage_bounds(s.num_blocks, s.stages))
    )
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as root:
        snapshot = bench_job(
            "bench-pipeline",
            s.refs(),
            root,
            batch_size=s.batch_size,
            micro_batches=s.micro_batches,
            steps=steps,
            seed=s.seed,
            schedule=s.schedule,
            stages=plans,
            num_blocks=s.num_blocks,
        )
        trainer = Trainer(snapshot, RayGroup)
        with threads(RUNNER_THREADS):
            status = trainer.run()
        if status is not RunStatus.SUCCEEDED:
            raise BenchError(f"the Shoal run failed: {trainer.report(0).error}")
        return list(trainer.report(0).metrics)


def busy_fractions(metrics: list[StepMetrics], warmup: int) -> list[float]:
    """Per stage, the median share of the step it spent computing (the rest: waiting on the
    bubble, on transfers, or for a core)."""
    timed = metrics[warmup:]
    stages = sorted({t.stage for m in timed for t in m.stages})
    return [
        statistics.median(
            sum(t.compute_s for t in m.stages if t.stage == stage) / m.step_time_s for m in timed
        )
        for stage in stages
    ]


@dataclass(frozen=True)
class _Round:
    """What one round measured: the result's numbers and what the extra keys are made of."""

    result: PipelineRound
    shoal_metrics: list[StepMetrics]
    step_s: dict[str, float]


def _measure_round(
    s: PipelineSettings, tiny: PipelineSettings, phase: Callable[[], None]
) -> _Round:
    """Every contender once, one after another (``phase`` is called as each starts)."""
    cores = os.cpu_count() or 1

    def rate(times: list[float]) -> float:
        return round_samples_per_s(times, s.batch_size, s.warmup)

    def step_s(times: list[float]) -> float:
        return statistics.median(times[s.warmup :])

    phase()
    all_cores = single_process_step_times(s, cores)
    phase()
    one_thread = single_process_step_times(s, 1)
    phase()
    side_by_side = side_by_side_step_times(s)
    tiny_local = single_process_step_times(tiny, 1)
    phase()
    with ray_session(s.stages) as node_id:
        phase()
        metrics = shoal_step_times(s, node_id, s.timed_steps)
        phase()
        tiny_shoal = [m.step_time_s for m in shoal_step_times(tiny, node_id, tiny.timed_steps)]
    phase()
    peer_times = peer.step_times(s)
    shoal = [m.step_time_s for m in metrics]
    result = PipelineRound(
        single_process=rate(all_cores),
        single_thread=rate(one_thread),
        side_by_side_thread=statistics.median(rate(times) for times in side_by_side),
        shoal=rate(shoal),
        torch_pipelining=rate(peer_times),
        overhead_ms=1000 * (step_s(tiny_shoal) - step_s(tiny_local)) / s.micro_batches,
    )
    return _Round(
        result,
        metrics[s.warmup :],
        {
            "shoal_step_s": step_s(shoal),
            "single_thread_step_s": step_s(one_thread),
            "torch_pipelining_step_s": step_s(peer_times),
        },
    )


def run_pipeline(s: PipelineSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Measure everything ``shoal bench pipeline`` reports; see ``report.pipeline_result``.

    The contenders run in ``s.repeats`` rounds, each of them once per round, so each ratio
    compares runs a minute apart at most. Ray runs only for Shoal's phases: the plain runs
    and the peer, which need no Ray, run without its processes beside them.
    """
    started = time.perf_counter()
    retain_freed_memory()  # the plain runs' allocator as Shoal's workers' (workers.host_memory)
    # The overhead model: negligible compute, so its step is all framework.
    tiny = replace(s, hidden=8, layers=1, features=8, outputs=1, steps=s.overhead_steps)
    labels = iter(round_phases(PIPELINE_PHASES, s.repeats))
    rounds = [_measure_round(s, tiny, lambda: progress(next(labels))) for _ in range(s.repeats)]
    return pipeline_result(
        s,
        [r.result for r in rounds],
        started=started,
        extra={
            "single_process_threads": os.cpu_count() or 1,
            **{key: statistics.median(r.step_s[key] for r in rounds) for key in rounds[0].step_s},
            "shoal_stage_busy": busy_fractions([m for r in rounds for m in r.shoal_metrics], 0),
            "overhead_model": f"mlp {tiny.parameters} parameters, {tiny.overhead_steps} steps",
        },
    )
