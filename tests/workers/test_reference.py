"""The single-process reference: it learns, micro-batching is exact, and resuming is seamless."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from shoal.workers.blocks import Block
from shoal.workers.reference import train_reference
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.zoo.data import loss_fn, make_data

pytestmark = pytest.mark.unit

MLP_DIGITS = (ModelRef("mlp", None, {"hidden": 32}), DataRef("digits", None, {}))
GPT_LM = (
    ModelRef("gpt", None, {"d_model": 32, "n_layers": 1, "n_heads": 2}),
    DataRef("synthetic-lm", None, {"vocab_size": 32, "seq_len": 16}),
)
CONVNET = (ModelRef("convnet", None, {"channels": [4, 4]}), DataRef("digits", None, {}))
ADAM = OptimizerConf("adam", 0.01)
SGD = OptimizerConf("sgd", 0.05, {"momentum": 0.9})


def train(pair: tuple[ModelRef, DataRef], optimizer: OptimizerConf = ADAM, **kw: Any) -> Any:
    args: dict[str, Any] = {"batch_size": 16, "micro_batches": 2, "steps": 6, "seed": 3}
    return train_reference(*pair, optimizer, **(args | kw))


def parameters(blocks: list[Block]) -> list[torch.Tensor]:
    return [p.detach() for block in blocks for p in block.module.parameters()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("pair", [MLP_DIGITS, GPT_LM], ids=["mlp-digits", "gpt-lm"])
def test_the_loss_falls(pair: tuple[ModelRef, DataRef], precision: str) -> None:
    losses = train(pair, steps=30, batch_size=32, precision=precision).losses
    assert len(losses) == 30
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])


def test_bf16_rounds_the_forward_but_keeps_fp32_weights() -> None:
    fp32, bf16 = train(GPT_LM, SGD), train(GPT_LM, SGD, precision="bf16")
    assert all(p.dtype == torch.float32 for p in parameters(bf16.blocks))
    assert bf16.losses == pytest.approx(fp32.losses, rel=1e-2)
    assert bf16.losses != pytest.approx(fp32.losses, rel=1e-5)


def test_clipping_bounds_the_first_sgd_step() -> None:
    """Plain SGD moves the parameters by lr x the clipped gradient, whose norm is max_norm."""
    clipped = OptimizerConf("sgd", 0.5, clip_grad_norm=0.01)
    before = parameters(train(MLP_DIGITS, clipped, steps=0).blocks)
    after = train(MLP_DIGITS, clipped, steps=1)
    moved = torch.cat(
        [(a - b).flatten() for a, b in zip(parameters(after.blocks), before, strict=True)]
    )
    assert after.grad_norms[0] > 0.01
    assert float(moved.norm()) == pytest.approx(0.5 * 0.01, rel=1e-4)


def test_a_max_norm_above_every_gradient_norm_changes_nothing() -> None:
    free = train(GPT_LM, SGD)
    loose = train(GPT_LM, OptimizerConf("sgd", 0.05, {"momentum": 0.9}, clip_grad_norm=1e6))
    assert max(free.grad_norms) < 1e6
    assert (loose.losses, loose.grad_norms) == (free.losses, free.grad_norms)
    for a, b in zip(parameters(loose.blocks), parameters(free.blocks), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pair", [MLP_DIGITS, GPT_LM, CONVNET], ids=["mlp", "gpt", "convnet"])
@pytest.mark.parametrize(
    ("optimizer", "atol"),
    [
        (SGD, 1e-6),
        # Adam divides by the root of the mean squared gradient, so on elements whose
        # gradient is near zero (a dead unit) it turns the rounding of another summation
        # order into steps of up to lr: only the same micro-batches give the same weights.
        (ADAM, 1e-3),
    ],
    ids=["sgd", "adam"],
)
def test_micro_batching_does_not_change_the_math(
    pair: tuple[ModelRef, DataRef], optimizer: OptimizerConf, atol: float
) -> None:
    whole = train(pair, optimizer, micro_batches=1)
    split = train(pair, optimizer, micro_batches=4)
    assert whole.losses == pytest.approx(split.losses, rel=1e-5)
    for a, b in zip(parameters(whole.blocks), parameters(split.blocks), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("pair", [MLP_DIGITS, GPT_LM], ids=["mlp", "gpt"])
def test_the_same_micro_batches_give_the_same_weights(pair: tuple[ModelRef, DataRef]) -> None:
    first, second = train(pair, micro_batches=4), train(pair, micro_batches=4)
    assert first.losses == second.losses
    assert all(
        torch.equal(a, b)
        for a, b in zip(parameters(first.blocks), parameters(second.blocks), strict=True)
    )


def test_the_reported_loss_is_the_mean_over_the_mini_batch() -> None:
    data = MLP_DIGITS[1]
    first = train(MLP_DIGITS, micro_batches=4, steps=1)
    fresh = train(MLP_DIGITS, steps=0).blocks  # the same initial blocks, untrained
    inputs, targets = make_data(data, 3).batch(0, 16)
    out = inputs
    for block in fresh:
        out = block.module(out)
    expected = loss_fn("classification")(out, targets).item()
    assert first.losses[0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("pair", [MLP_DIGITS, GPT_LM], ids=["mlp", "gpt"])
def test_resuming_from_block_states_equals_an_uninterrupted_run(
    pair: tuple[ModelRef, DataRef],
) -> None:
    uninterrupted = train(pair, steps=6)
    head = train(pair, steps=3)
    shipped = pickle.loads(pickle.dumps({b.index: b.state() for b in head.blocks}))
    tail = train(pair, steps=6, start_step=3, start_blocks=shipped)
    assert head.losses + tail.losses == uninterrupted.losses
    for a, b in zip(parameters(tail.blocks), parameters(uninterrupted.blocks), strict=True):
        assert torch.equal(a, b)


def test_factory_model_and_data() -> None:
    model = ModelRef(None, "tests.workers.test_factories:tiny_mlp_list", {"hidden": 16})
    data = DataRef(None, "tests.workers.test_factories:sum_data", {"width": 4})
    result = train_reference(
        model, data, ADAM, batch_size=32, micro_batches=4, steps=40, seed=0,
        allowed=["tests.workers.test_factories"],
    )  # fmt: skip
    assert len(result.blocks) == 3
    assert sum(result.losses[-5:]) < 0.5 * sum(result.losses[:5])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"batch_size": 10, "micro_batches": 4}, r"batch_size \(10\) must be a positive multiple"),
        ({"micro_batches": 0}, "positive multiple of micro_batches"),
        ({"start_step": 7}, r"start_step \(7\) must be between 0 and steps \(6\)"),
        (
            {"start_step": 1, "start_blocks": {0: {}}},
            r"holds the states of blocks \[0\]; .* 0\.\.2",
        ),
        ({"start_blocks": {0: {}, 1: {}, 2: {}, 3: {}}}, r"blocks \[0, 1, 2, 3\]; the model has"),
        ({"precision": "fp16"}, r"precision: unknown precision 'fp16'; choose one of"),
    ],
)
def test_bad_arguments_are_explained(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(MLP_DIGITS, **kw)
