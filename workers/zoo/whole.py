"""A job's whole model in one process: the blocks of its spec's model, in order, as one
``nn.Sequential``. What a user builds to load a model exported from Shoal
(``workers.model_file``): its state-dict names are the export's ``{block}.{name}``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from torch import nn

from shoal.workers.snapshot import DataRef, ModelRef
from shoal.workers.uploaded_code import local_code
from shoal.workers.zoo.data import make_data
from shoal.workers.zoo.models import build_blocks, count_blocks


def build_model(
    model: Mapping[str, Any],
    data: Mapping[str, Any],
    *,
    seed: int = 0,
    allowed: Sequence[str] = (),
    code: str | Path | None = None,
) -> nn.Sequential:
    """The model of a job spec's ``model`` and ``data`` sections (``{"builtin": ...,
    "config": {...}}`` or ``{"factory": ..., ...}``, as submitted; the data section gives
    the shapes), freshly initialized under ``seed``, on the CPU. ``code``: the folder of the
    job's uploaded code, which its ``code:`` factories import."""
    ref = ModelRef(model.get("builtin"), model.get("factory"), dict(model.get("config") or {}))
    source = DataRef(data.get("builtin"), data.get("factory"), dict(data.get("config") or {}))
    with local_code(code) if code is not None else nullcontext():
        meta = make_data(source, seed, allowed).meta
        count = count_blocks(ref, meta, allowed)
        return nn.Sequential(*build_blocks(ref, meta, seed, range(count), allowed))
