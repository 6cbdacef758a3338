"""Gradient-norm clipping across stages: ``torch.nn.utils.clip_grad_norm_`` as a reduction.

Clipping multiplies every gradient of the model by ``min(1, max_norm / (total + 1e-6))``,
``total`` being the L2 norm over all the model's gradients. A block only holds its own
(DESIGN invariant 2), so the norm is an explicit cross-stage reduction in three moves:

1. once the gradients are accumulated (and summed over the replicas), every stage returns
   the L2 norm of each of its gradients, in block and parameter order (``grad_norms``);
2. the runner joins them in stage order, replica 0 speaking for all (the replicas hold the
   same gradients after the all-reduce), and computes the total norm and the coefficient
   with torch's own operations (``clip_coefficient``);
3. every stage of every replica multiplies its gradients by the coefficient before its
   optimizer steps (``scale_grads``).

Exactness: torch computes the total as the norm of the per-tensor norms
(``torch._foreach_norm``, then ``vector_norm`` of their stack). Shipping those per-tensor
norms (one float per parameter tensor, not one sum of squares per stage) and folding them
with the same float32 operations reproduces torch's bits: on CPU, a pipeline without
replicas clips bitwise like ``clip_grad_norm_`` in one process
(tests/workers/pipeline/test_runner.py asserts it). A sum of squares per stage would
associate the sum differently, agreeing only to float tolerance. With replicas the gradients
themselves differ from one process's by rounding (see ``workers.pipeline.collective``), so
the clipped result agrees to the same tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from shoal.workers.wire import Wire, receive, send

_EPS = 1e-6
"""torch's guard against dividing by a zero norm, kept so the coefficients agree."""


def gradients(blocks: Iterable[Any]) -> list[Tensor]:
    """Every gradient of ``blocks``, block and parameter order. Parameters without one take
    no part, as in ``clip_grad_norm_`` and in the replicas' sum (an optimizer skips them, and
    a zero filled in would move Adam's moments; every replica runs the same code, so the
    sets agree)."""
    return [p.grad for block in blocks for p in block.module.parameters() if p.grad is not None]


def grad_norms(blocks: Iterable[Any]) -> Wire:
    """The L2 norm of every gradient of ``blocks``, block and parameter order, one tensor."""
    grads = gradients(blocks)
    if not grads:
        return send(torch.zeros(0))
    # On one device, or several (a tensor-parallel stage): the norms go to the first's.
    home = grads[0].device
    return send(torch.stack([n.to(home) for n in torch._foreach_norm(grads)]))


def clip_coefficient(parts: Sequence[Wire], max_norm: float | None) -> tuple[float, float | None]:
    """The total gradient norm over ``parts`` (every stage's ``grad_norms``, stage order),
    and the coefficient to multiply the gradients by: None when ``max_norm`` is None (no
    clipping), else ``min(1, max_norm / (total + 1e-6))`` computed as torch computes it."""
    cpu = torch.device("cpu")
    total = torch.linalg.vector_norm(torch.cat([receive(part, cpu) for part in parts]))
    if max_norm is None:
        return float(total), None
    coefficient = torch.clamp(max_norm / (total + _EPS), max=1.0)
    return float(total), float(coefficient)


def scale_grads(blocks: Iterable[Any], coefficient: float) -> None:
    """Multiply every gradient of ``blocks`` by ``coefficient`` in place."""
    grads = gradients(blocks)
    if grads:
        # A float32 scalar tensor, as clip_grad_norm_ multiplies by: the same products.
        torch._foreach_mul_(grads, torch.tensor(coefficient, device=grads[0].device))
