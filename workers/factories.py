"""Loads user factories ``pkg.mod:fn``: only functions defined in an allowed module.

A factory is named in a job spec as ``"package.module:function"``. Importing a module runs its
code, so a name is checked against the operator's allow-list (the ``SHOAL_ALLOWED_FACTORIES``
setting, handed to the workers in the job snapshot) before anything is imported (DESIGN
invariant 4). Listing a module allows the plain Python functions written in it, and nothing
else: not its submodules (each must be listed itself), not its private or dunder names, not
what it imports from other modules, and no class, built-in, ``functools.partial`` or callable
instance, whose call could run code the operator never looked at. All of that is checked
before the factory is called.

A factory of the job's **uploaded code** is named ``"code:module:function"``: no allow-list
applies (uploading code is a permission of its own, checked by the control plane), but the
module must be one of that code's, found in the job's working directory where Ray unpacked
it (``workers.uploaded_code``), never an installed one; the rest of the rules hold alike.

The contracts a factory must keep:

- a **model factory** is called ``fn(config: dict, meta: DataMeta)`` and returns an
  ``nn.Sequential`` or a list of ``nn.Module``: the model's blocks, in order, each block's
  output the next one's input. It is called under a seeded RNG, so it must draw its random
  initialization from torch's global generator and nothing else.
- a **data factory** is called ``fn(config: dict, seed: int)`` and returns an object that
  satisfies ``workers.zoo.data.DataSource``: a ``meta: DataMeta`` attribute and
  ``batch(step, batch_size) -> (inputs, targets)``, a pure function of the seed, the config,
  the step and the batch size.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from types import FunctionType, ModuleType
from typing import Any

from shoal.workers.uploaded_code import is_uploaded

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# fullmatch, not ``$``: a ``$`` anchor would also accept a trailing newline.
_PATH_RE = re.compile(rf"(?P<module>{_IDENT}(?:\.{_IDENT})*):(?P<attr>{_IDENT})")
CODE_PREFIX = "code:"


class FactoryError(ValueError):
    """A factory name is malformed, not allowed, or does not load to a function."""


def is_code(path: str) -> bool:
    """Whether the factory ``path`` names a function of the job's uploaded code."""
    return path.startswith(CODE_PREFIX)


def check_allowed(path: str, allowed: Sequence[str]) -> tuple[str, str]:
    """Split ``"pkg.mod:fn"`` into (module, attribute) if the module is allowed and the
    attribute a public name; imports nothing.

    The module must equal an entry of ``allowed``: ``"mypkg"`` allows neither
    ``mypkg.models`` (a submodule runs code of its own) nor ``mypkg_evil``. A
    ``code:module:function`` name needs no entry: its module is the job's own code.
    """
    uploaded = is_code(path)
    match = _PATH_RE.fullmatch(path.removeprefix(CODE_PREFIX) if uploaded else path)
    if match is None:
        shape = "code:module:function" if uploaded else "package.module:function"
        raise FactoryError(f"factory {path!r} is malformed; write it as '{shape}'")
    module, attr = match["module"], match["attr"]
    if not uploaded and module not in allowed:
        listed = ", ".join(sorted(allowed)) or "nothing"
        raise FactoryError(
            f"factory module {module!r} is not allowed (allowed: {listed}); an operator can"
            " add it to SHOAL_ALLOWED_FACTORIES (each module, submodules too, is listed by name)"
        )
    if attr.startswith("_"):
        raise FactoryError(
            f"factory {path!r} names a private name; point it at a public function of {module}"
        )
    return module, attr


def _kind(target: object) -> str:
    """What a non-function is, in words, for the error message."""
    if inspect.isclass(target):
        return "a class"
    if isinstance(target, ModuleType):
        return "a module"
    if isinstance(target, functools.partial):
        return "a functools.partial"
    if inspect.isbuiltin(target) or inspect.ismethoddescriptor(target):
        return "a built-in function"
    if inspect.ismethod(target):
        return "a bound method"
    name = type(target).__name__
    return f"a {name} instance" if callable(target) else f"a {name}"


def load_callable(path: str, allowed: Sequence[str]) -> Callable[..., Any]:
    """Import an allowed factory's module and return the function it names, refusing
    anything but a plain Python function defined in that module (nothing is called)."""
    module_name, attr = check_allowed(path, allowed)
    where = (
        "check that it is in the folder you uploaded"
        if is_code(path)
        else "install it on every worker node or fix the name"
    )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own code may raise anything while importing
        raise FactoryError(
            f"factory module {module_name!r} cannot be imported ({type(exc).__name__}: {exc});"
            f" {where}"
        ) from exc
    if is_code(path) and not is_uploaded(module):
        raise FactoryError(
            f"factory {path!r} names {module_name!r}, which is not a module of the job's"
            f" uploaded code (found at {getattr(module, '__file__', None) or 'no file'});"
            " name a module at the root of the folder you uploaded"
        )
    # The module's own namespace: getattr would run a module-level __getattr__.
    namespace = vars(module)
    if attr not in namespace:
        raise FactoryError(
            f"factory module {module_name!r} has no attribute {attr!r}; check the name after ':'"
        )
    target = namespace[attr]
    if not isinstance(target, FunctionType):
        raise FactoryError(
            f"factory {path!r} is {_kind(target)}, not a function; point it at a function"
            f" written in {module_name} (wrap anything else in one)"
        )
    if target.__module__ != module_name:
        raise FactoryError(
            f"factory {path!r} is {target.__module__}.{target.__qualname__}, imported into"
            f" {module_name}; name a function written in {module_name}, or have an operator"
            f" list {target.__module__} in SHOAL_ALLOWED_FACTORIES and name it there"
        )
    return target
