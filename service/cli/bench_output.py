"""How every ``shoal bench`` command shows itself: the --json flag, the phase progress bar,
numbers, and the caption saying where and when they were taken."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shoal.service.bench.report import DEVICES
from shoal.service.cli.options import InputError

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
