"""Placement of queued jobs on free devices."""

from __future__ import annotations

import pytest

from scheduler.placement import JobRequest, place
from tests.factories import device

pytestmark = pytest.mark.unit


def request(job_id: str, **kw: object) -> JobRequest:
    fields: dict[str, object] = {
        "priority": 0,
        "min_devices": 1,
        "max_devices": 1,
        "stages": None,
        "num_blocks": 4,
    }
    fields.update(kw)
    return JobRequest(job_id=job_id, **fields)  # type: ignore[arg-type]


def test_auto_takes_up_to_max_devices_and_blocks() -> None:
    free = [device("n1", i) for i in range(4)]
    placed, waiting = place([request("a", max_devices=8, num_blocks=3)], free)
    assert not waiting
    assert len(placed[0].devices) == 3


def test_explicit_stage_count_is_exact_or_waits() -> None:
    free = [device("n1", i) for i in range(2)]
    placed, waiting = place([request("a", stages=3, max_devices=3)], free)
    assert placed == []
    assert waiting[0].reason == "needs 3 free devices, 2 available"


def test_priority_first_and_backfill() -> None:
    free = [device("n1", i) for i in range(2)]
    jobs = [
        request("old-big", stages=3, max_devices=3),
        request("low", priority=-1),
        request("high", priority=5),
    ]
    placed, waiting = place(jobs, free)
    assert [p.job_id for p in placed] == ["high", "low"]
    assert [w.job_id for w in waiting] == ["old-big"]


def test_kind_and_spot_filters() -> None:
    free = [device("n1", 0, "t4", spot=True), device("n2", 0, "a100"), device("n3", 0, "t4")]
    placed, _ = place([request("a", device_kind="t4", spot_ok=False)], free)
    assert [d.id for d in placed[0].devices] == ["n3-t4-0"]
    _, waiting = place([request("b", device_kind="h100")], free)
    assert waiting[0].reason == "needs 1 free h100 devices, 0 available"


def test_devices_of_one_node_stay_together() -> None:
    free = [device("n1", 0), device("n2", 0), device("n2", 1), device("n2", 2)]
    placed, _ = place([request("a", max_devices=3)], free)
    assert {d.node_id for d in placed[0].devices} == {"n2"}


def test_no_device_is_given_twice() -> None:
    free = [device("n1", i) for i in range(3)]
    placed, _ = place([request(str(i), max_devices=2) for i in range(3)], free)
    ids = [d.id for p in placed for d in p.devices]
    assert len(ids) == len(set(ids)) == 3
