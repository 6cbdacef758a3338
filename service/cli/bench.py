"""``shoal bench``: measure the engine, its transport and the control plane on this machine.

Runs locally, never against a running ``shoal up``: the engine benches start their own Ray on
free ports (or use the one this process is connected to); ``dashboard`` and ``api`` serve a
scratch database on loopback. ``--json`` prints one JSON object on the last line; otherwise
a table.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from service.cli.bench_output import JSON_OPTION, bench_device, caption, device_option, fmt, phases
from service.cli.bench_step import step
from service.cli.options import InputError
from service.cli.render import make_console

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
"""What an option maker below returns: ``click.option(...)`` for one command's defaults."""


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
    """Benchmarks of the engine on this machine (see README, "Benchmarks")."""


bench.add_command(step)


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
    from service.bench.pipeline import pipeline_phases, run_pipeline
    from service.bench.report import PipelineSettings

    try:
        settings = PipelineSettings(
            hidden=hidden,
            layers=layers,
            batch_size=batch_size,
            micro_batches=micro_batches,
            schedule=schedule,
            steps=steps,
            repeats=repeats,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    console = make_console()
    with phases(console, len(pipeline_phases(repeats)), as_json) as progress:
        result = run_pipeline(settings, progress)
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"shoal bench pipeline: {result['model']}", caption=caption(result))
    table.add_column("what")
    table.add_column("samples/s", justify="right")
    table.add_column("vs ideal", justify="right")
    ideal = result["ideal_samples_per_s"]
    rows = [
        (
            f"PyTorch, 1 process, {result['single_process_threads']} threads",
            result["single_process_samples_per_s"],
        ),
        ("PyTorch, 1 process, 1 thread (one device)", result["single_thread_samples_per_s"]),
        (
            f"PyTorch, 1 thread each, {result['devices']} side by side",
            result["side_by_side_thread_samples_per_s"],
        ),
        (f"ideal: 1 device x {result['devices']} x m/(m+p-1)", ideal),
        ("ideal from the side-by-side thread", result["side_by_side_ideal_samples_per_s"]),
        ("Shoal, 2 stages on 2 devices", result["shoal_samples_per_s"]),
        ("torch.distributed.pipelining (gloo)", result["torch_pipelining_samples_per_s"]),
    ]
    for name, value in rows:
        table.add_row(name, fmt(value), fmt(value / ideal, 2) if ideal else "-")
    console.print(table)
    console.print(
        f"medians of {len(result['rounds'])} rounds' ratios: efficiency"
        f" {result['efficiency']:.2f} of ideal"
        f" ({result['side_by_side_efficiency']:.2f} of the side-by-side ideal); framework"
        f" overhead {result['overhead_ms_per_microbatch']:.2f} ms per micro-batch"
    )


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
    """Ray object refs vs Compiled Graphs between two actors; torch tensors vs numpy arrays."""
    from service.bench.transport import TransportSettings, run_transport

    settings = TransportSettings(repeats=repeats, calls=calls)
    if sizes:
        settings = TransportSettings(sizes=tuple(sorted(set(sizes))), repeats=repeats, calls=calls)
    console = make_console()
    with phases(console, 2 * len(settings.sizes) + 1, as_json) as progress:
        result = run_transport(settings, progress)
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(
        title="shoal bench transport: 2-actor chain, ms per value", caption=caption(result)
    )
    table.add_column("floats", justify="right")
    for name in (
        "object refs",
        "compiled graph",
        f"refs, {settings.inflight} in flight",
        f"graph, {settings.inflight} in flight",
        "graph speedup",
    ):
        table.add_column(name, justify="right")
    for size in settings.sizes:
        table.add_row(
            f"{size:,}",
            fmt(result["object_ref_chain_ms"][size], 3),
            fmt(result["compiled_graph_chain_ms"][size], 3),
            fmt(result["object_ref_chain_inflight_ms"][size], 3),
            fmt(result["compiled_graph_chain_inflight_ms"][size], 3),
            f"{result['compiled_graph_speedup'][size]:.2f}x",
        )
    console.print(table)
    big = max(settings.sizes)
    console.print(
        f"one actor call with {big:,} floats: torch tensor"
        f" {result['torch_tensor_call_ms']:.2f} ms, numpy array"
        f" {result['numpy_array_call_ms']:.2f} ms ({result['numpy_speedup']:.2f}x);"
        f" faster chain: {result['faster_chain']}"
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
    from service.bench.report import ELASTIC_PHASES, ElasticSettings
    from service.localray import LocalRay, LocalRayError, parse_devices

    try:
        settings = ElasticSettings(hidden=hidden, layers=layers, slowdown=slowdown, steps=steps)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    console = make_console()
    with (
        phases(console, len(ELASTIC_PHASES), as_json) as progress,
        tempfile.TemporaryDirectory(prefix="shoal-bench-elastic-") as tmp,
    ):
        progress(ELASTIC_PHASES[0])
        cluster = LocalRay(parse_devices(settings.devices), Path(tmp) / "logs")
        try:
            cluster.start()
        except LocalRayError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            # Ray reads its token when first imported: the cluster's must be set before.
            os.environ.update(cluster.client_env)
            from service.bench.elastic import run_elastic

            result = run_elastic(settings, cluster, Path(tmp), progress)
        finally:
            cluster.stop()
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title="shoal bench elastic", caption=caption(result))
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("static even cut, samples/s", fmt(result["static_samples_per_s"])),
        ("Shoal with rebalancing, samples/s", fmt(result["shoal_samples_per_s"])),
        ("best cut for the measured speeds, samples/s", fmt(result["best_samples_per_s"])),
        ("Shoal / best", fmt(result["shoal_over_best"], 2)),
        ("steps until the first re-cut", str(result["steps_to_rebalance"])),
        ("node killed: seconds to the next step", fmt(result["recovery_seconds"], 2)),
        ("steps replayed", str(result["steps_replayed"])),
        ("node added: seconds until used", fmt(result["growth_seconds"], 2)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


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
    help="Each device's memory budget as a fraction of one model's state (0.5-1).",
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
    as_json: bool,
) -> None:
    """SHARP vs one model after another on 2 local devices; simulated SHARP orderings on
    Hydra's setting and a 512-device spot cluster against the lower bound.

    On cuda the two devices are the machine's GPU (two Ray nodes that both see it), each
    with a memory budget under one model, so shards alternate between the GPU and pinned
    host memory."""
    import time
    from dataclasses import replace

    from service.bench.report import SHARP_BATCH_SIZE, SHARP_PHASES, SharpSettings
    from service.bench.simulation import run_simulated
    from service.localray import LocalRay, LocalRayError, parse_devices

    chosen = bench_device(device)
    try:
        settings = SharpSettings(
            device=chosen,
            steps=steps,
            models=models,
            hidden=hidden,
            layers=layers,
            batch_size=batch_size or SHARP_BATCH_SIZE[chosen],
            budget_fraction=budget_fraction,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    console = make_console()
    started = time.perf_counter()
    with (
        phases(console, len(SHARP_PHASES), as_json) as progress,
        tempfile.TemporaryDirectory(prefix="shoal-bench-sharp-") as tmp,
    ):
        # Simulated first, with no Ray processes beside it to slow the timed simulation.
        simulated = run_simulated(settings, progress)
        progress(SHARP_PHASES[3])
        # On cpu the nodes offer no GPU, so their devices are virtual CPU ones on any machine.
        gpus = None if chosen == "cuda" else 0
        nodes = [replace(node, gpus=gpus) for node in parse_devices(settings.devices)]
        cluster = LocalRay(nodes, Path(tmp) / "logs")
        try:
            cluster.start()
        except LocalRayError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            # Ray reads its token when first imported: the cluster's must be set before.
            os.environ.update(cluster.client_env)
            from service.bench.sharp import run_sharp

            result = run_sharp(settings, simulated, cluster, Path(tmp), progress, started)
        finally:
            cluster.stop()
    if as_json:
        click.echo(json.dumps(result))
        return
    _sharp_tables(console, result)


def _sharp_tables(console: Console, result: dict[str, Any]) -> None:
    total, train = result["sequential_seconds"], result["sequential_train_seconds"]
    real = Table(title=f"shoal bench sharp: {result['model']}", caption=caption(result))
    real.add_column(f"on 2 devices ({result['device']})")
    real.add_column("seconds", justify="right")
    real.add_column("speedup", justify="right")
    real.add_column("training only", justify="right")
    real.add_column("speedup", justify="right")
    for name, key in (
        ("one after another, plain model parallelism", "sequential"),
        ("SHARP, Sharded-LRTF", "sharp"),
        ("SHARP, prefetch off", "no_prefetch"),
    ):
        seconds, training = result[f"{key}_seconds"], result[f"{key}_train_seconds"]
        real.add_row(
            name,
            fmt(seconds, 2),
            f"{total / seconds:.2f}x" if seconds > 0 else "-",
            fmt(training, 2),
            f"{train / training:.2f}x" if training > 0 else "-",
        )
    console.print(real)
    local, busy = result["sim_two_devices"], result["sharp_device_busy"]
    console.print(
        f"SHARP's devices computing {' and '.join(f'{b:.2f}' for b in busy)} of the time;"
        f" the simulator, same shards at their measured task times and the executor's"
        f" measured latency ({local['latency_s'] * 1e3:.1f} ms), free copies:"
        f" {local['lrtf_mean_utilization']:.2f} busy,"
        f" {local['speedup_vs_model_parallel']:.2f}x over model parallelism"
    )
    rows = result["sim_settings"]
    strategies = list(rows[0]["results"])
    sim = Table(title="simulated: makespan / lower bound")
    sim.add_column("setting")
    for strategy in strategies:
        sim.add_column(strategy, justify="right")
    for row in rows:
        name = f"{row['name']} ({row['devices']} devices, {row['models']} models)"
        sim.add_row(name, *(fmt(row["results"][s]["ratio"], 3) for s in strategies))
    console.print(sim)
    scale = result["sim_scale"]
    console.print(
        f"{scale['devices']:,} devices x {scale['models']:,} models simulated with"
        f" Sharded-LRTF in {result['sim_1024_devices_seconds']:.2f} s"
        f" ({scale['lrtf_ratio']:.3f}x the lower bound)"
    )


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
    from service.bench.dashboard import BrowserMissing, run_dashboard_bench

    console = make_console()
    with phases(console, 3, as_json) as progress:
        try:
            result = run_dashboard_bench(jobs, repeats, chromium, progress)
        except BrowserMissing as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
        return
    m = result["machine"]
    table = Table(
        title=f"shoal bench dashboard: the jobs page with {jobs} jobs",
        caption=f"{m['date']}, {m['cpus']} cpus, load {m['load_average_1m']}, medians of"
        f" {repeats} runs",
    )
    table.add_column("measured")
    table.add_column("median ms", justify="right")
    table.add_column("runs (ms)")
    for name, key in (
        ("navigation to every row shown", "page_ready_ms"),
        ("the list request alone (peer)", "list_request_ms"),
    ):
        runs = ", ".join(fmt(v) for v in result[f"{key}_runs"])
        table.add_row(name, fmt(result[key]), runs)
    console.print(table)


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
    from service.bench.api import API_PHASES, ApiSettings, check, run_api_bench
    from service.bench.report import BenchError

    try:
        settings = ApiSettings(
            clients=clients,
            duration_s=duration,
            submissions=submissions,
            jobs=jobs,
            workers=workers,
            database_url=database_url,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    console = make_console()
    with phases(console, len(API_PHASES), as_json) as progress:
        try:
            result = run_api_bench(settings, progress)
        except BenchError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        _api_table(console, result)
    problems = check(result)
    if problems:
        raise click.ClickException("; ".join(problems))


def _api_table(console: Console, result: dict[str, Any]) -> None:
    s, m = result["settings"], result["machine"]
    backend = "PostgreSQL" if s["database_url"] else "SQLite"
    table = Table(
        title=f"shoal bench api: {s['clients']} clients for {s['duration_s']:g} s, {backend},"
        f" {s['workers']} worker(s)",
        caption=f"{m['date']}, {m['cpus']} cpus, load {m['load_average_1m']}, {result['wall_s']} s",
    )
    table.add_column("what")
    table.add_column("requests", justify="right")
    table.add_column("per s", justify="right")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    seconds = result["load_seconds"] or 1.0
    table.add_row(
        "status + listing",
        f"{result['requests']:,}",
        fmt(result["status_requests_per_s"]),
        fmt(result["p50_ms"], 2),
        fmt(result["p99_ms"], 2),
    )
    for name, key in (("GET /jobs/{id}", "status"), ("GET /jobs?limit=50", "list")):
        count = result[f"{key}_requests"]
        table.add_row(
            f"  {name}",
            f"{count:,}",
            fmt(count / seconds),
            fmt(result[f"{key}_p50_ms"], 2),
            fmt(result[f"{key}_p99_ms"], 2),
        )
    table.add_row(
        "POST /jobs, each key twice",
        f"{result['submit_requests']:,}",
        fmt(result["submit_requests"] / (result["submit_seconds"] or 1.0)),
        fmt(result["submit_p50_ms"], 2),
        fmt(result["submit_p99_ms"], 2),
    )
    console.print(table)
    during = result["during_load"]
    console.print(
        f"{result['jobs_created']} jobs created for {result['submissions']} keys;"
        f" {result['errors']} errors. CPU seconds during the status load: server"
        f" {during['server_cpu_s']}, load generator {during['load_generator_cpu_s']}"
        f" (load {during['load_average_1m']})"
    )
