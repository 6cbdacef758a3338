"""How every ``shoal bench`` command shows itself: the --json flag, the phase progress bar,
numbers, and the caption saying where and when they were taken."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on the last line."
)


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
    return (
        f"{m['date']}, {m['cpus']} cpus, load {m['load_average_1m']}, torch {m['torch']},"
        f" ray {m['ray']}, {result['wall_s']} s"
    )
