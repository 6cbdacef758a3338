"""The job contract: ``JobSpec``, validated once, with bounds and messages that name the field.

A spec arrives as JSON (API) or YAML (CLI). Unknown fields are refused; every field but
``name``, ``model``, ``data`` and ``steps`` has a default; model dimensions that follow from
the data are filled in from the dataset. ``validate_job_spec`` is the single entry point: it
returns the spec with the model/data configs completed, or raises ``SpecError``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scheduler.memory import submission_refusal
from scheduler.profile import BlockCost
from service.memo import OnceEach
from workers.factories import FactoryError, check_allowed, load_callable
from workers.snapshot import DataRef, ModelRef
from workers.zoo.registry import RegistryError, data_meta, resolve_model

log = logging.getLogger(__name__)

MAX_STEPS = 10_000_000
MAX_BATCH = 1_048_576
MAX_DEVICES = 4_096
MAX_NAME = 100
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def check_name(value: str, limit: int = MAX_NAME) -> str:
    """A job's or sweep's name: 1 to ``limit`` letters, digits, '_', '.', '-', the first a
    letter or digit."""
    # fullmatch, not a ``$`` anchor: ``$`` also matches before a trailing newline.
    if len(value) > limit or not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"use 1-{limit} letters, digits, '_', '.', '-', starting with a letter or digit"
        )
    return value


class SpecError(ValueError):
    """A spec is invalid. ``errors`` lists (dotted field, message) pairs."""

    def __init__(self, errors: Sequence[tuple[str, str]]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{f}: {m}" if f else m for f, m in self.errors))


class StrictModel(BaseModel):
    """A spec section: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ComponentSpec(StrictModel):
    """A built-in (``builtin``) or a factory ``pkg.module:function``, with its config."""

    builtin: str | None = Field(None, max_length=100)
    factory: str | None = Field(None, max_length=300)
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _exactly_one(self) -> ComponentSpec:
        if (self.builtin is None) == (self.factory is None):
            raise ValueError("give exactly one of 'builtin' or 'factory'")
        return self


class OptimizerSpec(StrictModel):
    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    momentum: float | None = Field(None, ge=0.0, lt=1.0, description="sgd only")
    nesterov: bool | None = Field(None, description="sgd only")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    betas: tuple[float, float] | None = Field(None, description="adam/adamw only")
    eps: float | None = Field(None, gt=0.0, le=1.0, description="adam/adamw only")
    clip_grad_norm: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="clip the L2 norm of the whole model's gradient to this before each step",
    )

    @model_validator(mode="after")
    def _fits_optimizer(self) -> OptimizerSpec:
        if self.name == "sgd" and (self.betas is not None or self.eps is not None):
            raise ValueError("betas and eps apply to adam/adamw, not sgd")
        if self.name != "sgd" and (self.momentum is not None or self.nesterov is not None):
            raise ValueError(f"momentum and nesterov apply to sgd, not {self.name}")
        if self.nesterov and not self.momentum:
            raise ValueError("nesterov needs momentum > 0")
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("betas must both be in [0, 1)")
        return self

    def params(self) -> dict[str, Any]:
        """Keyword arguments of the torch optimizer besides ``lr``."""
        fields = ("momentum", "nesterov", "weight_decay", "betas", "eps")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


class ParallelismSpec(StrictModel):
    stages: Literal["auto"] | int = "auto"
    replicas: Literal["auto"] | int = "auto"
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    recompute: bool = False

    @field_validator("stages", "replicas")
    @classmethod
    def _positive(cls, value: str | int) -> str | int:
        if isinstance(value, int) and not 1 <= value <= MAX_DEVICES:
            raise ValueError(f"must be 'auto' or an integer between 1 and {MAX_DEVICES}")
        return value


class ElasticSpec(StrictModel):
    """Runtime rebalancing (``scheduler.elastic``): every ``check_every_steps`` steps the
    runner re-cuts the blocks over its devices if the measured speeds predict a step at
    least ``min_gain`` faster that repays the move within ``horizon_steps`` steps."""

    repartition: bool = True
    check_every_steps: int = Field(10, ge=1, le=1_000_000)
    min_gain: float = Field(0.1, ge=0.0, lt=1.0)
    horizon_steps: int = Field(100, ge=1, le=MAX_STEPS)
    keep_copies: bool = Field(
        True,
        description="keep each worker's state in host memory on another node, taken every"
        " few steps: a lost device costs at most the steps since the last copy, without a"
        " restart",
    )
    copy_budget: float = Field(
        0.05,
        gt=0.0,
        le=1.0,
        description="the most of the training time the in-memory copies may cost: the steps"
        " between two copies grow until their measured cost fits (at most 100); 1: no"
        " limit, a copy at every step",
    )


class ResourcesSpec(StrictModel):
    min_devices: int = Field(1, ge=1, le=MAX_DEVICES)
    max_devices: int = Field(1, ge=1, le=MAX_DEVICES)
    device_kind: str | None = Field(None, max_length=63, description="only this kind")
    spot_ok: bool = True

    @model_validator(mode="after")
    def _ordered(self) -> ResourcesSpec:
        if self.max_devices < self.min_devices:
            raise ValueError(
                f"max_devices ({self.max_devices}) is less than min_devices ({self.min_devices})"
            )
        return self


class CheckpointSpec(StrictModel):
    every_steps: int = Field(50, ge=1, le=MAX_STEPS)
    keep: int = Field(3, ge=1, le=1_000)


class JobSpec(StrictModel):
    name: str = Field(..., max_length=MAX_NAME)
    model: ComponentSpec
    data: ComponentSpec
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    micro_batches: int = Field(1, ge=1, le=MAX_BATCH)
    steps: int = Field(..., ge=1, le=MAX_STEPS)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    elastic: ElasticSpec = Field(default_factory=ElasticSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    priority: int = Field(0, ge=-100, le=100)
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forward and loss under bfloat16 autocast, fp32 weights"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)

    @model_validator(mode="after")
    def _batch_split(self) -> JobSpec:
        if self.micro_batches > self.batch_size:
            raise ValueError(
                f"micro_batches ({self.micro_batches}) exceeds batch_size ({self.batch_size})"
            )
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by micro_batches"
                f" ({self.micro_batches})"
            )
        stages = self.parallelism.stages
        if isinstance(stages, int) and stages > self.resources.max_devices:
            raise ValueError(
                f"parallelism.stages ({stages}) needs {stages} devices but"
                f" resources.max_devices is {self.resources.max_devices}; raise max_devices"
            )
        return self


def pydantic_errors(exc: ValidationError) -> list[tuple[str, str]]:
    errors = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
        message = str(err["msg"]).removeprefix("Value error, ")
        errors.append((".".join(loc), message))
    return errors


def parse_job_spec(payload: Any) -> JobSpec:
    """Structural validation of a decoded JSON/YAML object."""
    if not isinstance(payload, dict):
        raise SpecError([("", "a job spec must be a JSON/YAML object (mapping)")])
    try:
        return JobSpec.model_validate(payload)
    except ValidationError as exc:
        raise SpecError(pydantic_errors(exc)) from None


def _check_factories(spec: JobSpec, allowed: Sequence[str]) -> None:
    """Refuse a factory that is not a function written in an allowed module: every name is
    checked against the allow-list before any module is imported, and nothing is called."""
    named = [
        (f"{part}.factory", ref.factory)
        for part, ref in (("data", spec.data), ("model", spec.model))
    ]
    for step in (check_allowed, load_callable):
        for field, path in named:
            if path is None:
                continue
            try:
                step(path, allowed)
            except FactoryError as exc:
                raise SpecError([(field, str(exc))]) from None


@dataclass(frozen=True)
class AcceptedSpec:
    """A spec that passed every check, with its model's block count and, where the model
    traces on the meta device (every built-in does), each block's cost."""

    spec: JobSpec
    num_blocks: int
    costs: tuple[BlockCost, ...] | None = None
    untraced: str | None = None  # why there are no costs


def complete_job_spec(spec: JobSpec, allowed_factories: Sequence[str]) -> AcceptedSpec:
    """Check builtins/factories and fill data-derived model dimensions."""
    _check_replicas(spec)
    # Factories first: a module outside the allow-list is refused before anything else runs.
    _check_factories(spec, allowed_factories)
    updates: dict[str, Any] = {}
    meta = None
    try:
        if spec.data.builtin is not None:
            data_config, meta = data_meta(spec.data.builtin, spec.data.config)
            updates["data"] = spec.data.model_copy(update={"config": data_config})
        if spec.model.builtin is not None:
            if meta is None:
                raise SpecError(
                    [("model.builtin", "built-in models need a built-in dataset; use a factory")]
                )
            resolved = resolve_model(spec.model.builtin, spec.model.config, meta)
            updates["model"] = spec.model.model_copy(update={"config": resolved.config})
    except RegistryError as exc:
        raise SpecError([(exc.field, exc.message)]) from None
    completed = spec.model_copy(update=updates)
    accepted = _trace(completed, allowed_factories)
    _check_stage_count(spec.parallelism.stages, accepted.num_blocks)
    return accepted


@dataclass(frozen=True)
class _Traced:
    num_blocks: int
    costs: tuple[BlockCost, ...] | None
    untraced: str | None


_BLOCK_COST_BYTES = 600
"""What one block's ``BlockCost`` holds in memory, with its fields (~0.5 KiB, measured)."""


def _trace_bytes(traced: _Traced) -> int:
    return len(traced.costs or ()) * _BLOCK_COST_BYTES + len(traced.untraced or "") + 100


TRACE_CACHE_BYTES = 32 * 2**20
_TRACES: OnceEach[_Traced] = OnceEach(256, TRACE_CACHE_BYTES, _trace_bytes)
"""Traces by what they depend on: a sweep's trials and many clients submit the same model
over and over, and a trace takes from tens of milliseconds to seconds. Bounded in bytes as
well as entries: a key holds a whole config (a factory's may be most of a request body)."""


def _trace(spec: JobSpec, allowed: Sequence[str]) -> AcceptedSpec:
    """The spec with its blocks counted and costed by tracing the model on the meta device;
    a factory model that does not trace there is built once on the CPU to count its blocks.
    Each distinct model, data, micro-batch size, optimizer and precision is traced once."""
    from workers.profiler import TraceError, trace_costs

    model = ModelRef(spec.model.builtin, spec.model.factory, spec.model.config)
    data = DataRef(spec.data.builtin, spec.data.factory, spec.data.config)
    micro_batch_size = spec.batch_size // spec.micro_batches
    momentum = bool(spec.optimizer.momentum)

    def trace() -> _Traced:
        try:
            costs = trace_costs(
                model,
                data,
                micro_batch_size=micro_batch_size,
                optimizer=spec.optimizer.name,
                momentum=momentum,
                allowed=allowed,
                precision=spec.precision,
            )
        except TraceError as exc:
            if spec.model.factory is None:
                # Every built-in model the registry accepts traces: one that does not is a
                # gap in its checks, logged, and still the spec's error (a 422, never a 500).
                log.error("built-in model %s did not trace: %s", spec.model.builtin, exc)
                raise SpecError(
                    [
                        (
                            "model.config",
                            f"the model cannot run on this data ({exc}); change model.config"
                            " or data.config",
                        )
                    ]
                ) from None
            return _Traced(_count_factory_blocks(model, data, allowed), None, str(exc))
        return _Traced(len(costs), costs, None)

    key = json.dumps(
        [
            asdict(model),
            asdict(data),
            micro_batch_size,
            spec.optimizer.name,
            momentum,
            spec.precision,
            *allowed,
        ],
        sort_keys=True,
        default=repr,
    )
    traced = _TRACES.get(key, trace)
    return AcceptedSpec(spec, traced.num_blocks, traced.costs, traced.untraced)


def check_memory(accepted: AcceptedSpec, largest_device_mb: int | None) -> None:
    """Refuse a model that cannot fit on the devices the job may use, whatever the partition
    (a lower bound on the memory per device); no devices known or no costs: nothing to check."""
    if accepted.costs is None or largest_device_mb is None:
        return
    spec = accepted.spec
    message = submission_refusal(
        accepted.costs,
        optimizer=spec.optimizer.name,
        micro_batch_size=spec.batch_size // spec.micro_batches,
        largest_device_bytes=largest_device_mb * 2**20,
        max_devices=spec.resources.max_devices,
    )
    if message is not None:
        raise SpecError([("resources.max_devices", message)])


def _count_factory_blocks(model: ModelRef, data: DataRef, allowed: Sequence[str]) -> int:
    """Build an allowed factory model once to learn its block count (and that it builds)."""
    from workers.zoo.data import make_data
    from workers.zoo.models import count_blocks

    # User code: any failure is a bad spec, reported under the factory that failed, not raised.
    try:
        meta = make_data(data, 0, allowed).meta
    except Exception as exc:
        field = "data.factory" if data.factory is not None else "data.config"
        raise SpecError([(field, f"building the data failed: {exc}")]) from None
    try:
        return count_blocks(model, meta, allowed)
    except Exception as exc:
        raise SpecError([("model.factory", f"building {model.factory} failed: {exc}")]) from None


def replica_count(spec: JobSpec) -> int:
    """Data-parallel replicas the job runs with: ``auto`` is 1 until the partitioner picks."""
    replicas = spec.parallelism.replicas
    return replicas if isinstance(replicas, int) else 1


def _check_replicas(spec: JobSpec) -> None:
    replicas = replica_count(spec)
    stages = spec.parallelism.stages
    per_replica = stages if isinstance(stages, int) else 1
    needed = per_replica * replicas
    if needed > spec.resources.max_devices:
        what = (
            f"{stages} stages x {replicas} replicas"
            if isinstance(stages, int)
            else (f"{replicas} replicas of at least one stage")
        )
        raise SpecError(
            [
                (
                    "parallelism.replicas",
                    f"{what} need {needed} devices but resources.max_devices is"
                    f" {spec.resources.max_devices}; raise max_devices or lower replicas",
                )
            ]
        )
    if replicas > spec.micro_batches:
        raise SpecError(
            [
                (
                    "parallelism.replicas",
                    f"{replicas} replicas need at least one micro-batch each but micro_batches"
                    f" is {spec.micro_batches}; raise micro_batches or lower replicas",
                )
            ]
        )


def _check_stage_count(stages: str | int, num_blocks: int) -> None:
    if isinstance(stages, int) and stages > num_blocks:
        raise SpecError(
            [
                (
                    "parallelism.stages",
                    f"{stages} stages but the model has only {num_blocks} blocks;"
                    " use fewer stages or a deeper model",
                )
            ]
        )


def validate_job_spec(payload: Any, allowed_factories: Sequence[str]) -> AcceptedSpec:
    """Parse and complete a job spec; the one entry point used by the API and the CLI."""
    return complete_job_spec(parse_job_spec(payload), allowed_factories)
