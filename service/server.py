"""Runs the control plane: migrate, connect to Ray, start the controller, serve the API."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, Literal

from shoal.service.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from shoal.service.controller import Controller

BACKLOG = 2048
"""Connections the API's socket queues before it accepts them (uvicorn's default)."""

STARTUP_FAILURE = 3
"""The exit status when the API does not start (uvicorn's)."""

LOG_FIELDS = ("job_id", "sweep_id", "event", "device_id")
"""Fields a log call may add (``extra=``): JSON lines carry them as keys of their own."""


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in LOG_FIELDS:
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(settings: Settings, stream: IO[str] | None = None) -> None:
    """Log lines (JSON objects with ``SHOAL_LOG_JSON``) to ``stream``, stderr by default."""
    handler = logging.StreamHandler(stream)
    if settings.log_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def serve(settings: Settings, sock: socket.socket) -> None:
    """Blocking: the API on ``sock`` (``listen``: bound to ``settings.host:port``) with the
    controller running beside it, in this process; with ``api_workers`` > 1 the API is
    served by that many processes of its own (``api_app``) and only the controller runs
    here."""
    import uvicorn

    from shoal.api.app import create_app
    from shoal.scheduler.placement import Quota
    from shoal.service.cluster import RayCluster
    from shoal.service.code_checks import code_checks
    from shoal.service.controller import Controller, ControllerConfig
    from shoal.service.db.session import make_engine, make_session_factory, migrate

    settings.check_safe()
    configure_logging(settings)
    url = settings.resolved_database_url
    migrate(url)
    factory = make_session_factory(make_engine(url))
    cluster = RayCluster(settings.ray_address, timeout_s=settings.ray_timeout_s)
    checks = code_checks(settings)
    controller = Controller(
        factory,
        cluster,
        ControllerConfig(
            checkpoint_root=settings.resolved_checkpoint_root,
            allowed_factories=tuple(settings.allowed_factories),
            poll_interval_s=settings.poll_interval_s,
            stage_overhead_s=settings.stage_overhead_ms / 1000,
            allreduce_s_per_byte=1 / (settings.allreduce_gb_per_s * 1e9),
            growth_min_gain=settings.growth_min_gain,
            default_quota=Quota(settings.user_max_jobs, settings.user_max_devices),
            code_store=checks.store,
            code_runner=checks,
            runner_silence_s=settings.runner_silence_s,
        ),
    )
    # Live streams (GET /api/v1/stream) never end by themselves: a stop waits 5 s at most.
    options: dict[str, Any] = {
        "log_config": None,
        "timeout_graceful_shutdown": 5,
        # The app alone reads X-Forwarded-For, from SHOAL_TRUSTED_PROXIES only: uvicorn's
        # default would believe it from any local peer.
        "proxy_headers": False,
    }
    if settings.api_workers == 1:
        server = uvicorn.Server(
            uvicorn.Config(create_app(settings, factory, controller), **options)
        )
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
        if not server.started:  # its log says why (the app's startup failed)
            raise SystemExit(STARTUP_FAILURE)
        return
    stop = threading.Event()
    thread = threading.Thread(
        target=_control, args=(controller, stop), name="shoal-controller", daemon=True
    )
    thread.start()
    os.environ.update(settings.environment())  # what the API processes build their app from
    # uvicorn's API processes bind the address themselves: it is free again a moment before.
    sock.close()
    try:
        uvicorn.run(
            f"{__name__}:api_app",
            factory=True,
            workers=settings.api_workers,
            host=settings.host,
            port=settings.port,
            **options,
        )
    finally:
        stop.set()
        thread.join(timeout=30)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: any free one), bound as uvicorn binds
    its own. ``shoal up`` binds it before it starts anything: a port in use fails at once,
    and one picked by 0 stays its own while Ray's processes, started next, take theirs;
    clients that connect meanwhile wait in its backlog. ``OSError`` if it cannot."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _control(controller: Controller, stop: threading.Event) -> None:
    """Run the controller until ``stop``; if it ends otherwise, end the process (its API
    processes with it) rather than serve with nothing placing or following jobs."""
    try:
        controller.run(stop)
    finally:
        if not stop.is_set():
            logging.getLogger(__name__).error("the controller stopped; stopping Shoal")
            os.kill(os.getpid(), signal.SIGTERM)


def api_app() -> FastAPI:
    """The app of one API process (uvicorn ``--factory``): settings from the ``SHOAL_*``
    environment, no controller (``serve`` runs it in the parent process; ``/readyz`` here
    checks the database)."""
    from shoal.api.app import create_app
    from shoal.service.db.session import make_engine, make_session_factory

    settings = Settings()
    configure_logging(settings)
    factory = make_session_factory(make_engine(settings.resolved_database_url))
    return create_app(settings, factory)


@contextmanager
def serving(app: Any, *, lifespan: Literal["on", "off"] = "off") -> Iterator[str]:
    """``app`` served on a thread, on a loopback socket bound before the server starts (so
    no wait is needed); its URL. Open streams are cut after 1 s when it stops. For tests and
    benchmarks that need real HTTP."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan=lifespan,
        timeout_graceful_shutdown=1,
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
