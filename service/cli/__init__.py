"""The ``shoal`` command group: its subcommands, its entry point and its error handling."""

from __future__ import annotations

from typing import Any

import click

from shoal.service.cli.bench import bench
from shoal.service.cli.devices import devices, drain, undrain
from shoal.service.cli.jobs import cancel, export, logs, restart, status, submit
from shoal.service.cli.server import db, node, token, up
from shoal.service.cli.sweeps import sweep, sweep_cancel, sweeps
from shoal.service.client import ApiError


class _ShoalGroup(click.Group):
    """Turns API errors of any subcommand into one line on stderr and exit code 1.

    Every failure is one message on stderr and a non-zero exit code (1: refused or
    unreachable, 2: bad input, see ``InputError``), never a traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as exc:
            raise click.ClickException(exc.message) from None


@click.group(cls=_ShoalGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Shoal: elastic training on heterogeneous, preemptible Ray clusters."""


# Job and sweep commands talk to the REST API; server commands act on this machine's database.
for _command in (
    submit,
    status,
    logs,
    cancel,
    restart,
    export,
    devices,
    drain,
    undrain,
    sweep,
    sweeps,
    sweep_cancel,
):
    cli.add_command(_command)
for _command in (up, node, token, db):
    cli.add_command(_command)
cli.add_command(bench)  # runs on this machine, no API: see service.cli.bench


def main() -> None:
    cli(prog_name="shoal")
