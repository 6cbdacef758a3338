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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from scheduler.memory import FLOAT_BYTES, optimizer_state_factor
from scheduler.profile import REFERENCE_GFLOPS, BlockCost
from workers.snapshot import DataRef, ModelRef
from workers.zoo.data import loss_fn, sample_batch
from workers.zoo.models import build_blocks, built_alike, count_blocks

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


def _trace_block(
    block: nn.Module, x: Tensor, end: Callable[[Tensor], Tensor], *, input_grad: bool
) -> _Trace:
    """One block's forward, ``end`` (the loss, or nothing) and backward, counted; the input's
    gradient only with ``input_grad`` (block 0's input is data and needs none)."""
    params = {id(p) for p in block.parameters()}
    saved = 0

    def pack(tensor: Tensor) -> Tensor:
        nonlocal saved
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in params:  # a parameter (or a view of one) is not an activation
            saved += _nbytes(tensor)
        return tensor

    with FlopCounterMode(display=False) as flops, saved_tensors_hooks(pack, lambda t: t):
        out = block(x.detach().requires_grad_(input_grad and x.is_floating_point()))
        tail = end(out)
        tail.backward(torch.ones_like(tail))  # type: ignore[no-untyped-call]
    return _Trace(flops.get_total_flops(), saved, out.detach())


def trace_costs(
    model: ModelRef,
    data: DataRef,
    *,
    micro_batch_size: int,
    optimizer: str,
    momentum: bool = False,
    allowed: Sequence[str] = (),
) -> tuple[BlockCost, ...]:
    """Every block's cost for one micro-batch of ``micro_batch_size`` samples (see the module
    docstring); ``optimizer`` sizes the optimizer state. Raises ``TraceError``."""
    state_factor = optimizer_state_factor(optimizer, momentum=momentum)
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
        traced: dict[tuple[object, ...], tuple[_Trace, int]] = {}
        for i in range(count):
            last = i == count - 1
            key = (alike[i], tuple(x.shape), x.dtype, i > 0, last)
            if key not in traced:
                block = blocks[alike[i]]
                end = (lambda y: loss(y, target)) if last else (lambda y: y)
                params = sum(p.numel() for p in block.parameters()) * FLOAT_BYTES
                traced[key] = (_trace_block(block, x, end, input_grad=i > 0), params)
            trace, params = traced[key]
            costs.append(
                BlockCost(
                    index=i,
                    fwd_bwd_s=trace.flops / (REFERENCE_GFLOPS * 1e9),
                    param_bytes=params,
                    optim_bytes=round(params * state_factor),
                    activation_bytes_per_sample=-(-trace.saved_bytes // rows),
                    input_bytes_per_sample=-(-_nbytes(x) // rows),
                )
            )
            x = trace.output
    except Exception as exc:  # model code: any failure means "cannot trace", with why
        raise TraceError(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    return tuple(costs)
