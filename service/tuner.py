"""A sweep's search algorithm: an Optuna study driven by ask-and-tell, held in memory.

Optuna decides what to try (grid, random, TPE samplers) and what to stop early (successive
halving as ASHA, the median rule); Shoal does not reimplement either. Shoal's database stays
the record of a sweep: after a control-plane restart the study is rebuilt from the trials
table (``Tuner.restore``): finished trials are added as they ended, running ones are asked
again with their parameters fixed (``enqueue_trial``) and their objectives reported again.
Samplers are seeded with the sweep's seed; a rebuilt study samples on from a fresh seed state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from shoal.service.sweepspec import ParamSpec, ParamValue, SweepSpec, grid_values

Outcome = Literal["complete", "pruned", "failed"]
_STATES: dict[Outcome, TrialState] = {
    "complete": TrialState.COMPLETE,
    "pruned": TrialState.PRUNED,
    "failed": TrialState.FAIL,
}

optuna.logging.set_verbosity(logging.WARNING)


def distribution(param: ParamSpec) -> BaseDistribution:
    if param.choices is not None:
        return CategoricalDistribution(param.choices)
    low, high = float(param.low or 0.0), float(param.high or 0.0)
    if param.type == "int":
        return IntDistribution(int(low), int(high), step=param.step or 1)
    return FloatDistribution(low, high, log=param.type == "log_uniform")


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its end-of-grid ``study.stop()``: that call is made for
    ``study.optimize`` and raises under ask-and-tell once the last point is told. The
    sweeper ends a grid sweep itself, after as many trials as the grid has points."""

    def after_trial(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        return None


def _sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    if spec.algorithm == "grid":
        # Optuna lists every point: grid_values refuses a grid over MAX_GRID before that.
        return _GridSampler(grid_values(spec.space), seed=spec.seed)
    if spec.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    return optuna.samplers.TPESampler(seed=spec.seed)


def _pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    rule = spec.early_stopping
    if rule.rule == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=rule.min_steps, reduction_factor=rule.reduction_factor
        )
    if rule.rule == "median":
        return optuna.pruners.MedianPruner(n_warmup_steps=rule.min_steps)
    return optuna.pruners.NopPruner()


class Tuner:
    """One sweep's study. Trials are known by the sweep's own trial numbers."""

    def __init__(self, spec: SweepSpec) -> None:
        self._study = optuna.create_study(
            direction=spec.objective.direction, sampler=_sampler(spec), pruner=_pruner(spec)
        )
        self._space = {name: distribution(p) for name, p in spec.space.items()}
        self._live: dict[int, optuna.Trial] = {}

    def ask(self, number: int) -> dict[str, ParamValue]:
        """Sample the parameters of trial ``number``."""
        trial = self._study.ask(self._space)
        self._live[number] = trial
        return dict(trial.params)

    def restore(
        self,
        number: int,
        params: Mapping[str, Any],
        intermediate: Mapping[int, float],
        outcome: Outcome | None,
        value: float | None,
    ) -> None:
        """Bring back a trial the database knows: finished (``outcome``) or still running."""
        if outcome is not None:
            self._study.add_trial(
                optuna.trial.create_trial(
                    params=dict(params),
                    distributions=self._space,
                    value=value if outcome == "complete" else None,
                    intermediate_values=dict(intermediate),
                    state=_STATES[outcome],
                )
            )
            return
        self._study.enqueue_trial(dict(params))
        trial = self._study.ask(self._space)
        for step, reported in sorted(intermediate.items()):
            trial.report(reported, step)
        self._live[number] = trial

    def report(self, number: int, step: int, value: float) -> bool:
        """Record trial ``number``'s objective at ``step``; whether the pruner stops it."""
        trial = self._live[number]
        trial.report(value, step)
        return trial.should_prune()

    def tell(self, number: int, outcome: Outcome, value: float | None = None) -> None:
        trial = self._live.pop(number)
        if outcome == "complete":
            self._study.tell(trial, value)
        else:
            self._study.tell(trial, state=_STATES[outcome])
