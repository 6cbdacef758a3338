"""A demoted shard's device tensors, kept for the next shard coming onto the device."""

import pytest
import torch

from shoal.workers.sharp.spares import Spares

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_a_kept_tensor_is_the_target_of_one_of_its_shape_and_dtype_and_of_no_other() -> None:
    spares = Spares()
    weight, bias = torch.ones(4, 8), torch.ones(8)
    spares.keep(weight)
    spares.keep(bias)
    assert spares.take(torch.empty(8), CPU) is bias
    assert spares.take(torch.empty(4, 8, dtype=torch.bfloat16), CPU) is not weight
    assert spares.take(torch.empty(8, 4), CPU) is not weight
    assert spares.take(torch.empty(4, 8), CPU) is weight
    again = spares.take(torch.empty(4, 8), CPU)  # each kept tensor is given once
    assert again is not weight and again.shape == (4, 8)


def test_what_nothing_took_is_let_go_with_the_release() -> None:
    spares = Spares()
    kept = torch.ones(3)
    spares.keep(kept)
    spares.release()
    made = spares.take(torch.empty(3), CPU)
    assert made is not kept and made.shape == (3,)
