"""Block costs traced on the meta device: FLOPs, parameter and activation bytes, per block."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from scheduler.memory import FLOAT_BYTES
from scheduler.profile import REFERENCE_GFLOPS
from workers.profiler import TraceError, trace_costs
from workers.snapshot import DataRef, ModelRef
from workers.zoo.data import make_data
from workers.zoo.models import build_blocks
from workers.zoo.registry import resolve_model

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
    """Exact where the kernels are the same on every device; attention kernels differ in what
    they keep for backward (CPU, meta and CUDA's flash kernel), so there within 10%."""
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
        if model.builtin == "gpt":
            assert cost.activation_bytes_per_sample == pytest.approx(real, rel=0.1)
        else:
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
