"""What the benchmarks report: settings, the pipeline ideal, efficiency, and the JSON shape.

Pure on purpose (no Ray, no torch): the numbers are checked by unit tests and the CLI prints
them as a table or as one JSON object.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from shoal.workers.snapshot import DataRef, JobSnapshot, ModelRef, OptimizerConf

Progress = Callable[[str], None]
"""Told the name of each phase as it starts (the CLI's progress bar)."""

PIPELINE_KEYS = (
    "single_process_samples_per_s",
    "single_thread_samples_per_s",
    "shoal_samples_per_s",
    "ideal_samples_per_s",
    "efficiency",
    "torch_pipelining_samples_per_s",
    "overhead_ms_per_microbatch",
)
"""The keys ``shoal bench pipeline --json`` always prints (issue 3)."""


ELASTIC_KEYS = (
    "static_samples_per_s",
    "shoal_samples_per_s",
    "best_samples_per_s",
    "shoal_over_best",
    "steps_to_rebalance",
    "recovery_seconds",
    "steps_replayed",
    "growth_seconds",
)
"""The keys ``shoal bench elastic --json`` always prints (issue 4)."""

ELASTIC_PHASES = (
    "starting a 3-node local Ray",
    "static even cut",
    "shoal, rebalancing",
    "best cut for the measured speeds",
    "preemption",
    "growth",
)


@dataclass(frozen=True)
class ElasticSettings:
    hidden: int = 1024
    layers: int = 5
    features: int = 256
    outputs: int = 16
    batch_size: int = 64
    micro_batches: int = 8
    slowdown: float = 3.0
    steps: int = 24
    """Steps of each heterogeneity run; the steady state is the median of the last third."""
    window: int = 3
    """The elastic policy's window (``elastic.check_every_steps``)."""
    seed: int = 0

    @property
    def devices(self) -> str:
        """The local cluster: three nodes of one device each, the third one slowed."""
        return f"1xcpu-a:4096,1xcpu-b:4096,1xcpu-slow:4096:slowdown={self.slowdown:g}"

    def __post_init__(self) -> None:
        if self.batch_size % self.micro_batches:
            raise ValueError("batch_size must be a multiple of micro_batches")
        if self.layers + 1 < 3:
            raise ValueError("the model needs at least 3 blocks (layers >= 2) for 3 stages")
        if self.steps < 3 * self.window or self.slowdown < 1.0:
            raise ValueError("steps must be >= 3 x window and slowdown >= 1")

    @property
    def num_blocks(self) -> int:
        return self.layers + 1


class BenchError(RuntimeError):
    """A benchmark could not run; the message says which part and why."""


@dataclass(frozen=True)
class PipelineSettings:
    """The model and run sizes of ``shoal bench pipeline``.

    The default MLP has ~26M parameters (7 hidden 2048-wide layers): big enough that compute
    dominates a micro-batch of 8 rows, small enough that one run takes a minute or two on
    2 CPU cores. The overhead model has negligible compute, so its step is all framework.
    """

    hidden: int = 2048
    layers: int = 7
    features: int = 512
    outputs: int = 16
    batch_size: int = 64
    micro_batches: int = 8
    stages: int = 2
    schedule: str = "1f1b"
    lr: float = 1e-3
    steps: int = 5
    """Timed steps of each contender in each round."""
    warmup: int = 2
    """Untimed steps before them (the allocator, the first calls)."""
    repeats: int = 3
    """Rounds: each runs every contender once, back to back (see ``pipeline_result``)."""
    overhead_steps: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batches"
                f" ({self.micro_batches})"
            )
        if not 1 <= self.stages <= self.layers + 1:
            raise ValueError(f"stages ({self.stages}) must be 1..{self.layers + 1} (the blocks)")
        if min(self.steps, self.repeats, self.overhead_steps) < 1 or self.warmup < 0:
            raise ValueError("steps, repeats and overhead_steps must be >= 1, warmup >= 0")

    @property
    def num_blocks(self) -> int:
        return self.layers + 1

    def refs(self) -> tuple[ModelRef, DataRef, OptimizerConf]:
        """The model, data and optimizer every contender trains."""
        return mlp_refs(self.hidden, self.layers, self.features, self.outputs, self.lr)

    @property
    def parameters(self) -> int:
        h = self.hidden
        return (self.features + 1) * h + (self.layers - 1) * (h + 1) * h + (h + 1) * self.outputs

    @property
    def timed_steps(self) -> int:
        """Steps each contender runs in a round, the warm-up included."""
        return self.warmup + self.steps


def stage_bounds(num_blocks: int, stages: int) -> list[tuple[int, int]]:
    """Equal block counts per stage, the remainder to the first stages (the bench's blocks
    cost the same, so this is the balanced partition; kept here so the bench does not move
    with the partitioner)."""
    share, rest = divmod(num_blocks, stages)
    bounds, start = [], 0
    for s in range(stages):
        stop = start + share + (1 if s < rest else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ideal_samples_per_s(
    single_device: float, devices: int, micro_batches: int, stages: int
) -> float:
    """Single-device throughput x devices x m/(m+p-1): perfect division of the work, less
    the GPipe/1F1B bubble (p-1)/(m+p-1) (Huang et al., 2019; Narayanan et al., 2021)."""
    if devices < 1 or micro_batches < 1 or stages < 1:
        raise ValueError("devices, micro_batches and stages must be >= 1")
    return single_device * devices * micro_batches / (micro_batches + stages - 1)


def efficiency(measured: float, ideal: float) -> float:
    """Measured throughput as a fraction of the ideal (0 when there is no ideal)."""
    return measured / ideal if ideal > 0 else 0.0


def windows(step_times: Sequence[float], warmup: int, repeats: int) -> list[float]:
    """The seconds of each repeat: the steps after ``warmup``, cut into ``repeats`` windows."""
    timed = list(step_times[warmup:])
    size = len(timed) // repeats
    if size < 1:
        raise BenchError(
            f"{len(step_times)} steps cannot make {repeats} repeats after {warmup} warm-up"
        )
    return [sum(timed[r * size : (r + 1) * size]) for r in range(repeats)]


def median_throughput(
    step_times: Sequence[float], samples_per_step: int, warmup: int, repeats: int
) -> float:
    """Median over repeats of samples per second (each repeat: its samples over its time)."""
    seconds = windows(step_times, warmup, repeats)
    size = (len(step_times) - warmup) // repeats
    return statistics.median(samples_per_step * size / s for s in seconds)


def median_step_s(step_times: Sequence[float], warmup: int, repeats: int) -> float:
    seconds = windows(step_times, warmup, repeats)
    size = (len(step_times) - warmup) // repeats
    return statistics.median(s / size for s in seconds)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def mlp_refs(
    hidden: int, layers: int, features: int, outputs: int, lr: float
) -> tuple[ModelRef, DataRef, OptimizerConf]:
    """The engine benches' model: the built-in MLP on synthetic regression data, SGD."""
    model = ModelRef("mlp", None, {"hidden": hidden, "layers": layers})
    data = DataRef("synthetic-regression", None, {"features": features, "outputs": outputs})
    return model, data, OptimizerConf("sgd", lr)


def bench_job(
    name: str,
    refs: tuple[ModelRef, DataRef, OptimizerConf],
    root: str | os.PathLike[str],
    **fields: Any,
) -> JobSnapshot:
    """A job an engine bench trains: ``name`` (this process's own), the model, data and
    optimizer ``refs``, a first attempt that writes no checkpoint (its root is ``root``),
    without recomputation; ``fields`` are the rest of the snapshot (batch, steps, seed,
    schedule, stages, ...)."""
    model, data, optimizer = refs
    return JobSnapshot(
        job_id=f"{name}-{os.getpid()}",
        attempt=1,
        model=model,
        data=data,
        optimizer=optimizer,
        recompute=False,
        checkpoint_root=str(root),
        checkpoint_every=0,
        checkpoint_keep=1,
        **fields,
    )


def machine() -> dict[str, Any]:
    """Where and when the numbers were taken: cores, load, versions."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count() or 1,
        "load_average_1m": round(load[0], 2),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "ray": _version("ray"),
        "numpy": _version("numpy"),
    }


@dataclass(frozen=True)
class PipelineRound:
    """One round of ``shoal bench pipeline``: each contender's samples/s, measured one after
    another within a minute or so, and the framework overhead in ms per micro-batch."""

    single_process: float
    single_thread: float
    side_by_side_thread: float
    shoal: float
    torch_pipelining: float
    overhead_ms: float

    def view(self, settings: PipelineSettings) -> dict[str, float]:
        """This round's values under the result's keys, its ratios taken within it."""
        p, m = settings.stages, settings.micro_batches
        ideal = ideal_samples_per_s(self.single_thread, p, m, p)
        side_by_side_ideal = ideal_samples_per_s(self.side_by_side_thread, p, m, p)
        return {
            "single_process_samples_per_s": self.single_process,
            "single_thread_samples_per_s": self.single_thread,
            "shoal_samples_per_s": self.shoal,
            "ideal_samples_per_s": ideal,
            "efficiency": efficiency(self.shoal, ideal),
            "torch_pipelining_samples_per_s": self.torch_pipelining,
            "overhead_ms_per_microbatch": self.overhead_ms,
            "torch_pipelining_efficiency": efficiency(self.torch_pipelining, ideal),
            "shoal_vs_torch_pipelining": efficiency(self.shoal, self.torch_pipelining),
            "side_by_side_thread_samples_per_s": self.side_by_side_thread,
            "side_by_side_ideal_samples_per_s": side_by_side_ideal,
            "side_by_side_efficiency": efficiency(self.shoal, side_by_side_ideal),
        }


def round_phases(names: Sequence[str], rounds: int) -> list[str]:
    """A progress bar's labels: every phase of every round."""
    return [f"round {n}/{rounds}: {name}" for n in range(1, rounds + 1) for name in names]


def round_samples_per_s(step_times: Sequence[float], samples_per_step: int, warmup: int) -> float:
    """A contender's samples per second over one round's steps after ``warmup``."""
    timed = step_times[warmup:]
    if not timed:
        raise BenchError(f"{len(step_times)} steps leave none to time after {warmup} warm-up")
    return samples_per_step * len(timed) / sum(timed)


def pipeline_result(
    settings: PipelineSettings,
    rounds: Sequence[PipelineRound],
    *,
    started: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON object of ``shoal bench pipeline``; the issue's keys come first.

    Every key is the median over the rounds of that round's value, a ratio taken within its
    round: the contenders of one round ran a minute apart at most, so a machine whose
    speed drifts between minutes (a shared VM's does by 10-30%) moves both sides of a ratio
    together, where medians taken separately would pair one minute's Shoal with another's
    peer. Each round's values are under ``rounds``.

    A virtual CPU device runs one thread (``workers.pipeline.stage``), so the single-device
    throughput of the ideal is the single-thread one. The side-by-side ideal takes instead
    one thread's throughput while the other devices' threads also run (on a CPU they share
    memory bandwidth; ``pipeline.side_by_side_step_times``).
    """
    if not rounds:
        raise BenchError("a pipeline result needs at least one round")
    views = [r.view(settings) for r in rounds]
    return {
        **{key: statistics.median(v[key] for v in views) for key in views[0]},
        "devices": settings.stages,
        "model": f"mlp {settings.parameters / 1e6:.1f}M parameters"
        f" ({settings.layers} x {settings.hidden} hidden, {settings.features} in,"
        f" {settings.outputs} out), sgd",
        "parameters": settings.parameters,
        "settings": asdict(settings),
        "rounds": views,
        **(extra or {}),
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }


SHARP_KEYS = (
    "sharp_seconds",
    "sequential_seconds",
    "speedup_vs_sequential",
    "no_prefetch_seconds",
    "sim_lrtf_over_lower_bound",
    "sim_fifo_over_lower_bound",
    "sim_1024_devices_seconds",
)
"""The keys ``shoal bench sharp --json`` always prints (the SHARP issue)."""

DEVICES = ("cpu", "cuda")
"""What a bench's devices may be: virtual CPU devices, or the machine's GPUs."""

SHARP_PHASES = (
    "simulated: Hydra's 8 devices x 12 models",
    "simulated: heterogeneous spot cluster",
    "simulated: 1,024 devices x 1,000 models",
    "starting a 2-node local Ray",
    "one after another, model parallel",
    "SHARP, Sharded-LRTF",
    "SHARP, prefetch off",
)


SHARP_BATCH_SIZE = {"cpu": 128, "cuda": 4096}
"""``shoal bench sharp``'s default batch on each kind of device."""


@dataclass(frozen=True)
class SharpSettings:
    """The sizes of ``shoal bench sharp``: ``models`` identical MLPs (seeds differ) on two
    devices for the real part, and the simulated clusters.

    The default MLP has ~30M parameters (8 hidden 2048-wide layers): a shard task computes
    for ~50 ms on one core, large against Ray's ~10-40 ms per task round trip on 2 cores.
    On ``cuda`` the devices are the machine's GPU (``devices``); the CLI's default batch
    there is ``SHARP_BATCH_SIZE``'s, sized (not measured) so that a shard's forward computes
    about as long as its state takes to come in from pinned host memory, where prefetching
    can hide the copy.
    """

    device: str = "cpu"
    models: int = 4
    hidden: int = 2048
    layers: int = 8
    features: int = 256
    outputs: int = 16
    batch_size: int = 128
    steps: int = 24
    lr: float = 1e-3
    budget_fraction: float = 0.75
    """One device's memory budget as a fraction of what one model holds through a step
    (parameters, gradients, optimizer state and what the batch keeps for the backward), plus
    room in each half for a block's backward temporaries: below 1, no model fits one device;
    SHARP cuts it into shards of at most half the budget."""
    seed: int = 0
    rounds: int = 1
    """Times the real half's variants run, their order rotated a round (``bench.sharp``)."""
    spot_devices: int = 512
    spot_models: int = 300
    scale_devices: int = 1024
    scale_models: int = 1000

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is none of {', '.join(DEVICES)}")
        if min(self.models, self.steps, self.batch_size, self.layers, self.rounds) < 1:
            raise ValueError("models, steps, batch_size, layers and rounds must be >= 1")
        if not 0.5 < self.budget_fraction < 1.0:
            raise ValueError(
                f"budget_fraction ({self.budget_fraction}) must be between 0.5 (half a model"
                " per device: the plain model-parallel baseline must fit) and 1 (a whole"
                " model would fit one device)"
            )
        if min(self.spot_devices, self.spot_models, self.scale_devices, self.scale_models) < 1:
            raise ValueError("the simulated clusters need at least one device and one model")

    @property
    def num_blocks(self) -> int:
        return self.layers + 1

    @property
    def devices(self) -> str:
        """The local cluster: two nodes of one device each (on ``cuda`` each node offers the
        machine's GPU: two devices on one GPU when it has one)."""
        kind = "gpu" if self.device == "cuda" else "cpu"
        return f"1x{kind}-a:4096,1x{kind}-b:4096"


def sharp_result(
    s: SharpSettings, real: dict[str, Any], sim: dict[str, Any], started: float
) -> dict[str, Any]:
    """The JSON object of ``shoal bench sharp``; the issue's keys come first. ``real`` has
    the three variants' seconds, ``sim`` the simulated settings (``bench.simulation``)."""
    sharp, sequential = real["sharp_seconds"], real["sequential_seconds"]
    return {
        "sharp_seconds": sharp,
        "sequential_seconds": sequential,
        "speedup_vs_sequential": sequential / sharp if sharp > 0 else 0.0,
        "no_prefetch_seconds": real["no_prefetch_seconds"],
        "sim_lrtf_over_lower_bound": sim["sim_lrtf_over_lower_bound"],
        "sim_fifo_over_lower_bound": sim["sim_fifo_over_lower_bound"],
        "sim_1024_devices_seconds": sim["sim_1024_devices_seconds"],
        **{k: v for k, v in real.items() if k not in SHARP_KEYS},
        **{k: v for k, v in sim.items() if k not in SHARP_KEYS},
        "settings": asdict(s),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def same_losses(variants: dict[str, Sequence[Sequence[float]]]) -> None:
    """Every variant trained every model to the same losses, bit for bit (SHARP does the
    same math as a plain run: ``workers.sharp.runner``); raises ``BenchError`` naming the
    first model and step where two differ."""
    names = list(variants)
    first = variants[names[0]]
    for name in names[1:]:
        other = variants[name]
        if len(other) != len(first):
            raise BenchError(f"{name} trained {len(other)} models, {names[0]} {len(first)}")
        for model, (want, got) in enumerate(zip(first, other, strict=True)):
            if list(want) == list(got):
                continue
            step = next(
                (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                min(len(want), len(got)),
            )
            raise BenchError(
                f"model {model}: {name} differs from {names[0]} at step {step + 1}"
                f" ({_at(got, step)} vs {_at(want, step)}); the executors must train"
                " exactly alike, so the timings are not comparable"
            )


def _at(losses: Sequence[float], index: int) -> str:
    return repr(losses[index]) if index < len(losses) else "no such step"
