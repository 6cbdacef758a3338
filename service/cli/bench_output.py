"""How every ``shoal bench`` command shows itself: the --json flag, the phase progress bar,
numbers, and the caption saying where and when they were taken."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shoal.service.bench.report import DEVICES
from shoal.service.cli.options import InputError
from shoal.service.cli.render import make_console

Result = dict[str, Any]
Settings = TypeVar("Settings")

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
"""What an option maker returns: ``click.option(...)`` for one command's defaults."""

JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on the last line."
)


def device_option(what: str) -> Decorator:
    """``--device cpu|cuda``: where ``what`` runs."""
    return click.option(
        "--device",
        type=click.Choice(DEVICES),
        default=None,
        help=f"Where {what} run [default: cuda when PyTorch sees a GPU, else cpu].",
    )


def rounds_option(most: int, what: str) -> Decorator:
    """``--rounds``: how many times a bench's contenders run (default once)."""
    return click.option(
        "--rounds", default=1, show_default=True, type=click.IntRange(1, most), help=what
    )


def bench_device(requested: str | None) -> str:
    """The device to bench on: the one asked for, else CUDA when PyTorch sees it, else CPU."""
    import torch

    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise InputError(
            "--device cuda: PyTorch sees no CUDA device on this machine"
            " (torch.cuda.is_available() is false); run on a GPU machine or use --device cpu"
        )
    return requested or ("cuda" if available else "cpu")


@contextmanager
def phases(console: Console, total: int, quiet: bool) -> Iterator[Any]:
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


def bench_settings(make: Callable[..., Settings], **options: Any) -> Settings:
    """A bench's settings from its options; one they refuse (``ValueError``, naming it) is
    the CLI's input error."""
    try:
        return make(**options)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def run_bench(
    count: int,
    as_json: bool,
    run: Callable[[Callable[[str], None]], Result],
    table: Callable[[Console, Result], None],
) -> Result:
    """``run`` a bench under a progress bar of ``count`` phases and print its result: one
    JSON object with --json, else ``table``. A bench that cannot run (``BenchError``, its
    message saying why) is the CLI's error. The result."""
    from shoal.service.bench.report import BenchError

    console = make_console()
    with phases(console, count, as_json) as progress:
        try:
            result = run(progress)
        except BenchError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        table(console, result)
    return result


def fmt(value: float, digits: int = 1) -> str:
    """A number with thousands separators and ``digits`` decimals."""
    return f"{value:,.{digits}f}"


def caption(result: dict[str, Any]) -> str:
    """A bench table's caption from its result's ``machine`` and ``wall_s``."""
    m = result["machine"]
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return (
        f"{m['date']}, {m['cpus']} cpus{gpu}, load {m['load_average_1m']}, torch {m['torch']},"
        f" ray {m['ray']}, {result['wall_s']} s"
    )
