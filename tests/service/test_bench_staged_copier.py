"""The staged candidate copier of ``shoal bench copier --copier staged``: how it packs a
state into chunks, and that its copy holds the boundary's state bit for bit (on a CPU
device, where it copies at once; on a GPU, marked ``gpu``, beside the next steps on its
side stream)."""

from __future__ import annotations

import pytest
import torch

from shoal.service.bench.plain_loop import PlainLoop
from shoal.service.bench.staged_copier import Chunk, Place, StagedCopier, pack
from shoal.service.bench.step_settings import StepSettings
from shoal.workers.blocks import tensors_in
from tests.workers.runs import assert_same_state

pytestmark = pytest.mark.unit

F32, F64 = torch.float32, torch.float64


def test_each_dtype_fills_chunks_in_order_and_a_larger_tensor_goes_alone() -> None:
    tensors = [
        torch.zeros(3),  # 12 bytes
        torch.zeros(2, dtype=F64),  # 16
        torch.zeros(4),  # 16: 28 of float32 so far
        torch.zeros(10),  # 40: larger than a chunk
        torch.zeros(1, dtype=F64),  # 8: 24 of float64
        torch.zeros(2),  # 8: past 32, so float32's first chunk closes
    ]
    chunks, places = pack(tensors, chunk_bytes=32)
    assert chunks == [
        Chunk(F32, (3,), 10, staged=False),
        Chunk(F32, (0, 2), 7, staged=True),
        Chunk(F64, (1, 4), 3, staged=True),  # the chunks left open, as they were last opened
        Chunk(F32, (5,), 2, staged=True),
    ]
    assert places == {
        3: Place(0, 0),
        0: Place(1, 0),
        2: Place(1, 3),
        1: Place(2, 0),
        4: Place(2, 2),
        5: Place(3, 0),
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_copy_holds_the_boundarys_state_while_the_next_steps_change_the_blocks(
    device: str,
) -> None:
    loop = PlainLoop(StepSettings(device=device, model="gpt", size="tiny"))
    copier = StagedCopier(loop.device, 3, chunk_bytes=4096)  # many chunks, some tensors alone
    copier.reserve(loop.blocks)
    for step in range(3):  # the first copy before AdamW has any state: the layout changes
        boundary = [b.state() for b in loop.blocks]
        copier.start(step, step + 1, loop.blocks)
        loop.step(step, copier.guard)
        copied = copier.latest()
        assert_same_state(copied, boundary)
        weight = next(iter(copied[0]["module"]))
        now = loop.blocks[0].state()["module"][weight]
        assert not torch.equal(copied[0]["module"][weight], now), "the step changed nothing"
    # Most tensors are views into a few chunks, not a buffer each.
    storages = {t.untyped_storage().data_ptr() for t in tensors_in(copied)}
    assert 1 < len(storages) < len(list(tensors_in(copied))) / 2, len(storages)
