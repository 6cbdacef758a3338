"""The device commands (devices, drain, undrain): clients of the REST API."""

from __future__ import annotations

import click
from rich.markup import escape

from shoal.service.cli.options import client_options, json_option, make_client
from shoal.service.cli.render import Json, devices_table, echo_json, make_console


@click.command()
@json_option
@client_options
def devices(as_json: bool, url: str | None, token: str | None) -> None:
    """List the devices of the cluster and what runs on them."""
    with make_client(url, token) as client:
        answer = client.devices()
    if as_json:
        echo_json(answer)
        return
    make_console().print(devices_table(answer))


@click.command()
@click.argument("device_id")
@json_option
@client_options
def drain(device_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Move jobs off a device at their next step boundary and place nothing more on it
    (an admin's command)."""
    with make_client(url, token) as client:
        _said(client.drain_device(device_id), as_json)


@click.command()
@click.argument("device_id")
@json_option
@client_options
def undrain(device_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Place jobs on a drained device again, such as one set aside because a worker failed
    on it, once it is mended (an admin's command)."""
    with make_client(url, token) as client:
        _said(client.undrain_device(device_id), as_json)


def _said(device: Json, as_json: bool) -> None:
    if as_json:
        echo_json(device)
        return
    if device["draining"]:
        line = f"device {device['id']} is draining: {device['drain_reason'] or 'no reason given'}"
    else:
        line = f"device {device['id']} takes jobs"
    make_console().print(escape(line))
