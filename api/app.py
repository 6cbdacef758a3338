"""The FastAPI application factory: routers, error handling, limits, controller lifespan."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import sqlalchemy as sa
from anyio import to_thread
from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

from shoal.api import stream
from shoal.api.errors import BodyLimit, install_error_handlers
from shoal.api.metrics import install_metrics
from shoal.api.paths import HidePaths, server_roots
from shoal.api.ratelimit import RateLimit
from shoal.api.routes import code, devices, health, jobs, sweeps, users
from shoal.api.security import LoopbackHost, SecurityHeaders
from shoal.api.stream import Feed
from shoal.service.auth import ADMIN_USER, Principal, PrincipalCache
from shoal.service.code_checks import code_checks
from shoal.service.controller import Controller
from shoal.service.db.models import User
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.settings import Settings

API_PREFIX = "/api/v1"
DASHBOARD = Path(__file__).parent / "dashboard"
DOCS_ASSETS = f"{API_PREFIX}/docs/assets"
"""Swagger UI's scripts and styles, served from the ``fastapi-offline`` package: the docs
page loads nothing from another site."""


def create_app(
    settings: Settings, session_factory: SessionFactory, controller: Controller | None = None
) -> FastAPI:
    """An app over an already-migrated database; runs ``controller`` in a thread if given."""
    settings.check_safe()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        stop = threading.Event()
        thread = None
        if controller is not None:
            thread = threading.Thread(
                target=controller.run, args=(stop,), name="shoal-controller", daemon=True
            )
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join(timeout=30)

    app = FastAPIOffline(
        title="Shoal",
        version="0.1.0",
        description="Elastic training on heterogeneous, preemptible Ray clusters.",
        openapi_url=f"{API_PREFIX}/openapi.json",
        docs_url=f"{API_PREFIX}/docs",
        redoc_url=None,
        static_url=DOCS_ASSETS,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.controller = controller
    app.state.anonymous = None if settings.auth else _anonymous_admin(session_factory)
    app.state.principals = PrincipalCache(settings.auth_cache_s)
    app.state.code_checks = code_checks(settings)
    install_error_handlers(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        larger={f"{API_PREFIX}/code": (settings.code_max_bytes, "SHOAL_CODE_MAX_BYTES")},
    )
    if settings.rate_limit_per_s is not None:
        app.add_middleware(
            RateLimit,
            rate=settings.rate_limit_per_s,
            burst=settings.rate_limit_burst,
            trusted_proxies=tuple(settings.trusted_proxies),
            authenticate=settings.auth,
        )
    install_metrics(app, session_factory, settings.metrics_token)
    if not settings.auth:
        app.add_middleware(LoopbackHost)
    app.add_middleware(HidePaths, roots=server_roots(settings))
    app.add_middleware(SecurityHeaders)  # the outermost: on every answer, refusals too
    app.include_router(health.router)
    app.include_router(jobs.router, prefix=API_PREFIX)
    app.include_router(sweeps.router, prefix=API_PREFIX)
    app.include_router(devices.router, prefix=API_PREFIX)
    app.include_router(users.router, prefix=API_PREFIX)
    app.include_router(code.router, prefix=API_PREFIX)
    app.state.feed = Feed(session_factory, settings.poll_interval_s)
    app.include_router(stream.router, prefix=API_PREFIX)

    app.mount("/static", StaticFiles(directory=DASHBOARD), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD / "index.html")

    return app


def _anonymous_admin(factory: SessionFactory) -> Principal:
    """With auth off (loopback only), every caller acts as the admin user."""
    with transaction(factory) as session:
        user = session.scalar(sa.select(User).where(User.name == ADMIN_USER))
        if user is None:
            user = User(name=ADMIN_USER, is_admin=True)
            session.add(user)
            session.flush()
        return Principal(user_id=user.id, name=user.name, is_admin=True)
