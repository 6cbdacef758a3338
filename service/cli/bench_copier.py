"""``shoal bench copier``: what in-memory copies cost a worker's steps, apart from the engine."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.table import Table

from shoal.service.bench.step_settings import DEFAULT_SIZE
from shoal.service.cli.bench_output import (
    JSON_OPTION,
    bench_device,
    bench_settings,
    caption,
    device_option,
    fmt,
    run_bench,
)
from shoal.service.cli.bench_step import model_options


@click.command()
@device_option("the loop's steps")
@model_options
@click.option(
    "--every",
    default=3,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Steps between copies in a window with copies (a job's copy interval).",
)
@click.option(
    "--steps",
    default=12,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Steps per window (a multiple of --every).",
)
@click.option(
    "--warmup", default=3, show_default=True, type=click.IntRange(1, 100), help="Untimed steps."
)
@click.option(
    "--rounds",
    default=5,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Pairs of windows, one without copies and one with, in turn first.",
)
@click.option(
    "--copier",
    "which",
    default="tensors",
    show_default=True,
    type=click.Choice(["tensors", "staged"]),
    help="Shoal's copier (each tensor copied on its own), or a candidate that copies through"
    " a staging buffer on the device, a chunk at a time.",
)
@JSON_OPTION
def copier(
    device: str | None,
    model: str,
    size: str | None,
    every: int,
    steps: int,
    warmup: int,
    rounds: int,
    which: str,
    as_json: bool,
) -> None:
    """A plain PyTorch loop taking Shoal's in-memory copies itself, in every other window.

    The copier as a stage runs it (a copy started at a step boundary, each block's
    optimizer step waiting for its copy; on a GPU on a side stream into pinned memory),
    without the engine around it: set beside `shoal bench step`'s copies overhead, what the
    copies cost the copier and what they cost the engine. Windows of --steps steps alternate
    within seconds, so a machine's drift between minutes does not enter the comparison.
    """
    from shoal.service.bench.copier import COPIER_PHASES, CopierSettings, run_copier

    chosen = bench_device(device)
    settings = bench_settings(
        CopierSettings,
        device=chosen,
        model=model,
        size=size or DEFAULT_SIZE[chosen],
        every=every,
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        copier=which,
    )
    count = len(COPIER_PHASES) * rounds
    run_bench(count, as_json, lambda progress: run_copier(settings, progress), _copier_table)


def _copier_table(console: Console, result: dict[str, Any]) -> None:
    table = Table(title=f"shoal bench copier: {result['model']}", caption=caption(result))
    table.add_column("what")
    table.add_column("ms", justify="right")
    table.add_row("a step without copies (median)", fmt(result["step_ms"]))
    table.add_row("a step with copies (median)", fmt(result["copies_step_ms"]))
    table.add_row("a copy's start", fmt(result["copy_start_ms"]))
    table.add_row("a copy's extra time in its window", fmt(result["copy_extra_ms"]))
    console.print(table)
    console.print(
        f"a copy every {result['copy_every']} steps costs {100 * result['copies_overhead']:.1f}%"
        f" of the time on {result['device']} ({result['state_bytes'] / 2**20:,.1f} MiB in"
        f" {result['state_tensors']} tensors a copy, {result['copier']} copier)"
    )
