"""The sweep commands (sweep, sweeps, sweep-cancel): clients of the REST API's sweeps."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from service.cli.options import client_options, json_option, make_client
from service.cli.render import (
    echo_json,
    is_terminal,
    make_console,
    print_sweep,
    styled_state,
    sweeps_table,
)
from service.cli.specfile import load_spec


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@client_options
def sweep(file: Path, as_json: bool, url: str | None, token: str | None) -> None:
    """Submit the sweep spec in FILE (.yaml, .yml or .json): a base job and a search space."""
    spec = load_spec(file, "sweep")
    with make_client(url, token) as client:
        answer = client.submit_sweep(spec)
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
@json_option
@client_options
def sweeps(
    sweep_id: str | None, limit: int, as_json: bool, url: str | None, token: str | None
) -> None:
    """List sweeps, or show one sweep (SWEEP_ID) with its trials and the best one."""
    with make_client(url, token) as client:
        answer = client.get_sweep(sweep_id) if sweep_id else client.list_sweeps(limit=limit)
    if as_json:
        echo_json(answer)
    elif sweep_id:
        print_sweep(make_console(), answer)
    else:
        make_console().print(sweeps_table(answer))


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
