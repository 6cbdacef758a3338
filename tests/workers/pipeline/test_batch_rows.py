"""A stage draws its rows of a step's batch itself: exactly those the runner would send."""

from __future__ import annotations

import pytest
import torch

from shoal.workers.pipeline.batch_rows import Draws, Rows
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.snapshot import DataRef
from shoal.workers.zoo.data import make_data
from tests.factories import ADAM, MLP, REGRESSION, TOKENS


def drawing(data: DataRef | None, batch_size: int) -> Draws:
    meta = make_data(REGRESSION, 7).meta
    return Draws(StageSetup(MLP, meta, ADAM, 7, 3, data=data, batch_size=batch_size))


@pytest.mark.unit
@pytest.mark.parametrize("data", [REGRESSION, TOKENS])
def test_a_stage_draws_the_rows_the_runner_would_have_sent(data: DataRef) -> None:
    draws = drawing(data, 12)
    x, y = make_data(data, 7).batch(5, 12)
    first, last = draws.take(Rows(5, 4, 8), torch.device("cpu"), inputs=True, targets=False)
    assert last is None and first is not None and torch.equal(first, x[4:8])
    none, both = draws.take(Rows(5, 8, 12), torch.device("cpu"), inputs=False, targets=True)
    assert none is None and both is not None and torch.equal(both, y[8:12])
    assert both.dtype == y.dtype


@pytest.mark.unit
def test_a_middle_stage_draws_nothing_and_needs_no_data() -> None:
    assert drawing(None, 4).take(
        Rows(0, 0, 4), torch.device("cpu"), inputs=False, targets=False
    ) == (
        None,
        None,
    )
    with pytest.raises(ValueError, match="without the job's data"):
        drawing(None, 4).take(Rows(0, 0, 4), torch.device("cpu"), inputs=True, targets=False)


@pytest.mark.unit
@pytest.mark.parametrize("rows", [Rows(0, 8, 16), Rows(0, 4, 4), Rows(0, -1, 4)])
def test_rows_outside_the_batch_are_refused_with_its_size(rows: Rows) -> None:
    draws = drawing(REGRESSION, 8)
    with pytest.raises(ValueError, match="it has 8 rows"):
        draws.take(rows, torch.device("cpu"), inputs=True, targets=True)
