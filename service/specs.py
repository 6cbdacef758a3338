"""The job contract: ``JobSpec``, validated once, with bounds and messages that name the field.

A spec arrives as JSON (API) or YAML (CLI). Unknown fields are refused; every field but
``name``, ``model``, ``data`` and ``steps`` has a default; model dimensions that follow from
the data are filled in from the dataset. ``validate_job_spec`` is the single entry point: it
returns the spec with the model/data configs completed, or raises ``SpecError``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shoal.scheduler.copies import DEFAULT_BUDGET
from shoal.scheduler.memory import submission_refusal
from shoal.scheduler.profile import BlockCost
from shoal.scheduler.tensor import per_device
from shoal.service.code_store import DIGEST_PATTERN
from shoal.service.spec_errors import SpecError, pydantic_errors
from shoal.service.traces import CodeRunner, TraceRequest, trace_spec
from shoal.workers.factories import FactoryError, check_allowed, is_code, load_callable
from shoal.workers.snapshot import DataRef, ModelRef
from shoal.workers.zoo.registry import RegistryError, data_meta, resolve_model

MAX_STEPS = 10_000_000
MAX_BATCH = 1_048_576
MAX_DEVICES = 4_096
MAX_TENSOR = 64
"""The most devices a tensor-parallel group may have (the devices of one node)."""
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


class StrictModel(BaseModel):
    """A spec section: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ComponentSpec(StrictModel):
    """A built-in (``builtin``), a factory ``pkg.module:function`` an operator installed, or
    ``code:module:function`` in the job's uploaded code, with its config."""

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
    shard: Literal["none", "optimizer", "gradients", "full", "auto"] = Field(
        "none",
        description="how the replicas of a stage split its state (ZeRO): optimizer, each"
        " keeps the optimizer state of 1/R of every block (ZeRO-1); gradients, the summed"
        " gradients too (ZeRO-2, reduce-scatter instead of all-reduce); full, the"
        " parameters too, each block's gathered whole only while it runs (ZeRO-3/FSDP;"
        " every replica gets the same number of micro-batches); none, whole replicas;"
        " auto, whole where the model fits so, else gradients, else full (decided each"
        " time the job is placed)",
    )

    tensor: int = Field(
        1,
        ge=1,
        le=MAX_TENSOR,
        description="devices per stage, all on one node: each block of the built-in GPT and"
        " MLP models split over them (Megatron's column and row splits, one sum per split"
        " pair), each device holding about 1/tensor of the block; with shard: none",
    )

    @field_validator("tensor")
    @classmethod
    def _unsharded(cls, value: int, info: ValidationInfo) -> int:
        shard = info.data.get("shard", "none")
        if value > 1 and shard != "none":
            raise ValueError(
                f"tensor: {value} is not combined with shard: {shard} yet; use shard: none"
                " (or tensor: 1)"
            )
        return value

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
        DEFAULT_BUDGET,
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
    code: str | None = Field(
        None,
        pattern=DIGEST_PATTERN,
        description="the digest of code uploaded with the job (`shoal submit --code DIR` sets"
        " it; POST /api/v1/code returns it), whose modules `code:module:function` factories"
        " name; it runs on the cluster's nodes, never in the control plane",
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
        for part, ref in (("model", self.model), ("data", self.data)):
            if self.code is None and ref.factory is not None and is_code(ref.factory):
                raise ValueError(
                    f"{part}.factory {ref.factory!r} names uploaded code but the spec has none;"
                    " submit with --code DIR (or set code to an upload's digest)"
                )
        stages = self.parallelism.stages
        if isinstance(stages, int) and stages > self.resources.max_devices:
            raise ValueError(
                f"parallelism.stages ({stages}) needs {stages} devices but"
                f" resources.max_devices is {self.resources.max_devices}; raise max_devices"
            )
        return self


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
    checked against the allow-list before any module is imported, and nothing is called.
    Uploaded code's factories (``code:``) are only read here: they are imported where the
    job's code is checked, in a Ray worker process."""
    named = [
        (f"{part}.factory", ref.factory)
        for part, ref in (("data", spec.data), ("model", spec.model))
    ]
    for step in (check_allowed, load_callable):
        for field, path in named:
            if path is None or (step is load_callable and is_code(path)):
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


def complete_job_spec(
    spec: JobSpec, allowed_factories: Sequence[str], code_runner: CodeRunner | None = None
) -> AcceptedSpec:
    """Check builtins/factories and fill data-derived model dimensions; a spec with uploaded
    code is traced by ``code_runner``."""
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
    request = TraceRequest(
        ModelRef(completed.model.builtin, completed.model.factory, completed.model.config),
        DataRef(completed.data.builtin, completed.data.factory, completed.data.config),
        completed.batch_size // completed.micro_batches,
        completed.optimizer.name,
        bool(completed.optimizer.momentum),
        completed.precision,
        tuple(allowed_factories),
        completed.code,
    )
    traced = trace_spec(request, code_runner)
    accepted = AcceptedSpec(completed, traced.num_blocks, traced.costs, traced.untraced)
    _check_stage_count(spec.parallelism.stages, accepted.num_blocks)
    _check_tensor(accepted)
    return accepted


def _check_tensor(accepted: AcceptedSpec) -> None:
    """A tensor-parallel job needs a model whose blocks' splits are known (traced), that has
    a block to split (``workers.tensor_split``), and whose every split goes ``tensor`` ways
    (a GPT layer by heads, a linear layer by output features)."""
    tensor = accepted.spec.parallelism.tensor
    if tensor == 1:
        return
    if accepted.costs is None:
        why = f"the model did not trace ({accepted.untraced}), so its blocks' splits are unknown"
        fix = "use 1"
    elif not any(c.split_bytes for c in accepted.costs):
        why = (
            "no block of the model has a split (splits exist for GPT layers, linear layers"
            " and blocks that declare one, tensor_split, that can be made on meta devices)"
        )
        fix = "use 1"
    else:
        most = _most_ways(accepted.costs)
        if tensor <= most:
            return
        why = (
            f"a block of the model splits at most {most} ways (its heads, output features"
            " or declared tensor_ways)"
        )
        fix = f"use parallelism.tensor <= {most}"
    raise SpecError([("parallelism.tensor", f"tensor: {tensor} cannot run: {why}; {fix}")])


def _most_ways(costs: Sequence[BlockCost]) -> int:
    """The most devices every split block of a model splits over (0: no block splits)."""
    return min((c.split_ways for c in costs if c.split_bytes), default=0)


def check_memory(accepted: AcceptedSpec, largest_device_mb: int | None) -> None:
    """Refuse a model that cannot fit on the devices the job may use, whatever the partition
    (a lower bound on the memory per device); no devices known or no costs: nothing to check.
    Where splitting its blocks over a tensor group would fit it, the refusal says so."""
    if accepted.costs is None or largest_device_mb is None:
        return
    spec = accepted.spec

    def refusal(tensor: int) -> str | None:
        return submission_refusal(
            per_device(accepted.costs or (), tensor),
            optimizer=spec.optimizer.name,
            micro_batch_size=spec.batch_size // spec.micro_batches,
            largest_device_bytes=largest_device_mb * 2**20,
            max_devices=spec.resources.max_devices // tensor,
            shards=_most_shards(spec),
            full=spec.parallelism.shard in ("full", "auto"),
        )

    message = refusal(spec.parallelism.tensor)
    if message is None:
        return
    if spec.parallelism.tensor == 1 and spec.parallelism.shard == "none":
        most = min(MAX_TENSOR, spec.resources.max_devices, _most_ways(accepted.costs))
        enough = next((n for n in range(2, most + 1) if refusal(n) is None), None)
        if enough is not None:
            message += (
                f"; or split each block over {enough} devices of a node"
                f" (parallelism.tensor: {enough})"
            )
    raise SpecError([("resources.max_devices", message)])


def _most_shards(spec: JobSpec) -> int:
    """The most replicas that may share a block's optimizer state: 1 unsharded; ``auto``
    replicas may grow to every device the job may use."""
    if spec.parallelism.shard == "none":
        return 1
    replicas = spec.parallelism.replicas
    return replicas if isinstance(replicas, int) else spec.resources.max_devices


def replica_count(spec: JobSpec) -> int:
    """Data-parallel replicas the job runs with: ``auto`` is 1 until the partitioner picks."""
    replicas = spec.parallelism.replicas
    return replicas if isinstance(replicas, int) else 1


def _check_replicas(spec: JobSpec) -> None:
    replicas = replica_count(spec)
    stages, tensor = spec.parallelism.stages, spec.parallelism.tensor
    per_replica = stages if isinstance(stages, int) else 1
    needed = per_replica * replicas * tensor
    if needed > spec.resources.max_devices:
        what = (
            f"{stages} stages x {replicas} replicas"
            if isinstance(stages, int)
            else (f"{replicas} replicas of at least one stage")
        ) + (f" x {tensor} devices each (parallelism.tensor)" if tensor > 1 else "")
        field, lower = (
            ("parallelism.tensor", "tensor") if tensor > 1 else ("parallelism.replicas", "replicas")
        )
        raise SpecError(
            [
                (
                    field,
                    f"{what} need {needed} devices but resources.max_devices is"
                    f" {spec.resources.max_devices}; raise max_devices or lower {lower}",
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
    if spec.parallelism.shard == "full" and spec.micro_batches % replicas:
        raise SpecError(
            [
                (
                    "parallelism.replicas",
                    f"shard: full runs its {replicas} replicas in lockstep, each on the same"
                    f" number of micro-batches, but micro_batches ({spec.micro_batches}) is"
                    f" not a multiple of {replicas}; use a multiple of it or other replicas",
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


def validate_job_spec(
    payload: Any, allowed_factories: Sequence[str], code_runner: CodeRunner | None = None
) -> AcceptedSpec:
    """Parse and complete a job spec; the one entry point used by the API and the CLI."""
    return complete_job_spec(parse_job_spec(payload), allowed_factories, code_runner)
