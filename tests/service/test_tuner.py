"""A sweep's study run to exhaustion under ask-and-tell, for every algorithm: no call raises
once the search space is covered, a grid yields each of its points once, and random and TPE
draw what Optuna's samplers draw with the sweep's seed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna
import pytest

from shoal.service.sweepspec import SweepSpec
from shoal.service.tuner import Tuner, distribution
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


@pytest.mark.parametrize(
    ("algorithm", "sampler"),
    [("random", optuna.samplers.RandomSampler), ("tpe", optuna.samplers.TPESampler)],
)
def test_a_sweep_draws_what_optunas_sampler_draws_with_its_seed(
    algorithm: str, sampler: Callable[..., optuna.samplers.BaseSampler]
) -> None:
    """Past TPE's start-up trials too: the study learns from what the trials reported."""
    space = {"optimizer.lr": {"type": "log_uniform", "low": 0.001, "high": 0.5}}
    space |= SPACES["two dimensions"]
    spec = SweepSpec.model_validate(
        sweep_spec(algorithm=algorithm, space=space, max_trials=24, seed=5)
    )
    drawn = run_to_exhaustion(spec, 24)
    study = optuna.create_study(direction="minimize", sampler=sampler(seed=5))
    space_of = {name: distribution(param) for name, param in spec.space.items()}
    plain = []
    for number in range(24):  # told as run_to_exhaustion tells them
        trial = study.ask(space_of)
        plain.append(trial.params)
        trial.report(1.0 / (number + 1), 5)
        if number % 3:
            study.tell(trial, 1.0 / (number + 1))
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert drawn == plain
    other = SweepSpec.model_validate({**sweep_spec(algorithm=algorithm, space=space), "seed": 6})
    assert run_to_exhaustion(other, 24) != drawn  # the seed is the sweep's
