"""The wire format: every bit of every dtype arrives, as a fresh tensor the stage may write."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from workers.wire import Bits, receive, send

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def _through_pickle(value: object) -> object:
    # What Ray does: protocol 5, buffers out of band.
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), cols=st.integers(1, 7))
def test_a_tensor_arrives_bitwise_equal(
    dtype: torch.dtype, seed: int, rows: int, cols: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    got = receive(_through_pickle(send(tensor)), CPU)  # type: ignore[arg-type]
    assert got.dtype == dtype
    assert got.shape == tensor.shape
    assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


def test_dtypes_numpy_lacks_travel_as_bits_and_others_as_plain_arrays() -> None:
    assert isinstance(send(torch.ones(2, dtype=torch.bfloat16)), Bits)
    assert isinstance(send(torch.ones(2)), np.ndarray)


def test_a_sent_tensor_leaves_autograd_behind() -> None:
    x = torch.ones(3, requires_grad=True)
    got = receive(send(x * 2), CPU)
    assert not got.requires_grad
    assert got.grad_fn is None


def test_a_read_only_array_arrives_as_a_writable_copy() -> None:
    array = np.arange(6, dtype=np.float32)
    array.setflags(write=False)  # as arrays out of Ray's shared-memory object store are
    got = receive(array, CPU)
    got.add_(1)  # an in-place op on a stage input must not touch the store
    assert array.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_row_slice_ships_only_its_rows() -> None:
    batch = torch.zeros(1000, 100)
    buffers: list[pickle.PickleBuffer] = []
    pickle.dumps(send(batch[10:12]), protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) == 2 * 100 * 4
