"""``shoal bench``: measure the pipeline engine and its transport on this machine.

Runs locally (no API): it starts its own Ray on free ports, or uses the one this process is
connected to. ``--json`` prints one JSON object on the last line; otherwise a table.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from service.cli.options import InputError
from service.cli.render import make_console


@click.group()
def bench() -> None:
    """Benchmarks of the engine on this machine (see README, "Benchmarks")."""


@contextmanager
def _phases(console: Console, total: int, quiet: bool) -> Iterator[Any]:
    """A progress bar advanced once per phase (to stderr's console; silent with --json)."""
    if quiet:
        yield lambda _name: None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task("starting", total=total)
        seen = [0]

        def advance(name: str) -> None:
            bar.update(task, description=name, completed=seen[0])
            seen[0] += 1

        yield advance
        bar.update(task, completed=total)


def _f(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


@bench.command()
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option(
    "--steps",
    default=3,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Timed steps per repeat.",
)
@click.option("--hidden", default=2048, show_default=True, type=click.IntRange(1, 16384))
@click.option(
    "--layers",
    default=7,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Hidden layers of the MLP (blocks = layers + 1).",
)
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1, 65536))
@click.option("--micro-batches", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(["gpipe", "1f1b"]))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
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
    from workers.bench.pipeline import PIPELINE_PHASES, run_pipeline
    from workers.bench.report import PipelineSettings

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
    with _phases(console, len(PIPELINE_PHASES), as_json) as progress:
        result = run_pipeline(settings, progress)
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"shoal bench pipeline: {result['model']}", caption=_caption(result))
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
        table.add_row(name, _f(value), _f(value / ideal, 2) if ideal else "-")
    console.print(table)
    console.print(
        f"efficiency {result['efficiency']:.2f} of ideal"
        f" ({result['side_by_side_efficiency']:.2f} of the side-by-side ideal); framework"
        f" overhead {result['overhead_ms_per_microbatch']:.2f} ms per micro-batch"
    )


@bench.command()
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50))
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def transport(repeats: int, calls: int, sizes: tuple[int, ...], as_json: bool) -> None:
    """Ray object refs vs Compiled Graphs between two actors; torch tensors vs numpy arrays."""
    from workers.bench.transport import TransportSettings, run_transport

    settings = TransportSettings(repeats=repeats, calls=calls)
    if sizes:
        settings = TransportSettings(sizes=tuple(sorted(set(sizes))), repeats=repeats, calls=calls)
    console = make_console()
    with _phases(console, 2 * len(settings.sizes) + 1, as_json) as progress:
        result = run_transport(settings, progress)
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(
        title="shoal bench transport: 2-actor chain, ms per value", caption=_caption(result)
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
            _f(result["object_ref_chain_ms"][size], 3),
            _f(result["compiled_graph_chain_ms"][size], 3),
            _f(result["object_ref_chain_inflight_ms"][size], 3),
            _f(result["compiled_graph_chain_inflight_ms"][size], 3),
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


def _caption(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (
        f"{m['date']}, {m['cpus']} cpus, load {m['load_average_1m']}, torch {m['torch']},"
        f" ray {m['ray']}, {result['wall_s']} s"
    )


@bench.command()
@click.option("--hidden", default=1024, show_default=True, type=click.IntRange(1, 16384))
@click.option(
    "--layers",
    default=5,
    show_default=True,
    type=click.IntRange(2, 256),
    help="Hidden layers of the MLP (blocks = layers + 1; 3 stages need 3).",
)
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def elastic(hidden: int, layers: int, slowdown: float, steps: int, as_json: bool) -> None:
    """Rebalancing around a straggler, recovery from a killed node, growth onto a new one,
    on a local multi-node Ray cluster."""
    from service.localray import LocalRay, LocalRayError, parse_devices
    from workers.bench.report import ELASTIC_PHASES, ElasticSettings

    try:
        settings = ElasticSettings(hidden=hidden, layers=layers, slowdown=slowdown, steps=steps)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    console = make_console()
    with (
        _phases(console, len(ELASTIC_PHASES), as_json) as progress,
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
            from workers.bench.elastic import run_elastic

            result = run_elastic(settings, cluster, Path(tmp), progress)
        finally:
            cluster.stop()
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title="shoal bench elastic", caption=_caption(result))
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("static even cut, samples/s", _f(result["static_samples_per_s"])),
        ("Shoal with rebalancing, samples/s", _f(result["shoal_samples_per_s"])),
        ("best cut for the measured speeds, samples/s", _f(result["best_samples_per_s"])),
        ("Shoal / best", _f(result["shoal_over_best"], 2)),
        ("steps until the first re-cut", str(result["steps_to_rebalance"])),
        ("node killed: seconds to the next step", _f(result["recovery_seconds"], 2)),
        ("steps replayed", str(result["steps_replayed"])),
        ("node added: seconds until used", _f(result["growth_seconds"], 2)),
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
@click.option("--hidden", default=2048, show_default=True, type=click.IntRange(1, 16384))
@click.option(
    "--layers",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Hidden layers of each MLP (blocks = layers + 1).",
)
@click.option("--batch-size", default=128, show_default=True, type=click.IntRange(1, 65536))
@click.option(
    "--budget-fraction",
    default=0.75,
    show_default=True,
    type=float,
    help="Each device's memory budget as a fraction of one model's state (0.5-1).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def sharp(
    steps: int,
    models: int,
    hidden: int,
    layers: int,
    batch_size: int,
    budget_fraction: float,
    as_json: bool,
) -> None:
    """SHARP vs one model after another on 2 local devices; simulated SHARP orderings on
    Hydra's setting and a 512-device spot cluster against the lower bound."""
    import time

    from service.localray import LocalRay, LocalRayError, parse_devices
    from workers.bench.report import SHARP_PHASES, SharpSettings
    from workers.bench.simulation import run_simulated

    try:
        settings = SharpSettings(
            steps=steps,
            models=models,
            hidden=hidden,
            layers=layers,
            batch_size=batch_size,
            budget_fraction=budget_fraction,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    console = make_console()
    started = time.perf_counter()
    with (
        _phases(console, len(SHARP_PHASES), as_json) as progress,
        tempfile.TemporaryDirectory(prefix="shoal-bench-sharp-") as tmp,
    ):
        # Simulated first, with no Ray processes beside it to slow the timed simulation.
        simulated = run_simulated(settings, progress)
        progress(SHARP_PHASES[3])
        cluster = LocalRay(parse_devices(settings.devices), Path(tmp) / "logs")
        try:
            cluster.start()
        except LocalRayError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            # Ray reads its token when first imported: the cluster's must be set before.
            os.environ.update(cluster.client_env)
            from workers.bench.sharp import run_sharp

            result = run_sharp(settings, simulated, cluster, Path(tmp), progress, started)
        finally:
            cluster.stop()
    if as_json:
        click.echo(json.dumps(result))
        return
    _sharp_tables(console, result)


def _sharp_tables(console: Console, result: dict[str, Any]) -> None:
    total, train = result["sequential_seconds"], result["sequential_train_seconds"]
    real = Table(title=f"shoal bench sharp: {result['model']}", caption=_caption(result))
    real.add_column("on 2 devices")
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
            _f(seconds, 2),
            f"{total / seconds:.2f}x" if seconds > 0 else "-",
            _f(training, 2),
            f"{train / training:.2f}x" if training > 0 else "-",
        )
    console.print(real)
    local, busy = result["sim_two_devices"], result["sharp_device_busy"]
    console.print(
        f"SHARP's devices computing {' and '.join(f'{b:.2f}' for b in busy)} of the time;"
        f" the simulator, same shards with free copies and no overhead:"
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
        sim.add_row(name, *(_f(row["results"][s]["ratio"], 3) for s in strategies))
    console.print(sim)
    scale = result["sim_scale"]
    console.print(
        f"{scale['devices']:,} devices x {scale['models']:,} models simulated with"
        f" Sharded-LRTF in {result['sim_1024_devices_seconds']:.2f} s"
        f" ({scale['lrtf_ratio']:.3f}x the lower bound)"
    )
