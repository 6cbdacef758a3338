"""In-memory copies made beside training: exactly the boundary's state, however late the
copy runs; waited for only by the change it must precede."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from shoal.workers.blocks import Block
from shoal.workers.pipeline.copier import Copier, CopyDropped, Held
from shoal.workers.snapshot import OptimizerConf

pytestmark = pytest.mark.unit

ADAM = OptimizerConf("adam", 0.01)


class LateCopier(Copier):
    """A Copier whose thread makes no copy until ``gate`` opens: whatever changes a block
    meanwhile shows in the copy unless ``guard`` holds it back."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), 3)
        self.gate = threading.Event()

    def _copy(self, state: Any) -> Any:
        self.gate.wait(timeout=30.0)
        return super()._copy(state)

    def open_soon(self) -> None:
        threading.Timer(0.2, self.gate.set).start()


def blocks() -> list[Block]:
    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Linear(8, 1)]
    return [Block(i, m, ADAM) for i, m in enumerate(modules)]


def forward_backward(chain: list[Block], seed: int, device: str = "cpu") -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed)).to(device)
    for block in chain:
        x = block.module(x)
    x.pow(2).mean().backward()  # type: ignore[no-untyped-call]


def train_step(chain: list[Block], copier: Copier, seed: int, device: str = "cpu") -> None:
    """A step as a stage runs it: forwards and backwards, then each block's update after
    its copy."""
    forward_backward(chain, seed, device)
    for block in chain:
        copier.guard(block.index)
        block.step()


def assert_states_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_states_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_states_equal(x, y)
    else:
        assert a == b


def test_a_copy_is_the_boundary_state_though_the_next_step_runs_before_it_is_made() -> None:
    chain, copier = blocks(), LateCopier()
    copier.gate.set()
    train_step(chain, copier, seed=0)  # Adam's state exists from here on
    copier.gate.clear()
    boundary = {b.index: b.state() for b in chain}
    copier.start(1, 1, chain)  # returns with the copy not made
    # The next step's forward (which moves the batch-norm statistics) and its updates,
    # the copy made 0.2 s later.
    copier.open_soon()
    train_step(chain, copier, seed=1)
    copied = copier.result(1)
    assert copied is not None
    for block in chain:
        assert_states_equal(copied[block.index], boundary[block.index])
    assert not torch.equal(
        chain[0].state()["module"]["1.running_mean"], boundary[0]["module"]["1.running_mean"]
    )
    # The step's updates waited for the copy, and only they: the copy's thread time is the
    # copy's cost, booked once.
    assert copier.take_busy() > 0 and copier.take_busy() == 0.0


def test_only_the_change_after_a_copy_waits_for_it() -> None:
    chain, copier = blocks(), LateCopier()
    copier.start(0, 1, chain)
    assert copier.pending(0) and copier.pending(1)
    forward_backward(chain, seed=0)  # forwards and backwards run with the copy not made
    assert not copier.gate.is_set()
    copier.open_soon()
    copier.guard(0)
    assert copier.gate.is_set()
    assert not copier.pending(0) and copier.pending(1)


def test_the_last_copies_started_are_kept_and_a_rollback_restores_each_exactly() -> None:
    chain, copier = blocks(), Copier(torch.device("cpu"), 3)
    states = {}
    for step in range(4):
        copier.start(step, step + 1, chain)
        states[step] = {b.index: b.state() for b in chain}
        train_step(chain, copier, seed=step)
    assert [s for s, _ in copier.steps()] == [1, 2, 3]
    assert copier.result(0) is None
    for step in (3, 1, 2):
        copied = copier.result(step)
        assert copied is not None
        for block in chain:
            block.load(copied[block.index])
            assert_states_equal(block.state(), states[step][block.index])


def test_a_shipment_waits_for_its_copy_to_start_and_gives_up_at_once_if_it_was_dropped() -> None:
    chain, copier = blocks(), Copier(torch.device("cpu"), 3)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(copier.wait_for(1, timeout=30.0)))
    waiter.start()
    time.sleep(0.1)  # the call beside training came first
    expected = {b.index: b.state() for b in chain}
    copier.start(4, 1, chain)
    waiter.join(timeout=30.0)
    assert len(got) == 1 and got[0][0] == 4
    for index, state in got[0][1].items():
        assert_states_equal(state, expected[index])
    # Copy 2 started, then the worker moved on (new blocks, a rollback) before its
    # shipment came: the shipment fails at once instead of waiting for a copy to come.
    copier.start(5, 2, chain)
    copier.clear()
    started = time.monotonic()
    with pytest.raises(CopyDropped, match="copy 2 was dropped"):
        copier.wait_for(2, timeout=30.0)
    assert time.monotonic() - started < 10.0  # not the 30 s it would wait for a copy
    assert copier.steps() == []
    with pytest.raises(TimeoutError, match=r"copy 3 did not start within 0\.1 s"):
        copier.wait_for(3, timeout=0.1)


def test_held_copies_keep_the_last_two_steps_of_each_owner_and_say_their_pieces() -> None:
    held = Held(2)
    for step in range(3):
        held.keep("dev-a", step, {0: {"module": step}, 1: {"module": step}})
    held.keep("dev-b", 2, {2: {"module": 2, "slice": {"rank": 1, "world": 3}}})
    assert held.steps() == {
        "dev-a": {1: [(0, 0, 1), (1, 0, 1)], 2: [(0, 0, 1), (1, 0, 1)]},
        "dev-b": {2: [(2, 1, 3)]},
    }
    assert held.get("dev-a", 1) == {0: {"module": 1}, 1: {"module": 1}}
    assert held.get("dev-a", 0) is None and held.get("dev-c", 2) is None
    held.clear()
    assert held.steps() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_copy_is_the_boundary_state_and_lands_in_pinned_memory() -> None:
    chain, copier = blocks(), Copier(torch.device("cuda"), 3)
    for block in chain:
        block.to(torch.device("cuda"))
    train_step(chain, copier, 0, "cuda")
    boundary = {b.index: b.state() for b in chain}
    copier.start(1, 1, chain)
    train_step(chain, copier, 1, "cuda")
    copied = copier.result(1)
    assert copied is not None
    for block in chain:
        assert_states_equal(copied[block.index], boundary[block.index])
    assert copied[1]["module"]["weight"].is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_pin_host_memory_only_when_the_state_grows() -> None:
    """A job's first copy comes before its optimizer has state; the copy after Adam's
    moments appear pins for them, and every copy after that reuses pinned memory."""
    chain, copier = blocks(), Copier(torch.device("cuda"), 3)
    for block in chain:
        block.to(torch.device("cuda"))

    def pinned_allocations() -> int:
        return int(torch.cuda.host_memory_stats()["num_host_alloc"])

    copier.start(0, 1, chain)  # no optimizer state yet
    train_step(chain, copier, 0, "cuda")
    copier.start(1, 2, chain)  # the moments appeared: pinned now
    settled = pinned_allocations()
    for step in range(2, 8):
        train_step(chain, copier, step, "cuda")
        copier.start(step, step + 1, chain)
    copier.settle()
    assert pinned_allocations() == settled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_copy_runs_beside_the_compute_stream() -> None:
    """A copy of ~0.8 GB (four 4096x4096 blocks with Adam's moments) runs on the side
    stream: work queued on the compute stream after it started is done within the first
    half of the copy's time (on the compute stream it would end with the copy), and the
    copy is the state it started from."""
    gpu = torch.device("cuda")
    torch.manual_seed(0)
    chain = [Block(i, nn.Linear(4096, 4096), ADAM) for i in range(4)]
    copier = Copier(gpu, 2)
    for block in chain:
        block.to(gpu)

    def step() -> None:
        x = torch.randn(64, 4096, device=gpu)
        for block in chain:
            x = block.module(x)
        x.pow(2).mean().backward()  # type: ignore[no-untyped-call]
        for block in chain:
            copier.guard(block.index)
            block.step()

    step()
    copier.start(1, 1, chain)  # pins the host memory the next copies reuse
    copier.settle()
    step()
    boundary = {b.index: b.state() for b in chain}
    # The marker's kernels loaded now: CUDA loads a kernel lazily, at its first launch, and
    # may synchronize the context to do so.
    torch.ones(1, device=gpu).add_(1)
    torch.cuda.synchronize()
    pinned = torch.cuda.host_memory_stats().get("num_host_alloc")
    started = time.perf_counter()
    copier.start(2, 2, chain)
    returned = time.perf_counter()
    torch.ones(1, device=gpu).add_(1)
    torch.cuda.current_stream(gpu).synchronize()
    computed = time.perf_counter()
    copier.settle()
    copied = time.perf_counter()
    state = (  # what tells a start that held the host from a compute stream that waited
        f"start returned after {returned - started:.4f} s (pinned host blocks made in it:"
        f" {pinned} -> {torch.cuda.host_memory_stats().get('num_host_alloc')}), the compute"
        f" was done after {computed - started:.4f} s, the copy after {copied - started:.4f} s"
    )
    assert computed - started < (copied - started) / 2, state
    result = copier.result(2)
    assert result is not None
    for block in chain:
        assert_states_equal(result[block.index], boundary[block.index])


def burn(cpu_s: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass


def test_the_threads_that_ship_and_hold_copies_count_as_their_cost_the_training_one_not() -> None:
    chain, copier = blocks(), Copier(torch.device("cpu"), 3)
    copier.start(0, 1, chain)  # from the training thread
    copier.settle()
    copier.take_busy()
    copier.count_thread()  # an in-process group ships from the training thread: not counted
    burn(0.2)
    assert copier.take_busy() < 0.1

    shipped, done = threading.Event(), threading.Event()

    def ship() -> None:  # the worker's thread beside training: it lives on
        copier.count_thread()
        burn(0.2)
        shipped.set()
        done.wait(timeout=30.0)

    beside = threading.Thread(target=ship)
    beside.start()
    assert shipped.wait(timeout=30.0)
    assert copier.take_busy() >= 0.2
    assert copier.take_busy() < 0.1  # counted once
    done.set()
    beside.join(timeout=30.0)
