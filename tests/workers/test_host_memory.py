"""A worker keeps freed host memory: a block freed and allocated again reuses its pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SIZE_MB = 20
"""A block past glibc's default mmap threshold (128 KiB), below the kept size (32 MiB)."""

# In a fresh process, on its main thread or a thread of its own (which glibc gives an arena
# of 64 MiB heaps), allocates, fills and frees ``blocks`` blocks three times; prints the
# minor page faults of each round.
_ROUNDS = textwrap.dedent(
    f"""
    import ctypes, resource, sys, threading
    from shoal.workers.host_memory import retain_freed_memory
    mode, where, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "retain":
        assert retain_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = {SIZE_MB} * 2**20

    def rounds():
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            blocks = [libc.malloc(size) for _ in range(count)]
            for block in blocks:
                ctypes.memset(block, 1, size)
            for block in reversed(blocks):
                libc.free(block)
            print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    if where == "thread":
        thread = threading.Thread(target=rounds)
        thread.start()
        thread.join()
    else:
        rounds()
    """
)
PAGES = SIZE_MB * 2**20 // 4096


def _faults(mode: str, where: str = "main", blocks: int = 1) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode, where, str(blocks)],
        capture_output=True,
        text=True,
        timeout=60,
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


def test_a_thread_keeps_its_freed_heaps() -> None:
    """Five blocks of 20 MiB fill two of a thread arena's 64 MiB heaps; glibc unmaps the
    second once it is wholly free unless the top pad keeps it (``workers.host_memory``)."""
    retained = _faults("retain", "thread", blocks=5)
    default = _faults("default", "thread", blocks=5)
    assert retained[0] > 4 * PAGES and max(retained[1:]) < PAGES // 10, (retained, default)
    # Without it, each round maps the second heap afresh (and the blocks past the default
    # mmap threshold are mapped per use).
    assert min(default[1:]) > PAGES, (retained, default)


def test_retaining_twice_answers_the_first_time() -> None:
    from shoal.workers.host_memory import retain_freed_memory

    assert retain_freed_memory() is retain_freed_memory()
