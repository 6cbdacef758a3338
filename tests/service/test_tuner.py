"""A sweep's study run to exhaustion under ask-and-tell, for every algorithm: no call raises
once the search space is covered, and a grid yields each of its points once."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.service.sweepspec import SweepSpec
from shoal.service.tuner import Tuner
from tests.factories import sweep_spec

pytestmark = pytest.mark.unit

SPACES: dict[str, dict[str, Any]] = {
    "two points": {"batch_size": {"type": "categorical", "choices": [16, 32]}},
    "one point": {"batch_size": {"type": "categorical", "choices": [32]}},
    "int range": {"steps": {"type": "int", "low": 10, "high": 12}},
    "two dimensions": {
        "batch_size": {"type": "categorical", "choices": [16, 32]},
        "steps": {"type": "int", "low": 10, "high": 20, "step": 10},
    },
}


def run_to_exhaustion(spec: SweepSpec, trials: int) -> list[dict[str, Any]]:
    """Ask, report and tell ``trials`` trials one after another, as the sweeper does."""
    tuner = Tuner(spec)
    seen = []
    for number in range(trials):
        params = tuner.ask(number)
        tuner.report(number, 5, 1.0 / (number + 1))
        tuner.tell(number, "complete" if number % 3 else "failed", 1.0 / (number + 1))
        seen.append(params)
    return seen


@pytest.mark.parametrize("space", SPACES, ids=list(SPACES))
@pytest.mark.parametrize("algorithm", ["grid", "random", "tpe"])
def test_every_algorithm_runs_past_its_space_without_raising(algorithm: str, space: str) -> None:
    spec = SweepSpec.model_validate(
        sweep_spec(algorithm=algorithm, space=SPACES[space], max_trials=6)
    )
    seen = run_to_exhaustion(spec, 6)
    assert len(seen) == 6


@pytest.mark.parametrize("space", SPACES, ids=list(SPACES))
def test_a_grid_yields_each_of_its_points_once(space: str) -> None:
    spec = SweepSpec.model_validate(sweep_spec(algorithm="grid", space=SPACES[space]))
    points = 1
    for param in spec.space.values():
        values = param.grid()
        assert values is not None
        points *= len(values)
    seen = run_to_exhaustion(spec, points)
    assert len({tuple(sorted(p.items())) for p in seen}) == points


def test_a_restored_grid_study_finishes_without_raising() -> None:
    """After a control-plane restart the study is rebuilt from the trials table."""
    spec = SweepSpec.model_validate(
        sweep_spec(algorithm="grid", space=SPACES["two points"], max_trials=2)
    )
    tuner = Tuner(spec)
    tuner.restore(0, {"batch_size": 16}, {5: 0.5}, "complete", 0.5)
    tuner.restore(1, {"batch_size": 32}, {5: 0.4}, None, None)
    tuner.tell(1, "complete", 0.3)
