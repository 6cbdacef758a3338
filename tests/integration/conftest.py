"""Fixtures of the process-level tests: `shoal up` as a real subprocess on the session's Ray."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from shoal.service.localray import HEALTH_CHECKS, RAY_ENV, LocalRay
from shoal.service.nodeprocs import kill_session

SHOAL = Path(sys.executable).parent / "shoal"
START_TIMEOUT_S = 60.0
"""Imports (torch, ray, fastapi), the Ray connection, migrations and the first tick."""
STOP_TIMEOUT_S = 15.0
POLL_S = 0.1


def wait_until(
    condition: Callable[[], Any],
    timeout_s: float,
    what: str,
    *,
    on_timeout: Callable[[], str] = str,
) -> Any:
    """Poll ``condition`` until it returns something truthy (returned); fail after the timeout
    with what ``on_timeout`` tells then (the state that did not come)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}\n{on_timeout()}")
        time.sleep(POLL_S)
    return value


class ShoalUp:
    """One ``shoal up`` process (its own process group) serving ``home`` against ``database_url``.

    It joins the session's Ray. ``ray.init`` of that cluster turned on Ray token
    authentication in the test process (``RAY_AUTH_MODE=token``, the token from
    ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``); the child inherits both from the environment.
    """

    def __init__(
        self,
        home: Path,
        database_url: str,
        ray_address: str | None,
        log_path: Path,
        *,
        devices: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.home = home
        self.database_url = database_url
        self.ray_address = ray_address
        self.devices = devices
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.url = ""

    @property
    def token_path(self) -> Path:
        return self.home / "admin.token"

    def start(self) -> ShoalUp:
        """Start the process and return once its API is ready (``/readyz`` answers 200)."""
        if not SHOAL.exists():
            pytest.fail(f"{SHOAL} not found; install the project into the venv (make test does)")
        # A previous run's address must not be mistaken for this run's.
        (self.home / "client.json").unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env.update(
            SHOAL_HOME=str(self.home),
            SHOAL_DATABASE_URL=self.database_url,
            SHOAL_POLL_INTERVAL_S="0.1",
        )
        if self.devices is not None:
            env["SHOAL_DEVICES"] = self.devices
        env.update(self.env)
        self._log = self.log_path.open("ab")
        self._log.write(f"\n===== shoal up at {time.strftime('%H:%M:%S')}\n".encode())
        self._log.flush()
        # Without an address, `shoal up` starts its own local Ray, one node per device group.
        where = ["--ray-address", self.ray_address] if self.ray_address else []
        args = [str(SHOAL), "up", *where, "--port", "0"]
        self.process = subprocess.Popen(
            [*args, "--home", str(self.home)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url = wait_until(
            self._client_url, self.start_timeout_s, "client.json", on_timeout=self.tail
        )
        wait_until(self._ready, self.start_timeout_s, f"{self.url}/readyz", on_timeout=self.tail)
        return self

    def _check_alive(self) -> None:
        assert self.process is not None
        code = self.process.poll()
        if code is not None:
            pytest.fail(f"shoal up exited with code {code}\n{self.tail()}")

    def _client_url(self) -> str | None:
        self._check_alive()
        try:
            url = json.loads((self.home / "client.json").read_text())["url"]
        except (FileNotFoundError, ValueError):  # not written yet, or half-written
            return None
        return str(url)

    def _ready(self) -> bool:
        self._check_alive()
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def kill9(self) -> None:
        """SIGKILL the whole process group (Ray's processes are not in it) and reap it."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self._close_log()

    def stop(self) -> None:
        """SIGTERM, a bounded wait, then SIGKILL of the group. Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group, if any
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int = 60) -> str:
        """The log's last ``lines`` lines but the access log's (each poll of a test is one)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        kept = [line for line in text.splitlines() if " uvicorn.access: " not in line]
        return f"--- last lines of {self.log_path}:\n" + "\n".join(kept[-lines:])


@contextlib.contextmanager
def started_shoals() -> Iterator[list[ShoalUp]]:
    """The ``shoal up`` processes a fixture starts: stopped at the end, the last one's output
    printed (pytest shows it when the test failed)."""
    started: list[ShoalUp] = []
    try:
        yield started
    finally:
        for process in started:
            process.stop()
        if started:
            print(started[-1].tail(lines=200))


@pytest.fixture
def empty_database(database_url: str, request: pytest.FixtureRequest) -> str:
    """The test's database: a new SQLite file, or the session's PostgreSQL database emptied."""
    if not database_url.startswith("sqlite"):
        # Shared by the session: jobs other tests left QUEUED would be placed by this Shoal.
        request.getfixturevalue("session_factory")
    return database_url


@pytest.fixture
def shoal_up(ray_address: str, tmp_path: Path) -> Iterator[Callable[[Path, str], ShoalUp]]:
    """Starts ``shoal up`` processes on the session's Ray."""
    with started_shoals() as started:

        def start(home: Path, database_url: str, **env: str) -> ShoalUp:
            log = tmp_path / "shoal-up.log"
            process = ShoalUp(home, database_url, ray_address, log, env=env)
            started.append(process)
            return process.start()

        yield start


@pytest.fixture
def shoal_cluster(tmp_path: Path) -> Iterator[Callable[[Path, str, str], ShoalUp]]:
    """Starts ``shoal up`` processes that run their own multi-node local Ray (``SHOAL_DEVICES``
    groups, one node each); stopping them stops those clusters and every actor on them."""
    with started_shoals() as started:

        def start(home: Path, database_url: str, devices: str) -> ShoalUp:
            # Each node of the cluster is a `ray start` of its own: a few seconds apiece.
            process = ShoalUp(
                home,
                database_url,
                None,
                tmp_path / "shoal-up.log",
                devices=devices,
                start_timeout_s=180.0,
            )
            started.append(process)
            return process.start()

        yield start


@pytest.fixture
def runner_reaper(ray_address: str) -> Iterator[list[str]]:
    """Job ids whose runner actors (detached, in the session's Ray) are killed at the end."""
    from shoal.workers.actors import kill_runner

    job_ids: list[str] = []
    yield job_ids
    for job_id in job_ids:
        kill_runner(job_id)


def ray_env(shoal: ShoalUp) -> dict[str, str]:
    """The environment of a ``ray`` command reaching the cluster ``shoal`` started."""
    return {**os.environ, **HEALTH_CHECKS, **LocalRay.read_env(shoal.home / RAY_ENV)}


def on_cluster(shoal: ShoalUp, command: list[str], what: str, timeout: float = 60.0) -> str:
    """Run ``command`` (``what`` it does, for a failure's message) with the environment
    that reaches ``shoal``'s cluster; its stdout."""
    done = subprocess.run(
        command, capture_output=True, text=True, env=ray_env(shoal), timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{what}: {done.stdout}{done.stderr}"
    return done.stdout


def ray_cli(shoal: ShoalUp, *args: str) -> str:
    """Run Ray's own ``ray`` command against ``shoal``'s cluster; its stdout."""
    return on_cluster(shoal, [str(SHOAL.parent / "ray"), *args], f"ray {' '.join(args)}")


RUNNER_NODE = """
import sys, ray
from shoal.workers.actors import HEAD_RESOURCE, find_runner
ray.init(log_to_driver=False, logging_level="ERROR")
runner = find_runner(sys.argv[1])
where = runner.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
heads = [n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD_RESOURCE in n["Resources"]]
print(ray.get(where, timeout=60), *heads)
"""


def runner_and_head_nodes(shoal: ShoalUp, job_id: str) -> tuple[str, str]:
    """The node a job's runner actor lives on and the cluster's head node, asked of Ray by
    a driver of its own."""
    command = [sys.executable, "-c", RUNNER_NODE, job_id]
    runner, head = on_cluster(shoal, command, "asking Ray for the runner's node", 120.0).split()
    return runner, head


@contextlib.contextmanager
def joined_node(shoal: ShoalUp, group: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``shoal node GROUP``: a node declaring the device group ``group`` joins ``shoal``'s
    cluster, as a new machine does; SIGKILLed with all it started at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [str(SHOAL), "node", group, "--home", str(shoal.home)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_S)
            kill_session(process.pid, time.monotonic() + STOP_TIMEOUT_S)
