"""``GET /metrics`` in Prometheus' text format, and the API's request latency behind it.

The training figures are read from the database at scrape time (``service.telemetry``), so
every replica of the control plane reports the same; the request latency histogram is this
process's. Labels are bounded: states and event kinds are fixed sets, device kinds are the
cluster's, routes are the API's path templates, and per-job series exist for RUNNING jobs
only (never more than devices). ``/metrics`` is open like the health probes, but an open
scrape gets aggregate series only: nothing that names a job (its id, step or loss) is shown
to a caller who could be any user. The per-job series need ``SHOAL_METRICS_TOKEN``, set and
brought as a bearer token; any other bearer token is refused (401).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator, Sequence

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.service.db.session import SessionFactory
from shoal.service.telemetry import RunningJob, read_running, read_telemetry

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class TrainingCollector(Collector):
    """Jobs, sweeps and devices by state and job events by kind: counts that name no job."""

    def __init__(self, factory: SessionFactory) -> None:
        self._factory = factory

    def collect(self) -> Iterator[Metric]:
        with self._factory() as session:
            t = read_telemetry(session)
        jobs = GaugeMetricFamily("shoal_jobs", "Jobs by state.", labels=["state"])
        for state, count in sorted(t.jobs.items()):
            jobs.add_metric([state], count)
        sweeps = GaugeMetricFamily("shoal_sweeps", "Sweeps by state.", labels=["state"])
        for state, count in sorted(t.sweeps.items()):
            sweeps.add_metric([state], count)
        devices = GaugeMetricFamily(
            "shoal_devices", "Devices by kind and state.", labels=["kind", "state"]
        )
        for (kind, state), count in sorted(t.devices.items()):
            devices.add_metric([kind, state], count)
        events = CounterMetricFamily(
            "shoal_job_events", "Job events by kind (repartition, recovered, ...).", labels=["kind"]
        )
        for kind, count in sorted(t.events.items()):
            events.add_metric([kind], count)
        yield from (jobs, sweeps, devices, events)


class RunningJobsCollector(Collector):
    """Each RUNNING job's latest step, by job id: loss, samples/s, steps/s, per-stage compute
    and idle seconds."""

    def __init__(self, factory: SessionFactory) -> None:
        self._factory = factory

    def collect(self) -> Iterator[Metric]:
        with self._factory() as session:
            running = read_running(session)
        yield from _running(running)


def _running(running: Sequence[RunningJob]) -> Iterator[Metric]:
    step = GaugeMetricFamily("shoal_job_step", "A running job's last trained step.", labels=["job"])
    loss = GaugeMetricFamily("shoal_job_loss", "A running job's last loss.", labels=["job"])
    samples = GaugeMetricFamily(
        "shoal_job_samples_per_second", "A running job's last step's samples/s.", labels=["job"]
    )
    steps = GaugeMetricFamily(
        "shoal_job_steps_per_second", "A running job's last step's steps/s.", labels=["job"]
    )
    mfu = GaugeMetricFamily(
        "shoal_job_mfu",
        "A running job's last step's model FLOPs utilization (0-1; absent when unknown).",
        labels=["job"],
    )
    labels = ["job", "stage", "replica"]
    compute = GaugeMetricFamily(
        "shoal_stage_compute_seconds", "Last step's compute seconds per stage.", labels=labels
    )
    idle = GaugeMetricFamily(
        "shoal_stage_idle_seconds", "Last step's idle seconds per stage.", labels=labels
    )
    for job in running:
        step.add_metric([job.id], job.step)
        if job.loss is not None:
            loss.add_metric([job.id], job.loss)
        if job.samples_per_s is not None:
            samples.add_metric([job.id], job.samples_per_s)
        if job.step_time_s:
            steps.add_metric([job.id], 1.0 / job.step_time_s)
        if job.mfu is not None:
            mfu.add_metric([job.id], job.mfu)
        for stage in job.stages:
            where = [job.id, str(stage["stage"]), str(stage.get("replica", 0))]
            compute.add_metric(where, stage["compute_s"])
            idle.add_metric(where, stage["idle_s"])
    yield from (step, loss, samples, steps, mfu, compute, idle)


class RequestTimer:
    """ASGI middleware: each HTTP request's seconds, by method, route template and status."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.histogram.labels(scope["method"], _template(scope), str(status)).observe(
                time.perf_counter() - started
            )


def _template(scope: Scope) -> str:
    """The matched route's path template, prefixes of included routers and mounts included
    (the route knows only its own part: the rest is the path before its concrete match);
    ``unmatched`` for a path no route matched."""
    own = getattr(scope.get("route"), "path", None)
    if not isinstance(own, str) or not own:
        return "unmatched"
    concrete = own
    for name, value in scope.get("path_params", {}).items():
        concrete = concrete.replace("{" + name + "}", str(value))
    path: str = scope["path"]
    return path[: -len(concrete)] + own if path.endswith(concrete) else own


def install_metrics(app: FastAPI, factory: SessionFactory, token: str | None) -> None:
    """Serve ``GET /metrics`` from registries of this app's own, and time every request: the
    open one (counts and latency) and, for a scrape bringing ``token``, the one that adds
    each running job's series."""
    latency = Histogram(
        "shoal_api_request_seconds",
        "API request latency by method, route template and status.",
        ["method", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=None,
    )
    counts = TrainingCollector(factory)
    open_registry = CollectorRegistry(auto_describe=False)
    full_registry = CollectorRegistry(auto_describe=False)
    open_registry.register(counts)
    open_registry.register(latency)
    full_registry.register(counts)
    full_registry.register(RunningJobsCollector(factory))
    full_registry.register(latency)
    app.add_middleware(RequestTimer, histogram=latency)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        given = request.headers.get("authorization")
        if given is None:
            return Response(generate_latest(open_registry), media_type=CONTENT_TYPE_LATEST)
        # Refused rather than answered with the counts: a scraper sent to read the per-job
        # series learns that its token (or the server's setting) is wrong.
        if token is None:
            return _refused("SHOAL_METRICS_TOKEN is not set on this server: no per-job series")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _refused("this bearer token is not SHOAL_METRICS_TOKEN")
        return Response(generate_latest(full_registry), media_type=CONTENT_TYPE_LATEST)


def _refused(why: str) -> Response:
    return Response(
        f"{why}; scrape without Authorization for the aggregate series only\n",
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
        media_type="text/plain",
    )
