"""What a job's current layout means for the dashboard: its pipeline schedule as run, and the
memory each of its stages is planned to take on its device.

Both are read from the job row (its partition, spec and traced block costs) with the same
code that chose the layout (``scheduler.schedules``, ``scheduler.memory``), so the pictures
show what the runner does, not a second model of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shoal.scheduler.memory import in_flight, stage_memory
from shoal.scheduler.schedules import Action, build, simulate
from shoal.service.db.models import Job
from shoal.service.jobs import JobConflict
from shoal.service.snapshots import block_costs

MAX_DRAWN_MICRO_BATCHES = 4_096
"""A drawn schedule has a cell per micro-batch and stage: a million would take a request
seconds and a GiB, so longer ones are described, not drawn."""


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    stages: int
    micro_batches: int
    """Per replica: its share of the mini-batch's micro-batches (the first replica's)."""
    timeline: tuple[tuple[Action | None, ...], ...]
    """One row per stage, one cell per time slot; None: the stage is idle (the bubble)."""

    @property
    def bubble(self) -> float:
        """The idle share of the stages' time slots: (p - 1) / (m + p - 1) for both schedules."""
        cells = [cell for row in self.timeline for cell in row]
        return sum(cell is None for cell in cells) / len(cells) if cells else 0.0


def pipeline_schedule(job: Job) -> PipelineSchedule:
    """The schedule the job's stages run each mini-batch, on its current partition."""
    if job.pool is not None:
        raise JobConflict(
            f"job {job.id} is a sweep trial trained by shard alternation (SHARP): its shards"
            " run one task at a time, with no pipeline schedule"
        )
    if not job.partition:
        raise JobConflict(
            f"job {job.id} is {job.state} and not placed: its stage count is chosen when it is"
        )
    replicas = 1 + max(int(row.get("replica", 0)) for row in job.partition)
    name = str(job.spec.get("parallelism", {}).get("schedule", "1f1b"))
    stages = _stages(job)
    share = -(-int(job.spec["micro_batches"]) // replicas)  # the first replica's share
    if share > MAX_DRAWN_MICRO_BATCHES:  # checked before anything is built: a cell each
        raise JobConflict(
            f"job {job.id} runs {share:,} micro-batches per stage each step, more than the"
            f" {MAX_DRAWN_MICRO_BATCHES:,} a schedule is drawn for; its bubble is"
            f" (p - 1) / (m + p - 1) = {(stages - 1) / (share + stages - 1):.2%}"
        )
    timeline, _ = simulate(build(name, stages, share))
    return PipelineSchedule(name, stages, share, timeline)


def planned_memory(jobs: Iterable[Job]) -> dict[str, int]:
    """Bytes each device holds for the stage placed on it (parameters, gradients, optimizer
    state and the activations its schedule keeps at its peak), by device id."""
    held: dict[str, int] = {}
    for job in jobs:
        if job.pool is not None or not job.partition:
            continue  # a SHARP trial's shards move in and out of its devices
        costs, stages = block_costs(job), _stages(job)
        parallelism = job.spec.get("parallelism", {})
        micro_batches = int(job.spec["micro_batches"])
        for row in job.partition:
            peak = in_flight(
                str(parallelism.get("schedule", "1f1b")), stages, int(row["stage"]), micro_batches
            )
            need = stage_memory(
                costs,
                (int(row["blocks"][0]), int(row["blocks"][1])),
                micro_batch_size=int(job.spec["batch_size"]) // micro_batches,
                in_flight=peak,
                recompute=bool(parallelism.get("recompute", False)),
                precision=str(job.spec.get("precision", "fp32")),
            )
            held[row["device_id"]] = held.get(row["device_id"], 0) + need.total
    return held


def _stages(job: Job) -> int:
    return 1 + max(int(row["stage"]) for row in job.partition)
