"""How a worker process's host allocator treats freed memory: kept for the next step.

A training step frees and re-allocates the same tensors every time: gradients, activations
and their gradients, optimizer temporaries. glibc's malloc hands large freed blocks back to
the kernel (``munmap`` for blocks past its mmap threshold, a trimmed heap top past its trim
threshold), so the next step's identical tensors are fresh pages, each one a page fault
plus the kernel zeroing it. Measured on the 2-core machine (one thread, the pipeline
bench's 26M-parameter MLP, 8 micro-batches; three interleaved pairs): 40,000-50,000 minor
faults per step, 14-17% of the process's time in the kernel, and a step of 0.466-0.478 s
against 0.387-0.392 s with freed memory kept (~2,300 faults, 0.7% in the kernel).

``retain_freed_memory`` makes malloc keep it, as PyTorch's CUDA caching allocator does for
device memory (and jemalloc or tcmalloc, which Intel recommends for PyTorch on CPUs, do by
default): blocks up to 32 MiB come from the heap, and the heap is not trimmed. A thread
other than the main one (a Ray actor with concurrency groups runs its calls on such threads:
a StageWorker's training calls do) allocates from an arena of its own, made of 64 MiB heaps
that glibc unmaps as soon as one is wholly free, whatever the trim threshold; a top pad of a
whole heap keeps them. Measured in the pipeline bench (2 stages, the 26M-parameter MLP):
one stage's training thread unmapped a 64 MiB heap several times a step, ~42,000 minor
faults a second (the other's ~6,700), and 3 a second with the pad. A process's resident
memory then stays at its peak instead of following each step's rise and fall; the peak is
what the memory plan counts anyway. Larger blocks are still mapped per use.

Without glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools

# mallopt parameters, glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_TOP_PAD = -2

MMAP_THRESHOLD = 32 * 2**20
"""The largest block served from the heap: glibc's upper limit for the threshold on 64-bit
machines (``DEFAULT_MMAP_THRESHOLD_MAX``); mallopt refuses more."""

TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the heap's top kept before trimming: the most mallopt takes (an int)."""

TOP_PAD = 2 * MMAP_THRESHOLD
"""Extra memory asked of the system whenever a heap grows, and kept free at its top: a
thread arena's heap size (``HEAP_MAX_SIZE``, twice the mmap threshold's upper limit). glibc
frees a thread arena's wholly free heap only if the heaps before it would keep this much
free (``heap_trim``), so a whole heap's worth keeps every one. The main heap asks the system
for this much more address space each time it grows; pages untouched stay unmapped."""


@functools.cache
def retain_freed_memory() -> bool:
    """Keep this process's freed host memory for reuse; whether the allocator took it
    (False without glibc). Once per process: later calls return the first answer."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: musl's mallopt ignores these
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # A fixed mmap threshold also stops glibc's own adjustment of both thresholds.
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all(mallopt(param, value) for param, value in settings)
