"""Placement of queued jobs on free devices."""

from __future__ import annotations

import pytest

from shoal.scheduler.devices import Device
from shoal.scheduler.placement import JobRequest, Quota, Running, Usage, place, preemptions
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


def test_quotas_cap_a_users_jobs_and_devices_and_say_so() -> None:
    free = [device("n1", i) for i in range(8)]
    jobs = [
        request("a1", owner="alice", max_devices=2),
        request("a2", owner="alice", max_devices=2),
        request("a3", owner="alice", max_devices=2),
        request("b1", owner="bob", min_devices=3, max_devices=3),
    ]
    quotas = {"alice": Quota(max_jobs=3, max_devices=3), "bob": Quota(max_devices=4)}
    usage = {"bob": Usage(jobs=1, devices=2)}
    placed, waiting = place(jobs, free, usage=usage, quotas=quotas)
    # alice: 2 devices, then the 1 left of her quota of 3; then her quota is spent.
    assert [(p.job_id, len(p.devices)) for p in placed] == [("a1", 2), ("a2", 1)]
    reasons = {w.job_id: w.reason for w in waiting}
    assert reasons["a3"] == "needs 1 devices, but alice holds 3 of a quota of 3 (max_devices)"
    assert reasons["b1"] == "needs 3 devices, but bob holds 2 of a quota of 4 (max_devices)"
    placed, waiting = place(jobs[:2], free, quotas={"alice": Quota(max_jobs=1)})
    assert [p.job_id for p in placed] == ["a1"]
    assert waiting[0].reason == "alice runs 1 jobs: the quota's most (max_jobs)"


def test_equal_priorities_share_fairly_by_the_devices_each_user_holds() -> None:
    free = [device("n1", i) for i in range(3)]
    jobs = [  # alice queued first, twice; bob holds nothing yet
        request("a1", owner="alice"),
        request("a2", owner="alice"),
        request("b1", owner="bob"),
        request("urgent", owner="alice", priority=9),
    ]
    placed, _ = place(jobs, free, usage={"alice": Usage(jobs=1, devices=1)})
    # Priority first; then bob, holding nothing, before alice, who now holds two.
    assert [p.job_id for p in placed] == ["urgent", "b1", "a1"]


def test_a_waiting_job_preempts_the_lowest_priorities_only_as_far_as_it_needs() -> None:
    free = [device("n1", 0)]
    held = {name: (device("n2", i),) for i, name in enumerate(["low-old", "low-young", "mid"])}
    running = [  # the caller gives the youngest first among equals
        Running(request("low-young", priority=0), held["low-young"]),
        Running(request("mid", priority=5), held["mid"]),
        Running(request("low-old", priority=0), held["low-old"]),
    ]
    urgent = request("urgent", priority=9, stages=3, max_devices=3)
    assert preemptions(urgent, running, free) == ["low-young", "low-old"]
    # Equal or lower priority preempts nothing; enough free devices need no preemption.
    assert preemptions(request("peer", priority=0, stages=2, max_devices=2), running, free) == []
    assert preemptions(request("small", priority=9), running, free) == []
    # Not even every lower job would make room: nobody is paused for nothing.
    assert preemptions(request("huge", priority=9, stages=9, max_devices=9), running, free) == []
    # Only devices the waiting job may use count (its kind).
    picky = request("picky", priority=9, stages=2, max_devices=2, device_kind="gpu")
    assert preemptions(picky, running, free) == []


def nodes(**counts: int) -> list[Device]:
    """Free devices: ``n1=3`` is three devices of node n1."""
    return [device(node, i) for node, count in counts.items() for i in range(count)]


def test_tensor_groups_are_whole_and_on_one_node_each() -> None:
    free = nodes(n1=3, n2=5, n3=1)  # 9 free, but only 2 + 4 make groups of 2
    placed, _ = place([request("a", tensor=2, max_devices=16, num_blocks=8)], free)
    ids = [d.id for d in placed[0].devices]
    assert ids == ["n2-cpu-0", "n2-cpu-1", "n2-cpu-2", "n2-cpu-3", "n1-cpu-0", "n1-cpu-1"]
    # min_devices and max_devices are totals of devices: 3..7 devices are 2..3 groups of 2.
    placed, _ = place([request("b", tensor=2, min_devices=3, max_devices=7)], nodes(n1=8))
    assert len(placed[0].devices) == 6
    # Auto stages, 2 replicas: whole replicas of whole groups (4 devices), not 6.
    placed, _ = place([request("c", tensor=2, replicas=2, max_devices=8)], nodes(n1=6))
    assert len(placed[0].devices) == 4


def test_explicit_stages_and_replicas_take_that_many_tensor_groups() -> None:
    job = request("a", stages=2, replicas=2, tensor=2, max_devices=8)
    placed, _ = place([job], nodes(n1=4, n2=3, n3=3))
    assert [d.node_id for d in placed[0].devices] == ["n1"] * 4 + ["n2"] * 2 + ["n3"] * 2
    _, waiting = place([job], nodes(n1=3, n2=3, n3=1))  # 7 free, 2 groups
    assert waiting[0].reason == (
        "needs 4 tensor groups of 2 devices on one node each, 2 available (free per node: 3, 3, 1)"
    )


def test_too_few_whole_tensor_groups_wait_saying_how_the_devices_are_spread() -> None:
    job = request("a", stages=2, tensor=4, max_devices=8)
    _, waiting = place([job], nodes(n1=5, n2=3))  # 8 free, but one group of 4
    assert waiting[0].reason == (
        "needs 2 tensor groups of 4 devices on one node each, 1 available (free per node: 5, 3)"
    )
    _, waiting = place([job], nodes(n1=1, n2=3, n3=2, n4=1, n5=1))
    assert waiting[0].reason.endswith("0 available (free per node: 3, 2, 1, 1, ...)")


def test_preemption_counts_a_victims_devices_only_where_they_complete_tensor_groups() -> None:
    free = [device("n1", 0), device("n2", 0), device("n2", 1)]  # one group of 2
    alone = Running(request("alone", priority=0), (device("n3", 0),))
    completes = Running(request("completes", priority=1), (device("n1", 1),))
    urgent = request("urgent", priority=9, stages=2, tensor=2, max_devices=4)
    # 4 devices once "alone" stops, but its device makes no group with any other.
    assert preemptions(urgent, [alone], free) == []
    assert preemptions(urgent, [alone, completes], free) == ["alone", "completes"]
