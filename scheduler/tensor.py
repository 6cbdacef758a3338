"""Tensor-parallel groups as the partitioner sees them (``parallelism.tensor: N``).

A stage of a tensor-parallel job runs on a *group* of N devices of one node, each block
split over them (``workers.tensor_split``). The partitioner cuts the model over groups as
it cuts over devices: a group counts as its slowest, smallest device, and each block as
what one device of the group holds and computes of it (``per_device``): the part of its
parameters a split divides (``BlockCost.split_bytes``) 1/N, the rest whole, and its time
in the same proportion. Activations count whole: the inputs and outputs of a split block
are whole on the group's first device, so this bounds what a device keeps from above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shoal.scheduler.devices import Device
from shoal.scheduler.profile import BlockCost


def per_device(costs: Sequence[BlockCost], tensor: int) -> tuple[BlockCost, ...]:
    """What one device of a group of ``tensor`` holds and computes of each block."""
    if tensor == 1:
        return tuple(costs)
    return tuple(_share(c, tensor) for c in costs)


def _share(cost: BlockCost, tensor: int) -> BlockCost:
    if cost.split_bytes == 0 or cost.param_bytes == 0:
        return cost
    piece = -(-cost.split_bytes // tensor)
    held = cost.param_bytes - cost.split_bytes + piece
    fraction = held / cost.param_bytes
    return replace(
        cost,
        fwd_bwd_s=cost.fwd_bwd_s * fraction,
        param_bytes=held,
        optim_bytes=-(-cost.optim_bytes * held // cost.param_bytes),
        split_bytes=piece,
    )


def node_devices(devices: Sequence[Device], tensor: int) -> list[list[Device]]:
    """Each node's devices by index, nodes in the order they first appear, cut to whole
    tensor groups of ``tensor``; nodes with none left out."""
    by_node: dict[str, list[Device]] = {}
    for device in devices:
        by_node.setdefault(device.node_id, []).append(device)
    nodes = [sorted(ds, key=lambda d: d.index) for ds in by_node.values()]
    return [ds[: len(ds) // tensor * tensor] for ds in nodes if len(ds) >= tensor]


def tensor_groups(devices: Sequence[Device], tensor: int) -> list[tuple[Device, ...]]:
    """``devices`` in groups of ``tensor`` on one node each (``node_devices``, in order);
    with ``tensor`` 1, each device alone, in the order given."""
    if tensor == 1:
        return [(d,) for d in devices]
    return [
        tuple(node[i : i + tensor])
        for node in node_devices(devices, tensor)
        for i in range(0, len(node), tensor)
    ]
