"""Counting and costing a job's model before it is accepted, here or in a Ray worker.

A spec's model is traced on the meta device (every built-in model is); a factory model that
does not trace there is built once on the CPU to count its blocks. Uploaded code is never
imported here: its spec is traced by a ``CodeRunner`` (``service.code_checks``) in a Ray
worker process with time and memory limits, running the same ``trace_model``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from shoal.scheduler.profile import BlockCost
from shoal.service.code_store import CodeNotFound
from shoal.service.memo import OnceEach
from shoal.service.spec_errors import SpecError
from shoal.workers.snapshot import DataRef, ModelRef

log = logging.getLogger(__name__)

T = TypeVar("T")


class CodeRunner(Protocol):
    """Runs a check with a job's uploaded code importable, in a Ray worker process with time
    and memory limits (``service.code_checks``): what the check raises is raised here."""

    def __call__(self, check: Callable[..., T], args: tuple[Any, ...], digest: str) -> T: ...


@dataclass(frozen=True)
class Traced:
    """A model's block count and, where it traces on the meta device, each block's cost."""

    num_blocks: int
    costs: tuple[BlockCost, ...] | None
    untraced: str | None


_BLOCK_COST_BYTES = 600
"""What one block's ``BlockCost`` holds in memory, with its fields (~0.5 KiB, measured)."""


def _trace_bytes(traced: Traced) -> int:
    return len(traced.costs or ()) * _BLOCK_COST_BYTES + len(traced.untraced or "") + 100


TRACE_CACHE_BYTES = 32 * 2**20
_TRACES: OnceEach[Traced] = OnceEach(256, TRACE_CACHE_BYTES, _trace_bytes)
"""Traces by what they depend on: a sweep's trials and many clients submit the same model
over and over, and a trace takes from tens of milliseconds to seconds. Bounded in bytes as
well as entries: a key holds a whole config (a factory's may be most of a request body)."""


@dataclass(frozen=True)
class TraceRequest:
    """What a trace depends on: the model, its data, the micro-batch, the optimizer's state,
    the precision, the factories allowed and the uploaded code they come from."""

    model: ModelRef
    data: DataRef
    micro_batch_size: int
    optimizer: str
    momentum: bool
    precision: str
    allowed: tuple[str, ...]
    code: str | None


def trace_spec(request: TraceRequest, code_runner: CodeRunner | None) -> Traced:
    """The model counted and costed (``trace_model``), here or, with uploaded code, by
    ``code_runner``. Each distinct request is traced once."""

    def trace() -> Traced:
        if request.code is None:
            return trace_model(request)
        if code_runner is None:
            raise SpecError([("code", "uploaded code is checked by the API; submit the job there")])
        try:
            return code_runner(trace_model, (request,), request.code)
        except CodeNotFound as exc:
            raise SpecError([("code", str(exc))]) from None

    return _TRACES.get(json.dumps(asdict(request), sort_keys=True, default=repr), trace)


def trace_model(request: TraceRequest) -> Traced:
    """The model's blocks counted and costed by tracing it on the meta device; a factory
    model that does not trace there is built once on the CPU to count its blocks. Raises
    ``SpecError``: the same here and in the Ray worker that checks uploaded code."""
    from shoal.workers.profiler import TraceError, trace_costs

    model, data, allowed = request.model, request.data, request.allowed
    try:
        costs = trace_costs(
            model,
            data,
            micro_batch_size=request.micro_batch_size,
            optimizer=request.optimizer,
            momentum=request.momentum,
            allowed=allowed,
            precision=request.precision,
        )
    except TraceError as exc:
        if model.factory is None:
            # Every built-in model the registry accepts traces: one that does not is a
            # gap in its checks, logged, and still the spec's error (a 422, never a 500).
            log.error("built-in model %s did not trace: %s", model.builtin, exc)
            raise SpecError(
                [
                    (
                        "model.config",
                        f"the model cannot run on this data ({exc}); change model.config"
                        " or data.config",
                    )
                ]
            ) from None
        return Traced(_count_factory_blocks(model, data, allowed), None, str(exc))
    return Traced(len(costs), costs, None)


def _count_factory_blocks(model: ModelRef, data: DataRef, allowed: Sequence[str]) -> int:
    """Build an allowed factory model once to learn its block count (and that it builds)."""
    from shoal.workers.zoo.data import make_data
    from shoal.workers.zoo.models import count_blocks

    # User code: any failure is a bad spec, reported under the factory that failed, not raised.
    try:
        meta = make_data(data, 0, allowed).meta
    except Exception as exc:
        field = "data.factory" if data.factory is not None else "data.config"
        raise SpecError([(field, f"building the data failed: {_said(exc)}")]) from None
    try:
        return count_blocks(model, meta, allowed)
    except Exception as exc:
        raise SpecError(
            [("model.factory", f"building {model.factory} failed: {_said(exc)}")]
        ) from None


def _said(exc: BaseException) -> str:
    """An exception in words: its message, or its type where it has none (MemoryError())."""
    return str(exc) or type(exc).__name__
