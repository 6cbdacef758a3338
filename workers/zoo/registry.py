"""Names, config schemas and derived sizes of the built-in models and datasets.

Light on purpose (no torch import): the service validates job specs with it, and the
execution side (``workers.zoo.models`` / ``workers.zoo.data``) builds what it describes.
Dimensions that follow from the data (input features, classes, vocabulary, sequence length)
are filled into a model config from the dataset's ``DataMeta`` when the user leaves them out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Task = Literal["regression", "classification", "lm"]

MAX_PARAMETERS = 20_000_000_000
"""Refuse models beyond this at submission: nothing in reach trains them."""


class RegistryError(ValueError):
    """A model/data choice or config is invalid; ``field`` is the dotted path to blame."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class DataMeta:
    """What a dataset yields: the task, one sample's input shape, and the target size.

    ``input_shape`` is ``(features,)`` for vectors, ``(channels, height, width)`` for images
    and ``(seq_len,)`` of token ids for language modelling; ``targets`` is the number of
    regression outputs, classes, or the vocabulary size.
    """

    task: Task
    input_shape: tuple[int, ...]
    targets: int
    vocab_size: int = 0


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------- datasets


class SyntheticRegressionConfig(_Config):
    features: int = Field(32, ge=1, le=65_536)
    outputs: int = Field(1, ge=1, le=4_096)
    noise: float = Field(0.05, ge=0.0, le=10.0)


class SyntheticLMConfig(_Config):
    vocab_size: int = Field(64, ge=2, le=65_536)
    seq_len: int = Field(32, ge=2, le=8_192)


class DigitsConfig(_Config):
    images: bool = Field(True, description="yield 1x8x8 images (False: 64 flat features)")


class PySourceConfig(_Config):
    seq_len: int = Field(64, ge=2, le=8_192)
    max_bytes: int = Field(4_000_000, ge=10_000, le=200_000_000)


@dataclass(frozen=True)
class DataEntry:
    name: str
    config_model: type[_Config]
    meta: Callable[[Any], DataMeta]


DATASETS: dict[str, DataEntry] = {
    "synthetic-regression": DataEntry(
        "synthetic-regression",
        SyntheticRegressionConfig,
        lambda c: DataMeta("regression", (c.features,), c.outputs),
    ),
    "synthetic-lm": DataEntry(
        "synthetic-lm",
        SyntheticLMConfig,
        lambda c: DataMeta("lm", (c.seq_len,), c.vocab_size, c.vocab_size),
    ),
    "digits": DataEntry(
        "digits",
        DigitsConfig,
        lambda c: DataMeta("classification", (1, 8, 8) if c.images else (64,), 10),
    ),
    "pysource": DataEntry(
        "pysource",
        PySourceConfig,
        # Byte-level: the vocabulary is every byte value, the same on every machine.
        lambda c: DataMeta("lm", (c.seq_len,), 256, 256),
    ),
}


# ------------------------------------------------------------------------------- models


class MLPConfig(_Config):
    hidden: int = Field(128, ge=1, le=65_536)
    layers: int = Field(2, ge=1, le=1_024, description="hidden layers; each is one block")
    activation: Literal["relu", "gelu", "tanh"] = "relu"
    in_features: int | None = Field(None, ge=1, le=16_777_216)
    out_features: int | None = Field(None, ge=1, le=1_048_576)


class ConvNetConfig(_Config):
    channels: list[int] = Field(default_factory=lambda: [16, 32], min_length=1, max_length=64)
    kernel_size: int = Field(3, ge=1, le=15)
    in_channels: int | None = Field(None, ge=1, le=4_096)
    height: int | None = Field(None, ge=1, le=4_096)
    width: int | None = Field(None, ge=1, le=4_096)
    classes: int | None = Field(None, ge=2, le=1_048_576)

    @model_validator(mode="after")
    def _channels_bounded(self) -> ConvNetConfig:
        if any(not 1 <= c <= 4_096 for c in self.channels):
            raise ValueError("every entry of channels must be between 1 and 4096")
        if self.kernel_size % 2 == 0:
            raise ValueError("kernel_size must be odd (same-size padding)")
        return self


class GPTConfig(_Config):
    d_model: int = Field(64, ge=8, le=16_384)
    n_layers: int = Field(2, ge=1, le=1_024, description="transformer layers; each is one block")
    n_heads: int = Field(4, ge=1, le=256)
    vocab_size: int | None = Field(None, ge=2, le=1_048_576)
    seq_len: int | None = Field(None, ge=2, le=65_536)

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        return self


def _flat(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


# A model dimension set by hand must agree with the data it trains on, or the first step
# fails (a shape mismatch, a label or token past the output layer) or, for regression,
# silently broadcasts: refused at submission, naming the field and the value that fits.


def _leave_out(field: str) -> str:
    return f"leave model.config.{field} out to take it from the data"


def _same(field: str, given: int, data: int, what: str) -> None:
    if given != data:
        raise RegistryError(
            f"model.config.{field}",
            f"is {given} but the data has {data} {what}; set it to {data} or {_leave_out(field)}",
        )


def _at_least(field: str, given: int, data: int, what: str) -> None:
    if given < data:
        raise RegistryError(
            f"model.config.{field}",
            f"is {given} but the data has {data} {what}; raise it to at least {data} or"
            f" {_leave_out(field)}",
        )


def _outputs(field: str, given: int, meta: DataMeta) -> None:
    """Regression outputs must match the targets exactly; a classifier or a language model
    needs at least one output per class or token value (spare ones are never the target)."""
    if meta.task == "regression":
        _same(field, given, meta.targets, "regression targets per sample")
    elif meta.task == "classification":
        _at_least(field, given, meta.targets, "classes")
    else:
        _at_least(field, given, meta.vocab_size, "token values")


def _mlp_complete(c: MLPConfig, meta: DataMeta) -> MLPConfig:
    if meta.task == "lm":
        raise RegistryError("model.builtin", "mlp cannot model token sequences; use gpt")
    done = c.model_copy(
        update={
            "in_features": c.in_features or _flat(meta.input_shape),
            "out_features": c.out_features or meta.targets,
        }
    )
    assert done.in_features is not None and done.out_features is not None
    _same("in_features", done.in_features, _flat(meta.input_shape), "features per sample")
    _outputs("out_features", done.out_features, meta)
    return done


def _mlp_params(c: MLPConfig) -> int:
    assert c.in_features is not None and c.out_features is not None
    first = c.in_features * c.hidden + c.hidden
    return (
        first
        + (c.layers - 1) * (c.hidden * c.hidden + c.hidden)
        + c.hidden * c.out_features
        + c.out_features
    )


def _convnet_complete(c: ConvNetConfig, meta: DataMeta) -> ConvNetConfig:
    if meta.task != "classification" or len(meta.input_shape) != 3:
        raise RegistryError(
            "model.builtin",
            "convnet needs image classification data (digits, with data.config.images true);"
            " use mlp for flat features",
        )
    channels, height, width = meta.input_shape
    done = c.model_copy(
        update={
            "in_channels": c.in_channels or channels,
            "height": c.height or height,
            "width": c.width or width,
            "classes": c.classes or meta.targets,
        }
    )
    assert done.in_channels and done.height and done.width and done.classes
    _same("in_channels", done.in_channels, channels, "image channels")
    _same("height", done.height, height, "pixels of image height")
    _same("width", done.width, width, "pixels of image width")
    _outputs("classes", done.classes, meta)
    return done


def _convnet_params(c: ConvNetConfig) -> int:
    assert c.in_channels and c.height and c.width and c.classes
    total, prev = 0, c.in_channels
    for ch in c.channels:
        total += prev * ch * c.kernel_size**2 + ch
        prev = ch
    return total + prev * c.height * c.width * c.classes + c.classes


def _gpt_complete(c: GPTConfig, meta: DataMeta) -> GPTConfig:
    if meta.task != "lm":
        raise RegistryError(
            "model.builtin", "gpt needs token-sequence data (synthetic-lm, pysource)"
        )
    done = c.model_copy(
        update={
            "vocab_size": c.vocab_size or meta.vocab_size,
            "seq_len": c.seq_len or meta.input_shape[0],
        }
    )
    assert done.vocab_size and done.seq_len
    _outputs("vocab_size", done.vocab_size, meta)
    # Learned positions: a longer model sees shorter sequences fine, a shorter one cannot.
    _at_least("seq_len", done.seq_len, meta.input_shape[0], "tokens per sequence")
    return done


def _gpt_params(c: GPTConfig) -> int:
    assert c.vocab_size and c.seq_len
    d = c.d_model
    per_layer = (
        12 * d * d + 10 * d
    )  # attention (4 d^2, bias on the output only), 4x MLP (8 d^2), 2 norms
    return c.vocab_size * d + c.seq_len * d + c.n_layers * per_layer + 2 * d + d * c.vocab_size


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config_model: type[_Config]
    complete: Callable[[Any, DataMeta], _Config]
    num_blocks: Callable[[Any], int]
    param_count: Callable[[Any], int]


MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry("mlp", MLPConfig, _mlp_complete, lambda c: c.layers + 1, _mlp_params),
    "convnet": ModelEntry(
        "convnet", ConvNetConfig, _convnet_complete, lambda c: len(c.channels) + 1, _convnet_params
    ),
    "gpt": ModelEntry("gpt", GPTConfig, _gpt_complete, lambda c: c.n_layers + 2, _gpt_params),
}


# ------------------------------------------------------------------------------ resolve


def _parse(model: type[_Config], config: dict[str, Any], field: str) -> _Config:
    try:
        return model.model_validate(config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        path = f"{field}.{where}" if where else field
        raise RegistryError(path, first["msg"]) from None


def data_meta(name: str, config: dict[str, Any]) -> tuple[dict[str, Any], DataMeta]:
    """Validate a built-in dataset's config; return it with defaults filled, and its meta."""
    entry = DATASETS.get(name)
    if entry is None:
        raise RegistryError(
            "data.builtin", f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}"
        )
    parsed = _parse(entry.config_model, config, "data.config")
    return parsed.model_dump(), entry.meta(parsed)


@dataclass(frozen=True)
class ResolvedModel:
    config: dict[str, Any]
    num_blocks: int
    param_count: int


def resolve_model(name: str, config: dict[str, Any], meta: DataMeta) -> ResolvedModel:
    """Validate a built-in model's config against the data; fill data-derived dimensions."""
    entry = MODELS.get(name)
    if entry is None:
        raise RegistryError(
            "model.builtin", f"unknown model {name!r}; choose one of {sorted(MODELS)}"
        )
    parsed = entry.complete(_parse(entry.config_model, config, "model.config"), meta)
    params = entry.param_count(parsed)
    if params > MAX_PARAMETERS:
        raise RegistryError(
            "model.config",
            f"the model has {params:,} parameters, more than the {MAX_PARAMETERS:,} allowed;"
            " make it smaller",
        )
    return ResolvedModel(parsed.model_dump(), entry.num_blocks(parsed), params)
