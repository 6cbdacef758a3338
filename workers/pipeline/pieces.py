"""Block states from saved pieces: copies of whole blocks, and sharded replicas' slices.

A replica of a sharded stage copies its share of each block (``BlockShard.live_state``):
the buffers, and one slice of the parameters and of their optimizer state, with the block's
parameter shapes and names and its optimizer groups. Recovery gathers one slice of each rank
(``scheduler.pieces``) and ``whole_states`` makes the block's state from them, as
``StageShards.unshard`` does over a live group: the slices end to end, in rank order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from shoal.scheduler.pieces import WHOLE, pieces_for
from shoal.workers.pipeline.sharding import per_param_state, unflatten
from shoal.workers.pipeline.stage_types import StageStateError


def piece_of(state: Mapping[str, Any]) -> tuple[int, int]:
    """Which piece of its block a saved state is: ``(rank, world)`` of a sharded replica's
    slice, ``(0, 1)`` for a whole block."""
    part = state.get("slice")
    if part is None:
        return WHOLE
    return int(part["rank"]), int(part["world"])


def whole_states(parts: Sequence[Mapping[int, Any]]) -> dict[int, Any]:
    """Block states by index from ``parts`` (each block states by index: ``export``s,
    copies): for each block, the first whole state, else its slices merged (the buffers
    those of the first part that has the block). Raises ``StageStateError`` for a block
    whose slices do not make it whole."""
    by_block: dict[int, list[Mapping[str, Any]]] = {}
    for part in parts:
        for index, state in part.items():
            by_block.setdefault(index, []).append(state)
    whole: dict[int, Any] = {}
    for index, states in by_block.items():
        chosen = pieces_for([piece_of(state) for state in states])
        if chosen is None:
            pieces = sorted(piece_of(state) for state in states)
            raise StageStateError(
                f"block {index}: the saved slices {pieces} (rank, world) do not make it"
                " whole: every rank of one sharding is needed"
            )
        if "slice" not in states[chosen[0]]:
            whole[index] = states[chosen[0]]
        else:
            whole[index] = _merge(states[0]["module"], [states[p]["slice"] for p in chosen])
    return whole


def _merge(buffers: Mapping[str, Any], slices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A block's whole state from its ``buffers`` and the ``slices`` (of its parameters and
    their optimizer state) in rank order."""
    first = slices[0]
    values = unflatten(torch.cat([part["values"] for part in slices]), first["shapes"])
    module = {**buffers, **{key: values[i] for key, i in first["params"].items()}}
    flat: dict[str, Any] = {}
    for key, value in first["state"].items():
        parts = [part["state"].get(key) for part in slices]
        if all(isinstance(v, Tensor) and v.dim() == 1 for v in parts):
            flat[key] = torch.cat(parts)
        else:
            flat[key] = value
    optimizer = {"state": per_param_state(flat, first["shapes"]), "param_groups": first["groups"]}
    return {"module": module, "optimizer": optimizer}
