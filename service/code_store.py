"""Uploaded code kept by content: one checked zip archive per SHA-256 digest.

A job spec names its code by digest (``"code": "sha256:..."``); the archive lives under
``$SHOAL_HOME/code`` on the control plane's host, and the controller hands its path to Ray,
which ships it to the nodes that run the job (``workers.uploaded_code``). The same bytes
uploaded twice are kept once; an archive is written whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shoal.service.code_archive import UNPACKED_FACTOR, ArchiveContents, inspect_archive
from shoal.workers.uploaded_code import JobCode

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_DIGEST_RE = re.compile(DIGEST_PATTERN)


class CodeNotFound(LookupError):
    """No upload has this digest; the message says how to make one."""


@dataclass(frozen=True)
class StoredCode:
    digest: str
    bytes: int
    contents: ArchiveContents


class CodeStore:
    """The uploads under ``root``; archives of at most ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def put(self, data: bytes) -> StoredCode:
        """Check ``data`` (``code_archive.ArchiveError`` if it is no usable archive) and keep
        it under its digest."""
        contents = inspect_archive(data, UNPACKED_FACTOR * self.max_bytes)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self._path(digest)
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(prefix=".upload-", dir=self.root)
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(data)
                os.replace(name, path)
            except BaseException:
                Path(name).unlink(missing_ok=True)
                raise
        return StoredCode(digest, len(data), contents)

    def path(self, digest: str) -> Path:
        """The archive of ``digest``; ``CodeNotFound`` if none was uploaded."""
        path = self._path(digest)
        if not path.is_file():
            raise CodeNotFound(
                f"no code was uploaded with digest {digest}; upload it first (`shoal submit"
                " --code DIR` does, or POST the zip to /api/v1/code)"
            )
        return path

    def code(self, digest: str) -> JobCode:
        """What a job with the code ``digest`` is started with (``CodeNotFound`` if none)."""
        return JobCode(digest, str(self.path(digest)))

    def _path(self, digest: str) -> Path:
        if not _DIGEST_RE.fullmatch(digest):
            raise ValueError(f"{digest!r} is not a code digest (sha256: and 64 hex digits)")
        return self.root / f"{digest.removeprefix('sha256:')}.zip"
