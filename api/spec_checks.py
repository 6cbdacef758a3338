"""Spec checks on threads of their own: tracing a submitted model and checking a sweep's
every value can take seconds of CPU, so they never run on the API's threads.

A submission awaits its check without holding any thread; at most ``spec_check_threads``
checks run at once and ``spec_check_queue`` wait, and one more is answered 503 with
Retry-After. However many heavy submissions arrive, the API's own threads stay free for
everything else: ``/healthz`` answers while they run.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, ParamSpec, TypeVar

from fastapi import Depends, HTTPException, Request, status

from shoal.service.settings import Settings

P = ParamSpec("P")
T = TypeVar("T")

RETRY_AFTER_S = 1


class SpecChecks:
    """A few threads for spec checks and a bounded number of submissions waiting on them."""

    def __init__(self, threads: int, queue: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shoal-spec-check")
        self._room = threads + queue
        self._lock = threading.Lock()
        self.pending = 0
        """Checks running or waiting for a thread."""

    async def run(self, check: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``check(*args, **kwargs)`` on a spec-check thread; 503 when the queue is full."""
        with self._lock:
            if self.pending >= self._room:
                raise HTTPException(
                    status.HTTP_503_SERVICE_UNAVAILABLE,
                    f"{self.pending} submissions are being checked already; retry in"
                    f" {RETRY_AFTER_S} s (SHOAL_SPEC_CHECK_THREADS and SHOAL_SPEC_CHECK_QUEUE"
                    " set how many)",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self.pending += 1
        context = contextvars.copy_context()
        future = self._pool.submit(lambda: context.run(check, *args, **kwargs))
        # Counted until the check is over, not until the caller stops waiting: a client
        # that hangs up does not stop the check its submission started.
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: object) -> None:
        with self._lock:
            self.pending -= 1


_CREATE = threading.Lock()


async def spec_checks(request: Request) -> SpecChecks:
    """The app's ``SpecChecks``, made on first use from its settings."""
    state = request.app.state
    with _CREATE:
        checks: SpecChecks | None = getattr(state, "spec_checks", None)
        if checks is None:
            settings: Settings = state.settings
            checks = SpecChecks(settings.spec_check_threads, settings.spec_check_queue)
            state.spec_checks = checks
    return checks


SpecChecksDep = Annotated[SpecChecks, Depends(spec_checks)]
