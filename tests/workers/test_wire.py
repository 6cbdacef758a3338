"""The wire format: every bit of every dtype arrives, as a fresh tensor the stage may write."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.workers.wire import Bits, receive, receive_tree, send, send_tree

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


def test_a_blocks_state_travels_as_arrays_and_arrives_bitwise_with_its_versions() -> None:
    from shoal.workers.blocks import Block
    from shoal.workers.snapshot import OptimizerConf

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    block = Block(0, module, OptimizerConf("adamw", 0.01))
    module(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    block.step()  # Adam's moments and 0-d step counts join the state
    state = block.state()
    shipped = _through_pickle(send_tree(state))
    # On the wire every tensor is an array: what Ray moves zero-copy.
    wired = [shipped["module"][k] for k in state["module"]]
    assert all(isinstance(v, np.ndarray | Bits) for v in wired)
    back = receive_tree(shipped, CPU)
    raw = module.state_dict()  # a module's own state dict carries its versions
    assert receive_tree(_through_pickle(send_tree(raw)), CPU)._metadata == raw._metadata
    for key, value in state["module"].items():
        assert back["module"][key].dtype == value.dtype
        assert torch.equal(back["module"][key].view(torch.int16), value.view(torch.int16))
    for index, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(back["optimizer"]["state"][index][name], value), name
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    Block(
        0,
        torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16),
        OptimizerConf("adamw", 0.01),
    ).load(back)  # loads as the state itself would
