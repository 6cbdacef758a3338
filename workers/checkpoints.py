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
"""

from __future__ import annotations

import builtins
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

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_BLOCK_RE = re.compile(r"^block-(\d{5,})\.pt$")

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


def _write_durably(path: Path, fill: Callable[[_HashingWriter], object]) -> dict[str, Any]:
    """Write a file through ``fill``, fsync it, and return its manifest entry."""
    with path.open("xb") as file:
        writer = _HashingWriter(file)
        fill(writer)
        file.flush()
        os.fsync(file.fileno())
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.nbytes}


def _fsync_dir(path: Path) -> None:
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
    """Checkpoints of many jobs under one root directory."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def _job_dir(self, job_id: str) -> Path:
        # The id becomes a directory name: nothing in it may climb out of the root.
        if not _JOB_RE.match(job_id):
            raise ValueError(
                f"job id {job_id!r} cannot name a checkpoint directory; use 1-128 letters,"
                " digits, '.', '_' or '-', starting with a letter or digit"
            )
        return self.root / job_id

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
        if not job_dir.is_dir():
            job_dir.mkdir(parents=True, exist_ok=True)
            _fsync_dir(job_dir.parent)
        final = job_dir / _step_dir_name(step)
        tmp = job_dir / f".tmp-{final.name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            files = {}
            for index in sorted(blocks):
                name = f"block-{index:05d}.pt"
                files[name] = _write_durably(
                    tmp / name, functools.partial(torch.save, blocks[index])
                )
            manifest = {
                "format_version": FORMAT_VERSION,
                "job_id": job_id,
                "step": step,
                "created_at": time.time(),
                "layout": layout_data,
                "files": files,
            }
            text = json.dumps(manifest, indent=2, sort_keys=True).encode()
            _write_durably(tmp / MANIFEST, lambda w: w.write(text))
            _fsync_dir(tmp)
            if final.exists():
                self._discard(final)
            tmp.rename(final)
            _fsync_dir(job_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self._info(job_id, step, final, manifest)

    @staticmethod
    def _info(job_id: str, step: int, path: Path, manifest: Mapping[str, Any]) -> CheckpointInfo:
        nbytes = sum(int(entry["bytes"]) for entry in manifest["files"].values())
        return CheckpointInfo(job_id, step, str(path), nbytes, float(manifest["created_at"]))

    def list(self, job_id: str) -> builtins.list[CheckpointInfo]:
        """The job's complete checkpoints, by step ascending (unreadable manifests skipped)."""
        job_dir = self._job_dir(job_id)
        if not job_dir.is_dir():
            return []
        found = []
        for entry in job_dir.iterdir():
            match = _STEP_RE.match(entry.name)
            if match is None or not (entry / MANIFEST).is_file():
                continue
            try:
                manifest = json.loads((entry / MANIFEST).read_bytes())
                found.append(self._info(job_id, int(match[1]), entry, manifest))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("skipping checkpoint %s: unreadable manifest (%s)", entry, exc)
        return sorted(found, key=lambda info: info.step)

    def latest(self, job_id: str) -> CheckpointInfo | None:
        """The job's newest complete checkpoint, if any."""
        complete = self.list(job_id)
        return complete[-1] if complete else None

    def read(self, job_id: str, step: int) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The manifest and the block states (index -> state) of a checkpoint, all verified."""
        path = self._job_dir(job_id) / _step_dir_name(step)
        manifest = self._manifest(job_id, step, path)
        blocks = {}
        try:
            for name, entry in manifest["files"].items():
                match = _BLOCK_RE.match(name)
                if match is None:
                    raise CheckpointError(f"{path / MANIFEST} lists {name!r}, not a block file")
                data = self._verified(path / name, int(entry["bytes"]), str(entry["sha256"]))
                blocks[int(match[1])] = torch.load(
                    io.BytesIO(data), map_location="cpu", weights_only=True
                )
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path / MANIFEST} is malformed ({exc!r})") from None
        return manifest, blocks

    def _manifest(self, job_id: str, step: int, path: Path) -> dict[str, Any]:
        try:
            manifest: dict[str, Any] = json.loads((path / MANIFEST).read_bytes())
        except FileNotFoundError:
            steps = [info.step for info in self.list(job_id)]
            raise CheckpointError(
                f"job {job_id} has no complete checkpoint at step {step}; complete ones: {steps}"
            ) from None
        except ValueError as exc:
            raise CheckpointError(f"{path / MANIFEST} is corrupt ({exc})") from None
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format version {version}, this Shoal reads {FORMAT_VERSION};"
                " restore it with the Shoal version that wrote it"
            )
        return manifest

    @staticmethod
    def _verified(path: Path, nbytes: int, sha256: str) -> bytes:
        # Verify the very bytes that get loaded: a file hashed and then reread could change.
        try:
            data = path.read_bytes()
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
        doomed = complete[: len(complete) - keep]
        for info in doomed:
            self._discard(Path(info.path))
        return [info.step for info in doomed]

    @staticmethod
    def _discard(path: Path) -> None:
        # Renaming first makes the removal atomic for readers: a half-deleted checkpoint
        # would otherwise sit under its own name.
        trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex}")
        path.rename(trash)
        _fsync_dir(path.parent)
        shutil.rmtree(trash)
