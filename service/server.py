"""Runs the control plane: migrate, connect to Ray, start the controller, serve the API."""

from __future__ import annotations

import json
import logging

from service.settings import Settings


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(settings: Settings) -> None:
    handler = logging.StreamHandler()
    if settings.log_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def serve(settings: Settings) -> None:
    """Blocking: the API on ``settings.host:port`` with the controller running beside it."""
    import uvicorn

    from api.app import create_app
    from service.cluster import RayCluster
    from service.controller import Controller, ControllerConfig
    from service.db.session import make_engine, make_session_factory, migrate

    settings.check_safe()
    configure_logging(settings)
    url = settings.resolved_database_url
    migrate(url)
    factory = make_session_factory(make_engine(url))
    cluster = RayCluster(settings.ray_address, timeout_s=settings.ray_timeout_s)
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
        ),
    )
    app = create_app(settings, factory, controller)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None)
