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
