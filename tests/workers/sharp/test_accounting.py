"""A SHARP device's accounting as shards alternate on it (``ShardHost``): one task runs at a
time, so only the running task's shard is counted at what its task needs (gradients,
temporaries, what a backward recomputes), the others at their state and what their
micro-batches in flight keep, so more of them stay on the device; never more than the
budget, a prefetched shard included once its own task runs."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.scheduler.devices import Device
from shoal.workers.sharp.shard_types import ShardKey
from shoal.workers.snapshot import DataRef, ModelRef
from tests.workers.sharp_memory import Case, alternate, shards_for

SMALL: Case = (
    ModelRef("gpt", None, {"d_model": 64, "n_layers": 4, "n_heads": 4}),
    DataRef("synthetic-lm", None, {"vocab_size": 64, "seq_len": 32}),
    16,
)
CPU = Device("cpu-0", "node-0", 0, "cpu", 40960, gpu=False)


def trace(recompute: bool) -> tuple[list[tuple[ShardKey, dict[str, Any]]], int]:
    """What the host held after each task of two models' two steps, and its budget."""
    rows: list[tuple[ShardKey, dict[str, Any]]] = []
    host, _, _ = alternate(
        CPU, "fp32", recompute, probe=lambda key, held: rows.append((key, held)), case=SMALL
    )
    return rows, host.budget_bytes


@pytest.mark.parametrize("recompute", [False, True])
def test_a_device_never_accounts_for_more_than_its_budget(recompute: bool) -> None:
    rows, budget = trace(recompute)
    shards, _ = shards_for("fp32", recompute, SMALL)
    assert len(rows) == 2 * 2 * 2 * len(shards)  # 2 models, 2 steps, forwards and backwards
    on_device = [(key, h["resident_bytes"] + h["residue_bytes"]) for key, h in rows]
    over = [(key, now) for key, now in on_device if now > budget]
    assert not over, f"budget {budget}: {over}"


def test_shards_between_their_tasks_leave_the_device_room_for_more_of_them() -> None:
    """Every shard is cut to need at most half the budget while its task runs: counted so
    whether it runs or not, two would fit; counted as they hold, more stay."""
    shards, budget = shards_for("fp32", True, SMALL)
    assert all(2 * s.bytes <= budget for s in shards) and len(shards) >= 4, shards
    rows, _ = trace(recompute=True)
    resident = [len(h["resident"]) for _, h in rows]
    assert max(resident) > 2, resident
