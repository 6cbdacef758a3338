"""Loads user factories ``pkg.mod:fn``, only from allowed modules.

A factory is named in a job spec as ``"package.module:function"``. Importing a module runs its
code, so a name is checked against the operator's allow-list (the ``SHOAL_ALLOWED_FACTORIES``
setting, handed to the workers in the job snapshot) before anything is imported (DESIGN
invariant 4).

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

import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_PATH_RE = re.compile(rf"^(?P<module>{_IDENT}(?:\.{_IDENT})*):(?P<attr>{_IDENT})$")


class FactoryError(ValueError):
    """A factory name is malformed, not allowed, or does not load to a callable."""


def check_allowed(path: str, allowed: Sequence[str]) -> tuple[str, str]:
    """Split ``"pkg.mod:fn"`` into (module, attribute) if the module is allowed; imports nothing.

    The module must equal an entry of ``allowed`` or be a submodule of one: ``"mypkg"``
    allows ``mypkg.models`` but not ``mypkg_evil``.
    """
    match = _PATH_RE.match(path)
    if match is None:
        raise FactoryError(f"factory {path!r} is malformed; write it as 'package.module:function'")
    module, attr = match["module"], match["attr"]
    if not any(module == entry or module.startswith(entry + ".") for entry in allowed):
        listed = ", ".join(sorted(allowed)) or "nothing"
        raise FactoryError(
            f"factory module {module!r} is not allowed (allowed: {listed}); an operator can"
            " add it, or a package above it, to SHOAL_ALLOWED_FACTORIES"
        )
    return module, attr


def load_callable(path: str, allowed: Sequence[str]) -> Callable[..., Any]:
    """Import an allowed factory and return it."""
    module_name, attr = check_allowed(path, allowed)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own code may raise anything while importing
        raise FactoryError(
            f"factory module {module_name!r} cannot be imported ({type(exc).__name__}: {exc});"
            " install it on every worker node or fix the name"
        ) from exc
    try:
        target = getattr(module, attr)
    except AttributeError:
        raise FactoryError(
            f"factory module {module_name!r} has no attribute {attr!r}; check the name after ':'"
        ) from None
    if not callable(target):
        raise FactoryError(
            f"factory {path!r} is a {type(target).__name__}, not a function; point it at a callable"
        )
    return target  # type: ignore[no-any-return]
