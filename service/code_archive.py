"""The archive a user's code travels in: a zip of a directory's files, made and checked here.

``shoal submit --code DIR`` packs DIR with ``pack_directory``: its files at the archive's
root (``DIR/models.py`` is ``models.py``), in name order with fixed timestamps, so the same
files always make the same bytes and so the same digest. The server checks an upload with
``inspect_archive`` before keeping it, without extracting or importing anything: Ray
unpacks it on the nodes as the workers' working directory (``runtime_env`` ``working_dir``),
where its top-level modules are imported by ``code:`` factories.
"""

from __future__ import annotations

import io
import stat
import sys
import zipfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path, PurePosixPath

MAX_FILES = 10_000
MAX_PACKED_BYTES = 2**30
"""The most a client packs before the server's limit (SHOAL_CODE_MAX_BYTES) can say no."""
UNPACKED_FACTOR = 4
"""An archive may unpack to at most this many times the largest upload."""

_SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", ".venv", ".mypy_cache"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo")
_EPOCH = (1980, 1, 1, 0, 0, 0)


class ArchiveError(ValueError):
    """The archive cannot be used as a job's code; the message says why and what to change."""


@dataclass(frozen=True)
class ArchiveContents:
    modules: tuple[str, ...]
    """The top-level import names it provides (``models`` for ``models.py`` or ``models/``)."""
    files: int
    unpacked_bytes: int


def pack_directory(directory: Path, max_bytes: int = MAX_PACKED_BYTES) -> bytes:
    """``directory``'s files as a zip, the same bytes for the same files; caches, version
    control folders and byte code left out. ``ArchiveError`` if it holds no Python file or
    packs to more than ``max_bytes`` (the server refuses what is over its own limit)."""
    if not directory.is_dir():
        raise ArchiveError(f"{directory} is not a directory; pass the folder holding your code")
    files = sorted(_walk(directory))
    if not any(path.suffix == ".py" for path in files):
        raise ArchiveError(f"{directory} holds no .py file; pass the folder with your modules")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            entry = zipfile.ZipInfo(path.relative_to(directory).as_posix(), date_time=_EPOCH)
            entry.external_attr = (stat.S_IFREG | 0o644) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, path.read_bytes())
    data = buffer.getvalue()
    if len(data) > max_bytes:
        raise ArchiveError(
            f"{directory} packs to {len(data)} bytes, over the {max_bytes} a code upload may"
            " have; leave data and checkpoints out (the data factory can read them on the nodes)"
        )
    return data


def _walk(directory: Path) -> list[Path]:
    found = []
    for path in directory.rglob("*"):
        if any(part in _SKIPPED_DIRS for part in path.relative_to(directory).parts):
            continue
        if path.is_symlink():
            raise ArchiveError(f"{path} is a symbolic link; copy the file it points to instead")
        if path.is_file() and not path.name.endswith(_SKIPPED_SUFFIXES):
            found.append(path)
    return found


def inspect_archive(data: bytes, max_unpacked_bytes: int) -> ArchiveContents:
    """Check an uploaded archive without extracting it: a zip of plain files with safe
    relative names, at most ``max_unpacked_bytes`` unpacked, providing at least one
    top-level module, none of which would hide an installed module on the workers."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise ArchiveError(
            "the upload is not a zip archive; send a zip of your code's folder (`shoal submit"
            " --code DIR` makes one)"
        ) from None
    with archive:
        entries = archive.infolist()
    if len(entries) > MAX_FILES:
        raise ArchiveError(f"the archive holds {len(entries)} entries; at most {MAX_FILES}")
    modules: set[str] = set()
    unpacked = 0
    for entry in entries:
        _check_entry(entry)
        unpacked += entry.file_size
        module = _top_level_module(PurePosixPath(entry.filename))
        if module is not None:
            modules.add(module)
    if unpacked > max_unpacked_bytes:
        raise ArchiveError(
            f"the archive unpacks to {unpacked} bytes, over the {max_unpacked_bytes} allowed"
        )
    if not modules:
        raise ArchiveError(
            "the archive holds no Python module at its root (a .py file, or a folder with"
            " one); zip the folder's contents, not the folder"
        )
    for module in sorted(modules):
        _check_not_hiding(module)
    return ArchiveContents(tuple(sorted(modules)), len(entries), unpacked)


def _check_entry(entry: zipfile.ZipInfo) -> None:
    name = entry.filename
    path = PurePosixPath(name)
    if "\\" in name or path.is_absolute() or ".." in path.parts or not path.parts:
        raise ArchiveError(
            f"archive entry {name!r} is not a plain relative path; zip the folder's files only"
        )
    if stat.S_ISLNK(entry.external_attr >> 16):
        raise ArchiveError(f"archive entry {name!r} is a symbolic link; store the file itself")
    if entry.flag_bits & 0x1:
        raise ArchiveError(f"archive entry {name!r} is encrypted; upload it unencrypted")


def _top_level_module(path: PurePosixPath) -> str | None:
    """The module a file makes importable at the archive's root, if any."""
    if path.suffix != ".py":
        return None
    top = path.parts[0] if len(path.parts) > 1 else path.stem
    return top if top.isidentifier() else None


def _check_not_hiding(module: str) -> None:
    """The workers import uploaded modules before installed ones (the working directory is
    first on their path): one named like the standard library or an installed package would
    break Shoal's own code in the job's processes."""
    if module in sys.stdlib_module_names or module in sys.builtin_module_names:
        raise ArchiveError(
            f"the archive's top-level module {module!r} has the name of a standard library"
            " module and would hide it; rename it"
        )
    if find_spec(module) is not None:
        raise ArchiveError(
            f"the archive's top-level module {module!r} has the name of an installed module"
            " and would hide it on the workers; rename it (or put it in a package of your own)"
        )
