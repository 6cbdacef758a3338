"""Factory names: parsed, checked against the allow-list before import, loaded to callables.

The toy factories at the bottom are real ones: other worker tests name them as
``tests.workers.test_factories:<fn>``.
"""

from __future__ import annotations

import copy
import importlib
import math
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.workers.factories import FactoryError, check_allowed, load_callable
from shoal.workers.tensor_split import Piece, SplitBlock, cuts, linear_piece
from shoal.workers.zoo.registry import DataMeta

pytestmark = pytest.mark.unit

HERE = "tests.workers.test_factories"
HOSTILE = "tests.workers.hostile_factories"


@pytest.mark.parametrize(
    ("path", "allowed", "expected"),
    [
        ("mypkg:fn", ["mypkg"], ("mypkg", "fn")),
        ("mypkg.models:build", ["mypkg", "mypkg.models"], ("mypkg.models", "build")),
        ("mypkg.models.deep:build", ["other", "mypkg.models.deep"], ("mypkg.models.deep", "build")),
        ("_p1.m_2:f_", ["_p1.m_2"], ("_p1.m_2", "f_")),
    ],
)
def test_listed_modules_pass(path: str, allowed: list[str], expected: tuple[str, str]) -> None:
    assert check_allowed(path, allowed) == expected


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("mypkg_evil:fn", ["mypkg"]),  # a prefix of the name is not a parent package
        ("mypkg:fn", ["mypkg.models"]),  # a parent of an allowed module is not allowed
        ("mypkg.models:build", ["mypkg"]),  # nor is a submodule: it runs code of its own
        ("mypkg.models.deep:build", ["mypkg.models"]),
        ("os:system", []),
        ("os:system", ["mypkg"]),
    ],
)
def test_modules_outside_the_allow_list_are_refused(path: str, allowed: list[str]) -> None:
    with pytest.raises(FactoryError, match="SHOAL_ALLOWED_FACTORIES"):
        check_allowed(path, allowed)


@pytest.mark.parametrize("attr", ["_private", "__getattr__", "__builtins__", "__loader__", "_"])
def test_private_and_dunder_names_are_refused_before_import(attr: str) -> None:
    name = "tests.workers.never_imported_module"
    with pytest.raises(FactoryError, match="private name"):
        load_callable(f"{name}:{attr}", [name])
    assert name not in sys.modules


@pytest.mark.parametrize(
    "path",
    ["mypkg", "mypkg:", ":fn", "mypkg:fn:x", "my pkg:fn", "mypkg..m:fn", "../x:fn", "1pkg:fn",
     "mypkg:fn()", "mypkg/models:fn", "", "mypkg:fn\n", "\nmypkg:fn", "mypkg:fn "],
)  # fmt: skip
def test_malformed_names_show_the_expected_form(path: str) -> None:
    with pytest.raises(FactoryError, match=r"package\.module:function"):
        check_allowed(path, ["mypkg"])


def test_check_allowed_imports_nothing() -> None:
    name = "tests.workers.never_imported_module"
    check_allowed(f"{name}:fn", [name])
    assert name not in sys.modules


def test_load_callable_returns_the_function() -> None:
    assert load_callable(f"{HERE}:tiny_mlp", [HERE]) is tiny_mlp


def test_load_callable_refuses_before_importing() -> None:
    with pytest.raises(FactoryError, match="not allowed"):
        load_callable(f"{HERE}:tiny_mlp", ["workers"])


@pytest.fixture
def hostile() -> ModuleType:
    """The allowed module of hostile names, with its record of calls emptied."""
    module = importlib.import_module(HOSTILE)  # it imports this module: not at the top
    module.CALLS.clear()
    return module


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("ModelClass", "is a class, not a function"),
        ("DataClass", "is a class, not a function"),
        ("callable_instance", "is a _CallableModel instance, not a function"),
        ("bound_method", "is a bound method, not a function"),
        ("partial_mlp", "is a functools.partial, not a function"),
        ("system", "is a built-in function, not a function"),
        ("subprocess", "is a module, not a function"),
        ("factories_module", "is a module, not a function"),
        ("NOT_CALLABLE", "is a int, not a function"),
        ("getoutput", "is subprocess.getoutput, imported into"),
        ("tiny_mlp", f"is {HERE}.tiny_mlp, imported into"),
        ("renamed_elsewhere", f"is {HERE}.tiny_mlp_list, imported into"),
        ("no_such_name", "has no attribute 'no_such_name'"),  # not handed to __getattr__
    ],
)
def test_only_functions_written_in_the_module_resolve_and_nothing_is_called(
    hostile: ModuleType, attr: str, message: str
) -> None:
    with pytest.raises(FactoryError, match=re.escape(message)):
        load_callable(f"{HOSTILE}:{attr}", [HOSTILE])
    assert hostile.CALLS == []


def test_a_function_written_in_an_allowed_module_resolves(hostile: ModuleType) -> None:
    assert load_callable(f"{HOSTILE}:own_mlp", [HOSTILE]) is hostile.own_mlp
    assert load_callable(f"{HOSTILE}:own_data", [HOSTILE]) is hostile.own_data
    assert hostile.CALLS == []


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.workers.no_such_module:fn", "cannot be imported.*ModuleNotFoundError"),
        (f"{HERE}:no_such_function", "has no attribute 'no_such_function'"),
        (f"{HERE}:HERE", "is a str, not a function"),
    ],
)
def test_load_failures_say_what_went_wrong(path: str, message: str) -> None:
    with pytest.raises(FactoryError, match=message):
        load_callable(path, [HERE, "tests.workers.no_such_module"])


def test_errors_are_value_errors() -> None:
    # The service maps ValueError to a 4xx naming the field; a FactoryError must be one.
    assert issubclass(FactoryError, ValueError)


# ------------------------------------------------------------------ toy factories for tests


def tiny_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """A model factory returning an nn.Sequential: three blocks."""
    hidden = int(config.get("hidden", 8))
    return nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(math.prod(meta.input_shape), hidden)),
        nn.Tanh(),
        nn.Linear(hidden, meta.targets),
    )


def tiny_mlp_list(config: dict[str, Any], meta: DataMeta) -> list[nn.Module]:
    """A model factory returning a list of blocks."""
    return list(tiny_mlp(config, meta))


def dropout_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """Three blocks whose forwards draw random numbers (dropout): a forward run again
    equals its first run only under the RNG states that one ran under."""
    hidden = int(config.get("hidden", 8))
    return nn.Sequential(
        nn.Sequential(nn.Linear(math.prod(meta.input_shape), hidden), nn.Dropout(0.5)),
        nn.Sequential(nn.Tanh(), nn.Dropout(0.5), nn.Linear(hidden, hidden)),
        nn.Linear(hidden, meta.targets),
    )


def normed_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """Two blocks, each a linear layer followed by a layer norm: no block has a
    tensor-parallel split (the norm would run on each device's columns)."""
    hidden = int(config.get("hidden", 8))
    return nn.Sequential(
        nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(meta.input_shape), hidden), nn.LayerNorm(hidden)
        ),
        nn.Sequential(nn.Linear(hidden, meta.targets), nn.LayerNorm(meta.targets)),
    )


class ResidualMLP(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``, a block of a factory's own that declares its
    tensor-parallel split: by the MLP's hidden features, column then row."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.tensor_ways = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return out

    def tensor_split(self, devices: Sequence[torch.device]) -> SplitBlock:
        return SplitResidualMLP(self, devices)


class SplitResidualMLP(SplitBlock):
    """``ResidualMLP`` split: each device its hidden features' rows of ``fc1`` and columns
    of ``fc2``; the norm and ``fc2``'s bias on the first device, the partial sums added
    there in device order."""

    def __init__(self, block: ResidualMLP, devices: Sequence[torch.device]) -> None:
        super().__init__(devices)
        self.norm = copy.deepcopy(block.norm).to(self.home)
        self.fc2_bias = nn.Parameter(block.fc2.bias.detach().to(self.home).clone())
        w1, b1, w2 = block.fc1.weight.detach(), block.fc1.bias.detach(), block.fc2.weight.detach()
        parts = cuts(block.fc1.out_features, len(devices))
        self.fc1 = nn.ModuleList(
            linear_piece(w1[lo:hi], b1[lo:hi], d)
            for (lo, hi), d in zip(parts, devices, strict=True)
        )
        self.fc2 = nn.ModuleList(
            linear_piece(w2[:, lo:hi], None, d) for (lo, hi), d in zip(parts, devices, strict=True)
        )
        each = range(len(devices))
        self.pieces = {
            "norm.weight": Piece(("norm.weight",)),
            "norm.bias": Piece(("norm.bias",)),
            "fc1.weight": Piece(tuple(f"fc1.{i}.weight" for i in each)),
            "fc1.bias": Piece(tuple(f"fc1.{i}.bias" for i in each)),
            "fc2.weight": Piece(tuple(f"fc2.{i}.weight" for i in each), dim=1),
            "fc2.bias": Piece(("fc2_bias",)),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        partial = [
            fc2(F.gelu(fc1(h.to(d)))).to(self.home)
            for fc1, fc2, d in zip(self.fc1, self.fc2, self.devices, strict=True)
        ]
        total = partial[0]
        for more in partial[1:]:
            total = total + more
        out: torch.Tensor = x + (total + self.fc2_bias)
        return out


def residual_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """Three blocks, the middle one a ``ResidualMLP`` (its split declared) of
    ``config["hidden"]`` hidden features (default 6)."""
    width, hidden = 8, int(config.get("hidden", 6))
    return nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(math.prod(meta.input_shape), width)),
        ResidualMLP(width, hidden),
        nn.Linear(width, meta.targets),
    )


class _DataDependent(nn.Module):
    """Reads a value out of its input: fine on real tensors, impossible on the meta device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.abs().max().item() > 0)


def data_dependent_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """A model that trains but does not trace on the meta device: four blocks."""
    return nn.Sequential(*tiny_mlp(config, meta), _DataDependent())


def wrong_width_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """Four blocks whose first expects 5 input features whatever the data has: a factory's
    mistake no check before training can see, so its first forward fails."""
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, meta.targets))


def not_a_model(config: dict[str, Any], meta: DataMeta) -> str:
    return "a string"


class SumData:
    """A data factory's source: learn the sum of random features."""

    def __init__(self, config: dict[str, Any], seed: int):
        self.width = int(config.get("width", 4))
        self.seed = seed
        self.meta = DataMeta("regression", (self.width,), 1)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        x = torch.randn(batch_size, self.width, generator=g)
        return x, x.sum(dim=1, keepdim=True)


def sum_data(config: dict[str, Any], seed: int) -> SumData:
    return SumData(config, seed)


def not_a_source(config: dict[str, Any], seed: int) -> object:
    return object()
