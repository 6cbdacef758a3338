"""``shoal bench elastic``: the elastic runtime on a local multi-node Ray cluster.

One local cluster (``service.localray``: one ``ray start`` node per device, one device
emulated ``slowdown`` x slower) and Shoal's engine (``Trainer`` + ``RayGroup`` on StageWorker
actors) measure three things:

1. Heterogeneity: the same job on an even 3-stage cut (static), with runtime rebalancing
   (Shoal), and on the best contiguous cut for the speeds Shoal measured (exhaustive search
   over every cut and device order), each run statically: steady-state samples/s, and the
   steps Shoal took to move.
2. Preemption: a job whose workers keep in-memory copies; the node of one stage is killed
   (SIGKILL of the node's every process, as a spot machine vanishes): seconds from the kill
   to the next completed step, and steps replayed.
3. Growth: a node joins; the controller's decision (``scheduler.resize`` and
   ``scheduler.layout``) is sent to the runner as a relayout: seconds from the node's start
   until a step ran on its device.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from itertools import combinations, permutations
from pathlib import Path
from typing import Any

import ray

from shoal.scheduler.devices import Device, NodeInfo, node_devices
from shoal.scheduler.elastic import ElasticConfig
from shoal.scheduler.layout import plan_layout
from shoal.scheduler.placement import JobRequest
from shoal.scheduler.profile import BlockCost, range_time
from shoal.scheduler.resize import candidate
from shoal.scheduler.types import BlockRange
from shoal.scheduler.workload import Workload
from shoal.service.bench.report import (
    ELASTIC_KEYS,
    ELASTIC_PHASES,
    BenchError,
    ElasticSettings,
    Progress,
    bench_job,
    machine,
    mlp_refs,
    stage_bounds,
)
from shoal.service.devicespec import parse_devices
from shoal.service.localray import LocalRay
from shoal.workers.pipeline.group import RayGroup
from shoal.workers.pipeline.rebalance import snapshot_policy
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.profiler import trace_costs
from shoal.workers.snapshot import (
    DataRef,
    JobSnapshot,
    ModelRef,
    OptimizerConf,
    RunnerEvent,
    RunStatus,
    StepMetrics,
    stage_plans,
)


def _refs(s: ElasticSettings) -> tuple[ModelRef, DataRef, OptimizerConf]:
    return mlp_refs(s.hidden, s.layers, s.features, s.outputs, 1e-3)


def cluster_devices() -> list[Device]:
    """Every virtual device of the connected Ray cluster, sorted by kind."""
    nodes = [
        NodeInfo(str(n["NodeID"]), bool(n["Alive"]), dict(n["Resources"]), dict(n["Labels"]))
        for n in ray.nodes()  # type: ignore[no-untyped-call]
    ]
    return sorted((d for n in nodes for d in node_devices(n)), key=lambda d: d.kind)


def _costs(s: ElasticSettings) -> tuple[BlockCost, ...]:
    model, data, _ = _refs(s)
    return trace_costs(
        model, data, micro_batch_size=s.batch_size // s.micro_batches, optimizer="sgd"
    )


def _snapshot(
    s: ElasticSettings,
    root: Path,
    name: str,
    devices: Sequence[Device],
    ranges: Sequence[BlockRange],
    **fields: Any,
) -> JobSnapshot:
    """The bench's job ``name`` on ``devices`` cut at ``ranges``; ``fields`` replace any
    of its snapshot's (the preemption's job trains until it is stopped)."""
    job = {
        "batch_size": s.batch_size,
        "micro_batches": s.micro_batches,
        "steps": s.steps,
        "seed": s.seed,
        "schedule": "1f1b",
        "stages": stage_plans(devices, ranges),
        "num_blocks": s.num_blocks,
        "block_costs": _costs(s),
    }
    return bench_job(f"bench-elastic-{name}", _refs(s), root / "checkpoints", **(job | fields))


def _run(snapshot: JobSnapshot) -> tuple[list[StepMetrics], list[RunnerEvent]]:
    trainer = Trainer(snapshot, RayGroup, policy=snapshot_policy(snapshot))
    if trainer.run() is not RunStatus.SUCCEEDED:
        raise BenchError(f"the {snapshot.job_id} run failed: {trainer.report(0).error}")
    report = trainer.report(0)
    return list(report.metrics), list(report.events)


def _steady(metrics: Sequence[StepMetrics], batch: int, after: int = 0) -> float:
    """Samples/s: the median step of the last third of the steps after step ``after``."""
    times = [m.step_time_s for m in metrics if m.step > after]
    tail = times[-max(1, len(times) // 3) :]
    return batch / statistics.median(tail)


def best_cut(
    costs: Sequence[BlockCost], speeds: dict[str, float], micro_batches: int
) -> tuple[list[str], list[BlockRange], float]:
    """Exhaustive search: every device order and every contiguous cut into one stage per
    device; the one with the least (m + p - 1) x slowest stage time."""
    n, ids = len(costs), sorted(speeds)
    best: tuple[list[str], list[BlockRange], float] | None = None
    for order in permutations(ids):
        for cuts in combinations(range(1, n), len(ids) - 1):
            bounds = list(zip((0, *cuts), (*cuts, n), strict=True))
            slowest = max(
                range_time(costs, b, speeds[d]) for d, b in zip(order, bounds, strict=True)
            )
            step = (micro_batches + len(ids) - 1) * slowest
            if best is None or step < best[2]:
                best = (list(order), bounds, step)
    if best is None:
        raise BenchError(f"{n} blocks cannot be cut into {len(ids)} stages")
    return best


def _heterogeneity(s: ElasticSettings, root: Path, progress: Progress) -> dict[str, Any]:
    devices = cluster_devices()
    if len(devices) != 3:
        raise BenchError(f"the local cluster shows {len(devices)} devices, not 3")
    even = stage_bounds(s.num_blocks, 3)
    progress(ELASTIC_PHASES[1])
    static, _ = _run(_snapshot(s, root, "static", devices, even))
    progress(ELASTIC_PHASES[2])
    conf = ElasticConfig(window_steps=s.window, min_gain=0.1, horizon_steps=1000)
    shoal, events = _run(_snapshot(s, root, "shoal", devices, even, elastic=conf))
    moves = [e for e in events if e.kind == "repartition"]
    if not moves:
        raise BenchError("Shoal did not rebalance: " + "; ".join(e.message for e in events))
    last_move = moves[-1].step
    speeds = dict(moves[0].data["speeds"])
    progress(ELASTIC_PHASES[3])
    order, bounds, _ = best_cut(_costs(s), speeds, s.micro_batches)
    by_id = {d.id: d for d in devices}
    best, _ = _run(_snapshot(s, root, "best", [by_id[d] for d in order], bounds))
    batch = s.batch_size
    return {
        "static_samples_per_s": _steady(static, batch),
        "shoal_samples_per_s": _steady(shoal, batch, after=last_move),
        "best_samples_per_s": _steady(best, batch),
        "steps_to_rebalance": moves[0].step,
        "repartitions": [
            {
                "step": e.step,
                "to": [r["blocks"] for r in e.data["to"]],
                "gain": e.data["predicted_gain"],
            }
            for e in moves
        ],
        "best_partition": {"devices": order, "blocks": bounds},
        "measured_speeds": speeds,
    }


class _Background:
    """A long job trained in a thread, watched from this one."""

    def __init__(self, snapshot: JobSnapshot) -> None:
        self.trainer = Trainer(snapshot, RayGroup)
        self.thread = threading.Thread(target=self.trainer.run, daemon=True)
        self.thread.start()

    def wait(
        self,
        condition: Callable[[list[StepMetrics], list[RunnerEvent]], bool],
        timeout: float,
        what: str,
    ) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            report = self.trainer.report(0)
            if report.status.is_final:
                raise BenchError(
                    f"the job ended {report.status.value} during {what}: {report.error}"
                )
            if condition(list(report.metrics), list(report.events)):
                return time.monotonic()
            time.sleep(0.01)
        raise BenchError(f"timed out after {timeout:g} s waiting for {what}")

    def stop(self) -> None:
        self.trainer.cancel()
        self.thread.join(timeout=120)


def _preemption_and_growth(
    s: ElasticSettings, root: Path, cluster: LocalRay, progress: Progress
) -> dict[str, Any]:
    progress(ELASTIC_PHASES[4])
    devices = [d for d in cluster_devices() if d.kind != "cpu-slow"] + [
        d for d in cluster_devices() if d.kind == "cpu-slow"
    ]
    ranges = stage_bounds(s.num_blocks, 3)
    snap = _snapshot(
        s, root, "preempt", devices, ranges, steps=100_000, keep_copies=True, min_devices=1
    )
    job = _Background(snap)
    try:
        job.wait(lambda m, e: len(m) >= 5, 300, "five steps")
        victim = devices[1]  # stage 1, on the second node (cpu-b)
        kinds = [spec.kind for spec in parse_devices(s.devices)]
        # Halfway through a step: a preemption lands at any moment, not on a boundary.
        metrics = job.trainer.report(0).metrics
        time.sleep(metrics[-1].step_time_s / 2)
        before = len(job.trainer.report(0).metrics)
        known = len(job.trainer.report(0).events)
        killed = time.monotonic()
        cluster.kill_node(kinds.index(victim.kind))
        phases: dict[str, float] = {}  # seconds from the kill to each event's first sight

        def stepped_after_recovery(m: list[StepMetrics], e: list[RunnerEvent]) -> bool:
            for x in e[known:]:
                phases.setdefault(x.kind, round(time.monotonic() - killed, 2))
            return len(m) > before and "recovered" in phases

        done = job.wait(stepped_after_recovery, 300, "the first step after the node loss")
        events = list(job.trainer.report(0).events)
        lost = [e for e in events if e.kind == "device_lost"]
        recovery = done - killed
        # The runner's own time to re-form the job; before it, the loss was being detected.
        restore = next(e.data["seconds"] for e in events[known:] if e.kind == "recovered")
        replayed = lost[0].data["steps_replayed"] if lost else None
        # The copies' cadence in force at the loss, as the job measured and reported it.
        prior = events[: events.index(lost[0])] if lost else events
        cadence = [e.data for e in prior if e.kind == "copies"]

        progress(ELASTIC_PHASES[5])
        joined = time.monotonic()
        cluster.add_node(parse_devices("1xcpu-new:4096")[0])
        node_up = time.monotonic()
        by_id = {d.id: d for d in cluster_devices()}
        new = next(d for d in by_id.values() if d.kind == "cpu-new")
        running = [by_id[row["device_id"]] for row in _latest_rows(job.trainer)]
        request = JobRequest("bench", 0, 1, 3, None, s.num_blocks, None, True, None)
        found = candidate(request, running, [new], set())
        if found is None:
            raise BenchError("the new device was not offered to the job")
        layout = plan_layout(
            found.devices,
            {},
            costs=snap.block_costs,
            stages=None,
            replicas=None,
            workload=Workload(s.micro_batches, s.batch_size // s.micro_batches),
        )
        job.trainer.relayout(stage_plans(layout.devices, layout.ranges), layout.plan.micro_batches)
        used = job.wait(
            lambda m, e: any(t.device_id == new.id for t in m[-1].stages),
            300,
            "a step on the new device",
        )
        relayout = next(e for e in reversed(job.trainer.report(0).events) if e.kind == "relayout")
        return {
            "recovery_seconds": recovery,
            "recovery_events_s": phases,
            "recovery_detect_s": round(phases["recovered"] - restore, 2),
            "recovery_restore_s": round(restore, 2),
            "steps_replayed": replayed,
            "copy_interval_steps": cadence[-1]["interval"] if cadence else 1,
            "copies_overhead": cadence[-1]["overhead"] if cadence else None,
            "growth_seconds": used - joined,
            "growth_node_start_s": round(node_up - joined, 2),
            "growth_relayout_s": round(relayout.data["seconds"], 2),
            "killed_device": victim.id,
            "grown_layout": [r["blocks"] for r in relayout.data["to"]],
        }
    finally:
        job.stop()


def _latest_rows(trainer: Trainer) -> list[dict[str, Any]]:
    """The partition the trainer runs now, as its latest recovered/relayout event says."""
    events = trainer.report(0).events
    rows: list[dict[str, Any]] = next(
        e.data["to"] for e in reversed(events) if e.kind in ("recovered", "relayout")
    )
    return rows


def run_elastic(
    s: ElasticSettings, cluster: LocalRay, root: Path, progress: Progress = lambda _: None
) -> dict[str, Any]:
    """Measure on ``cluster`` (started from ``s.devices``, its token in this process's
    environment before Ray was imported: ``service.cli.bench``); files go under ``root``."""
    started = time.perf_counter()
    ray.init(address=cluster.address, log_to_driver=False, namespace="shoal-bench")
    try:
        hetero = _heterogeneity(s, root, progress)
        churn = _preemption_and_growth(s, root, cluster, progress)
    finally:
        ray.shutdown()
    best = hetero["best_samples_per_s"]
    return {
        "static_samples_per_s": hetero["static_samples_per_s"],
        "shoal_samples_per_s": hetero["shoal_samples_per_s"],
        "best_samples_per_s": best,
        "shoal_over_best": hetero["shoal_samples_per_s"] / best if best > 0 else 0.0,
        "steps_to_rebalance": hetero["steps_to_rebalance"],
        "recovery_seconds": churn["recovery_seconds"],
        "steps_replayed": churn["steps_replayed"],
        "growth_seconds": churn["growth_seconds"],
        "copies_overhead": churn["copies_overhead"],
        "copy_interval_steps": churn["copy_interval_steps"],
        **{k: v for k, v in hetero.items() if k not in ELASTIC_KEYS},
        **{k: v for k, v in churn.items() if k not in ELASTIC_KEYS},
        "settings": asdict(s),
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
