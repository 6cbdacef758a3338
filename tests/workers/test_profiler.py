"""Block costs traced on the meta device: FLOPs, parameter and activation bytes, per block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from shoal.scheduler.memory import FLOAT_BYTES
from shoal.scheduler.profile import REFERENCE_GFLOPS
from shoal.workers.profiler import TraceError, trace_costs
from shoal.workers.snapshot import DataRef, ModelRef
from shoal.workers.zoo.data import make_data
from shoal.workers.zoo.models import build_blocks
from shoal.workers.zoo.registry import resolve_model

pytestmark = pytest.mark.unit

REGRESSION = DataRef("synthetic-regression", None, {"features": 12, "outputs": 3})
FACTORIES = "tests.workers.test_factories"


def _flops(cost_s: float) -> float:
    return cost_s * REFERENCE_GFLOPS * 1e9


def test_linear_blocks_cost_their_matrix_products() -> None:
    model = ModelRef("mlp", None, {"hidden": 16, "layers": 2})
    costs = trace_costs(model, REGRESSION, micro_batch_size=4, optimizer="adam")
    assert len(costs) == 3
    # Forward 2nk per product; backward 2nk for the weight gradient, and 2nk more for the
    # input gradient except on block 0, whose input (the data) needs none.
    assert _flops(costs[0].fwd_bwd_s) == 4 * 4 * 12 * 16
    assert _flops(costs[1].fwd_bwd_s) == 6 * 4 * 16 * 16
    assert _flops(costs[2].fwd_bwd_s) == 6 * 4 * 16 * 3
    assert costs[1].param_bytes == (16 * 16 + 16) * FLOAT_BYTES
    assert costs[1].optim_bytes == 2 * costs[1].param_bytes  # Adam's two moments
    assert [c.input_bytes_per_sample for c in costs] == [12 * 4, 16 * 4, 16 * 4]


@pytest.mark.parametrize(
    ("model", "data"),
    [
        (ModelRef("mlp", None, {"hidden": 16, "layers": 2}), REGRESSION),
        (ModelRef("gpt", None, {"d_model": 16, "n_layers": 2, "n_heads": 2}), None),
        (ModelRef("convnet", None, {}), DataRef("digits", None, {})),
    ],
    ids=["mlp", "gpt", "convnet"],
)
def test_traced_bytes_match_a_real_cpu_run(model: ModelRef, data: DataRef | None) -> None:
    """Exact, attention included: the trace counts it as the fused kernels keep it, and
    PyTorch's CPU attention is such a kernel (flash)."""
    data = data or DataRef("synthetic-lm", None, {"vocab_size": 32, "seq_len": 8})
    rows = 3
    costs = trace_costs(model, data, micro_batch_size=rows, optimizer="sgd")
    source = make_data(data, 0, ())
    x, _ = source.batch(0, rows)
    blocks = build_blocks(model, source.meta, 0, range(len(costs)))
    assert sum(c.param_bytes for c in costs) == (
        resolve_model(model.builtin or "", model.config, source.meta).param_count * FLOAT_BYTES
    )
    for block, cost in zip(blocks[:-1], costs[:-1], strict=True):  # the last adds the loss
        params = {id(p) for p in block.parameters()}
        saved: list[int] = []

        def pack(t: torch.Tensor, params: set[int] = params, saved: list[int] = saved) -> object:
            base = t._base if t._base is not None else t
            if id(base) not in params:
                saved.append(t.numel() * t.element_size())
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            out = block(x.requires_grad_(x.is_floating_point() and block is not blocks[0]))
        assert cost.input_bytes_per_sample == x.numel() * x.element_size() // rows
        real = -(-sum(saved) // rows)
        assert cost.activation_bytes_per_sample == real
        x = out.detach()


def test_a_model_far_larger_than_memory_traces() -> None:
    # 15 hidden layers of 16384^2: 4 billion parameters, 15 GiB of fp32 before gradients.
    model = ModelRef("mlp", None, {"hidden": 16_384, "layers": 16})
    costs = trace_costs(model, REGRESSION, micro_batch_size=2, optimizer="sgd")
    assert sum(c.param_bytes for c in costs) > 15 * 2**30
    assert _flops(costs[5].fwd_bwd_s) == 6 * 2 * 16_384 * 16_384


def test_a_factory_model_traces_and_a_data_dependent_one_cannot() -> None:
    data = DataRef(None, f"{FACTORIES}:sum_data", {"width": 5})
    model = ModelRef(None, f"{FACTORIES}:tiny_mlp", {"hidden": 7})
    costs = trace_costs(model, data, micro_batch_size=2, optimizer="sgd", allowed=[FACTORIES])
    assert [c.param_bytes // FLOAT_BYTES for c in costs] == [5 * 7 + 7, 0, 7 + 1]
    odd = ModelRef(None, f"{FACTORIES}:data_dependent_mlp", {})
    with pytest.raises(TraceError):
        trace_costs(odd, data, micro_batch_size=2, optimizer="sgd", allowed=[FACTORIES])


def test_attention_is_counted_as_the_fused_kernels_keep_it() -> None:
    """Flash and memory-efficient attention keep the query, key, value, output and a
    log-sum-exp per query row, nothing of size sequence x sequence: a GPT layer's saved
    bytes per sample grow with the sequence, not with its square."""
    model = ModelRef("gpt", None, {"d_model": 32, "n_layers": 1, "n_heads": 2})

    def layer_bytes(seq_len: int) -> int:
        data = DataRef("synthetic-lm", None, {"vocab_size": 32, "seq_len": seq_len})
        layer = trace_costs(model, data, micro_batch_size=4, optimizer="sgd")[1]
        return layer.activation_bytes_per_sample

    assert layer_bytes(256) == 2 * layer_bytes(128) == 4 * layer_bytes(64)


def test_bf16_traces_what_autocast_keeps_without_the_weight_copies() -> None:
    """An MLP's blocks under real CPU autocast keep bfloat16 inputs for their products; the
    bf16 trace counts the same bytes, leaving out the weights' bfloat16 copies (the memory
    model counts those per micro-batch in flight)."""
    model = ModelRef("mlp", None, {"hidden": 16, "layers": 3})
    rows = 3
    fp32 = trace_costs(model, REGRESSION, micro_batch_size=rows, optimizer="sgd")
    bf16 = trace_costs(model, REGRESSION, micro_batch_size=rows, optimizer="sgd", precision="bf16")
    source = make_data(REGRESSION, 0, ())
    x, _ = source.batch(0, rows)
    blocks = build_blocks(model, source.meta, 0, range(len(bf16)))
    for block, cost in zip(blocks[:-1], bf16[:-1], strict=True):
        copies = {(tuple(p.shape), torch.bfloat16) for p in block.parameters()}
        saved: list[int] = []

        def pack(t: torch.Tensor, copies: set[Any] = copies, saved: list[int] = saved) -> Any:
            if (tuple(t.shape), t.dtype) not in copies:  # the weights' autocast copies
                saved.append(t.numel() * t.element_size())
            return t

        with saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x.requires_grad_(block is not blocks[0]))
        assert cost.activation_bytes_per_sample == -(-sum(saved) // rows)
        x = out.detach()
    assert all(b.activation_bytes_per_sample < f.activation_bytes_per_sample
               for b, f in zip(bf16[1:-1], fp32[1:-1], strict=True))  # fmt: skip
    with pytest.raises(ValueError, match="precision: unknown precision 'fp8'"):
        trace_costs(model, REGRESSION, micro_batch_size=rows, optimizer="sgd", precision="fp8")


def test_attention_called_by_keyword_counts_alike() -> None:
    """A model may name the query, key and value: the trace counts that call as it counts
    a positional one."""
    from shoal.workers.profiler import _attention_inputs

    q, k, v = (torch.empty(1, device="meta") for _ in range(3))
    assert _attention_inputs((q,), {"key": k, "value": v}) == (q, k, v)
    assert _attention_inputs((q, k, v), {}) == (q, k, v)
