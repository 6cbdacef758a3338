"""The one settings object: every knob, its ``SHOAL_*`` environment variable and its default.

Settings are built by ``get_settings()`` (or constructed in tests) and handed out; nothing
reads the environment at import time. ``Settings.check_safe()`` refuses unsafe combinations
at start-up.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DEVICES = "2xcpu-fast:2048,2xcpu-slow:2048:slowdown=2"


class UnsafeSettings(ValueError):
    """A configuration Shoal refuses to start with; the message says how to fix it."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHOAL_", extra="ignore")

    home: Path = Field(
        default_factory=lambda: Path.home() / ".shoal",
        description="State directory: SQLite database, checkpoints, admin token.",
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite:///$SHOAL_HOME/shoal.db."
    )
    host: str = Field("127.0.0.1", description="Address the API binds to.")
    port: int = Field(8000, ge=0, le=65535, description="API port (0: any free port).")
    ray_address: str | None = Field(
        None, description="Existing Ray cluster to join; unset: `shoal up` starts a local one."
    )
    devices: str = Field(
        DEFAULT_DEVICES,
        description="Virtual devices of the local Ray: COUNTxKIND:MEMORY_MB[:slowdown=F][:spot].",
    )
    allowed_factories: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated modules whose model/data factories jobs may use.",
    )
    checkpoint_root: str | None = Field(
        None,
        description="Checkpoint directory (shared storage on a cluster);"
        " default $SHOAL_HOME/checkpoints.",
    )
    auth: bool = Field(
        True, description="Require bearer tokens (only a loopback bind may turn it off)."
    )
    poll_interval_s: float = Field(0.5, ge=0.0, le=60.0, description="Controller reconcile period.")
    ray_timeout_s: float = Field(30.0, gt=0.0, le=600.0, description="Timeout of every Ray call.")
    stage_overhead_ms: float = Field(
        3.0,
        ge=0.0,
        le=10_000.0,
        description="Per stage and micro-batch, the framework's time beyond compute, for the"
        " partitioner (shoal bench pipeline measures it).",
    )
    allreduce_gb_per_s: float = Field(
        0.7,
        gt=0.0,
        le=10_000.0,
        description="Gradient all-reduce bandwidth between replicas, for the partitioner.",
    )
    growth_min_gain: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="A running job grows onto free devices only if its predicted step gets at"
        " least this much faster (0.1: 10%).",
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest accepted request body.")
    max_page_size: int = Field(500, ge=1, le=10_000, description="Cap on list page sizes.")
    log_json: bool = Field(False, description="Log as JSON lines.")

    @field_validator("allowed_factories", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'shoal.db'}"

    @property
    def resolved_checkpoint_root(self) -> str:
        return self.checkpoint_root or str(self.home / "checkpoints")

    @property
    def admin_token_path(self) -> Path:
        return self.home / "admin.token"

    def check_safe(self) -> None:
        """Refuse to serve without auth on anything but a loopback address."""
        if self.auth:
            return
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback:
            raise UnsafeSettings(
                f"SHOAL_AUTH=false with SHOAL_HOST={self.host}: anyone on the network could run"
                " code on the cluster; enable auth or bind to 127.0.0.1"
            )


def get_settings() -> Settings:
    return Settings()
