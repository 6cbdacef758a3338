"""The cases the memory model is checked on, on a GPU (``test_memory_on_gpu``) and on a CPU
device (``test_memory_on_cpu``): each model, fp32 and bf16, GPipe and 1F1B, with and without
recompute, over 4 micro-batches."""

from __future__ import annotations

MICRO_BATCHES = 4

CASES = [
    (case, precision, schedule, recompute)
    for case in ("mlp", "gpt")
    for precision in ("fp32", "bf16")
    for schedule in ("gpipe", "1f1b")
    for recompute in (False, True)
]
