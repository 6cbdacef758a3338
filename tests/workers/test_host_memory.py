"""A worker keeps freed host memory: a block freed and allocated again reuses its pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SIZE_MB = 20
"""A block past glibc's default mmap threshold (128 KiB), below the kept size (32 MiB)."""

# Allocates, fills and frees one block three times in a fresh process; prints the minor
# page faults of each round.
_ROUNDS = textwrap.dedent(
    f"""
    import ctypes, resource, sys
    from workers.host_memory import retain_freed_memory
    if sys.argv[1] == "retain":
        assert retain_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = {SIZE_MB} * 2**20
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)
PAGES = SIZE_MB * 2**20 // 4096


def _faults(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [int(line) for line in done.stdout.split()]


def test_a_freed_block_is_reused_without_page_faults() -> None:
    retained = _faults("retain")
    default = _faults("default")
    # Kept: the second and third rounds run on the first round's pages.
    assert retained[0] > PAGES // 2 and max(retained[1:]) < PAGES // 50, (retained, default)
    # glibc's default maps the first block and unmaps it on free; the second comes from
    # fresh heap pages: the faults the setting saves a training step.
    assert default[1] > PAGES // 2, (retained, default)


def test_retaining_twice_answers_the_first_time() -> None:
    from workers.host_memory import retain_freed_memory

    assert retain_freed_memory() is retain_freed_memory()
