"""``shoal bench step``: one job's steps through Shoal's engine against plain PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from shoal.service.bench.step_settings import DEFAULT_SIZE, SIZES, StepSettings
from shoal.service.cli.bench_output import (
    JSON_OPTION,
    bench_device,
    bench_settings,
    caption,
    device_option,
    fmt,
    rounds_option,
    run_bench,
)


def model_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--model`` and ``--size``: one of the step benches' models (``SIZES``)."""
    size = click.option(
        "--size",
        type=click.Choice(list(SIZES["gpt"])),
        default=None,
        help=f"The model's size [default: {DEFAULT_SIZE['cpu']} on cpu, {DEFAULT_SIZE['cuda']}"
        " on cuda].",
    )
    model = click.option(
        "--model", default="gpt", show_default=True, type=click.Choice(sorted(SIZES))
    )
    return model(size(command))


@click.command()
@device_option("both contenders")
@click.option(
    "--stages",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Shoal's pipeline stages, one device each (cuda: one GPU each).",
)
@model_options
@click.option(
    "--steps",
    default=5,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Timed steps per repeat.",
)
@click.option(
    "--warmup",
    default=2,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Untimed steps first (Shoal's first one starts its workers).",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Timed windows of --steps steps per run; a run's figure is their median.",
)
@rounds_option(
    20,
    "Times the three contenders run in turn; each figure is the median over rounds"
    " (a ratio taken within its round).",
)
@JSON_OPTION
def step(
    device: str | None,
    stages: int,
    model: str,
    size: str | None,
    steps: int,
    warmup: int,
    repeats: int,
    rounds: int,
    as_json: bool,
) -> None:
    """A plain PyTorch loop vs Shoal (without and with in-memory copies) on one job's steps.

    Both train the same blocks on the same batches with the same micro-batches, gradient
    accumulation and AdamW (lr 3e-4); on a CPU the plain loop runs one thread, as a Shoal
    virtual device does. Sizes (batch / micro-batches):

    \b
    gpt tiny   d_model 32, 1 layer, sequence 16, vocabulary 64     8 / 2
    gpt small  d_model 256, 4 layers, sequence 64, vocabulary 256  16 / 4  (3.3M)
    gpt large  d_model 512, 8 layers, sequence 128, vocabulary 256 32 / 4  (25.5M)
    mlp tiny   2 x 16 hidden, 8 in, 4 out                          8 / 2
    mlp small  4 x 2048 hidden, 512 in, 16 out                     64 / 4  (13.7M)
    mlp large  8 x 4096 hidden, 1024 in, 16 out                    256 / 4 (121.7M)
    """
    from shoal.service.bench.report import round_phases
    from shoal.service.bench.step import STEP_PHASES, run_step

    chosen = bench_device(device)
    settings = bench_settings(
        StepSettings,
        device=chosen,
        model=model,
        size=size or DEFAULT_SIZE[chosen],
        stages=stages,
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        rounds=rounds,
    )
    count = len(round_phases(STEP_PHASES, rounds))
    run_bench(count, as_json, lambda progress: run_step(settings, progress), _step_table)


def _step_table(console: Console, result: dict[str, Any]) -> None:
    stages = result["stages"]
    where = f"{stages} stage{'s' if stages > 1 else ''} on {result['device']}"
    table = Table(title=f"shoal bench step: {result['model']}", caption=caption(result))
    table.add_column("what")
    table.add_column("samples/s", justify="right")
    table.add_column("ms per step", justify="right")
    table.add_column("vs plain", justify="right")
    table.add_column("MFU", justify="right")
    plain = result["plain_samples_per_s"]
    threads = ", 1 thread" if result["device"] == "cpu" else ""
    mfu = result["mfu"]
    rows = [
        (f"plain PyTorch, 1 process{threads}", plain, result["plain_step_s"], mfu["plain"]),
        (f"Shoal, {where}", result["shoal_samples_per_s"], result["shoal_step_s"], mfu["shoal"]),
        (
            f"Shoal, {where}, keeping copies (its copying windows)",
            result["shoal_copies_samples_per_s"],
            result["shoal_copies_step_s"],
            mfu["shoal_copies"],
        ),
    ]
    for name, rate, seconds, share in rows:
        table.add_row(
            name,
            fmt(rate),
            fmt(1000 * seconds),
            fmt(rate / plain, 2) if plain else "-",
            f"{100 * share:.1f}%" if share is not None else "-",
        )
    console.print(table)
    busy = " ".join(f"{b:.2f}" for b in result["stage_busy"])
    console.print(
        f"Shoal / plain {result['shoal_over_plain']:.2f}; copies cost"
        f" {100 * result['copies_overhead']:.1f}% of Shoal's time where it copies (windows"
        " with copies against those without); stages computing"
        f" {busy} of each step ({result['batch']} samples, {result['micro_batches']}"
        " micro-batches)"
    )
    if (tail := result["copies_tail_share"]) >= 0.005:
        console.print(
            f"The copying windows' last copies ran on into the paused ones for {100 * tail:.1f}%"
            " of their time: the copies' cost may read that much low"
        )
    if result["peak_tflops"] is not None:
        console.print(
            f"MFU: the model's {result['step_flops'] / 1e9:,.1f} GFLOP a step over the device's"
            f" float32 peak, {result['peak_tflops']:,.2f} TFLOP/s"
        )
