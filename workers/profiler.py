"""Block costs by tracing: each block's FLOPs and bytes, counted on PyTorch's meta device.

The model is built on the ``meta`` device (shapes and dtypes, no storage, no arithmetic), and
one micro-batch runs forward and backward through it block by block, the loss on the last:
``FlopCounterMode`` counts each block's forward and backward FLOPs, a saved-tensors hook
counts the bytes autograd keeps for its backward (the activations a micro-batch in flight
holds), and the block's input is the stage boundary it would be. Nothing is allocated, so a
model far larger than this machine traces in about a second, built-in or factory alike.

What a block costs is a property of the model; how fast a device runs it is a property of the
device, measured (``scheduler.profile``). Costs are expressed as seconds on the reference
device, one doing ``REFERENCE_GFLOPS``; a device measured at g GFLOP/s runs them g /
``REFERENCE_GFLOPS`` times as fast. The count covers matrix products and convolutions (what
``FlopCounterMode`` counts: the bulk of a deep model's time); element-wise work and the
optimizer step are left out, so blocks without matrix products (an embedding lookup) cost
next to nothing.

The saved bytes are those of the kernels a GPU runs, not of the meta device's fallbacks:

- Attention (``F.scaled_dot_product_attention``) runs its unfused math path on the meta
  device, which saves the attention matrices; the fused kernels a GPU runs (flash,
  memory-efficient) keep only the query, key, value, output and each row's log-sum-exp,
  and that is what is counted.
- Under ``precision: bf16`` the trace casts as autocast does (``_AsOnGpu``): matrix
  products and attention take bfloat16 inputs, norms, softmaxes and losses float32 ones,
  so their saved inputs are counted in the dtype autocast keeps. The bfloat16 copies of
  the weights are left out here: ``scheduler.memory`` counts them per micro-batch in
  flight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from shoal.scheduler.memory import FLOAT_BYTES, optimizer_state_factor
from shoal.scheduler.profile import REFERENCE_GFLOPS, BlockCost
from shoal.workers.precision import autocast_dtype
from shoal.workers.snapshot import DataRef, ModelRef
from shoal.workers.tensor_split import SplitSize, split_size
from shoal.workers.zoo.data import loss_fn, sample_batch
from shoal.workers.zoo.models import build_blocks, built_alike, count_blocks

_META = torch.device("meta")


class TraceError(RuntimeError):
    """The model could not be traced on the meta device (it needs real data or storage)."""


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class _Trace:
    flops: int
    saved_bytes: int
    output: Tensor


_LOW = frozenset(
    {"linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d",
     "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
     "scaled_dot_product_attention"}
)  # fmt: skip
"""Functions CUDA autocast runs in bfloat16 (matrix products, convolutions, attention)."""

_FLOAT32 = frozenset(
    {"layer_norm", "group_norm", "softmax", "log_softmax", "cross_entropy",
     "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits",
     "kl_div", "exp", "log", "pow", "sum", "cumsum", "norm", "logsumexp"}
)  # fmt: skip
"""Functions CUDA autocast runs in float32 (norms, softmaxes, losses, reductions)."""


class _Saved:
    """The bytes autograd keeps for a block's backward, activations only."""

    def __init__(self, params: set[int]) -> None:
        self.bytes = 0
        self.params = params
        """Ids of the block's parameters and of their autocast copies: not activations."""
        self.copies: list[Tensor] = []
        """The copies, alive while the trace runs: no other tensor takes one's id."""

    def pack(self, tensor: Tensor) -> Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.params:  # a parameter (or a view of one) is not an activation
            self.bytes += _nbytes(tensor)
        return tensor


class _AsOnGpu(TorchFunctionMode):
    """Attention counted as the fused kernels keep it; under ``low`` (bfloat16), the casts
    of CUDA autocast (module docstring)."""

    def __init__(self, saved: _Saved, low: torch.dtype | None) -> None:
        super().__init__()
        self._saved, self._low = saved, low

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if self._low is not None and name in _LOW:
            args, kwargs = self._cast(args, kwargs, self._low)
        elif self._low is not None and name in _FLOAT32:
            args, kwargs = self._cast(args, kwargs, torch.float32)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        before = self._saved.bytes
        out = func(*args, **kwargs)
        q, k, v = _attention_inputs(args, kwargs)
        rows = q.numel() // q.shape[-1] * 4  # float32 log-sum-exp per query row
        self._saved.bytes = before + sum(_nbytes(t) for t in (q, k, v, out)) + rows
        return out

    def _cast(
        self, args: Sequence[Any], kwargs: dict[str, Any], dtype: torch.dtype
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        def cast(value: Any) -> Any:
            if not (isinstance(value, Tensor) and value.is_floating_point()):
                return value
            if value.dtype == dtype:
                return value
            copy = value.to(dtype)
            if id(value) in self._saved.params:  # a weight's copy: scheduler.memory counts it
                self._saved.params.add(id(copy))
                self._saved.copies.append(copy)
            return copy

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _attention_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Tensor, ...]:
    """The query, key and value of a ``scaled_dot_product_attention`` call, by position or
    by name."""
    names = ("query", "key", "value")
    return tuple(args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names))


def _trace_block(
    block: nn.Module,
    x: Tensor,
    end: Callable[[Tensor], Tensor],
    *,
    input_grad: bool,
    low: torch.dtype | None,
) -> _Trace:
    """One block's forward, ``end`` (the loss, or nothing) and backward, counted; the input's
    gradient only with ``input_grad`` (block 0's input is data and needs none); ``low``: the
    autocast dtype of the forward and the loss (None: float32 throughout)."""
    saved = _Saved({id(p) for p in block.parameters()})
    with FlopCounterMode(display=False) as flops, saved_tensors_hooks(saved.pack, lambda t: t):
        with _AsOnGpu(saved, low):
            out = block(x.detach().requires_grad_(input_grad and x.is_floating_point()))
            tail = end(out)
        tail.backward(torch.ones_like(tail))  # type: ignore[no-untyped-call]
    return _Trace(flops.get_total_flops(), saved.bytes, out.detach())


def trace_costs(
    model: ModelRef,
    data: DataRef,
    *,
    micro_batch_size: int,
    optimizer: str,
    momentum: bool = False,
    allowed: Sequence[str] = (),
    precision: str = "fp32",
) -> tuple[BlockCost, ...]:
    """Every block's cost for one micro-batch of ``micro_batch_size`` samples (see the module
    docstring); ``optimizer`` sizes the optimizer state, ``precision`` the activations.
    Raises ``TraceError``."""
    state_factor = optimizer_state_factor(optimizer, momentum=momentum)
    low = autocast_dtype(precision)
    rows = micro_batch_size
    try:
        # The sample batch is shapes on the meta device too: a submission builds no data.
        meta, x, target = sample_batch(data, rows, allowed)
        with _META:  # factory models too: counting builds them, on the meta device here
            count = count_blocks(model, meta, allowed)
            # A block built alike to an earlier one, on the same input, costs what it did:
            # a 1,000-layer model builds and traces its few distinct blocks only.
            alike = built_alike(model, meta, count)
            distinct = sorted(set(alike))
            blocks = dict(
                zip(distinct, build_blocks(model, meta, 0, distinct, allowed), strict=True)
            )
        loss = loss_fn(meta.task)
        costs = []
        traced: dict[tuple[object, ...], tuple[_Trace, int, SplitSize]] = {}
        for i in range(count):
            last = i == count - 1
            key = (alike[i], tuple(x.shape), x.dtype, i > 0, last)
            if key not in traced:
                block = blocks[alike[i]]
                end = (lambda y: loss(y, target)) if last else (lambda y: y)
                params = sum(p.numel() for p in block.parameters()) * FLOAT_BYTES
                trace = _trace_block(block, x, end, input_grad=i > 0, low=low)
                traced[key] = (trace, params, split_size(block))
            trace, params, split = traced[key]
            costs.append(
                BlockCost(
                    index=i,
                    fwd_bwd_s=trace.flops / (REFERENCE_GFLOPS * 1e9),
                    param_bytes=params,
                    optim_bytes=round(params * state_factor),
                    activation_bytes_per_sample=-(-trace.saved_bytes // rows),
                    input_bytes_per_sample=-(-_nbytes(x) // rows),
                    split_bytes=split.numel * FLOAT_BYTES,
                    split_ways=split.ways,
                )
            )
            x = trace.output
    except Exception as exc:  # model code: any failure means "cannot trace", with why
        raise TraceError(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    return tuple(costs)
