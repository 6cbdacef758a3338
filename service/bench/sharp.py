"""``shoal bench sharp``: SHARP against training the models one after another, on 2 devices.

The devices are virtual CPU devices, or (``--device cuda``) two devices on the machine's GPU,
each with a memory budget under one model's state, so shards come in from pinned host memory.

Several identical MLPs (their seeds differ), each larger than one device's memory budget,
train on the same two devices three ways, every one through Shoal's own engine:

1. One after another with plain model parallelism: ``workers.pipeline.runner.Trainer`` with two
   stages over the two devices and one micro-batch, so one device computes at a time.
2. Together under SHARP (``workers.sharp.runner.SharpTrainer``, Sharded-LRTF, prefetch on):
   each model cut into shards of at most half a device's budget, the devices running shard
   tasks of different models at once.
3. SHARP with prefetch off.

Every variant trains the same models on the same batches to the same losses, bit for bit
(``report.same_losses``), so their wall times compare like for like. With ``rounds`` the
variants run that many times, their order rotated one place a round (a variant's time moved
by up to ~10% between rounds of one process: docs/benchmarks.md), and the figures are those
of the round whose SHARP training speedup is the median. The pools and groups are
parameters: the bench runs them on Ray actors, the unit tests in-process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from shoal.scheduler.devices import Device
from shoal.scheduler.memory import stage_memory, transient_bytes
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.sharp import Shard, ShardError, shard_model
from shoal.scheduler.types import DeviceId
from shoal.service.bench.elastic import cluster_devices
from shoal.service.bench.hardware import device_name, host_to_device_gbps, machine_with
from shoal.service.bench.pipeline import RUNNER_THREADS, threads
from shoal.service.bench.report import (
    SHARP_PHASES,
    BenchError,
    Progress,
    SharpSettings,
    bench_job,
    mlp_refs,
    same_losses,
    sharp_result,
    stage_bounds,
)
from shoal.service.bench.simulation import simulate_local
from shoal.service.localray import LocalRay
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.pipeline.stage_types import torch_device
from shoal.workers.pipeline.worker_group import GroupFactory
from shoal.workers.profiler import trace_costs
from shoal.workers.sharp.runner import SharpTrainer
from shoal.workers.sharp.shard_pool import Call, HostPool, PoolFactory, RayPool, await_all
from shoal.workers.sharp.shard_types import TaskResult
from shoal.workers.sharp.shard_worker import TASKS
from shoal.workers.snapshot import (
    DataRef,
    JobSnapshot,
    ModelRef,
    OptimizerConf,
    RunnerEvent,
    RunStatus,
    stage_plans,
)


def refs(s: SharpSettings) -> tuple[ModelRef, DataRef, OptimizerConf]:
    return mlp_refs(s.hidden, s.layers, s.features, s.outputs, s.lr)


def model_costs(s: SharpSettings) -> tuple[BlockCost, ...]:
    """The blocks' costs for the whole batch (one micro-batch: plain model parallelism)."""
    model, data, _ = refs(s)
    return trace_costs(model, data, micro_batch_size=s.batch_size, optimizer="sgd")


def held_bytes(costs: Sequence[BlockCost], batch_size: int) -> int:
    """What one model holds through a step: its parameters, gradients and optimizer state,
    and what a batch of ``batch_size`` keeps for the backward."""
    return sum(
        2 * c.param_bytes + c.optim_bytes + batch_size * c.activation_bytes_per_sample
        for c in costs
    )


def snapshots(
    s: SharpSettings,
    root: Path,
    variant: str,
    costs: tuple[BlockCost, ...],
    devices: Sequence[Device] = (),
) -> list[JobSnapshot]:
    """The models, as jobs of ``variant``; with ``devices``, two stages over them (the
    model-parallel baseline), else none (SHARP places shards itself)."""
    stages = stage_plans(devices, stage_bounds(s.num_blocks, len(devices))) if devices else ()
    return [
        bench_job(
            f"bench-sharp-{variant}-{i}",
            refs(s),
            root / variant,
            batch_size=s.batch_size,
            micro_batches=1,
            steps=s.steps,
            seed=s.seed + i,
            schedule="gpipe",
            stages=stages,
            num_blocks=s.num_blocks,
            block_costs=costs,
            keep_copies=True,  # as a sweep's trials by default (elastic.keep_copies)
        )
        for i in range(s.models)
    ]


ROUND_TRIPS = 5
"""Calls per device whose round trip ``_Watched`` times once training is done."""


class _Watched:
    """A host pool that notes when the first shard task went out, each device's compute
    seconds, each task's compute seconds by (op, shard), and once training is done the
    round trip of a call to each idle worker (``ROUND_TRIPS`` each; the executor's first
    calls also wait for the workers to start): what calibrates the simulator's run of the
    same work (``bench.simulation.simulate_local``)."""

    def __init__(self, inner: HostPool) -> None:
        self.inner = inner
        self.devices = inner.devices
        self.first_task: float | None = None
        self.last_task: float | None = None
        """When the executor had the last shard task's result: training's end, before
        the writer thread's final checkpoints (one after another's step times leave its
        out too)."""
        self.compute_s = [0.0] * len(inner.devices)
        self.host_s = [0.0] * len(inner.devices)
        self.task_s: dict[tuple[str, int], list[float]] = {}
        self.task_host_s: dict[tuple[str, int], list[float]] = {}
        self.idle_s: list[float] = []
        self.round_trips: list[float] = []
        self._calls: dict[Call, tuple[str, int]] = {}

    def submit(self, host: int, method: str, *args: Any) -> Call:
        self._starting(method)
        call = self.inner.submit(host, method, *args)
        self._note(call, args)
        return call

    def submit_after(self, host: int, after: Call, method: str, *args: Any) -> Call:
        return self.inner.submit_after(host, after, method, *args)

    def submit_run(self, host: int, tasks: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Call]:
        self._starting(tasks[0][0])
        calls = self.inner.submit_run(host, tasks)
        for call, (_, args) in zip(calls, tasks, strict=True):
            self._note(call, args)
        return calls

    def _starting(self, method: str) -> None:
        if self.first_task is None and method in TASKS:
            self.first_task = time.perf_counter()

    def _note(self, call: Call, args: tuple[Any, ...]) -> None:
        self._calls[call] = (call.method, args[0][1] if call.method in TASKS else -1)

    def wait(self, calls: Sequence[Call], timeout: float) -> list[Call]:
        return self.inner.wait(calls, timeout)

    def result(self, call: Call) -> Any:
        value = self.inner.result(call)
        method, shard = self._calls.pop(call, ("", -1))
        if isinstance(value, TaskResult):
            self.last_task = time.perf_counter()
            self.compute_s[call.host] += value.compute_s
            self.host_s[call.host] += value.host_s
            self.task_s.setdefault((method, shard), []).append(value.compute_s)
            self.task_host_s.setdefault((method, shard), []).append(value.host_s)
            self.idle_s.append(value.idle_s)
        return value

    def outputs(self, call: Call) -> Any:
        return self.inner.outputs(call)

    def give_up(self, host: int, reason: str) -> None:
        self.inner.give_up(host, reason)

    def shutdown(self) -> None:
        for host in range(len(self.devices)):
            for _ in range(ROUND_TRIPS):
                sent = time.perf_counter()
                await_all(self.inner, [self.inner.submit(host, "pid")], 60.0)
                self.round_trips.append(time.perf_counter() - sent)
        self.inner.shutdown()


def train_sharp(
    snaps: Sequence[JobSnapshot],
    devices: Sequence[Device],
    budget: int,
    make_pool: PoolFactory,
    *,
    prefetch: bool,
) -> dict[str, Any]:
    """Train ``snaps`` together under SHARP: wall seconds (from starting the workers), the
    seconds from the first shard task's submission to the last one's result, each
    device's busy share of those, every loss."""
    pools: list[_Watched] = []

    def watched(devs: Sequence[Device], budgets: Mapping[DeviceId, int]) -> HostPool:
        pools.append(_Watched(make_pool(devs, budgets)))
        return pools[-1]

    budgets = {d.id: budget for d in devices}
    trainer = SharpTrainer(snaps, devices, watched, budgets=budgets, prefetch=prefetch)
    started, cpu = time.perf_counter(), time.process_time()
    statuses = trainer.run()
    ended, cpu = time.perf_counter(), time.process_time() - cpu
    failed = {
        snap.job_id: trainer.report(snap.job_id, 0).error
        for snap in snaps
        if statuses.get(snap.job_id) is not RunStatus.SUCCEEDED
    }
    if failed:
        raise BenchError(f"SHARP (prefetch {'on' if prefetch else 'off'}) failed: {failed}")
    (pool,) = pools
    train_s = (pool.last_task or ended) - (pool.first_task or started)
    reports = [trainer.report(snap.job_id, 0) for snap in snaps]
    placements = [e for r in reports for e in r.events if e.kind == "placement"]
    return {
        "seconds": ended - started,
        "train_seconds": train_s,
        "device_busy": [c / train_s for c in pool.compute_s],
        "worker_busy": [h / train_s for h in pool.host_s],
        "task_seconds": {key: statistics.median(v) for key, v in pool.task_s.items()},
        "task_host_seconds": {key: statistics.median(v) for key, v in pool.task_host_s.items()},
        "task_idle_seconds": statistics.median(pool.idle_s) if pool.idle_s else 0.0,
        "round_trip_seconds": statistics.median(pool.round_trips) if pool.round_trips else 0.0,
        "driver_cpu_seconds": cpu,
        "losses": [[m.loss for m in r.metrics] for r in reports],
        "promoted_bytes": trainer.promoted_bytes,
        "shards_per_model": [len(e.data["stages"]) for e in placements],
        "copy_intervals": [_copy_interval(r.events) for r in reports],
    }


def _copy_interval(events: Sequence[RunnerEvent]) -> int:
    """The steps between a model's copies as its last ``copies`` event said (1: none said,
    so copies at every step, its tasks taking them)."""
    said = [e.data["interval"] for e in events if e.kind == "copies"]
    return int(said[-1]) if said else 1


def train_one_after_another(
    snaps: Sequence[JobSnapshot], make_group: GroupFactory
) -> dict[str, Any]:
    """Train ``snaps`` one after another, each with its own stage workers: wall seconds,
    the sum of their step times, each device's busy share of that, every loss."""
    started = time.perf_counter()
    losses, step_s, busy = [], 0.0, dict.fromkeys((p.device.id for p in snaps[0].stages), 0.0)
    for snap in snaps:
        trainer = Trainer(snap, make_group)
        if trainer.run() is not RunStatus.SUCCEEDED:
            raise BenchError(
                f"the model-parallel run {snap.job_id} failed: {trainer.report(0).error}"
            )
        metrics = trainer.report(0).metrics
        losses.append([m.loss for m in metrics])
        step_s += sum(m.step_time_s for m in metrics)
        for m in metrics:
            for t in m.stages:
                busy[t.device_id] += t.compute_s
    return {
        "seconds": time.perf_counter() - started,
        "train_seconds": step_s,
        "device_busy": [b / step_s for b in busy.values()] if step_s > 0 else [],
        "losses": losses,
    }


def measured_shards(
    shards: Sequence[Shard], task_s: Mapping[tuple[str, int], float]
) -> tuple[Shard, ...]:
    """``shards`` with the median seconds their forward and backward tasks took."""
    return tuple(
        replace(
            shard,
            forward_s=task_s.get(("forward", shard.index), shard.forward_s),
            backward_s=task_s.get(("backward", shard.index), shard.backward_s),
        )
        for shard in shards
    )


def measure(
    s: SharpSettings,
    devices: Sequence[Device],
    root: Path,
    make_pool: PoolFactory,
    make_group: GroupFactory,
    progress: Progress = lambda _: None,
) -> dict[str, Any]:
    """The real half of the bench on ``devices`` (two): the three variants' seconds and
    breakdowns, after checking that they trained every model alike."""
    if len(devices) != 2:
        raise BenchError(f"the bench needs 2 devices, the cluster shows {len(devices)}")
    if any(d.gpu != (s.device == "cuda") for d in devices):
        shown = ", ".join(f"{d.id} ({'gpu' if d.gpu else 'cpu'})" for d in devices)
        raise BenchError(
            f"the bench runs on {s.device} devices, the cluster shows {shown}; on cuda every"
            " node must see a GPU, on cpu none may offer one"
        )
    target = torch_device(devices[0])
    costs = model_costs(s)
    # Each half of a device (a running shard, a prefetched one) keeps room for a block's
    # backward temporaries too (``scheduler.memory``): the fraction sizes the rest.
    room = max(transient_bytes(c, s.batch_size) for c in costs)
    held = held_bytes(costs, s.batch_size)
    budget = int(s.budget_fraction * held) + 2 * room
    # What one device would need to hold a whole model (reported beside the budget).
    whole = stage_memory(costs, (0, len(costs)), micro_batch_size=s.batch_size, in_flight=1)
    try:
        shards = shard_model(costs, budget, s.batch_size, recompute=False)
    except ShardError as exc:
        raise BenchError(f"{exc} (here: raise budget_fraction or add layers)") from None
    if len(shards) < 2:
        raise BenchError(f"one model fits half of a {budget}-byte device; lower budget_fraction")
    variants: dict[str, Callable[[str], dict[str, Any]]] = {
        SEQUENTIAL: lambda tag: train_one_after_another(
            snapshots(s, root, f"sequential{tag}", costs, devices), make_group
        ),
        SHARP: lambda tag: train_sharp(
            snapshots(s, root, f"sharp{tag}", costs), devices, budget, make_pool, prefetch=True
        ),
        NO_PREFETCH: lambda tag: train_sharp(
            snapshots(s, root, f"no-prefetch{tag}", costs),
            devices,
            budget,
            make_pool,
            prefetch=False,
        ),
    }
    rounds: list[dict[str, dict[str, Any]]] = []
    # Each variant's driver (a job's runner, the sweep's executor) with one torch thread, as
    # its Ray actor has in the service: idle OpenMP threads would spin on the devices' cores.
    with threads(RUNNER_THREADS):
        for number, order in enumerate(round_orders(s.rounds)):
            ran: dict[str, dict[str, Any]] = {}
            for name in order:
                progress(sharp_phase(name, number, s.rounds))
                ran[name] = variants[name](f"-{number + 1}" if number else "")
            rounds.append(ran)
    # The rate shards come in at on a GPU (measured here, after the runs, in this process).
    gbps = host_to_device_gbps(target) if target.type == "cuda" else None
    same_losses(
        {
            name if s.rounds == 1 else f"{name}, round {number + 1}": ran[name]["losses"]
            for number, ran in enumerate(rounds)
            for name in VARIANTS
        }
    )
    chosen = median_round(rounds)
    plain, sharp, lazy = (rounds[chosen][name] for name in VARIANTS)
    return {
        "rounds": [_round_summary(ran) for ran in rounds],
        "median_round": chosen + 1,
        "sharp_seconds": sharp["seconds"],
        "sequential_seconds": plain["seconds"],
        "no_prefetch_seconds": lazy["seconds"],
        "sharp_train_seconds": sharp["train_seconds"],
        "sequential_train_seconds": plain["train_seconds"],
        "no_prefetch_train_seconds": lazy["train_seconds"],
        "sharp_device_busy": sharp["device_busy"],
        "sharp_worker_busy": sharp["worker_busy"],
        "sequential_device_busy": plain["device_busy"],
        "sharp_driver_cpu_seconds": sharp["driver_cpu_seconds"],
        "sim_two_devices": simulate_local(
            measured_shards(shards, sharp["task_seconds"]),
            s.models,
            s.steps,
            budget,
            latency_s=sharp["round_trip_seconds"] / 2,
            bandwidth_gbps=gbps,
        ),
        "host_to_device_gbps": gbps,
        "sharp_task_seconds": {
            f"{op} {shard}": seconds
            for (op, shard), seconds in sorted(sharp["task_seconds"].items())
        },
        # Where a task's time goes besides computing: in its worker (its inputs and outputs
        # moved between host and device), and waiting for it before it starts.
        "sharp_task_host_seconds": {
            f"{op} {shard}": seconds
            for (op, shard), seconds in sorted(sharp["task_host_seconds"].items())
        },
        "sharp_task_idle_seconds": sharp["task_idle_seconds"],
        "sharp_round_trip_seconds": sharp["round_trip_seconds"],
        "promoted_bytes": sharp["promoted_bytes"],
        "no_prefetch_promoted_bytes": lazy["promoted_bytes"],
        "shards_per_model": sharp["shards_per_model"],
        "sharp_copy_intervals": sharp["copy_intervals"],
        "model_held_bytes": held,
        "model_bytes": whole.total,
        "budget_bytes": budget,
        "final_losses": [losses[-1] for losses in sharp["losses"]],
        "model": f"{s.models} x mlp {s.num_blocks} blocks ({s.layers} x {s.hidden} hidden,"
        f" {s.features} in, {s.outputs} out), sgd, batch {s.batch_size}, {s.steps} steps",
        "device": device_name(target),
        "machine": machine_with(target),
    }


SEQUENTIAL, SHARP, NO_PREFETCH = "one after another", "SHARP", "SHARP without prefetch"
VARIANTS = (SEQUENTIAL, SHARP, NO_PREFETCH)
"""The real half's variants, in the order of its first round."""


def round_orders(rounds: int) -> list[tuple[str, ...]]:
    """Each round's order of the variants, rotated one place a round: over three rounds each
    variant runs once first, once second and once last."""
    return [VARIANTS[n % len(VARIANTS) :] + VARIANTS[: n % len(VARIANTS)] for n in range(rounds)]


def sharp_phase(variant: str, number: int, rounds: int) -> str:
    """The progress bar's label of ``variant`` in round ``number`` (from 0) of ``rounds``."""
    name = SHARP_PHASES[len(SHARP_PHASES) - len(VARIANTS) + VARIANTS.index(variant)]
    return name if rounds == 1 else f"round {number + 1}/{rounds}: {name}"


def median_round(rounds: Sequence[Mapping[str, Mapping[str, Any]]]) -> int:
    """The index of the round whose SHARP training speedup (one after another's training
    seconds over SHARP's) is the median; of two middle ones, the lower."""
    speedups = [ran[SEQUENTIAL]["train_seconds"] / ran[SHARP]["train_seconds"] for ran in rounds]
    ranked = sorted(range(len(rounds)), key=lambda n: speedups[n])
    return ranked[(len(ranked) - 1) // 2]


def _round_summary(ran: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One round's figures; its variants in the order they ran (``ran``'s)."""
    plain, sharp, lazy = (ran[name] for name in VARIANTS)
    return {
        "order": list(ran),
        "sequential_seconds": plain["seconds"],
        "sharp_seconds": sharp["seconds"],
        "no_prefetch_seconds": lazy["seconds"],
        "sequential_train_seconds": plain["train_seconds"],
        "sharp_train_seconds": sharp["train_seconds"],
        "no_prefetch_train_seconds": lazy["train_seconds"],
        "train_speedup": plain["train_seconds"] / sharp["train_seconds"],
        "sharp_device_busy": sharp["device_busy"],
    }


def run_sharp(
    s: SharpSettings,
    simulated: dict[str, Any],
    cluster: LocalRay,
    root: Path,
    progress: Progress = lambda _: None,
    started: float | None = None,
) -> dict[str, Any]:
    """Measure on ``cluster`` (started from ``s.devices``, its token in this process's
    environment before Ray was imported: ``service.cli.bench``) and add the ``simulated``
    numbers (``bench.simulation``); files go under ``root``."""
    began = time.perf_counter() if started is None else started
    ray.init(address=cluster.address, log_to_driver=False, namespace="shoal-bench")
    try:
        real = measure(s, cluster_devices(), root, RayPool, RayGroup, progress)
    finally:
        ray.shutdown()
    return sharp_result(s, real, simulated, began)
