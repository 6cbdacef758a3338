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


def test_replicas_multiply_the_devices_of_an_explicit_stage_count() -> None:
    free = [device("n1", i) for i in range(5)]
    placed, waiting = place([request("a", stages=2, replicas=2, max_devices=4)], free)
    assert not waiting
    assert len(placed[0].devices) == 4
    _, waiting = place([request("b", stages=2, replicas=3, max_devices=6)], free)
    assert waiting[0].reason == "needs 6 free devices, 5 available"


def test_auto_stages_with_replicas_take_whole_replicas() -> None:
    free = [device("n1", i) for i in range(5)]
    placed, _ = place([request("a", replicas=2, max_devices=8, num_blocks=4)], free)
    assert len(placed[0].devices) == 4  # 5 free: 2 x 2, not 5
    placed, _ = place([request("b", replicas=2, max_devices=8, num_blocks=1)], free)
    assert len(placed[0].devices) == 2  # one block: one stage each
    _, waiting = place([request("c", replicas=3, min_devices=4, max_devices=9)], free)
    assert waiting[0].reason == "needs 6 free devices, 5 available"


def test_auto_replicas_take_whole_pipelines() -> None:
    free = [device("n1", i) for i in range(7)]
    placed, _ = place([request("a", stages=2, replicas=None, max_devices=8)], free)
    assert len(placed[0].devices) == 6  # 7 free: three pipelines of 2
    _, waiting = place([request("b", stages=3, replicas=None, max_devices=8)], free[:2])
    assert waiting[0].reason == "needs 3 free devices, 2 available"


def test_auto_everything_offers_up_to_max_devices_beyond_the_blocks() -> None:
    free = [device("n1", i) for i in range(6)]
    placed, _ = place([request("a", replicas=None, max_devices=5, num_blocks=2)], free)
    assert len(placed[0].devices) == 5  # replicas can use more devices than blocks
    _, waiting = place([request("b", replicas=None, min_devices=7, max_devices=8)], free)
    assert waiting[0].reason == "needs 7 free devices, 6 available"


def test_one_replica_pipeline_stays_on_one_node() -> None:
    free = [device("n1", 0), device("n1", 1), device("n2", 0), device("n2", 1)]
    placed, _ = place([request("a", stages=2, replicas=2, max_devices=4)], free)
    nodes = [d.node_id for d in placed[0].devices]
    assert nodes[:2] == [nodes[0]] * 2 and nodes[2:] == [nodes[2]] * 2
