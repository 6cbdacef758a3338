"""Mixed precision: the autocast a job's forward and loss run under.

``fp32`` runs the model as it is. ``bf16`` runs every block's forward and the loss under
``torch.autocast(device_type, dtype=torch.bfloat16)`` (mixed-precision training after
Micikevicius et al., 2018; bfloat16 keeps float32's exponent range, so no loss scaling):
parameters, gradients and optimizer state stay float32 (the master weights) and autocast
casts to bfloat16 for the ops that gain from it (matmuls, convolutions), keeping float32
for those that need the range (softmax, norms, losses). Backward runs outside autocast, as
torch recommends: autograd replays each op's casts. Activations leave a stage in whatever
dtype the forward produced; ``workers.wire`` carries bfloat16 bit for bit.

Exactness: cutting the model into stages changes neither the ops nor their order, so a bf16
pipeline without replicas equals a bf16 ``workers.reference`` run bitwise on CPU (measured
on the test MLP and GPT with and without recompute; tests/workers/pipeline/test_runner.py asserts
it). With replicas the summed gradients round differently, as in fp32; measured over two
steps the parameters stayed within 1.2e-7 of the reference, but a float32 difference that
flips a bfloat16 rounding in the next forward is larger, so long bf16 runs with replicas
drift from the reference faster than fp32 ones. Not measured on CUDA.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""Each precision a job may ask for, and the dtype autocast runs in (None: no autocast)."""


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision``; an unknown one is a ValueError naming the field."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision: unknown precision {precision!r}; choose one of {list(PRECISIONS)}"
        )
    return PRECISIONS[precision]


def autocast(dtype: torch.dtype | None, device: torch.device) -> AbstractContextManager[object]:
    """The context a forward runs under on ``device``: autocast to ``dtype``, or nothing."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)
