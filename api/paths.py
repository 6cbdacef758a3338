"""No server filesystem path leaves in an answer: the directories Shoal knows (its state
directory, the checkpoint root, the SQLite database's, its code and its Python) are replaced
in every JSON and event-stream body by a name an operator can read them back from.

Paths reach answers from many places: a checkpoint's location in its event, a worker's
error text in a job's reason (``/…/step-00000042/manifest.json is corrupt``), an exception
a factory raised. Cleaning each source would miss the next one, so the edge does it once,
for every route: ``/home/u/.shoal/checkpoints/j1/step-00000042`` is answered as
``$SHOAL_CHECKPOINT_ROOT/j1/step-00000042``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import sqlalchemy as sa
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.service.settings import Settings

_TEXT_TYPES = (b"application/json", b"text/event-stream")


def server_roots(settings: Settings) -> dict[str, str]:
    """The server's directories and the name each is shown as."""
    roots = {
        sys.base_prefix: "<python>",
        sys.prefix: "<python>",
        str(Path(__file__).resolve().parents[1]): "<shoal>",
        str(settings.home): "$SHOAL_HOME",
    }
    database = sa.engine.make_url(settings.resolved_database_url)
    if database.drivername.startswith("sqlite") and database.database not in (None, ":memory:"):
        roots.setdefault(str(Path(database.database or "").parent), "<database directory>")
    checkpoints = settings.resolved_checkpoint_root
    if "://" not in checkpoints:  # an object store's URL is not a server path
        roots[checkpoints] = "$SHOAL_CHECKPOINT_ROOT"
    return roots


def replacements(roots: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """(what, by) byte pairs: each root as given, absolute and resolved, raw and as JSON
    writes it (escaped, and ``\\u``-escaped), longest first so that a root inside another
    is named by the innermost."""
    pairs: dict[bytes, bytes] = {}
    for root, name in roots.items():
        for form in _forms(root):
            if len(Path(form).parts) < 2:
                continue  # "/" would take every slash of the body with it
            for encoded in _encodings(form):
                pairs.setdefault(encoded, name.encode())
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))


def _forms(root: str) -> Iterable[str]:
    return {root.rstrip("/") or root, os.path.abspath(root), os.path.realpath(root)}


def _encodings(text: str) -> Iterable[bytes]:
    return {
        text.encode(),
        json.dumps(text)[1:-1].encode(),
        json.dumps(text, ensure_ascii=False)[1:-1].encode(),
    }


def hide(body: bytes, pairs: list[tuple[bytes, bytes]]) -> bytes:
    for what, by in pairs:
        if what in body:
            body = body.replace(what, by)
    return body


class HidePaths:
    """ASGI middleware applying ``hide`` to JSON and event-stream bodies."""

    def __init__(self, app: ASGIApp, roots: dict[str, str]) -> None:
        self.app = app
        self.pairs = replacements(roots)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "HEAD":  # HEAD: no body to clean
            await self.app(scope, receive, send)
            return
        start: Message | None = None  # held until the body's length is known
        sized = started = False
        held: list[bytes] = []

        async def hiding(message: Message) -> None:
            nonlocal start, sized, started
            if message["type"] == "http.response.start" and _is_text(message):
                start = message
                sized = any(name == b"content-length" for name, _ in start["headers"])
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            more = message.get("more_body", False)
            if sized:  # one answer of a known length: hidden whole, its length set again
                held.append(message.get("body", b""))
                if more:
                    return
                body = hide(b"".join(held), self.pairs)
                start["headers"] = [
                    (name, str(len(body)).encode() if name == b"content-length" else value)
                    for name, value in start["headers"]
                ]
            else:  # a stream: each event is sent in one piece
                body = hide(message.get("body", b""), self.pairs)
            if not started:
                await send(start)
                started = True
            await send({"type": "http.response.body", "body": body, "more_body": more})

        await self.app(scope, receive, hiding)


def _is_text(start: Message) -> bool:
    for name, value in start.get("headers", []):
        if name == b"content-type":
            return bool(value.split(b";")[0].strip() in _TEXT_TYPES)
    return False
