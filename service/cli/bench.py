"""``shoal bench``: measure the engine, its transport and the control plane on this machine.

Runs locally, never against a running ``shoal up``: the engine benches start their own Ray on
free ports (or use the one this process is connected to); ``dashboard`` and ``api`` serve a
scratch database on loopback. ``--json`` prints one JSON object on the last line; otherwise
a table.
"""

from __future__ import annotations

from pathlib import Path

import click

from shoal.service.cli.bench_copier import copier
from shoal.service.cli.bench_output import (
    JSON_OPTION,
    Decorator,
    bench_device,
    bench_settings,
    device_option,
    rounds_option,
    run_bench,
)
from shoal.service.cli.bench_shard import shard
from shoal.service.cli.bench_step import step
from shoal.service.cli.bench_tables import (
    api_table,
    dashboard_table,
    elastic_table,
    pipeline_table,
    sharp_tables,
    transport_table,
)


def _repeats(default: int, most: int = 50, what: str | None = None) -> Decorator:
    return click.option(
        "--repeats", default=default, show_default=True, type=click.IntRange(1, most), help=what
    )


def _hidden(default: int) -> Decorator:
    return click.option(
        "--hidden", default=default, show_default=True, type=click.IntRange(1, 16384)
    )


def _layers(default: int, *, least: int = 1, what: str = "the MLP", note: str = "") -> Decorator:
    return click.option(
        "--layers",
        default=default,
        show_default=True,
        type=click.IntRange(least, 256),
        help=f"Hidden layers of {what} (blocks = layers + 1{note}).",
    )


def _batch_size(default: int) -> Decorator:
    return click.option(
        "--batch-size", default=default, show_default=True, type=click.IntRange(1, 65536)
    )


@click.group()
def bench() -> None:
    """Benchmarks of the engine on this machine (see docs/benchmarks.md)."""


bench.add_command(step)
bench.add_command(copier)
bench.add_command(shard)


@bench.command()
@_repeats(3, what="Rounds; each runs every contender once, one after another.")
@click.option(
    "--steps",
    default=5,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Timed steps of each contender in each round (after 2 untimed ones).",
)
@_hidden(2048)
@_layers(7)
@_batch_size(64)
@click.option("--micro-batches", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(["gpipe", "1f1b"]))
@JSON_OPTION
def pipeline(
    repeats: int,
    steps: int,
    hidden: int,
    layers: int,
    batch_size: int,
    micro_batches: int,
    schedule: str,
    as_json: bool,
) -> None:
    """Single-process PyTorch vs Shoal (2 stages, 2 devices) vs torch.distributed.pipelining."""
    from shoal.service.bench.pipeline import PIPELINE_PHASES, run_pipeline
    from shoal.service.bench.report import PipelineSettings, round_phases

    settings = bench_settings(
        PipelineSettings,
        hidden=hidden,
        layers=layers,
        batch_size=batch_size,
        micro_batches=micro_batches,
        schedule=schedule,
        steps=steps,
        repeats=repeats,
    )
    count = len(round_phases(PIPELINE_PHASES, repeats))
    run_bench(count, as_json, lambda progress: run_pipeline(settings, progress), pipeline_table)


@bench.command()
@_repeats(3)
@click.option(
    "--calls",
    default=40,
    show_default=True,
    type=click.IntRange(4, 10000),
    help="Timed calls per repeat (a quarter of them for the large value).",
)
@click.option(
    "--size",
    "sizes",
    multiple=True,
    type=click.IntRange(1, 64 * 1024 * 1024),
    help="Floats per value (repeatable) [default: 1024 and 1048576].",
)
@JSON_OPTION
def transport(repeats: int, calls: int, sizes: tuple[int, ...], as_json: bool) -> None:
    """Ray object refs vs Compiled Graphs between two actors; torch tensors vs numpy arrays;
    a pipeline link's round trip, socket vs gloo."""
    from shoal.service.bench.transport import TransportSettings, run_transport

    settings = TransportSettings(repeats=repeats, calls=calls)
    if sizes:
        settings = TransportSettings(sizes=tuple(sorted(set(sizes))), repeats=repeats, calls=calls)
    run_bench(
        2 * len(settings.sizes) + 2,
        as_json,
        lambda progress: run_transport(settings, progress),
        lambda console, result: transport_table(console, result, settings.sizes, settings.inflight),
    )


@bench.command()
@_hidden(1024)
@_layers(5, least=2, note="; 3 stages need 3")
@click.option(
    "--slowdown",
    default=3.0,
    show_default=True,
    type=click.FloatRange(1.0, 100.0),
    help="How much slower the emulated straggler is.",
)
@click.option(
    "--steps",
    default=24,
    show_default=True,
    type=click.IntRange(3, 10000),
    help="Steps of each heterogeneity run (at least 3 x the window).",
)
@JSON_OPTION
def elastic(hidden: int, layers: int, slowdown: float, steps: int, as_json: bool) -> None:
    """Rebalancing around a straggler, recovery from a killed node, growth onto a new one,
    on a local multi-node Ray cluster."""
    from shoal.service.bench.local import bench_elastic
    from shoal.service.bench.report import ELASTIC_PHASES, ElasticSettings

    settings = bench_settings(
        ElasticSettings, hidden=hidden, layers=layers, slowdown=slowdown, steps=steps
    )
    run_bench(
        len(ELASTIC_PHASES),
        as_json,
        lambda progress: bench_elastic(settings, progress),
        elastic_table,
    )


@bench.command()
@click.option(
    "--steps",
    default=24,
    show_default=True,
    type=click.IntRange(1, 10000),
    help="Training steps of every model in every variant.",
)
@click.option("--models", default=4, show_default=True, type=click.IntRange(1, 32))
@_hidden(2048)
@_layers(8, what="each MLP")
@click.option(
    "--batch-size",
    default=None,
    type=click.IntRange(1, 65536),
    help="Rows per step [default: 128 on cpu, 4096 on cuda].",
)
@click.option(
    "--budget-fraction",
    default=0.75,
    show_default=True,
    type=float,
    help="Each device's memory budget as a fraction of what one model holds through a step"
    " (its state and the batch's kept activations; 0.5-1).",
)
@rounds_option(
    9,
    "Times the real half's three variants run, their order rotated one place a round;"
    " the figures are those of the round with the median SHARP training speedup.",
)
@device_option("the two devices of the real half")
@JSON_OPTION
def sharp(
    device: str | None,
    steps: int,
    models: int,
    hidden: int,
    layers: int,
    batch_size: int | None,
    budget_fraction: float,
    rounds: int,
    as_json: bool,
) -> None:
    """SHARP vs one model after another on 2 local devices; simulated SHARP orderings on
    Hydra's setting and a 512-device spot cluster against the lower bound.

    On cuda the two devices are the machine's GPU (two Ray nodes that both see it), each
    with a memory budget under one model, so shards alternate between the GPU and pinned
    host memory."""
    from shoal.service.bench.local import bench_sharp
    from shoal.service.bench.report import SHARP_BATCH_SIZE, SHARP_PHASES, SharpSettings

    chosen = bench_device(device)
    settings = bench_settings(
        SharpSettings,
        device=chosen,
        steps=steps,
        models=models,
        hidden=hidden,
        layers=layers,
        batch_size=batch_size or SHARP_BATCH_SIZE[chosen],
        budget_fraction=budget_fraction,
        rounds=rounds,
    )
    phases = len(SHARP_PHASES) + 3 * (rounds - 1)  # the real half's three variants a round
    run_bench(phases, as_json, lambda progress: bench_sharp(settings, progress), sharp_tables)


@bench.command()
@click.option("--jobs", default=500, show_default=True, type=click.IntRange(1, 5000))
@_repeats(5, most=100)
@click.option(
    "--chromium",
    default="/usr/bin/chromium",
    show_default=True,
    type=click.Path(path_type=Path),
    help="The browser Playwright drives (never downloaded).",
)
@JSON_OPTION
def dashboard(jobs: int, repeats: int, chromium: Path, as_json: bool) -> None:
    """The jobs page with JOBS jobs in chromium: navigation to every row shown, vs the list
    request alone."""
    from shoal.service.bench.dashboard import run_dashboard_bench

    run_bench(
        3,
        as_json,
        lambda progress: run_dashboard_bench(jobs, repeats, chromium, progress),
        lambda console, result: dashboard_table(console, result, jobs, repeats),
    )


@bench.command()
@click.option(
    "--clients",
    default=50,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Concurrent clients of the status and listing phase.",
)
@click.option(
    "--duration",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600.0),
    help="Seconds of the status and listing phase.",
)
@click.option(
    "--submissions",
    default=200,
    show_default=True,
    type=click.IntRange(1, 5000),
    help="Idempotency keys, each submitted twice at once.",
)
@click.option(
    "--jobs", default=500, show_default=True, type=click.IntRange(1, 100_000), help="Jobs seeded."
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Processes serving the API, as SHOAL_API_WORKERS gives shoal up.",
)
@click.option(
    "--database-url",
    default=None,
    help="A PostgreSQL server to make (and drop) a scratch database on, e.g."
    " postgresql+psycopg://postgres@127.0.0.1:5432/postgres [default: a SQLite file].",
)
@JSON_OPTION
def api(
    clients: int,
    duration: float,
    submissions: int,
    jobs: int,
    workers: int,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Load on the REST API on loopback: CLIENTS clients reading job status and lists for
    DURATION seconds, then SUBMISSIONS idempotent submissions each sent twice at once."""
    from shoal.service.bench.api import API_PHASES, ApiSettings, check, run_api_bench

    settings = bench_settings(
        ApiSettings,
        clients=clients,
        duration_s=duration,
        submissions=submissions,
        jobs=jobs,
        workers=workers,
        database_url=database_url,
    )
    result = run_bench(
        len(API_PHASES), as_json, lambda progress: run_api_bench(settings, progress), api_table
    )
    problems = check(result)
    if problems:
        raise click.ClickException("; ".join(problems))
