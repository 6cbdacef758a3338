"""``GET /api/v1/stream``: server-sent events of job updates and job events, live.

One poll of the database per interval serves every open stream (``Feed``): hundreds of
dashboard tabs cost one query each ``SHOAL_POLL_INTERVAL_S``, not one each per tab. Each
stream gets what its principal may see (an admin: everything; a user: their jobs), as
``event: job`` (a jobs-table row: state, step, loss, devices) and ``event: event`` (a job
event: placement, repartition, device_lost, checkpoint, ...), with a comment line every
15 s so proxies keep the connection open. A stream that falls more than ``QUEUE`` messages
behind is ended; the client reconnects and reloads. The stream starts at "now": a client
reads the current state over the REST API first.

A stream re-checks its token in the database every ``SHOAL_AUTH_CACHE_S`` (every poll
interval when that is 0) and ends once the token is revoked or its user's rights change, as
REST refuses such a token at most that much later: a reconnect then answers 401.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import SQLAlchemyError

from shoal.api.deps import PrincipalDep, SettingsDep, bearer_token, lookup_token
from shoal.service.auth import Principal
from shoal.service.db.session import SessionFactory
from shoal.service.feed import Change, Cursor, read_changes, start_cursor

QUEUE = 2000
KEEP_ALIVE_S = 15.0

router = APIRouter(tags=["stream"])

Recheck = Callable[[], Awaitable[bool]]
"""Whether a stream's viewer may still watch (its token valid, its rights unchanged)."""


@dataclass(eq=False)
class _Viewer:
    principal: Principal
    queue: asyncio.Queue[str | None] = field(default_factory=lambda: asyncio.Queue(QUEUE))

    def sees(self, change: Change) -> bool:
        return self.principal.is_admin or change.owner_id == self.principal.user_id


class Feed:
    """The database poll behind every open stream; it runs while someone watches."""

    def __init__(self, factory: SessionFactory, interval_s: float) -> None:
        self._factory = factory
        self._interval_s = max(interval_s, 0.05)
        self._viewers: set[_Viewer] = set()
        self._task: asyncio.Task[None] | None = None

    async def watch(
        self, principal: Principal, recheck: Recheck | None = None, every_s: float = 0.0
    ) -> AsyncIterator[str]:
        """The stream of one viewer, as server-sent-event text; with ``recheck``, asked at
        least every ``every_s`` (never more often than the feed polls), it ends once the
        viewer may no longer watch."""
        viewer = _Viewer(principal)
        self._viewers.add(viewer)
        if self._task is None or self._task.done():
            cursor = await asyncio.to_thread(self._start)
            self._task = asyncio.create_task(self._poll(cursor))
        every_s = max(every_s, self._interval_s)
        try:
            yield ": connected\n\n"
            sent = checked = time.monotonic()
            while True:
                now = time.monotonic()
                if recheck is not None and now - checked >= every_s:
                    if not await recheck():
                        yield ": the token was revoked or its rights changed\n\n"
                        return
                    checked = now
                if now - sent >= KEEP_ALIVE_S:
                    yield ": keep-alive\n\n"
                    sent = now
                due = sent + KEEP_ALIVE_S
                if recheck is not None:
                    due = min(due, checked + every_s)
                try:
                    message = await asyncio.wait_for(viewer.queue.get(), max(due - now, 0.0))
                except TimeoutError:
                    continue
                if message is None:
                    return  # it fell behind: the client reconnects and reloads
                yield message
                sent = time.monotonic()
        finally:
            self._viewers.discard(viewer)

    def _start(self) -> Cursor:
        with self._factory() as session:
            return start_cursor(session)

    def _read(self, cursor: Cursor) -> tuple[list[Change], Cursor]:
        with self._factory() as session:
            return read_changes(session, cursor)

    async def _poll(self, cursor: Cursor) -> None:
        while self._viewers:
            await asyncio.sleep(self._interval_s)
            changes, cursor = await asyncio.to_thread(self._read, cursor)
            for change in changes:
                text = f"event: {change.kind}\ndata: {json.dumps(change.data)}\n\n"
                for viewer in list(self._viewers):
                    if viewer.sees(change):
                        _offer(viewer, text)


def _offer(viewer: _Viewer, text: str) -> None:
    try:
        viewer.queue.put_nowait(text)
    except asyncio.QueueFull:
        while not viewer.queue.empty():
            viewer.queue.get_nowait()
        viewer.queue.put_nowait(None)


@router.get("/stream", response_class=StreamingResponse)
async def stream(
    request: Request, principal: PrincipalDep, settings: SettingsDep
) -> StreamingResponse:
    """Server-sent events: ``job`` (a job's row changed) and ``event`` (a job event), for
    the jobs the caller may see, from now on; the stream ends when the caller's token is
    revoked (within ``SHOAL_AUTH_CACHE_S``)."""
    feed: Feed = request.app.state.feed
    token = bearer_token(request.headers) if settings.auth else None
    recheck = None if token is None else _recheck(request, token, principal)
    return StreamingResponse(
        feed.watch(principal, recheck, settings.auth_cache_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _recheck(request: Request, token: str, principal: Principal) -> Recheck:
    factory = request.app.state.session_factory

    async def still_valid() -> bool:
        try:
            return await lookup_token(factory, token) == principal
        except SQLAlchemyError:
            return True  # the database is away: asked again next time, not cut for that

    return still_valid
