"""Reading the device inventory from Ray node data (GPU resources, virtual-device labels)."""

from __future__ import annotations

import pytest

from shoal.scheduler.devices import (
    DEVICE_RESOURCE,
    LABEL_KIND,
    LABEL_MEMORY_MB,
    LABEL_SLOWDOWN,
    LABEL_SPOT,
    InventoryError,
    NodeInfo,
    inventory,
    node_devices,
)

pytestmark = pytest.mark.unit

NODE_A = "a" * 56
NODE_B = "b" * 56


def test_virtual_devices_from_resource_and_labels() -> None:
    node = NodeInfo(
        NODE_A,
        True,
        {"CPU": 4.0, DEVICE_RESOURCE: 2.0},
        {LABEL_KIND: "cpu-slow", LABEL_MEMORY_MB: "1024", LABEL_SPOT: "true", LABEL_SLOWDOWN: "3"},
    )
    devices = node_devices(node)
    assert [d.id for d in devices] == ["aaaaaaaa-cpu-slow-0", "aaaaaaaa-cpu-slow-1"]
    assert all(d.kind == "cpu-slow" and d.memory_mb == 1024 and d.spot for d in devices)
    assert all(d.emulate_slowdown == 3.0 and not d.gpu for d in devices)


def test_gpu_devices_from_ray_resources() -> None:
    node = NodeInfo(NODE_A, True, {"GPU": 2.0, "accelerator_type:A100": 1.0, "CPU": 16.0}, {})
    devices = node_devices(node)
    assert len(devices) == 2
    assert devices[0].gpu and devices[0].kind == "a100" and devices[0].memory_mb == 40 * 1024


def test_gpu_kind_and_memory_labels_win() -> None:
    node = NodeInfo(
        NODE_A,
        True,
        {"GPU": 1.0, "accelerator_type:A100": 1.0},
        {LABEL_KIND: "a100-80g", LABEL_MEMORY_MB: "81920", LABEL_SPOT: "1"},
    )
    (dev,) = node_devices(node)
    assert (dev.kind, dev.memory_mb, dev.spot) == ("a100-80g", 81920, True)


def test_defaults_without_labels_and_nodes_without_devices() -> None:
    (dev,) = node_devices(NodeInfo(NODE_A, True, {DEVICE_RESOURCE: 1.0}, {}))
    assert (dev.kind, dev.memory_mb, dev.spot, dev.emulate_slowdown) == ("cpu", 2048, False, 1.0)
    assert node_devices(NodeInfo(NODE_B, True, {"CPU": 8.0}, {})) == []


def test_dead_nodes_offer_nothing() -> None:
    assert node_devices(NodeInfo(NODE_A, False, {DEVICE_RESOURCE: 4.0}, {})) == []


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({LABEL_SPOT: "maybe"}, "not a boolean"),
        ({LABEL_SLOWDOWN: "fast"}, "not a number"),
        ({LABEL_SLOWDOWN: "0"}, "must be > 0"),
        ({LABEL_MEMORY_MB: "-5"}, "must be > 0"),
        ({LABEL_KIND: "A B/../c"}, "not a device kind"),
    ],
)
def test_bad_labels_are_named(labels: dict[str, str], message: str) -> None:
    with pytest.raises(InventoryError, match=message):
        node_devices(NodeInfo(NODE_A, True, {DEVICE_RESOURCE: 1.0}, labels))


def test_inventory_is_ordered_by_node_then_index() -> None:
    nodes = [
        NodeInfo(NODE_B, True, {DEVICE_RESOURCE: 2.0}, {}),
        NodeInfo(NODE_A, True, {DEVICE_RESOURCE: 1.0}, {LABEL_KIND: "fast"}),
    ]
    assert [d.id for d in inventory(nodes)] == [
        "aaaaaaaa-fast-0",
        "bbbbbbbb-cpu-0",
        "bbbbbbbb-cpu-1",
    ]
