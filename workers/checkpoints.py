"""The checkpoint store: write, list, read, retain; atomic and checksummed.

Layout on disk, one directory per checkpoint, one file per block (DESIGN invariant 2: a
checkpoint written under one partition reads back as per-block states under any other)::

    <root>/<job_id>/step-00000042/block-00003.pt    torch.save of Block.state()
                                 /manifest.json     step, job_id, layout, files (sha256,
                                                    bytes), created_at, format_version

A checkpoint is visible only once complete (DESIGN invariant 3): it is written into a
temporary sibling ``.tmp-step-...-<uuid>``, every file is fsynced, the manifest goes last,
then the directory is renamed into place and the parent fsynced. A crash leaves at most a
temporary directory, which is never listed. Reads verify every file against the manifest.

The root may be a directory or any fsspec URL (``s3://bucket/shoal``, ``gs://...``,
``memory://...``). An object store has no atomic rename: there the manifest is the commit —
a checkpoint's block files are moved into place first and its manifest last (one object
written whole), and a checkpoint is discarded manifest first, so a reader never sees one
without its files.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_STEP_RE = re.compile(r"^step-(\d{8,})\Z")
_BLOCK_RE = re.compile(r"^block-(\d{5,})\.pt\Z")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint; ``nbytes`` counts its block files."""

    job_id: str
    step: int
    path: str
    nbytes: int
    created_at: float


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or from an incompatible version."""


@dataclass(frozen=True)
class Restorable:
    """What a run resumes from: the newest checkpoint that reads back whole (None: none
    does, the run starts from its seed) and the newer ones that did not, with why."""

    info: CheckpointInfo | None
    blocks: dict[int, dict[str, Any]]
    skipped: tuple[tuple[int, str], ...] = ()


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through it."""

    def __init__(self, file: IO[bytes]):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.nbytes += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class _Local:
    """A local directory: every file fsynced, a checkpoint published by one atomic rename."""

    def __init__(self, root: str) -> None:
        self.root = root

    @staticmethod
    def join(*parts: str) -> str:
        return os.path.join(*parts)

    @staticmethod
    def isdir(path: str) -> bool:
        return os.path.isdir(path)

    @staticmethod
    def isfile(path: str) -> bool:
        return os.path.isfile(path)

    @staticmethod
    def listdir(path: str) -> builtins.list[str]:
        return os.listdir(path)

    @staticmethod
    def read_bytes(path: str) -> bytes:
        return Path(path).read_bytes()

    @staticmethod
    def makedirs(path: str) -> None:
        if not os.path.isdir(path):
            _private_dirs(path)
            _fsync_dir(os.path.dirname(path))

    @staticmethod
    def write(path: str, fill: Callable[[_HashingWriter], object]) -> dict[str, Any]:
        """Write a file through ``fill``, fsync it, and return its manifest entry."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE_FILE)
        with os.fdopen(fd, "wb") as file:
            writer = _HashingWriter(file)
            fill(writer)
            file.flush()
            os.fsync(file.fileno())
        return {"sha256": writer.sha256.hexdigest(), "bytes": writer.nbytes}

    def publish(self, tmp: str, final: str) -> None:
        _fsync_dir(tmp)
        if os.path.exists(final):
            self.discard(final)
        os.rename(tmp, final)
        _fsync_dir(os.path.dirname(final))

    @staticmethod
    def discard(path: str) -> None:
        # Renaming first makes the removal atomic for readers: a half-deleted checkpoint
        # would otherwise sit under its own name.
        trash = os.path.join(
            os.path.dirname(path), f".trash-{os.path.basename(path)}-{uuid.uuid4().hex}"
        )
        os.rename(path, trash)
        _fsync_dir(os.path.dirname(path))
        shutil.rmtree(trash)

    @staticmethod
    def remove(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class _Remote:
    """Any other fsspec file system (object stores): the manifest, moved last, commits."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root

    @staticmethod
    def join(*parts: str) -> str:
        return "/".join(part.rstrip("/") for part in parts)

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def listdir(self, path: str) -> builtins.list[str]:
        return [
            str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False)
        ]

    def read_bytes(self, path: str) -> bytes:
        data: bytes = self.fs.cat_file(path)
        return data

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write(self, path: str, fill: Callable[[_HashingWriter], object]) -> dict[str, Any]:
        with self.fs.open(path, "wb") as file:
            writer = _HashingWriter(file)
            fill(writer)
        return {"sha256": writer.sha256.hexdigest(), "bytes": writer.nbytes}

    def publish(self, tmp: str, final: str) -> None:
        if self.isfile(self.join(final, MANIFEST)):
            self.discard(final)
        names = sorted(self.listdir(tmp), key=lambda name: name == MANIFEST)  # manifest last
        for name in names:
            self.fs.mv(self.join(tmp, name), self.join(final, name))
        self.remove(tmp)

    def discard(self, path: str) -> None:
        manifest = self.join(path, MANIFEST)
        if self.isfile(manifest):
            self.fs.rm_file(manifest)  # invisible from here on
        self.remove(path)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)


def _storage(root: str | os.PathLike[str]) -> _Local | _Remote:
    import fsspec

    fs, path = fsspec.core.url_to_fs(os.fspath(root))
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        return _Local(path)
    return _Remote(fs, str(root).rstrip("/"))


_PRIVATE_FILE = 0o600
_PRIVATE_DIR = 0o700
"""Checkpoints hold a job's weights: only the service's user may read them (a shared root
that exists already keeps the mode its operator gave it)."""


def _private_dirs(path: str) -> None:
    """``os.makedirs`` with every directory it creates private (it gives only the last one
    its ``mode``)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it first
            os.mkdir(directory, _PRIVATE_DIR)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _jsonable(value: Any) -> Any:
    """Let a layout hold the workers' frozen dataclasses (stage plans, devices)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointStore:
    """Checkpoints of many jobs under one root: a directory or any fsspec URL."""

    def __init__(self, root: str | os.PathLike[str]):
        self._files = _storage(root)
        self.root = self._files.root

    def _job_dir(self, job_id: str) -> str:
        # The id becomes a directory name: nothing in it may climb out of the root.
        if not _JOB_RE.match(job_id):
            raise ValueError(
                f"job id {job_id!r} cannot name a checkpoint directory; use 1-128 letters,"
                " digits, '.', '_' or '-', starting with a letter or digit"
            )
        return self._files.join(self.root, job_id)

    def write(
        self,
        job_id: str,
        step: int,
        blocks: Mapping[int, dict[str, Any]],
        layout: Mapping[str, Any],
    ) -> CheckpointInfo:
        """Write the states of ``blocks`` (index -> ``Block.state()``) at ``step``, atomically.

        ``layout`` records what the checkpoint was written under (model config, block ranges,
        devices, seed, data cursor...); it must be JSON data or dataclasses of it. An existing
        checkpoint at the same step is replaced.
        """
        files = self._files
        job_dir = self._job_dir(job_id)
        if step < 0 or not blocks or any(i < 0 for i in blocks):
            raise ValueError(
                f"a checkpoint needs a step >= 0 (got {step}) and at least one block with an"
                f" index >= 0 (got {sorted(blocks)})"
            )
        try:
            layout_data = json.loads(json.dumps(dict(layout), default=_jsonable))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the checkpoint layout cannot be stored as JSON: {exc}") from None
        files.makedirs(job_dir)
        name = _step_dir_name(step)
        final = files.join(job_dir, name)
        tmp = files.join(job_dir, f".tmp-{name}-{uuid.uuid4().hex}")
        files.makedirs(tmp)
        try:
            entries = {}
            for index in sorted(blocks):
                block = f"block-{index:05d}.pt"
                entries[block] = files.write(
                    files.join(tmp, block), functools.partial(torch.save, blocks[index])
                )
            manifest = {
                "format_version": FORMAT_VERSION,
                "job_id": job_id,
                "step": step,
                "created_at": time.time(),
                "layout": layout_data,
                "files": entries,
            }
            text = json.dumps(manifest, indent=2, sort_keys=True).encode()
            files.write(files.join(tmp, MANIFEST), lambda w: w.write(text))
            files.publish(tmp, final)
        except BaseException:
            files.remove(tmp)
            raise
        return self._info(job_id, step, final, manifest)

    @staticmethod
    def _info(job_id: str, step: int, path: str, manifest: Mapping[str, Any]) -> CheckpointInfo:
        nbytes = sum(int(entry["bytes"]) for entry in manifest["files"].values())
        return CheckpointInfo(job_id, step, path, nbytes, float(manifest["created_at"]))

    def list(self, job_id: str) -> builtins.list[CheckpointInfo]:
        """The job's complete checkpoints, by step ascending (unreadable manifests skipped)."""
        files = self._files
        job_dir = self._job_dir(job_id)
        if not files.isdir(job_dir):
            return []
        found = []
        for name in files.listdir(job_dir):
            entry = files.join(job_dir, name)
            match = _STEP_RE.match(name)
            if match is None or not files.isfile(files.join(entry, MANIFEST)):
                continue
            try:
                manifest = json.loads(files.read_bytes(files.join(entry, MANIFEST)))
                found.append(self._info(job_id, int(match[1]), entry, manifest))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("skipping checkpoint %s: unreadable manifest (%s)", entry, exc)
        return sorted(found, key=lambda info: info.step)

    def restorable(self, job_id: str) -> Restorable:
        """The newest checkpoint whose every file matches its checksum, read; a corrupt or
        truncated newer one is passed over (and named), never loaded."""
        skipped = []
        for info in reversed(self.list(job_id)):
            try:
                _, blocks = self.read(job_id, info.step)
            except CheckpointError as exc:
                log.warning("checkpoint of %s at step %s is unusable: %s", job_id, info.step, exc)
                skipped.append((info.step, str(exc)))
                continue
            return Restorable(info, blocks, tuple(skipped))
        return Restorable(None, {}, tuple(skipped))

    def latest(self, job_id: str) -> CheckpointInfo | None:
        """The job's newest complete checkpoint, if any."""
        complete = self.list(job_id)
        return complete[-1] if complete else None

    def read(self, job_id: str, step: int) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The manifest and the block states (index -> state) of a checkpoint, all verified."""
        path = self._files.join(self._job_dir(job_id), _step_dir_name(step))
        manifest = self._manifest(job_id, step, path)
        where = self._files.join(path, MANIFEST)
        blocks = {}
        try:
            for name, entry in manifest["files"].items():
                match = _BLOCK_RE.match(name)
                if match is None:
                    raise CheckpointError(f"{where} lists {name!r}, not a block file")
                data = self._verified(
                    self._files.join(path, name), int(entry["bytes"]), str(entry["sha256"])
                )
                blocks[int(match[1])] = torch.load(
                    io.BytesIO(data), map_location="cpu", weights_only=True
                )
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{where} is malformed ({exc!r})") from None
        return manifest, blocks

    def _manifest(self, job_id: str, step: int, path: str) -> dict[str, Any]:
        where = self._files.join(path, MANIFEST)
        try:
            manifest: dict[str, Any] = json.loads(self._files.read_bytes(where))
        except FileNotFoundError:
            steps = [info.step for info in self.list(job_id)]
            raise CheckpointError(
                f"job {job_id} has no complete checkpoint at step {step}; complete ones: {steps}"
            ) from None
        except ValueError as exc:
            raise CheckpointError(f"{where} is corrupt ({exc})") from None
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format version {version}, this Shoal reads {FORMAT_VERSION};"
                " restore it with the Shoal version that wrote it"
            )
        return manifest

    def _verified(self, path: str, nbytes: int, sha256: str) -> bytes:
        # Verify the very bytes that get loaded: a file hashed and then reread could change.
        try:
            data = self._files.read_bytes(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the checkpoint is damaged") from None
        if len(data) != nbytes or hashlib.sha256(data).hexdigest() != sha256:
            raise CheckpointError(
                f"{path} does not match its checksum ({len(data)} bytes, expected {nbytes});"
                " the checkpoint is corrupt, restore an older one"
            )
        return data

    def retain(self, job_id: str, keep: int) -> builtins.list[int]:
        """Delete all but the newest ``keep`` complete checkpoints; return the deleted steps."""
        if keep < 0:
            raise ValueError(f"keep ({keep}) must be >= 0")
        complete = self.list(job_id)
        doomed = complete[: max(0, len(complete) - keep)]
        for info in doomed:
            self._files.discard(info.path)
        return [info.step for info in doomed]
