"""What a job's runner does once, before its first step: check that the stages form a
pipeline over the model's blocks, say where they run and how fast and full their devices
are, and load the checkpoint the job resumes from."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from shoal.workers.checkpoint_events import resumed_event
from shoal.workers.checkpoints import Restorable
from shoal.workers.device_memory import device_memory_event
from shoal.workers.device_speed import device_speed_event
from shoal.workers.pipeline.worker_group import WorkerGroup
from shoal.workers.run_log import RunLog
from shoal.workers.snapshot import RunnerEvent, StagePlan


class PlanError(ValueError):
    """The snapshot's stages do not form a pipeline over the model's blocks."""


def check_plans(stages: Sequence[StagePlan], num_blocks: int, replicas: int = 1) -> list[StagePlan]:
    """The plans laid out replica-major (worker ``r * p + s`` is stage s of replica r), if
    every replica's stages cover blocks [0, num_blocks) contiguously with the same ranges."""
    by_replica: dict[int, list[StagePlan]] = {}
    for plan in stages:
        by_replica.setdefault(plan.replica, []).append(plan)
    if sorted(by_replica) != list(range(replicas)):
        raise PlanError(
            f"the stages name replicas {sorted(by_replica)}; a job of {replicas} replicas needs"
            f" each of 0..{replicas - 1}"
        )
    layouts: list[list[StagePlan]] = []
    for r in range(replicas):
        plans = sorted(by_replica[r], key=lambda p: p.index)
        if [p.index for p in plans] != list(range(len(plans))) or not plans:
            raise PlanError(
                f"stage indices of replica {r} must be 0..p-1, got {[p.index for p in plans]}"
            )
        bounds = [p.blocks for p in plans]
        contiguous = all(a[1] == b[0] for a, b in pairwise(bounds))
        if bounds[0][0] != 0 or bounds[-1][1] != num_blocks or not contiguous:
            raise PlanError(f"stage block ranges {bounds} must cover [0, {num_blocks}) in order")
        if layouts and bounds != [p.blocks for p in layouts[0]]:
            raise PlanError(
                f"replica {r} has stage ranges {bounds}, replica 0 has"
                f" {[p.blocks for p in layouts[0]]}; replicas must hold the same blocks"
            )
        layouts.append(plans)
    return [p for plans in layouts for p in plans]


def announce(
    group: WorkerGroup,
    plans: Sequence[StagePlan],
    replicas: int,
    step: int,
    run: RunLog,
    timeout: float,
) -> dict[str, float]:
    """Record where the stages run (``placement``), then measure each device's speed (every
    device of a tensor group's: ``device_speed``) and, on a GPU, what its worker holds
    before any block (``device_memory``); the speeds by device id, in GFLOP/s."""
    sizes = _ask_all(group, len(plans), "nbytes", timeout)
    pids = _ask_all(group, len(plans), "pid", timeout)
    stages = [
        {
            "stage": p.index,
            "replica": p.replica,
            "device_id": p.device.id,
            "kind": p.device.kind,
            "node_id": p.device.node_id,
            "blocks": list(p.blocks),
            "bytes": size,
            "pid": pid,
        }
        for p, size, pid in zip(plans, sizes, pids, strict=True)
    ]
    ranges = ", ".join(f"{p.blocks[0]}-{p.blocks[1] - 1}@{p.device.id}" for p in plans)
    what = f"{len(plans) // replicas} stages" + (f" x {replicas} replicas" if replicas > 1 else "")
    run.record(RunnerEvent("placement", step, f"{what}: {ranges}", {"stages": stages}))
    speeds: dict[str, float] = {}
    # One device at a time: concurrent benchmarks on shared cores would measure contention.
    for w, p in enumerate(plans):
        measured, overhead = group.get(
            [group.submit(w, "measure_speed"), group.submit(w, "device_overhead")], timeout
        )
        if overhead.how != "none":
            run.record(device_memory_event(p.device, overhead, step))
        for device, gflops in zip(p.group, measured, strict=True):
            speeds[device.id] = gflops
            run.record(device_speed_event(device, gflops, step, stage=p.index, replica=p.replica))
    return speeds


def restore(
    group: WorkerGroup,
    plans: Sequence[StagePlan],
    restorable: Restorable,
    num_blocks: int,
    run: RunLog,
    timeout: float,
) -> int:
    """Load the checkpoint to resume from into the stages; the step to run from (0: none)."""
    latest = restorable.info
    if latest is None:
        if restorable.skipped:  # every checkpoint unusable: from the seed, said so
            run.record(resumed_event(restorable))
        return 0
    states = restorable.blocks
    missing = sorted(set(range(num_blocks)) - set(states))
    if missing:
        raise PlanError(
            f"the checkpoint at step {latest.step} has no state for blocks {missing};"
            " it was written for another model"
        )
    loads = [
        group.submit(w, "load", {i: states[i] for i in range(*p.blocks)})
        for w, p in enumerate(plans)
    ]
    group.get(loads, timeout)
    run.record(resumed_event(restorable))
    run.resumed_at(latest.step)
    return latest.step


def _ask_all(group: WorkerGroup, count: int, method: str, timeout: float) -> list[Any]:
    return group.get([group.submit(w, method) for w in range(count)], timeout)
