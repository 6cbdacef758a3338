"""Options shared by the ``shoal`` commands, and the settings and API client built from them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from shoal.service.client import ShoalClient, resolve_config
from shoal.service.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])


class InputError(click.ClickException):
    """Bad input from the person at the terminal (a spec file, an option): exit code 2."""

    exit_code = 2


def client_options(command: F) -> F:
    command = click.option(
        "--token",
        envvar="SHOAL_TOKEN",
        help="API token [env SHOAL_TOKEN; default: $SHOAL_HOME/admin.token].",
    )(command)
    return click.option(
        "--url",
        envvar="SHOAL_URL",
        help="Shoal's address [env SHOAL_URL; default: where `shoal up` serves].",
    )(command)


def idempotency_option(what: str) -> Callable[[F], F]:
    return click.option(
        "--idempotency-key",
        help=f"Retrying with the same key never makes a second {what} [default: file hash"
        " + nonce].",
    )


def code_option(command: F) -> F:
    return click.option(
        "--code",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="A folder of your own Python modules to send with it: factories name them as"
        " code:module:function. Needs the code permission; the code runs on the cluster.",
    )(command)


def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print the raw JSON answer.")(
        command
    )


def make_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with the options that were given on top."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InputError(f"invalid setting: {problems} (see SHOAL_* variables)") from None


def make_client(url: str | None, token: str | None) -> ShoalClient:
    config = resolve_config(url, token, make_settings())
    return ShoalClient(config.url, config.token)
