"""``shoal bench api``: a bounded load test of the control plane's REST API on loopback.

A scratch database (a SQLite file, or a database of its own on a PostgreSQL server) gets
``jobs`` jobs of one (non-admin) user; the real app (no controller: nothing trains) is served
by uvicorn in a process of its own, as ``shoal up`` serves it (uvloop, httptools, access log
off), so the load generator here does not share its interpreter lock. Then:

1. *Status*: ``clients`` concurrent clients (asyncio, one keep-alive connection each)
   for ``duration_s``: each loops ``GET /jobs/{id}`` of a random seeded job and, every 10th
   request, ``GET /jobs?limit=50``. Each client's first request is a warm-up, not counted.
2. *Submissions*: ``submissions`` distinct ``Idempotency-Key``s, each sent twice at once
   (``2 x submissions`` concurrent ``POST /jobs``); the database must then hold exactly one
   job per key, and both answers of a key must name that job.

Every client has a token of its own (all of one user), as separate clients would: the API
rate-limits each token, and the limiter stays on, since it is part of what a request costs,
at 1,000 requests/s per token unless ``SHOAL_RATE_LIMIT_PER_S`` says otherwise.

Latencies are taken in the load generator, so they include its own queueing: on 2 cores
the server and the client share the CPU, and a saturated client inflates the tail.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from shoal.service.bench.data import SPEC, fill
from shoal.service.bench.http_load import Connection
from shoal.service.bench.report import BenchError, Progress, machine
from shoal.service.db.models import Job
from shoal.service.db.scratch import create_database, drop_database
from shoal.service.db.session import make_engine
from shoal.service.raynode import free_port
from shoal.service.settings import Settings

API_KEYS = (
    "status_requests_per_s",
    "p50_ms",
    "p99_ms",
    "errors",
    "submissions",
    "jobs_created",
)
"""The keys ``shoal bench api --json`` always prints, first (the issue's)."""

API_PHASES = (
    "seeding the database",
    "starting the server",
    "status and listing load",
    "idempotent submissions",
)
LIST_EVERY = 10
"""Every 10th request of a status client lists jobs instead."""
ROUTES = {
    "status": "GET /api/v1/jobs/{id}",
    "list": "GET /api/v1/jobs?limit=50",
    "submit": "POST /api/v1/jobs",
}
SERVER_START_S = 60.0
SUBMIT_TIMEOUT_S = 120.0
STARTED = "Application startup complete"
"""What uvicorn logs (at info, the level the bench serves at: no access log) per worker."""
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Timeout)\b.*")


@dataclass(frozen=True)
class ApiSettings:
    clients: int = 50
    duration_s: float = 30.0
    submissions: int = 200
    jobs: int = 500
    workers: int = 1
    """Processes serving the API (``SHOAL_API_WORKERS`` of ``shoal up``)."""
    database_url: str | None = None
    """A PostgreSQL server to make a scratch database on; None: a SQLite file."""
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.clients, self.submissions, self.jobs, self.workers) < 1:
            raise ValueError("clients, submissions, jobs and workers must be >= 1")
        if self.duration_s <= 0:
            raise ValueError(f"duration must be > 0 seconds, not {self.duration_s}")
        if self.database_url is not None and not self.database_url.startswith("postgresql"):
            raise ValueError(
                "--database-url must be a PostgreSQL server's URL (postgresql+psycopg://...);"
                " leave it out for a scratch SQLite file"
            )


@dataclass
class Samples:
    """One phase's outcome as the load generator saw it."""

    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    """Successful requests' latencies by kind (``status``, ``list``, ``submit``)."""
    errors: list[str] = field(default_factory=list)
    """One line per failed request: its status code or transport error, and its route."""
    seconds: float = 0.0

    def add(self, kind: str, started: float, error: str | None) -> None:
        """A request of ``kind`` sent at ``started`` has ended, with ``error`` (a status code
        or an exception's name) or None."""
        if error is None:
            elapsed = (time.perf_counter() - started) * 1000
            self.latencies_ms.setdefault(kind, []).append(elapsed)
        else:
            self.errors.append(f"{error} {ROUTES[kind]}")

    def all_ms(self) -> list[float]:
        return [ms for values in self.latencies_ms.values() for ms in values]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def api_result(
    settings: ApiSettings,
    load: Samples,
    submit: Samples,
    *,
    jobs_created: int,
    keys_split: int,
    during_load: dict[str, float | None],
    server: dict[str, Any],
    server_errors: list[str],
    started: float,
) -> dict[str, Any]:
    """The JSON object of ``shoal bench api``: the issue's keys first, then the breakdown.

    ``status_requests_per_s`` counts every successful phase-1 request (status and listing)
    over the phase's wall time (the last requests end a little after ``duration_s``)."""
    ok = sum(len(v) for v in load.latencies_ms.values())
    every = load.all_ms()
    status, listing = load.latencies_ms.get("status", []), load.latencies_ms.get("list", [])
    submit_ms = submit.latencies_ms.get("submit", [])
    return {
        "status_requests_per_s": round(ok / load.seconds, 1) if load.seconds else 0.0,
        "p50_ms": round(percentile(every, 0.5), 2),
        "p99_ms": round(percentile(every, 0.99), 2),
        "errors": len(load.errors) + len(submit.errors),
        "submissions": settings.submissions,
        "jobs_created": jobs_created,
        "submit_p99_ms": round(percentile(submit_ms, 0.99), 2),
        "submit_p50_ms": round(percentile(submit_ms, 0.5), 2),
        "submit_requests": 2 * settings.submissions,
        "submit_keys_answered_differently": keys_split,
        "requests": ok,
        "status_requests": len(status),
        "list_requests": len(listing),
        "status_p50_ms": round(percentile(status, 0.5), 2),
        "status_p99_ms": round(percentile(status, 0.99), 2),
        "list_p50_ms": round(percentile(listing, 0.5), 2),
        "list_p99_ms": round(percentile(listing, 0.99), 2),
        "max_ms": round(max(every, default=0.0), 2),
        "load_seconds": round(load.seconds, 2),
        "submit_seconds": round(submit.seconds, 2),
        "rate_limited": sum(e.startswith("429 ") for e in load.errors + submit.errors),
        "error_samples": sorted(set(load.errors + submit.errors))[:5],
        "server_errors": server_errors,
        "during_load": during_load,
        "settings": asdict(settings),
        "server": server,
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }


@contextmanager
def scratch_database(server_url: str | None, home: Path) -> Iterator[str]:
    """A new, empty database (a SQLite file under ``home``, or one made on the PostgreSQL
    server at ``server_url`` and dropped afterwards); its URL."""
    if server_url is None:
        yield f"sqlite:///{home / 'shoal.db'}"
        return
    try:
        url = create_database(server_url, "shoal_bench")
    except sa.exc.OperationalError as exc:
        raise BenchError(f"cannot create a scratch database at {server_url}: {exc.orig}") from None
    try:
        yield url
    finally:
        drop_database(server_url, url)


@contextmanager
def server(database: str, home: Path, workers: int) -> Iterator[tuple[str, int]]:
    """uvicorn serving the API as ``shoal up`` does (``service.server.api_app``, ``workers``
    processes) in a child process, ready; its URL and process id."""
    port = free_port()
    env = {**os.environ, **rate_limits(), "SHOAL_HOME": str(home), "SHOAL_DATABASE_URL": database}
    env.pop("SHOAL_ADMIN_TOKEN", None)
    log = home / "server.log"
    command = [
        *(sys.executable, "-m", "uvicorn", "shoal.service.server:api_app", "--factory"),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)),
        *("--no-access-log", "--log-level", "info", "--timeout-graceful-shutdown", "2"),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, log, workers)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, workers: int) -> None:
    """Until every worker has logged its start-up (uvicorn's info line) and one answers."""
    deadline = time.monotonic() + SERVER_START_S
    with httpx.Client(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BenchError(f"the API server exited at start: {log.read_text()[-2000:]}")
            try:
                started = log.read_text(errors="replace").count(STARTED)
                if started >= workers and client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # nothing to wait on but the socket and the log: poll them
    raise BenchError(f"the API server was not ready after {SERVER_START_S:.0f} s")


def server_errors(log: str) -> list[str]:
    """The distinct exceptions (last line of each traceback) in the server's log, 5 at most."""
    found = dict.fromkeys(
        m.group(0)[:300] for m in map(_EXCEPTION_LINE.match, log.splitlines()) if m
    )
    return list(found)[:5]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its live children (Linux's /proc;
    None elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    try:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # After the name: state, ppid, ..., utime and stime are fields 14 and 15.
            if int(entry.name) == pid or int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / ticks
    except OSError:
        return None
    return round(total, 2)


BENCH_RATE_LIMITS = {"SHOAL_RATE_LIMIT_PER_S": "1000", "SHOAL_RATE_LIMIT_BURST": "1000"}
"""The server's rate limit per token unless the environment sets one: on (it is part of
what a request costs) but above what one client sends here (20-60 requests/s): with the
default 50/s, the clients of a less busy API process would be refused and spin on 429s."""


def rate_limits() -> dict[str, str]:
    return {name: os.environ.get(name, value) for name, value in BENCH_RATE_LIMITS.items()}


def _served(settings: ApiSettings, home: Path) -> dict[str, Any]:
    """What the server ran with, beyond the bench's own settings (from the environment)."""
    served = Settings(home=home, database_url=settings.database_url)
    limits = rate_limits()
    return {
        "workers": settings.workers,
        "threads": served.api_threads,
        "rate_limit_per_s": float(limits["SHOAL_RATE_LIMIT_PER_S"]),
        "rate_limit_burst": int(limits["SHOAL_RATE_LIMIT_BURST"]),
        "backend": "postgresql" if settings.database_url else "sqlite",
    }


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


async def status_load(
    url: str, tokens: Sequence[str], job_ids: Sequence[str], duration_s: float, seed: int
) -> Samples:
    """Phase 1: one keep-alive connection per token looping status requests (every
    ``LIST_EVERY``-th a listing) until ``duration_s`` after all have warmed up."""
    clients = len(tokens)
    samples = Samples()
    warm, go = asyncio.Barrier(clients + 1), asyncio.Event()
    window: list[float] = []

    async def client(number: int) -> None:
        rng = random.Random(seed * 100_003 + number)
        connection = await Connection.open(url, tokens[number])
        try:
            await _get(connection, f"/api/v1/jobs/{rng.choice(job_ids)}", "status", Samples())
            await warm.wait()
            await go.wait()
            sent = 0
            while time.perf_counter() < window[0] + duration_s:
                sent += 1
                if sent % LIST_EVERY == 0:
                    await _get(connection, "/api/v1/jobs?limit=50", "list", samples)
                else:
                    path = f"/api/v1/jobs/{rng.choice(job_ids)}"
                    await _get(connection, path, "status", samples)
        finally:
            connection.close()

    tasks = [asyncio.create_task(client(n)) for n in range(clients)]
    await warm.wait()
    window.append(time.perf_counter())
    go.set()
    await asyncio.gather(*tasks)
    samples.seconds = time.perf_counter() - window[0]
    return samples


async def _get(connection: Connection, path: str, kind: str, samples: Samples) -> None:
    started = time.perf_counter()
    try:
        code = await connection.get(path)
        error = None if 200 <= code < 300 else str(code)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        error = type(exc).__name__
    samples.add(kind, started, error)


async def submissions(url: str, tokens: Sequence[str], prefix: str) -> tuple[Samples, int]:
    """Phase 2: one key per token, each POSTed twice at once with that token (a client and
    its retry), after one untimed submission (its key outside ``prefix``) that warms up the
    server's spec checks; the samples and how many keys were answered twice with success but
    with different jobs (failures count as errors)."""
    samples, count = Samples(), len(tokens)
    limits = httpx.Limits(max_connections=2 * count, max_keepalive_connections=2 * count)
    async with httpx.AsyncClient(base_url=url, timeout=SUBMIT_TIMEOUT_S, limits=limits) as http:

        async def submit(i: int, key: str, into: Samples) -> str | None:
            spec = {**SPEC, "name": f"submit-{i:04d}"}
            headers = {"Authorization": f"Bearer {tokens[i]}", "Idempotency-Key": key}
            started = time.perf_counter()
            try:
                response = await http.post("/api/v1/jobs", json=spec, headers=headers)
            except httpx.HTTPError as exc:
                into.add("submit", started, type(exc).__name__)
                return None
            ok = response.status_code in (200, 201)
            into.add("submit", started, None if ok else str(response.status_code))
            return str(response.json()["id"]) if ok else None

        await submit(0, "warm-up", Samples())
        started = time.perf_counter()
        answers = await asyncio.gather(
            *(submit(i, f"{prefix}{i}", samples) for i in range(count) for _ in range(2))
        )
        samples.seconds = time.perf_counter() - started
    pairs = [(answers[2 * i], answers[2 * i + 1]) for i in range(count)]
    split = sum(1 for a, b in pairs if None not in (a, b) and a != b)
    return samples, split


def count_jobs(database: str, prefix: str) -> int:
    """Jobs in ``database`` whose idempotency key starts with ``prefix``."""
    engine = make_engine(database)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).where(Job.idempotency_key.startswith(prefix))
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def run_api_bench(settings: ApiSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Everything ``shoal bench api`` reports; see ``api_result``."""
    started = time.perf_counter()
    phases = iter(API_PHASES)
    prefix = f"bench-api-{uuid.uuid4().hex[:8]}-"
    with (
        tempfile.TemporaryDirectory(prefix="shoal-bench-api-") as tmp,
        scratch_database(settings.database_url, Path(tmp)) as database,
    ):
        progress(next(phases))
        tokens = settings.clients + settings.submissions
        seeded = fill(database, settings.jobs, admin=False, tokens=tokens)
        readers, writers = seeded.tokens[: settings.clients], seeded.tokens[settings.clients :]
        progress(next(phases))
        with server(database, Path(tmp), settings.workers) as (url, pid):
            progress(next(phases))
            before = cpu_seconds(pid), time.process_time()
            load = asyncio.run(
                status_load(url, readers, seeded.job_ids, settings.duration_s, settings.seed)
            )
            after = cpu_seconds(pid), time.process_time()
            during = {
                "server_cpu_s": _spent(before[0], after[0]),
                "load_generator_cpu_s": _spent(before[1], after[1]),
                # ``machine()``'s load is taken after the submissions, when it has decayed.
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            progress(next(phases))
            submit, split = asyncio.run(submissions(url, writers, prefix))
        created = count_jobs(database, prefix)
        logged = server_errors((Path(tmp) / "server.log").read_text(errors="replace"))
    return api_result(
        settings,
        load,
        submit,
        jobs_created=created,
        keys_split=split,
        during_load=during,
        server=_served(settings, Path(tmp)),
        server_errors=logged,
        started=started,
    )


def check(result: dict[str, Any]) -> list[str]:
    """What a run got wrong (empty: nothing): errors, or other than one job per key."""
    problems = []
    if result["errors"]:
        problems.append(f"{result['errors']} requests failed: {result['error_samples']}")
    if result["jobs_created"] != result["submissions"]:
        problems.append(
            f"{result['jobs_created']} jobs created for {result['submissions']} idempotency keys"
        )
    if result["submit_keys_answered_differently"]:
        problems.append(
            f"{result['submit_keys_answered_differently']} keys' two answers named different jobs"
        )
    return problems
