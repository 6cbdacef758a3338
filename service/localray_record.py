"""The record `shoal up` keeps in its home of the local Ray cluster it runs, and the
identities of that cluster's processes: what a restarted `shoal up` needs to adopt the
cluster, or to stop every process of it, without ever touching another process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECORD = "local-ray.json"
"""The file in ``SHOAL_HOME`` naming the local cluster of `shoal up` while it may run."""

_PS_ENV = {**os.environ, "LC_ALL": "C", "TZ": "UTC"}
"""``ps`` writes start times in the locale and time zone: fixed, so a record reads back."""


class RecordError(ValueError):
    """The record cannot be read; the message names the file and what to do."""


@dataclass(frozen=True)
class ProcessId:
    """A process as recorded: its pid and its start time, so that a pid the system has
    given to another process since is never taken for it."""

    pid: int
    started: str

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The live (not zombie) process ``pid`` now, or None."""
        listing = subprocess.run(
            ["ps", "-o", "stat=,lstart=", "-p", str(pid)],
            capture_output=True,
            text=True,
            check=False,
            env=_PS_ENV,
        ).stdout.strip()
        if not listing:
            return None
        state, _, started = listing.partition(" ")
        return None if state.startswith("Z") else cls(pid, " ".join(started.split()))

    @classmethod
    def this_process(cls) -> ProcessId:
        me = cls.of(os.getpid())
        if me is None:  # pragma: no cover - ps cannot fail to list its own parent
            raise RuntimeError("ps does not list this process")
        return me

    def alive(self) -> bool:
        """Whether this very process (same pid, same start time) still runs."""
        return ProcessId.of(self.pid) == self

    def pid_reused(self) -> bool:
        """Whether another process runs under this process's pid now."""
        now = ProcessId.of(self.pid)
        return now is not None and now != self


@dataclass(frozen=True)
class NodeRecord:
    """One node: its device group, its ``ray start --block`` process (which leads the
    node's session: the raylet, the GCS and the workers run in it) and its log."""

    group: str
    process: ProcessId
    log_path: str


@dataclass(frozen=True)
class ClusterRecord:
    """The local cluster: where it listens, its auth token, the `shoal up` that owns it,
    and its nodes, head first."""

    address: str
    token: str
    owner: ProcessId
    nodes: tuple[NodeRecord, ...]

    def write(self, path: Path) -> None:
        """Write it whole or not at all (a temporary file renamed), readable by the owner
        only (it holds the cluster's token)."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(asdict(self), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> ClusterRecord | None:
        """The record at ``path``, or None if there is none."""
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return cls(
                address=str(data["address"]),
                token=str(data["token"]),
                owner=ProcessId(**data["owner"]),
                nodes=tuple(
                    NodeRecord(str(n["group"]), ProcessId(**n["process"]), str(n["log_path"]))
                    for n in data["nodes"]
                ),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise RecordError(
                f"cannot read {path} ({exc!r}), the record of the local Ray cluster a previous"
                " `shoal up` started: stop that cluster's `ray start` processes if any still"
                " run, then delete the file"
            ) from None

    @staticmethod
    def remove(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
