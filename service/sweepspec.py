"""The sweep contract: ``SweepSpec`` (a base job, a search space, an algorithm, early stopping),
validated once, and ``trial_spec``, which turns one trial's parameters into its job's spec.

A search space maps dotted field paths of the base job (``optimizer.lr``,
``model.config.hidden``, ``batch_size``) to a distribution. Validation applies each
distribution's extremes (and each categorical choice) to the base job and validates the
result as a job, so a space that could produce an invalid trial is refused at submission,
with the error under ``space.<path>``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from shoal.scheduler.sharp import ShardError, shard_model
from shoal.service.spec_errors import SpecError, pydantic_errors
from shoal.service.specs import (
    MAX_DEVICES,
    MAX_NAME,
    AcceptedSpec,
    JobSpec,
    StrictModel,
    check_memory,
    check_name,
)
from shoal.service.specs import validate_job_spec as _validate_job
from shoal.service.traces import CodeRunner

MAX_PARAMS = 16
MAX_CHOICES = 32
MAX_TRIALS = 1000
MAX_GRID = 10_000
MAX_CHECKED_BLOCKS = 8_192
"""A sweep's check validates a job per value of its space (each traced, each cut into
shards: work that grows with the blocks); this bounds the blocks of all of them at once."""
ParamValue = float | int | str | bool
MAX_SWEEP_NAME = MAX_NAME - len(f"-{MAX_TRIALS - 1}")
"""Room for the trials' suffix: every trial's job name (``trial_name``) is a valid job name."""


def trial_name(sweep: str, number: int) -> str:
    """The job name of a sweep's trial ``number``."""
    return f"{sweep}-{number}"


class ParamSpec(StrictModel):
    """One dimension of the search space."""

    type: Literal["uniform", "log_uniform", "int", "categorical"]
    low: float | None = Field(None, allow_inf_nan=False)
    high: float | None = Field(None, allow_inf_nan=False)
    step: int | None = Field(None, ge=1, description="int only: the grid's spacing")
    choices: list[ParamValue] | None = Field(None, min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="after")
    def _complete(self) -> ParamSpec:
        if self.type == "categorical":
            if self.choices is None or self.low is not None or self.high is not None:
                raise ValueError("a categorical parameter takes 'choices' (and no low/high)")
            return self
        if self.choices is not None or self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter takes 'low' and 'high' (and no choices)")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.type == "log_uniform" and self.low <= 0:
            raise ValueError(f"log_uniform needs low > 0, got {self.low:g}")
        if self.type == "int" and not (self.low.is_integer() and self.high.is_integer()):
            raise ValueError("an int parameter needs whole numbers for low and high")
        if self.step is not None and self.type != "int":
            raise ValueError("step applies to int parameters only")
        return self

    def extremes(self) -> list[ParamValue]:
        """The values that bound what a trial may get: low and high, or every choice."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None  # checked in _complete
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]

    def grid_length(self) -> int | None:
        """How many values a finite dimension (categorical, int) has, counted without listing
        them (an int range may be as wide as a seed's); None for continuous ones."""
        if self.choices is not None:
            return len(self.choices)
        if self.type != "int":
            return None
        assert self.low is not None and self.high is not None
        return (int(self.high) - int(self.low)) // (self.step or 1) + 1

    def grid(self) -> list[ParamValue] | None:
        """Every value of a finite dimension (categorical, int); None for continuous ones.
        Raises ``ValueError`` rather than list more than ``MAX_GRID`` values."""
        length = self.grid_length()
        if length is None:
            return None
        if length > MAX_GRID:
            raise ValueError(f"{length} grid values are more than {MAX_GRID}")
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None
        return list(range(int(self.low), int(self.high) + 1, self.step or 1))


class ObjectiveSpec(StrictModel):
    metric: Literal["loss"] = Field(
        "loss", description="the training loss: the metric every job reports each step"
    )
    direction: Literal["minimize", "maximize"] = "minimize"
    every_steps: int = Field(
        10, ge=1, le=1_000_000, description="report the objective to the pruner this often"
    )


class EarlyStoppingSpec(StrictModel):
    """Pruning rules from Optuna: asynchronous successive halving (ASHA) or the median rule."""

    rule: Literal["none", "asha", "median"] = "asha"
    min_steps: int = Field(
        10, ge=1, le=1_000_000, description="ASHA's minimum resource; the median rule's warm-up"
    )
    reduction_factor: int = Field(3, ge=2, le=10, description="ASHA: keep 1 in this many")


class RetentionSpec(StrictModel):
    keep_best: int = Field(
        3, ge=0, le=MAX_TRIALS, description="trials whose checkpoints are kept; others' deleted"
    )


class SweepSpec(StrictModel):
    name: str = Field(
        ...,
        max_length=MAX_SWEEP_NAME,
        description=f"at most {MAX_SWEEP_NAME} characters: trial n's job is named <name>-<n>",
    )
    base: JobSpec
    space: dict[str, ParamSpec] = Field(..., min_length=1, max_length=MAX_PARAMS)
    algorithm: Literal["grid", "random", "tpe"] = "tpe"
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the sampler's seed")
    max_trials: int = Field(16, ge=1, le=MAX_TRIALS)
    max_concurrent: int = Field(4, ge=1, le=64)
    executor: Literal["sharp", "jobs"] = Field(
        "sharp",
        description="sharp: the running trials share `devices` devices, their shards taking"
        " turns (Hydra's shard alternation); jobs: each trial is placed as a job of its own",
    )
    devices: int = Field(2, ge=1, le=MAX_DEVICES, description="sharp: the devices trials share")
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    early_stopping: EarlyStoppingSpec = Field(default_factory=EarlyStoppingSpec)
    retention: RetentionSpec = Field(default_factory=RetentionSpec)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value, MAX_SWEEP_NAME)

    @field_validator("space")
    @classmethod
    def _paths(cls, space: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
        for path in space:
            parts = path.split(".")
            if not all(p.isidentifier() for p in parts) or parts[0] == "name":
                raise ValueError(
                    f"{path!r} is not a field path of the base job; use dotted names such as"
                    " optimizer.lr or model.config.hidden"
                )
        return space


def grid_points(space: Mapping[str, ParamSpec]) -> int:
    """How many points a grid over ``space`` has, by arithmetic: the product of its
    dimensions' lengths (a continuous dimension has no grid: 0)."""
    return math.prod(param.grid_length() or 0 for param in space.values())


def grid_values(space: Mapping[str, ParamSpec]) -> dict[str, list[ParamValue]]:
    """Every dimension's values, for a grid sampler. A grid of more than ``MAX_GRID`` points
    raises ``ValueError`` before any value is listed (a sampler lists every point)."""
    points = grid_points(space)
    if points > MAX_GRID:
        raise ValueError(f"the grid has {_count(points)} points, more than {MAX_GRID}")
    return {path: param.grid() or [] for path, param in space.items()}


def _count(number: int) -> str:
    """A count for a message: in full, or its order of magnitude when it would be a wall of
    digits (an int range may span 10^300)."""
    return str(number) if number < 10**12 else f"about 10^{len(str(number)) - 1}"


def _check_grid(space: Mapping[str, ParamSpec]) -> None:
    """A grid search needs finite dimensions and at most ``MAX_GRID`` points, counted before
    anything is listed or validated; the widest dimension is the field to blame."""
    for path, param in space.items():
        if param.grid_length() is None:
            raise SpecError(
                [
                    (
                        f"space.{path}",
                        f"grid search needs finite values; {param.type} has none: use"
                        " categorical choices or an int range",
                    )
                ]
            )
    points = grid_points(space)
    if points <= MAX_GRID:
        return
    widest = max(space, key=lambda path: space[path].grid_length() or 0)
    sizes = " x ".join(f"{path}: {_count(p.grid_length() or 0)}" for path, p in space.items())
    raise SpecError(
        [
            (
                f"space.{widest}",
                f"the grid has {_count(points)} points ({sizes} values), more than {MAX_GRID};"
                f" narrow space.{widest} (a smaller range or a larger step) or use algorithm"
                " random or tpe",
            )
        ]
    )


@dataclass(frozen=True)
class AcceptedSweep:
    """A sweep that passed every check, with its completed base job."""

    spec: SweepSpec
    base: AcceptedSpec

    @property
    def grid_size(self) -> int | None:
        """How many trials a grid search has (None for other algorithms)."""
        if self.spec.algorithm != "grid":
            return None
        return grid_points(self.spec.space)

    @property
    def trials(self) -> int:
        """How many trials the sweep runs: ``max_trials``, or fewer for a smaller grid."""
        grid = self.grid_size
        return self.spec.max_trials if grid is None else min(grid, self.spec.max_trials)


def parse_sweep_spec(payload: Any) -> SweepSpec:
    if not isinstance(payload, dict):
        raise SpecError([("", "a sweep spec must be a JSON/YAML object (mapping)")])
    try:
        return SweepSpec.model_validate(payload)
    except ValidationError as exc:
        raise SpecError(pydantic_errors(exc)) from None


def trial_spec(
    base: Mapping[str, Any], params: Mapping[str, ParamValue], name: str
) -> dict[str, Any]:
    """The base job with ``params`` applied (dotted paths) and the trial's ``name``."""
    spec = copy.deepcopy(dict(base))
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            node = node[part]
        node[leaf] = value
    spec["name"] = name
    return spec


def _check_path(base: Mapping[str, Any], path: str) -> None:
    if path == "code":
        raise SpecError(
            [("space.code", "the sweep's code is one for all its trials; search other fields")]
        )
    node: Any = base
    *parents, leaf = path.split(".")
    for depth, part in enumerate(parents):
        if not isinstance(node, Mapping) or part not in node:
            where = ".".join(parents[:depth]) or "the job"
            raise SpecError([(f"space.{path}", f"{where} has no section {part!r}")])
        node = node[part]
    if not isinstance(node, Mapping) or leaf not in node:
        known = ", ".join(sorted(node)) if isinstance(node, Mapping) else "none"
        where = ".".join(parents) or "the job"
        raise SpecError([(f"space.{path}", f"{where} has no field {leaf!r} (its fields: {known})")])
    if isinstance(node[leaf], Mapping):
        raise SpecError([(f"space.{path}", "names a section, not a field; search its fields")])


def complete_sweep_spec(
    spec: SweepSpec,
    allowed_factories: Sequence[str],
    largest_device_mb: int | None = None,
    code_runner: CodeRunner | None = None,
) -> AcceptedSweep:
    """Check that every trial the space can produce is a valid job that fits the largest
    device (when one is known): a grid is finite and bounded, each path names a field of the
    completed base job and each extreme value validates (with uploaded code, checked by
    ``code_runner``)."""

    checked_blocks = 0

    def job(payload: dict[str, Any]) -> AcceptedSpec:
        nonlocal checked_blocks
        accepted = _validate_job(payload, allowed_factories, code_runner)
        if spec.executor == "jobs":
            check_memory(accepted, largest_device_mb)
        else:
            check_shards(accepted, largest_device_mb)
        checked_blocks += accepted.num_blocks
        return accepted

    if spec.algorithm == "grid":
        _check_grid(spec.space)
    try:
        base = job(spec.base.model_dump(mode="json"))
    except SpecError as exc:  # the base job's fields, as the sweep's body names them
        raise SpecError([(f"base.{f}" if f else "base", m) for f, m in exc.errors]) from None
    base_json = base.spec.model_dump(mode="json")
    # A trial applies its values to the base as submitted (so does the sweeper): a model
    # dimension the base leaves to the data follows each trial's data.
    submitted = spec.base.model_dump(mode="json")
    for path, param in spec.space.items():
        _check_path(base_json, path)
        for value in param.extremes():
            try:
                job(trial_spec(submitted, {path: value}, spec.base.name))
            except SpecError as exc:
                problems = "; ".join(f"{f}: {m}" if f else m for f, m in exc.errors)
                raise SpecError(
                    [(f"space.{path}", f"the value {value!r} makes an invalid job ({problems})")]
                ) from None
            if checked_blocks > MAX_CHECKED_BLOCKS:
                raise SpecError([(f"space.{path}", _too_many_blocks(checked_blocks))])
    if spec.executor == "sharp" and base.spec.optimizer.clip_grad_norm is not None:
        raise SpecError(
            [
                (
                    "base.optimizer.clip_grad_norm",
                    "the sharp executor steps each shard on its own, so it cannot clip the"
                    " whole model's gradient; drop it or use executor: jobs",
                )
            ]
        )
    return AcceptedSweep(spec, base)


def _too_many_blocks(blocks: int) -> str:
    return (
        f"checking every value of the space takes models of {blocks:,} blocks in all (the"
        f" base job's and one per value), more than {MAX_CHECKED_BLOCKS:,}; give fewer"
        " choices or int ranges (only their ends are checked), or search smaller models"
    )


def check_shards(accepted: AcceptedSpec, largest_device_mb: int | None) -> None:
    """Under SHARP a trial's model is cut into shards that fit half a device: refuse one
    with a block too big for that on the largest known device (nothing known: no check)."""
    if accepted.costs is None or largest_device_mb is None:
        return
    rows = accepted.spec.batch_size // accepted.spec.micro_batches
    try:
        shard_model(
            accepted.costs,
            largest_device_mb * 2**20,
            rows,
            micro_batches=accepted.spec.micro_batches,
            recompute=accepted.spec.parallelism.recompute,
            precision=accepted.spec.precision,
        )
    except ShardError as exc:
        raise SpecError([("micro_batches", str(exc))]) from None


def validate_sweep_spec(payload: Any, allowed_factories: Sequence[str]) -> AcceptedSweep:
    """Parse and complete a sweep spec (no device known, so memory is not checked)."""
    return complete_sweep_spec(parse_sweep_spec(payload), allowed_factories)
