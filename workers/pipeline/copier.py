"""A worker's in-memory copies of its own blocks, taken beside training, not in its way.

At a step boundary ``Copier.start`` takes every block's state as it is then into fresh host
memory, and returns at once; the next step's forwards and backwards run while the copy is
made. Only a block's optimizer step must wait for that block's copy (``guard``), since it
is the first thing to change the block's parameters and optimizer state: so the copy is
exactly the boundary's state. What the forward pass changes itself (a module's buffers,
such as batch-norm statistics) is copied before ``start`` returns; it is small.

- Blocks on a CUDA device (where they are as the copy starts: a SHARP shard moves between
  the GPU and host memory) are copied on a side stream into pinned host memory, one event per
  block; ``guard`` makes the compute stream wait for the block's event, so the host never
  waits for it. Pinning host memory takes longer than a step (hundreds of megabytes:
  ~0.1 s), so a copy that needs more than is pinned pins what all the copies alive at once
  need (the kept ones, the one being made among them) and hands it to torch's caching host
  allocator, which the copies after reuse: never pinned afresh. That is
  the first copy, and the first after the state grew: a job's first copy, at step 0, is
  taken before its optimizer has any state (Adam's moments appear with the first step).
- Blocks on the CPU (a CPU device's, or a SHARP shard demoted to host memory) are copied
  by a background thread; ``guard`` waits for the block's part of it. That thread's CPU
  time is the device's own time (a CPU device is its cores), and so is that of the thread
  that ships and holds copies (``count_thread``): it is reported (``take_busy``) and booked
  as the copies' cost.

The last ``generations`` copies started are kept, the one being made among them (the
oldest goes as a new one starts); ``result`` waits for one to complete.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from shoal.workers.blocks import map_tensors, tensors_in
from shoal.workers.pipeline.pieces import piece_of

_CUDA: Any = torch.cuda  # torch's stubs leave Stream and Event untyped


class Copyable(Protocol):
    """What a copy is taken of: a block (``Block``), or a sharded replica's share of one
    (``BlockShard``)."""

    @property
    def index(self) -> int: ...

    @property
    def module(self) -> nn.Module: ...

    def live_state(self) -> dict[str, Any]: ...


class CopyDropped(RuntimeError):
    """The copy waited for was dropped (its worker rolled back or changed its blocks)."""


class _BlockCopy(Protocol):
    def guard(self) -> None:
        """Order the block's next change after its copy."""

    def result(self) -> Any:
        """The block's state on the host, once the copy is complete."""


@dataclass(frozen=True)
class _ThreadCopy:
    future: Future[Any]

    def guard(self) -> None:
        self.future.result()

    def result(self) -> Any:
        return self.future.result()


@dataclass(frozen=True)
class _StreamCopy:
    state: Any
    event: Any  # torch.cuda.Event: torch's stubs leave it untyped

    def guard(self) -> None:
        torch.cuda.current_stream(self.event.device).wait_event(self.event)

    def result(self) -> Any:
        self.event.synchronize()
        return self.state


@dataclass
class _Copy:
    step: int
    number: int
    blocks: dict[int, _BlockCopy] = field(default_factory=dict)
    pieces: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Each block's piece, ``(rank, world)`` (``workers.pipeline.pieces``)."""


class Copier:
    """The copies of one worker's blocks on ``device``: the last ``generations`` started
    kept."""

    def __init__(self, device: torch.device, generations: int) -> None:
        self._kept: deque[_Copy] = deque(maxlen=generations)
        self._changed = threading.Condition()
        self._started = 0
        """The number of the latest copy started (``start``'s ``number``)."""
        self._threads = ThreadClock()
        """The thread beside training that ships and holds copies."""
        self._copying_s = 0.0
        """The copying thread's CPU seconds, measured around each copy (its exact cost)."""
        self._training: int | None = None
        """The thread that starts copies (and trains): its time is booked as it goes."""
        self._unguarded: dict[int, _BlockCopy] = {}
        """Each block's latest copy its next change has not been ordered after yet."""
        self._stream: Any = _CUDA.Stream(device) if device.type == "cuda" else None
        """The side stream copies of blocks on a GPU run on (made at the first such copy
        where the blocks moved there after the copier was made: a SHARP shard's)."""
        self._ready: Counter[int] = Counter()
        """One copy's host tensors by the allocator's size class, that pinned memory was
        made ready for, for every copy alive at once (CUDA; ``_pin``)."""
        self._thread: ThreadPoolExecutor | None = None

    def reserve(self, blocks: Sequence[Copyable]) -> None:
        """Make ready the host memory a copy of ``blocks`` needs (CUDA: pin what is not
        pinned yet; a one-off, not each copy's cost, so it is kept out of the time a copy
        is measured to take). ``start`` does it too where it was not done."""
        self._pin([b.live_state() for b in blocks])  # nothing to pin for blocks on a CPU

    @property
    def copying(self) -> bool:
        """Whether this worker takes copies: one was started here."""
        return self._started > 0

    def start(self, step: int, number: int, blocks: Sequence[Copyable]) -> None:
        """Start copy ``number`` (rising from 1 with each copy the runner asks for): of
        ``blocks`` as they are after ``step`` steps; returns at once."""
        self._training = threading.get_ident()
        copy = _Copy(step, number)
        with self._changed:  # the oldest goes first: its host memory serves the new one
            while len(self._kept) >= (self._kept.maxlen or 0):
                self._kept.popleft()
        try:
            self._begin(copy, blocks)
            self._unguarded.update(copy.blocks)
        finally:  # a copy that failed to start counts as started and dropped
            with self._changed:
                if len(copy.blocks) == len(blocks):
                    self._kept.append(copy)
                self._started = max(self._started, number)
                self._changed.notify_all()

    def _begin(self, copy: _Copy, blocks: Sequence[Copyable]) -> None:
        live = [(b.index, forward_changes_copied(b)) for b in blocks]
        copy.pieces.update((index, piece_of(state)) for index, state in live)
        gpu = next((t.device for _, s in live for t in tensors_in(s) if t.is_cuda), None)
        if gpu is not None:
            self._pin([state for _, state in live])
            if self._stream is None:
                self._stream = _CUDA.Stream(gpu)
            self._stream.wait_stream(torch.cuda.current_stream(gpu))
            with torch.cuda.stream(self._stream):
                for index, state in live:
                    host = map_tensors(state, self._to_pinned)
                    event = _CUDA.Event()
                    event.record(self._stream)
                    copy.blocks[index] = _StreamCopy(host, event)
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-copy")
        for index, state in live:
            copy.blocks[index] = _ThreadCopy(self._thread.submit(self._copy, state))

    def skip(self, number: int) -> None:
        """Copy ``number`` will not be made: a ``wait_for`` it raises ``CopyDropped``."""
        with self._changed:
            self._started = max(self._started, number)
            self._changed.notify_all()

    def pending(self, index: int) -> bool:
        """Whether block ``index`` has a copy its next change must be ordered after."""
        return index in self._unguarded

    def guard(self, index: int) -> None:
        """Before block ``index`` changes: order that after its copies (a copy started
        later than an earlier one completes later: the thread and the stream are FIFO)."""
        copy = self._unguarded.pop(index, None)
        if copy is not None:
            copy.guard()

    def settle(self) -> None:
        """Wait until every kept copy is complete (before the blocks change otherwise)."""
        for copy in list(self._kept):
            for block in copy.blocks.values():
                block.result()

    def steps(self) -> list[tuple[int, list[tuple[int, int, int]]]]:
        """The kept copies: each one's step and its blocks' pieces, ``(block, rank,
        world)``."""
        return [
            (copy.step, [(i, *copy.pieces[i]) for i in sorted(copy.blocks)]) for copy in self._kept
        ]

    def result(self, step: int) -> dict[int, Any] | None:
        """The blocks' host states of the copy of ``step``, once complete; None if none
        is kept."""
        copy = next((c for c in self._kept if c.step == step), None)
        if copy is None:
            return None
        return {index: block.result() for index, block in copy.blocks.items()}

    def wait_for(self, number: int, timeout: float) -> tuple[int, dict[int, Any]]:
        """Copy ``number``'s step and blocks' host states, once complete, waiting up to
        ``timeout`` seconds for it to start (a call from another thread may come before
        the ``start`` it follows). A copy started and no longer kept (dropped by ``clear``,
        or the oldest kept as a later one started) raises ``CopyDropped`` at once."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._started < number:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"copy {number} did not start within {timeout:g} s")
                self._changed.wait(left)
            copy = next((c for c in self._kept if c.number == number), None)
        if copy is None:
            raise CopyDropped(f"copy {number} was dropped: the worker moved on")
        return copy.step, {index: block.result() for index, block in copy.blocks.items()}

    def release(self, number: int) -> None:
        """Drop the copies up to ``number`` (delivered elsewhere: the host need not keep
        them); the copies a block's next change is ordered after stay so."""
        with self._changed:
            kept = [c for c in self._kept if c.number > number]
            self._kept.clear()
            self._kept.extend(kept)

    def clear(self) -> None:
        """Drop every copy (once complete): they are of a state that no longer runs."""
        self.settle()
        self._unguarded.clear()
        self._ready.clear()  # the next blocks may differ
        with self._changed:
            self._kept.clear()

    def close(self) -> None:
        """No more copies (the blocks are forgotten): the copying thread ends once the
        copies under way are made."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)

    def count_thread(self) -> None:
        """Count the calling thread's CPU time as the copies' from now on (the thread that
        ships and holds them), unless it is the thread that trains (an in-process group)."""
        if threading.get_ident() != self._training:
            self._threads.join()

    def take_busy(self) -> float:
        """The CPU seconds the copies' threads spent since the last call (CPU devices)."""
        with self._changed:
            copying, self._copying_s = self._copying_s, 0.0
        return copying + self._threads.take()

    def _copy(self, state: Any) -> Any:
        started = time.thread_time()
        host = map_tensors(state, _host_copy)
        with self._changed:  # before the copy is complete: booked with the step that waits
            self._copying_s += time.thread_time() - started
        return host

    def _pin(self, states: list[Any]) -> None:
        """Make torch's caching host allocator hold pinned blocks for every copy alive at
        once of ``states`` (the kept ones, the one being made among them), when they need
        more than it was made to hold: request at once what the kept copies do not already
        hold, and free it into the allocator's cache, where the copies'
        ``torch.empty(pin_memory=True)`` find it. Counted by the allocator's size classes:
        the requests it serves from blocks it had cached count too, so a copy after this
        never pins."""
        needs = _size_classes(t for t in tensors_in(states) if t.device.type != "cpu")
        if needs <= self._ready:
            return
        alive = self._kept.maxlen or 0
        held = _size_classes(
            t
            for copy in self._kept
            for block in copy.blocks.values()
            if isinstance(block, _StreamCopy)
            for t in tensors_in(block.state)
            if t.is_pinned()  # not the small CPU tensors copied as they are
        )
        wanted = Counter({size: alive * count for size, count in needs.items()}) - held
        spare = [
            torch.empty(size, dtype=torch.uint8, pin_memory=True)
            for size, count in wanted.items()
            for _ in range(count)
        ]
        del spare
        self._ready = needs

    def _to_pinned(self, tensor: Tensor) -> Tensor:
        if tensor.device.type == "cpu":  # such as Adam's step counts: tiny, copied now
            return tensor.clone()
        host = _pinned_like(tensor)
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)
        return host


def _size_classes(tensors: Iterable[Tensor]) -> Counter[int]:
    """How many of ``tensors`` fall in each of torch's caching host allocator's size
    classes: it rounds every request up to a power of two, and serves it from any cached
    block of that size."""
    return Counter(1 << max(t.nbytes - 1, 0).bit_length() for t in tensors)


def _pinned_like(tensor: Tensor) -> Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


class ThreadClock:
    """The CPU seconds a set of threads spend, each counted from when it joins."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()

    def join(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            if ident not in self._last:
                self._last[ident] = time.thread_time()

    def take(self) -> float:
        """Their CPU seconds since the last ``take`` (or since they joined)."""
        spent = 0.0
        with self._lock:
            for ident, last in list(self._last.items()):
                try:
                    now = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except OSError:  # the thread has ended
                    del self._last[ident]
                    continue
                spent += now - last
                self._last[ident] = now
        return spent


def _host_copy(tensor: Tensor) -> Tensor:
    return tensor.to("cpu", copy=True)


def forward_changes_copied(block: Copyable) -> dict[str, Any]:
    """The block's live state (``Copyable.live_state``) with what a forward pass changes in
    place, its module's buffers, already copied to the host."""
    state = block.live_state()
    buffers = {name for name, _ in block.module.named_buffers()}
    state["module"] = {
        name: _host_copy(value) if name in buffers else value
        for name, value in state["module"].items()
    }
    return state


class Held:
    """The copies a worker holds for other workers (its buddies' ``shipment``s), by owner:
    the last ``generations`` of each, as they came. Kept from the calls beside training
    while training calls read them, hence the lock."""

    def __init__(self, generations: int = 2) -> None:
        self._generations = generations
        self._by_owner: dict[str, deque[tuple[int, dict[int, Any]]]] = {}
        self._lock = threading.Lock()

    def keep(self, owner: str, step: int, states: dict[int, Any]) -> None:
        with self._lock:
            kept = self._by_owner.setdefault(owner, deque(maxlen=self._generations))
            kept.append((step, states))

    def steps(self) -> dict[str, dict[int, list[tuple[int, int, int]]]]:
        """Each owner's held steps and their blocks' pieces, ``(block, rank, world)``."""
        with self._lock:
            return {
                owner: {
                    step: [(i, *piece_of(states[i])) for i in sorted(states)]
                    for step, states in kept
                }
                for owner, kept in self._by_owner.items()
            }

    def get(self, owner: str, step: int) -> dict[int, Any] | None:
        with self._lock:
            return dict(self._by_owner.get(owner, ())).get(step)

    def clear(self) -> None:
        with self._lock:
            self._by_owner.clear()
