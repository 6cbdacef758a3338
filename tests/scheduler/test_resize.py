"""Which devices a running job moves to: off draining devices, onto free ones."""

from __future__ import annotations

import pytest

from shoal.scheduler.placement import JobRequest
from shoal.scheduler.resize import candidate, worth_growing
from tests.factories import device

pytestmark = pytest.mark.unit


def request(max_devices: int = 4, **fields: object) -> JobRequest:
    base: dict[str, object] = {
        "job_id": "j",
        "priority": 0,
        "min_devices": 1,
        "max_devices": max_devices,
        "stages": None,
        "num_blocks": 8,
    }
    base.update(fields)
    return JobRequest(**base)  # type: ignore[arg-type]


A0, A1, A2 = (device("node-a", i) for i in range(3))
B0, B1 = (device("node-b", i) for i in range(2))


def test_nothing_to_do_without_free_or_draining_devices() -> None:
    assert candidate(request(), [A0, A1], [], set()) is None
    assert candidate(request(max_devices=2), [A0, A1], [A2], set()) is None  # at max already


def test_growth_takes_free_devices_up_to_max_same_node_first() -> None:
    found = candidate(request(max_devices=4), [A0, A1], [B0, A2, B1], set())
    assert found is not None
    assert [d.id for d in found.devices] == [A0.id, A1.id, A2.id, B0.id]
    assert found.added == (A2.id, B0.id) and found.draining == ()
    assert "growing onto free devices" in found.reason


def test_a_draining_device_is_left_and_replaced_when_one_is_free() -> None:
    found = candidate(request(max_devices=2), [A0, A1], [B0], {A1.id})
    assert found is not None
    assert [d.id for d in found.devices] == [A0.id, B0.id]
    assert found.draining == (A1.id,) and found.added == (B0.id,)
    alone = candidate(request(max_devices=2), [A0, A1], [], {A1.id})
    assert alone is not None and [d.id for d in alone.devices] == [A0.id]


def test_draining_free_devices_and_ineligible_kinds_are_not_offered() -> None:
    gpu = device("node-b", 5, kind="a100")
    found = candidate(request(device_kind="cpu"), [A0], [B0, gpu], {B0.id})
    assert found is None


def test_growth_must_be_worth_it() -> None:
    assert worth_growing(1.0, 0.85, 0.1)
    assert not worth_growing(1.0, 0.95, 0.1)
