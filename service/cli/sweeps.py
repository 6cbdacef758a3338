"""The sweep commands (sweep, sweeps, sweep-cancel): clients of the REST API's sweeps."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from shoal.service.cli.options import (
    client_options,
    code_option,
    idempotency_option,
    json_option,
    make_client,
)
from shoal.service.cli.render import (
    echo_json,
    format_loss,
    is_terminal,
    make_console,
    print_sweep,
    styled_state,
    sweep_progress,
    sweeps_table,
    trial_line,
)
from shoal.service.cli.specfile import load_spec, submission_key
from shoal.service.client import ShoalClient
from shoal.service.lifecycle import JobState


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@idempotency_option("sweep")
@code_option
@json_option
@client_options
def sweep(
    file: Path,
    idempotency_key: str | None,
    code: Path | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """Submit the sweep spec in FILE (.yaml, .yml or .json): a base job and a search space."""
    spec = load_spec(file, "sweep")
    with make_client(url, token) as client:
        answer = client.submit_sweep(spec, submission_key(file, idempotency_key), code)
    if as_json:
        echo_json(answer)
        return
    make_console().print(
        f"sweep [bold]{answer['id']}[/] ({escape(answer['name'])})"
        f" {styled_state(answer['state'])}, {answer['max_trials']} trials\n"
        f"follow it with: shoal sweeps {answer['id']}"
    )


@click.command()
@click.argument("sweep_id", required=False)
@click.option(
    "--limit",
    default=50,
    show_default=True,
    type=click.IntRange(1, 500),
    help="How many sweeps to list, newest first.",
)
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="With SWEEP_ID: a progress bar of its trials until it ends (exit code 1 if FAILED).",
)
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.0, 60.0),
    help="Seconds between polls with --follow.",
)
@json_option
@client_options
def sweeps(
    sweep_id: str | None,
    limit: int,
    follow: bool,
    interval: float,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """List sweeps, or show one sweep (SWEEP_ID) with its trials and the best one."""
    if follow and (sweep_id is None or as_json):
        raise click.UsageError("--follow needs a SWEEP_ID and prints no JSON")
    with make_client(url, token) as client:
        if sweep_id is None:
            answer = client.list_sweeps(limit=limit)
        elif follow:
            answer = _follow(client, sweep_id, interval)
        else:
            answer = client.get_sweep(sweep_id)
    if as_json:
        echo_json(answer)
    elif sweep_id:
        print_sweep(make_console(), answer)
    else:
        make_console().print(sweeps_table(answer))
    if follow and answer["state"] == JobState.FAILED:
        sys.exit(1)


_ENDED = ("SUCCEEDED", "PRUNED", "FAILED", "CANCELLED")


def _follow(client: ShoalClient, sweep_id: str, interval: float) -> dict[str, Any]:
    """Poll the sweep until it ends: a line per trial as it ends, a bar of trials ended."""
    ended: set[int] = set()
    with sweep_progress(make_console()) as progress:
        sweep = client.get_sweep(sweep_id)
        task = progress.add_task(escape(sweep["name"]), total=sweep["max_trials"], best="-")
        while True:
            for trial in sweep["trials"]:
                if trial["state"] in _ENDED and trial["number"] not in ended:
                    ended.add(trial["number"])
                    progress.console.print(trial_line(trial))
            best = sweep["best"]
            progress.update(
                task, completed=len(ended), best=format_loss(best["objective"]) if best else "-"
            )
            if is_terminal(sweep["state"]):
                return sweep
            time.sleep(interval)
            sweep = client.get_sweep(sweep_id)


@click.command("sweep-cancel")
@click.argument("sweep_id")
@json_option
@client_options
def sweep_cancel(sweep_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Cancel a sweep: a queued one at once; a running one's trials at their next step."""
    with make_client(url, token) as client:
        answer = client.cancel_sweep(sweep_id)
    if as_json:
        echo_json(answer)
        return
    pending = answer["cancel_requested"] and not is_terminal(answer["state"])
    note = "; its trials stop at their next step boundary" if pending else ""
    make_console().print(f"sweep {answer['id']} {styled_state(answer['state'])}{note}")
