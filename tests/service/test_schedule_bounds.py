"""A job's drawn schedule is bounded: a million micro-batches are described, not drawn."""

from __future__ import annotations

import time

import pytest

from shoal.service.db.models import Job
from shoal.service.jobs import JobConflict
from shoal.service.layouts import MAX_DRAWN_MICRO_BATCHES, pipeline_schedule
from tests.factories import job_spec

pytestmark = pytest.mark.unit


def placed(micro_batches: int) -> Job:
    spec = job_spec(batch_size=micro_batches, micro_batches=micro_batches)
    partition = [
        {"stage": s, "replica": 0, "device_id": f"d{s}", "blocks": [s, s + 1]} for s in range(2)
    ]
    return Job(id="job-1", spec=spec, partition=partition, pool=None, state="RUNNING")


def test_a_schedule_of_a_million_micro_batches_is_refused_before_it_is_built() -> None:
    started = time.perf_counter()
    with pytest.raises(JobConflict, match="1,048,576 micro-batches per stage") as caught:
        pipeline_schedule(placed(1_048_576))
    assert "its bubble is (p - 1) / (m + p - 1) = 0.00%" in str(caught.value)
    assert time.perf_counter() - started < 1


def test_a_schedule_up_to_the_bound_is_drawn() -> None:
    drawn = pipeline_schedule(placed(MAX_DRAWN_MICRO_BATCHES))
    assert drawn.micro_batches == MAX_DRAWN_MICRO_BATCHES and drawn.stages == 2
