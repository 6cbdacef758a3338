"""Model FLOPs utilization: the share of its devices' peak a job's step really used.

MFU (PaLM, Chowdhery et al., 2022) is the model's FLOPs per step (the traced forward and
backward, ``workers.profiler``: matrix products and convolutions, recomputation left out) over
the step's seconds times the summed peak FLOP/s of the devices the step ran on. A GPU's peak is
its data-sheet dense figure for the job's precision (``PEAK_TFLOPS``; fp32 is the non-tensor
figure, PyTorch's default for float32 matrix products); a device the table does not list, a CPU
virtual device among them, is its measured matrix-product rate (``Stage.measure_speed``: float32,
one thread on a CPU), and a device neither lists nor measured gives no MFU. Measured in float32,
such a peak does not stand for a bf16 job's: a bf16 job on an unlisted GPU gives none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shoal.scheduler.profile import REFERENCE_GFLOPS, BlockCost

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100": {"fp32": 66.9, "bf16": 989.4},
    "h200": {"fp32": 66.9, "bf16": 989.4},
    "a100": {"fp32": 19.5, "bf16": 312.0},
    "a100-80g": {"fp32": 19.5, "bf16": 312.0},
    "l4": {"fp32": 30.3, "bf16": 121.0},
    "a10": {"fp32": 31.2, "bf16": 125.0},
    "v100": {"fp32": 15.7},
    "t4": {"fp32": 8.1},
}
"""Dense peak TFLOP/s by GPU kind (as ``scheduler.devices`` names it) and precision, from
NVIDIA's data sheets: H100 and H200 SXM, A100 SXM, L4, A10, V100 SXM2, T4. Without sparsity;
V100 and T4 have no bfloat16 tensor cores."""

_PRODUCT_KINDS = (
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100", "a100"),
    ("l4", "l4"),
    ("a10", "a10"),
    ("v100", "v100"),
    ("t4", "t4"),
)
"""What a GPU's product name contains (``torch.cuda.get_device_name``, lowercased, e.g.
"NVIDIA H100 80GB HBM3") and its kind in ``PEAK_TFLOPS``; longer and newer names first, so
that "a100" is not read as "a10"."""


def gpu_kind(product: str) -> str | None:
    """The ``PEAK_TFLOPS`` kind of a GPU by its product name; None for one the table lacks.
    An 80 GB A100 has the 40 GB one's peaks, so both read "a100"."""
    name = product.lower()
    for part, kind in _PRODUCT_KINDS:
        if part in name:
            return kind
    return None


@dataclass(frozen=True)
class DevicePeak:
    """What MFU needs to know of one device."""

    kind: str
    gpu: bool
    measured_gflops: float | None
    """Its measured matrix-product rate, once a worker measured it."""


def peak_flops(device: DevicePeak, precision: str) -> float | None:
    """The device's peak FLOP/s for ``precision`` jobs (module docstring); None: unknown."""
    listed = PEAK_TFLOPS.get(device.kind, {}) if device.gpu else {}
    if precision in listed:
        return listed[precision] * 1e12
    if device.gpu and precision != "fp32":
        return None
    if device.measured_gflops is None or device.measured_gflops <= 0:
        return None
    return device.measured_gflops * 1e9


def step_flops(costs: Sequence[BlockCost], micro_batches: int) -> float:
    """The model's FLOPs in one step: every block's traced forward and backward of one
    micro-batch (its cost on the reference device, ``scheduler.profile``), per micro-batch."""
    per_micro_batch = sum(c.fwd_bwd_s for c in costs) * REFERENCE_GFLOPS * 1e9
    return per_micro_batch * micro_batches


def mfu(flops: float, step_s: float, peaks: Iterable[float | None]) -> float | None:
    """``flops`` done in ``step_s`` seconds over the devices' summed ``peaks``; None when a
    device's peak is unknown, there is no device, or nothing was counted or timed."""
    known = list(peaks)
    if not known or any(p is None or p <= 0 for p in known) or step_s <= 0 or flops <= 0:
        return None
    return flops / (step_s * sum(p for p in known if p is not None))
