"""Where the control plane meets uploaded code: checking a spec with it, shipping it to jobs.

``CodeChecks`` is the ``service.traces.CodeRunner`` of the API and the controller: it runs a
spec's check with the job's code in a Ray worker process under the settings' limits
(``workers.uploaded_code.call_with_code``), joining the Ray cluster on first use (an API
process that never sees code never does). ``job_code`` is what a runner is started with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from shoal.service.cluster import connect_ray
from shoal.service.code_store import CodeStore
from shoal.service.settings import Settings
from shoal.service.spec_errors import SpecError
from shoal.workers.uploaded_code import CodeRunFailed, JobCode, call_with_code

T = TypeVar("T")


def job_code(digest: str | None, store: CodeStore | None) -> JobCode | None:
    """The code a job with ``digest`` runs with (``CodeNotFound`` if its archive is gone)."""
    if digest is None:
        return None
    if store is None:
        raise RuntimeError("a job with uploaded code, but no code store; a wiring bug")
    return store.code(digest)


@dataclass(frozen=True)
class CodeChecks:
    store: CodeStore
    connect: Callable[[], object]
    """Joins the Ray cluster (``service.cluster.connect_ray``); called before each check."""
    timeout_s: float
    memory_bytes: int

    def __call__(self, check: Callable[..., T], args: tuple[Any, ...], digest: str) -> T:
        code = self.store.code(digest)
        self.connect()
        try:
            return call_with_code(
                check, args, code, timeout_s=self.timeout_s, memory_bytes=self.memory_bytes
            )
        except CodeRunFailed as exc:
            raise SpecError([("code", str(exc))]) from None


def code_checks(settings: Settings) -> CodeChecks:
    """The uploads under ``$SHOAL_HOME/code`` and their checks, as ``settings`` bound them."""
    return CodeChecks(
        CodeStore(settings.code_root, settings.code_max_bytes),
        partial(connect_ray, settings.ray_address),
        settings.code_check_timeout_s,
        settings.code_check_memory_mb * 2**20,
    )
