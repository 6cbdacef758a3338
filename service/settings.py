"""The one settings object: every knob, its ``SHOAL_*`` environment variable and its default.

Settings are built by ``get_settings()`` (or constructed in tests) and handed out; nothing
reads the environment at import time. ``Settings.check_safe()`` refuses unsafe combinations
at start-up.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DEVICES = "2xcpu-fast:2048,2xcpu-slow:2048:slowdown=2"


class UnsafeSettings(ValueError):
    """A configuration Shoal refuses to start with; the message says how to fix it."""


ADMIN_TOKEN_HINT = (
    "make one with: python3 -c \"import secrets; print('shoal_' + secrets.token_urlsafe(32))\""
)


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
    code_max_bytes: int = Field(
        16 * 2**20,
        ge=1024,
        le=2**30,
        description="Largest code upload (a zip archive, `shoal submit --code DIR`); its files"
        " unpacked may take 4x this.",
    )
    code_check_timeout_s: float = Field(
        120.0,
        gt=0.0,
        le=3600.0,
        description="Seconds the check of a spec with uploaded code may take: its model is"
        " built and traced in a Ray worker process, never in the API's (a slower one is a 422).",
    )
    code_check_memory_mb: int = Field(
        4096,
        ge=256,
        le=1_048_576,
        description="Memory the check of a spec with uploaded code may allocate in its Ray"
        " worker process beyond what the process holds when it starts the check.",
    )
    poll_interval_s: float = Field(0.5, ge=0.0, le=60.0, description="Controller reconcile period.")
    ray_timeout_s: float = Field(30.0, gt=0.0, le=600.0, description="Timeout of every Ray call.")
    runner_silence_s: float = Field(
        300.0,
        gt=0.0,
        le=86_400.0,
        description="A job's runner that answers no poll for this long in a row (its actor"
        " never started, its process wedged) is taken for lost: it is stopped and the job"
        " resumes from its latest checkpoint, as after a runner that died.",
    )
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
    user_max_jobs: int | None = Field(
        None, ge=1, description="Jobs a user may run at once, unless an admin set theirs."
    )
    user_max_devices: int | None = Field(
        None, ge=1, description="Devices a user's jobs may hold at once, unless set for them."
    )
    rate_limit_per_s: float | None = Field(
        50.0,
        gt=0.0,
        description="Requests per second per token (per address without one) on average;"
        " unset: no limit. Health probes and /metrics are never limited.",
    )
    rate_limit_burst: int = Field(200, ge=1, description="Requests a token may send at once.")
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated addresses or networks (10.0.0.0/8) of the reverse proxies"
        " in front of the API: only from these does X-Forwarded-For name the caller (for the"
        " rate limit); empty: the connecting address is the caller.",
    )
    auth_cache_s: float = Field(
        5.0,
        ge=0.0,
        le=300.0,
        description="Seconds the API remembers whom a token belongs to: a token revoked with"
        " `shoal token revoke` is refused at most this much later (0: look every token up).",
    )
    api_threads: int = Field(
        8,
        ge=1,
        le=64,
        description="Requests the API serves at once on its threads (the rest wait their"
        " turn): a few more than the CPUs keeps the database busy; many more only makes"
        " them fight for Python's interpreter lock.",
    )
    api_workers: int = Field(
        1,
        ge=1,
        le=32,
        description="Processes serving the API (the controller runs in `shoal up`'s own):"
        " Python runs one request at a time per process, so more use more CPUs. Each has"
        " its own rate-limit buckets and request-latency histogram.",
    )
    spec_check_threads: int = Field(
        1,
        ge=1,
        le=64,
        description="Submissions whose specs are checked at once (the model traced, a sweep's"
        " every value), on threads of their own: however heavy, they never hold the threads"
        " that serve everything else (health probes included). Checks hold Python's"
        " interpreter lock, so a second thread runs them no faster and slows every request.",
    )
    spec_check_queue: int = Field(
        256,
        ge=0,
        le=10_000,
        description="Submissions that may wait for a spec-check thread (waiting holds no"
        " thread, only the parsed spec: at most SHOAL_MAX_BODY_BYTES each); more are answered"
        " 503 with Retry-After. Room for a burst the size of a user's rate-limit burst.",
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest accepted request body.")
    max_page_size: int = Field(500, ge=1, le=10_000, description="Cap on list page sizes.")
    log_json: bool = Field(False, description="Log as JSON lines.")
    admin_token: SecretStr | None = Field(
        None,
        description="The admin's API token, chosen outside Shoal (e.g. a Kubernetes Secret):"
        " `shoal_` and 32+ more characters; unset: `shoal up` makes one and writes it to"
        " $SHOAL_HOME/admin.token.",
    )
    metrics_token: str | None = Field(
        None,
        min_length=16,
        description="Bearer token a `GET /metrics` scrape brings to get the per-job series"
        " (ids, steps, losses); without it a scrape gets aggregate series only.",
    )

    @field_validator("admin_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # `SHOAL_ADMIN_TOKEN=` as compose passes it

    @field_validator("admin_token")
    @classmethod
    def _token_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            token = value.get_secret_value()
            if not token.startswith("shoal_") or len(token) < len("shoal_") + 32:
                raise ValueError(
                    f"must be 'shoal_' followed by at least 32 characters ({ADMIN_TOKEN_HINT})"
                )
        return value

    @field_validator("allowed_factories", "trusted_proxies", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network; list proxies as 10.0.0.5 or"
                    " 10.0.0.0/8, comma-separated"
                ) from None
        return value

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'shoal.db'}"

    @property
    def resolved_checkpoint_root(self) -> str:
        return self.checkpoint_root or str(self.home / "checkpoints")

    @property
    def code_root(self) -> Path:
        """Where uploaded code is kept, one zip archive per content digest."""
        return self.home / "code"

    @property
    def admin_token_path(self) -> Path:
        return self.home / "admin.token"

    def environment(self) -> dict[str, str]:
        """These settings as the ``SHOAL_*`` variables that give them back (for the processes
        this one starts); unset ones are left out."""
        env = {}
        for name, value in self:
            if value is None:
                continue
            if isinstance(value, SecretStr):
                text = value.get_secret_value()
            elif isinstance(value, bool):
                text = str(value).lower()
            elif isinstance(value, list):
                text = ",".join(value)
            else:
                text = str(value)
            env[f"SHOAL_{name.upper()}"] = text
        return env

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
