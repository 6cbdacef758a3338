"""Starts and stops the local Ray cluster of `shoal up`.

The cluster is one ``ray start --block`` node per device group of ``SHOAL_DEVICES``: the
first group is the head, the others join it. Every node declares its virtual devices the
way ``scheduler.devices`` reads them back (the ``shoal_device`` resource and the
``shoal.io/*`` labels), so one laptop acts out a heterogeneous, spot-laden cluster.

The cluster uses Ray token authentication with a fresh token of its own; a process that
connects to it needs ``LocalRay.client_env`` in its environment (Ray turns token auth on
only for clusters it discovers, never for an explicit address).

The nodes are processes of their own: a `shoal up` killed without a chance to stop them
(SIGKILL, a crash) leaves them running, and the jobs' detached runners on them training.
So the cluster is recorded in ``SHOAL_HOME`` (``service.localray_record``) while it may
run, and the next `shoal up` there adopts it, runners and all, or, when it cannot be used,
stops every process of it before starting anything: never two copies of one job.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from shoal.service.devicespec import VirtualNode
from shoal.service.localray_record import ClusterRecord, NodeRecord, ProcessId, RecordError
from shoal.service.nodeprocs import kill_node, signal_group
from shoal.service.raynode import LOOPBACK, free_port, node_command

HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
"""A node that stops answering is declared dead after 3 missed checks of 2 s each (~3-6 s)
instead of Ray's default ~15 s (5 missed checks, 3 s apart): a lost spot node's workers are
given up on, and recovered, that much sooner. A 1 s timeout was measured too tight on a
saturated 2-core machine (a busy raylet was declared dead while new workers started). Set
the same variables on a real cluster's head to get the same."""

WORKER_PRESTART = {
    "RAY_enable_worker_prestart": "true",
    "RAY_preload_python_modules": "shoal.workers.actors",
}
"""For a node that joins a running cluster: it starts one Python worker per CPU as it
starts, with Shoal's actor code (torch with it) imported before it takes work, so the first
workers placed there (a job growing onto the node) start without that import. In ``shoal
bench elastic`` the new node's worker was built 2.3-3.0 s after the node was alive (6 runs),
against 3.9-5.4 s without (4 runs; 2-core machine). Not set for the nodes a local cluster
starts with: on one shared machine, prestarting on every node coincided with a lower
Shoal / best in that bench (docs/benchmarks.md). ``shoal node`` sets it, and
``deploy/k8s``'s ``settings.env`` for every Ray pod (each with cores of its own)."""

RAY_ENV = "ray.env"
"""The file in ``SHOAL_HOME`` where `shoal up` leaves its local cluster's address and token."""


class LocalRayError(RuntimeError):
    """The local Ray cluster did not start; the message points to the log to read."""


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


# Runs in a child process so that the caller's own Ray connection (if any) is left alone.
_WAIT_SCRIPT = """
import sys, time
import ray
address, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
ray.init(address=address, log_to_driver=False, logging_level="ERROR")
while (alive := sum(1 for n in ray.nodes() if n["Alive"])) < want:
    if time.monotonic() > deadline:
        sys.exit(f"{alive} of {want} Ray nodes alive")
    time.sleep(0.25)
"""


@dataclass
class _Node:
    """A node's ``ray start --block``: ``process`` if this `shoal up` started it, None if
    it adopted it from an earlier one (then only ``identity`` knows it)."""

    spec: VirtualNode
    log_path: Path
    identity: ProcessId
    process: subprocess.Popen[bytes] | None
    log: IO[bytes] | None

    def ended(self) -> str | None:
        """None while the node runs, else how it ended."""
        if self.process is not None:
            code = self.process.poll()
            return None if code is None else f"exited with code {code}"
        return None if self.identity.alive() else "is gone"


class LocalRay:
    """A local Ray cluster, one ``ray start --block`` process group per node; a context manager."""

    def __init__(
        self,
        nodes: Sequence[VirtualNode],
        log_dir: Path,
        *,
        record_path: Path | None = None,
        start_timeout_s: float = 120.0,
        adopt_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        poll_interval_s: float = 0.25,
    ) -> None:
        """``record_path``: where the cluster is recorded while it may run; a cluster
        recorded there by an earlier `shoal up` is adopted or stopped by ``start``."""
        if not nodes:
            raise ValueError("a local Ray cluster needs at least one device group")
        self._specs = tuple(nodes)
        self._log_dir = log_dir
        self._record_path = record_path
        self._start_timeout_s = start_timeout_s
        self._adopt_timeout_s = adopt_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._poll_interval_s = poll_interval_s
        self._ray = Path(sys.executable).parent / "ray"
        self._token = secrets.token_hex(32)
        self._port: int | None = None
        self._nodes: list[_Node] = []
        self._env_path: Path | None = None
        self.previous: str | None = None
        """What ``start`` did with a cluster an earlier `shoal up` left running, if any."""

    @property
    def address(self) -> str:
        """The head's GCS address, ``127.0.0.1:PORT``."""
        if self._port is None:
            raise RuntimeError("the local Ray cluster is not started; call start() first")
        return f"{LOOPBACK}:{self._port}"

    @property
    def client_env(self) -> dict[str, str]:
        """Environment a process needs to connect to this cluster (its auth token)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self._token}

    def write_env(self, path: Path) -> None:
        """Write what a ``ray`` command needs to reach this cluster (``RAY_ADDRESS`` and
        the token) as ``NAME=value`` lines, readable by the owner only; removed on stop."""
        text = "".join(
            f"{k}={v}\n" for k, v in {"RAY_ADDRESS": self.address, **self.client_env}.items()
        )
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        self._env_path = path

    @staticmethod
    def read_env(path: Path) -> dict[str, str]:
        """The variables ``write_env`` wrote to ``path``."""
        lines = path.read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    @property
    def pids(self) -> list[int]:
        """Process ids (and process-group and session ids) of the ``ray start`` processes,
        head first."""
        return [node.identity.pid for node in self._nodes]

    @property
    def kinds(self) -> list[str]:
        """Each node's device kind, head first: ``kill_node`` takes an index of this list."""
        return [node.spec.kind for node in self._nodes]

    @property
    def log_paths(self) -> list[Path]:
        return [node.log_path for node in self._nodes]

    def start(self) -> LocalRay:
        """Start every node and return once all are alive; on failure nothing is left running.

        A cluster recorded at ``record_path`` by an earlier `shoal up` is adopted instead
        (its actors with it) if it runs the same device groups and answers within
        ``adopt_timeout_s``; otherwise every process of it is stopped first.
        """
        if self._nodes:
            raise RuntimeError("the local Ray cluster is already started")
        if not self._ray.exists():
            raise LocalRayError(f"{self._ray} not found; install ray into {sys.prefix}")
        if self._record_path is not None and self._adopt(self._record_path):
            return self
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._token = secrets.token_hex(32)
        self._port = free_port()
        atexit.register(self.stop)
        limit = self._start_timeout_s
        deadline = time.monotonic() + limit
        try:
            head = self._launch(0, self._specs[0])
            while not _accepts(self._port):
                self._check_running(deadline, limit, "the Ray head to accept connections", head)
                time.sleep(self._poll_interval_s)
            # One node at a time: nodes joining together pick the same socket names in the
            # session directory and one raylet dies ("bind: Address already in use").
            for index, spec in enumerate(self._specs[1:], start=1):
                self._launch(index, spec)
                self._wait_alive(deadline, limit)
            if len(self._specs) == 1:
                self._wait_alive(deadline, limit)
        except BaseException:
            self.stop()
            raise
        return self

    def _adopt(self, path: Path) -> bool:
        """Adopt the cluster recorded at ``path`` if it is usable (True); else stop every
        process of it and forget it (False)."""
        record = _read_record(path)
        if record is None:
            return False
        where = f"the local Ray cluster at {record.address} an earlier `shoal up` left running"
        reason = self._unusable(record)
        if reason is None:
            self._token = record.token
            self._port = int(record.address.rpartition(":")[2])
            self._nodes = [
                _Node(spec, Path(node.log_path), node.process, None, None)
                for spec, node in zip(self._specs, record.nodes, strict=True)
            ]
            atexit.register(self.stop)
            self._write_record()  # this process owns it now: no other `shoal up` takes it
            try:
                timeout = self._adopt_timeout_s
                self._log_dir.mkdir(parents=True, exist_ok=True)  # the wait's probe logs there
                self._wait_alive(time.monotonic() + timeout, timeout)
            except LocalRayError as exc:
                reason = str(exc)
                self.stop()
            else:
                self.previous = f"adopted {where}, with the jobs running on it"
                return True
        else:
            _stop_recorded(record, path, time.monotonic() + self._stop_timeout_s)
        self.previous = f"stopped {where}: {reason}"
        return False

    def _unusable(self, record: ClusterRecord) -> str | None:
        """Why the recorded cluster cannot be adopted, or None."""
        recorded = [node.group for node in record.nodes]
        wanted = [spec.group for spec in self._specs]
        if recorded != wanted:
            return f"it runs the device groups {','.join(recorded)}, not {','.join(wanted)}"
        gone = [node.group for node in record.nodes if not node.process.alive()]
        if gone:
            return f"its node {gone[0]} is gone"
        host, _, port = record.address.rpartition(":")
        if host != LOOPBACK or not port.isdigit() or not _accepts(int(port)):
            return f"its head does not accept connections at {record.address}"
        return None

    def add_node(self, spec: VirtualNode) -> None:
        """Start one more node (a new machine joining); returns once Ray sees it alive."""
        if not self._nodes:
            raise RuntimeError("the local Ray cluster is not started; call start() first")
        self._launch(len(self._nodes), spec, joining=True)
        self._wait_alive(time.monotonic() + self._start_timeout_s, self._start_timeout_s)

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index`` (not the head) and every process it started: a node lost
        without notice, as a preempted spot machine is."""
        if index == 0:
            raise ValueError("the head holds the cluster's state; kill another node")
        self._reap(self._nodes[index])
        self._nodes.pop(index)
        self._write_record()

    def _launch(self, index: int, spec: VirtualNode, *, joining: bool = False) -> _Node:
        if index == 0:
            args = node_command(self._ray, spec, head_port=self._port)
        else:
            args = node_command(self._ray, spec, address=self.address)
        log_path = self._log_dir / f"ray-{index}-{spec.kind}.log"
        log = log_path.open("ab")
        log.write(f"$ {' '.join(args)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self._child_env(), **(WORKER_PRESTART if joining else {})},
            start_new_session=True,
        )
        # No start time if it exited at once: a successor never takes its pid for it.
        identity = ProcessId.of(process.pid) or ProcessId(process.pid, "")
        node = _Node(spec, log_path, identity, process, log)
        self._nodes.append(node)
        # Recorded before it can have started anything: a `shoal up` killed from here on
        # leaves nothing its successor does not know of.
        self._write_record()
        return node

    def _write_record(self) -> None:
        if self._record_path is None:
            return
        nodes = [NodeRecord(n.spec.group, n.identity, str(n.log_path)) for n in self._nodes]
        record = ClusterRecord(self.address, self._token, ProcessId.this_process(), tuple(nodes))
        record.write(self._record_path)

    def _check_running(self, deadline: float, limit: float, waiting_for: str, node: _Node) -> None:
        """Raise if a node ended or ``deadline`` (``limit`` s after the wait began) passed."""
        for each in self._nodes:
            ended = each.ended()
            if ended is not None:
                raise LocalRayError(
                    f"the Ray node for device group {each.spec.kind} {ended}"
                    f" while waiting for {waiting_for}; see {each.log_path}"
                )
        if time.monotonic() > deadline:
            raise LocalRayError(
                f"timed out after {limit:g} s waiting for {waiting_for}; see {node.log_path}"
            )

    def _wait_alive(self, deadline: float, limit: float) -> None:
        waiting_for = f"{len(self._nodes)} Ray nodes to be alive"
        probe_log = self._log_dir / "ray-wait.log"
        remaining = f"{max(deadline - time.monotonic(), 0.0):.1f}"
        args = [sys.executable, "-c", _WAIT_SCRIPT, self.address, str(len(self._nodes)), remaining]
        with probe_log.open("wb") as log:
            probe = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._child_env(),
            )
            try:
                while probe.poll() is None:
                    self._check_running(deadline + 5.0, limit, waiting_for, self._nodes[-1])
                    time.sleep(self._poll_interval_s)
            finally:
                if probe.poll() is None:
                    probe.kill()
                    probe.wait()
        if probe.returncode != 0:
            lines = probe_log.read_text(errors="replace").strip().splitlines() or ["no output"]
            raise LocalRayError(
                f"the local Ray cluster did not come up ({lines[-1]}) while waiting for"
                f" {waiting_for}; see {probe_log} and"
                f" {', '.join(str(path) for path in self.log_paths)}"
            )

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, **HEALTH_CHECKS, **self.client_env}
        # An explicit token wins over these; an inherited address must not redirect `ray`.
        for name in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
            env.pop(name, None)
        return env

    def stop(self) -> None:
        """Stop every node with SIGKILL (its process group, then whatever of its session is
        left). Idempotent. The whole cluster goes, its work with it: Ray's own answer to a
        SIGTERM, draining the node for up to 30 s until no work is left on it, would only
        wait (measured: `shoal up` on an idle 2-node cluster took 12.3 s to stop, now 2.2 s).

        A node leaves the list only once its session is gone, so a stop cut short (a second
        Ctrl-C) is finished by the one registered for exit, and the record only once every
        node has, so a stop cut shorter still is finished by the next `shoal up`.
        """
        for node in self._nodes:
            if node.process is not None:
                signal_group(node.process.pid, signal.SIGKILL)
        while self._nodes:
            self._reap(self._nodes[0])
            self._nodes.pop(0)
        self._port = None
        if self._env_path is not None:
            self._env_path.unlink(missing_ok=True)
            self._env_path = None
        if self._record_path is not None:
            ClusterRecord.remove(self._record_path)
        atexit.unregister(self.stop)

    def _reap(self, node: _Node) -> None:
        """SIGKILL the node's process group and every process left of its session."""
        kill_node(node.identity, node.process, time.monotonic() + self._stop_timeout_s)
        if node.log is not None:
            node.log.close()

    @staticmethod
    def stop_recorded(path: Path, *, stop_timeout_s: float = 10.0) -> str | None:
        """Stop every process of the cluster recorded at ``path`` (an earlier `shoal up`
        left it running) and forget it; what was done, or None if nothing was recorded.
        For a `shoal up` that will not run the local cluster (``--ray-address``): the
        runners on the old cluster would otherwise train beside the ones it starts."""
        record = _read_record(path)
        if record is None:
            return None
        _stop_recorded(record, path, time.monotonic() + stop_timeout_s)
        return f"stopped the local Ray cluster at {record.address} an earlier `shoal up` left"

    def __enter__(self) -> LocalRay:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _read_record(path: Path) -> ClusterRecord | None:
    """The cluster recorded at ``path`` if no live `shoal up` owns it; None if none is."""
    try:
        record = ClusterRecord.read(path)
    except RecordError as exc:
        raise LocalRayError(str(exc)) from None
    if record is not None and record.owner.alive():
        raise LocalRayError(
            f"another `shoal up` (pid {record.owner.pid}) runs the local Ray cluster recorded"
            f" in {path}; stop it first, or give this one a --home of its own"
        )
    return record


def _stop_recorded(record: ClusterRecord, path: Path, deadline: float) -> None:
    for node in record.nodes:
        kill_node(node.process, None, deadline)
    ClusterRecord.remove(path)
