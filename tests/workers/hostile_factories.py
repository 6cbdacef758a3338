"""An allowed factory module holding every kind of name a factory must not resolve to.

Tests list this module in the allow-list and name each attribute below as a factory: only
``own_mlp`` and ``own_data`` may resolve. Anything here that runs records itself in ``CALLS``,
so a test sees that a refused factory was never called.
"""

from __future__ import annotations

import functools
import subprocess  # noqa: F401 - a module, reachable as an attribute
from os import system  # noqa: F401 - a built-in function, imported
from subprocess import getoutput  # noqa: F401 - a Python function written elsewhere
from typing import Any

from torch import nn

import tests.workers.test_factories as factories_module
from shoal.workers.zoo.registry import DataMeta
from tests.workers.test_factories import SumData, sum_data, tiny_mlp

CALLS: list[str] = []
NOT_CALLABLE = 42


def own_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    """The one model factory here that may resolve: a function written in this module."""
    return tiny_mlp(config, meta)


def own_data(config: dict[str, Any], seed: int) -> SumData:
    """The one data factory here that may resolve."""
    return sum_data(config, seed)


def _private_mlp(config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
    CALLS.append("_private_mlp")
    return tiny_mlp(config, meta)


class ModelClass(nn.Sequential):
    """Calling a class runs its __init__ (and its metaclass): code outside any function."""

    def __init__(self, config: dict[str, Any], meta: DataMeta) -> None:
        CALLS.append("ModelClass")
        super().__init__(*tiny_mlp(config, meta))


class _CallableModel:
    def __call__(self, config: dict[str, Any], meta: DataMeta) -> nn.Sequential:
        CALLS.append("callable_instance")
        return tiny_mlp(config, meta)


callable_instance = _CallableModel()
bound_method = callable_instance.__call__
partial_mlp = functools.partial(tiny_mlp)
renamed_elsewhere = factories_module.tiny_mlp_list  # written in another module, renamed here
DataClass = SumData  # a class written elsewhere, re-exported


def __getattr__(name: str) -> Any:
    """A module-level hook (PEP 562): resolving must not consult it."""
    CALLS.append(f"__getattr__({name})")
    return own_mlp
