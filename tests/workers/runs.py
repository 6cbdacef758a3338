"""What a finished engine run left, and how it compares with the single-process reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from shoal.workers.checkpoints import CheckpointStore
from shoal.workers.pipeline.runner import Trainer
from shoal.workers.reference import ReferenceResult, train_reference
from shoal.workers.snapshot import JobSnapshot, StepMetrics


def final_states(snap: JobSnapshot) -> dict[int, dict[str, Any]]:
    _, states = CheckpointStore(snap.checkpoint_root).read(snap.job_id, snap.steps)
    return states


def reference(snap: JobSnapshot) -> ReferenceResult:
    return train_reference(
        snap.model,
        snap.data,
        snap.optimizer,
        batch_size=snap.batch_size,
        micro_batches=snap.micro_batches,
        steps=snap.steps,
        seed=snap.seed,
        allowed=snap.allowed_factories,
        precision=snap.precision,
    )


def assert_matches_reference(snap: JobSnapshot, steps: Sequence[StepMetrics]) -> None:
    """The final parameters, and the loss and gradient norm of every step in ``steps``
    (the last ones of the run), equal the reference's to the DESIGN tolerance."""
    ref = reference(snap)
    states = final_states(snap)
    for block in ref.blocks:
        for name, expected in block.module.state_dict().items():
            actual = states[block.index]["module"][name]
            assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), (block.index, name)
    tail = slice(len(ref.losses) - len(steps), None)
    assert [m.loss for m in steps] == pytest.approx(ref.losses[tail], rel=1e-5, abs=1e-6)
    assert [m.grad_norm for m in steps] == pytest.approx(ref.grad_norms[tail], rel=1e-5)


def metrics(trainer: Trainer) -> list[StepMetrics]:
    return list(trainer.report(0).metrics)


def assert_bitwise_equal(a: dict[int, Any], b: dict[int, Any]) -> None:
    """Two runs' final block states hold bitwise the same parameters."""
    assert sorted(a) == sorted(b)
    for i, state in a.items():
        for name, tensor in state["module"].items():
            assert torch.equal(b[i]["module"][name], tensor), (i, name)


def assert_same_state(a: object, b: object) -> None:
    """Two block states (or any nesting of dicts, lists and tensors) equal: every tensor
    bitwise and of the same dtype, everything else by value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (sorted(a), b)
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b
