"""The server commands (up, token, db): they act on this machine's database and cluster."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from shoal.service.cli.options import F, InputError, make_settings
from shoal.service.cli.render import make_console, print_banner
from shoal.service.client import write_config
from shoal.service.devicespec import DeviceSpecError, VirtualNode, parse_devices
from shoal.service.localray import (
    HEALTH_CHECKS,
    RAY_ENV,
    WORKER_PRESTART,
    LocalRay,
    LocalRayError,
)
from shoal.service.localray_record import RECORD
from shoal.service.raynode import node_command
from shoal.service.settings import Settings, UnsafeSettings


def _home_option(command: F) -> F:
    return click.option(
        "--home",
        type=click.Path(file_okay=False, path_type=Path),
        help="State directory [env SHOAL_HOME; default ~/.shoal].",
    )(command)


@contextlib.contextmanager
def _database(settings: Settings) -> Iterator[str]:
    """The migrated database URL; a database that cannot be opened is one clear error."""
    import sqlalchemy as sa

    from shoal.service.db.session import migrate

    url = settings.resolved_database_url
    shown = sa.engine.make_url(url).render_as_string(hide_password=True)
    try:
        migrate(url)
        yield url
    except (sa.exc.OperationalError, sa.exc.InterfaceError, OSError) as exc:
        reason = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
        raise click.ClickException(
            f"cannot use the database {shown} ({reason}); check SHOAL_HOME and SHOAL_DATABASE_URL"
        ) from None


@click.group()
def token() -> None:
    """API tokens (acts on the database of this machine's settings)."""


@token.command("create")
@click.option("--user", required=True, help="User name; created if new.")
@click.option("--admin", is_flag=True, help="Make the user an admin (sees every job).")
@click.option(
    "--code",
    is_flag=True,
    help="Let the user send code of their own with jobs (`shoal submit --code DIR`): that"
    " code runs on the cluster's nodes.",
)
@_home_option
def token_create(user: str, admin: bool, code: bool, home: Path | None) -> None:
    """Create a token for USER and print it (it is shown only once). --admin and --code grant
    and never take away: an admin revokes the code permission with `PUT
    /api/v1/users/NAME/code`."""
    from shoal.service.auth import AuthError, create_token
    from shoal.service.db.session import make_engine, make_session_factory

    with _database(make_settings(home=home)) as url:
        engine = make_engine(url)
        try:
            secret = create_token(make_session_factory(engine), user=user, admin=admin, code=code)
        except AuthError as exc:
            raise InputError(str(exc)) from None
        finally:
            engine.dispose()
    click.echo(secret)


@token.command("revoke")
@click.argument("secret", metavar="TOKEN", default="-")
@_home_option
def token_revoke(secret: str, home: Path | None) -> None:
    """Revoke TOKEN at once: every request bringing it is refused from now on. TOKEN `-` (the
    default) reads it from standard input, so that it appears in no process list or history."""
    from shoal.service.auth import revoke_token
    from shoal.service.db.session import make_engine, make_session_factory

    if secret == "-":
        secret = sys.stdin.readline().strip()
    if not secret:
        raise InputError("no token given: pass TOKEN, or - and the token on standard input")
    with _database(make_settings(home=home)) as url:
        engine = make_engine(url)
        try:
            revoked = revoke_token(make_session_factory(engine), secret)
        finally:
            engine.dispose()
    if not revoked:
        raise InputError(f"token {secret[:12]}… is unknown or revoked already")
    click.echo(f"token {secret[:12]}… revoked")


@click.group()
def db() -> None:
    """The database (acts on the database of this machine's settings)."""


@db.command("upgrade")
@_home_option
def db_upgrade(home: Path | None) -> None:
    """Bring the database schema to the latest version."""
    with _database(make_settings(home=home)):
        pass
    click.echo("the database schema is up to date")


def _client_url(host: str, port: int) -> str:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"http://{host}:{port}"
    if address.is_unspecified:
        return f"http://127.0.0.1:{port}"
    return f"http://[{host}]:{port}" if address.version == 6 else f"http://{host}:{port}"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds like Ctrl-C, so the local Ray is stopped


@click.command()
@click.option("--ray-address", help="Join this Ray cluster instead of starting a local one.")
@click.option("--devices", help="Virtual devices of the local Ray [env SHOAL_DEVICES].")
@click.option("--host", help="Address the API binds to [env SHOAL_HOST; default 127.0.0.1].")
@click.option("--port", type=int, help="API port, 0 for any free one [env SHOAL_PORT; 8000].")
@_home_option
def up(
    ray_address: str | None,
    devices: str | None,
    host: str | None,
    port: int | None,
    home: Path | None,
) -> None:
    """Run Shoal here: database, local Ray cluster, API, dashboard and controller."""
    from shoal.service.server import listen

    settings = make_settings(
        ray_address=ray_address, devices=devices, host=host, port=port, home=home
    )
    try:
        settings.check_safe()
        nodes = None if settings.ray_address else parse_devices(settings.devices)
    except (UnsafeSettings, DeviceSpecError) as exc:
        raise InputError(str(exc)) from None
    try:  # first: a port in use fails before anything starts; one picked by 0 stays ours
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        raise InputError(
            f"--port: the API cannot listen on {where} ({exc.strerror or exc}): give a free"
            " port (SHOAL_PORT), or 0 for any"
        ) from None
    with sock:
        _up(settings.model_copy(update={"port": sock.getsockname()[1]}), nodes, sock)


def _up(settings: Settings, nodes: list[VirtualNode] | None, sock: socket.socket) -> None:
    """``up`` once its options are checked and the API's socket is bound."""
    from shoal.service.auth import AuthError, ensure_admin_token
    from shoal.service.db.session import make_engine, make_session_factory
    from shoal.service.server import serve

    with _database(settings) as db_url:
        engine = make_engine(db_url)
        try:
            admin_token = ensure_admin_token(settings, make_session_factory(engine))
        except AuthError as exc:
            raise InputError(str(exc)) from None
        finally:
            engine.dispose()
    console = make_console()
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    local: LocalRay | None = None
    record = settings.home / RECORD
    try:
        if nodes is None:
            # A local cluster an earlier `shoal up` here left running would go on training
            # its jobs beside the runners this one starts on the other cluster.
            if stopped := LocalRay.stop_recorded(record):
                console.print(stopped, markup=False)
        else:
            with console.status(f"starting a local Ray cluster of {len(nodes)} nodes"):
                local = LocalRay(nodes, settings.home / "logs", record_path=record).start()
            if local.previous:
                console.print(local.previous, markup=False)
            # `ray` commands (status, drain-node, start --address) reach it with these.
            local.write_env(settings.home / RAY_ENV)
            # The control plane in this process connects with the cluster's own token.
            os.environ.update(local.client_env)
            settings = settings.model_copy(update={"ray_address": local.address})
        url = _client_url(settings.host, settings.port)
        write_config(settings.home, url)
        print_banner(console, settings, url, admin_token, local)
        serve(settings, sock)
    except LocalRayError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass
    finally:
        if local is not None:
            with console.status("stopping the local Ray cluster"):
                local.stop()
        signal.signal(signal.SIGTERM, previous_sigterm)
    console.print("Shoal stopped")


@click.command()
@click.argument("group")
@click.option(
    "--address",
    help="Join the Ray cluster at this address (HOST:PORT) from a machine or container of"
    " its own, instead of `shoal up`'s local cluster.",
)
@_home_option
def node(group: str, address: str | None, home: Path | None) -> None:
    """Join one more node to the local Ray cluster of `shoal up` (or, with --address, to any
    Ray cluster), declaring the virtual devices GROUP (COUNTxKIND:MEMORY_MB[:slowdown=F]
    [:spot], as in SHOAL_DEVICES): a machine arriving. It runs until stopped; a SIGTERM
    (kill PID, docker stop) drains it first, so jobs move off it before it goes, as on a
    spot node's notice."""
    settings = make_settings(home=home)
    try:
        nodes = parse_devices(group)
    except DeviceSpecError as exc:
        raise InputError(str(exc)) from None
    if len(nodes) != 1:
        raise InputError(f"GROUP {group!r} names {len(nodes)} nodes; give one group per node")
    ray = Path(sys.executable).parent / "ray"
    if address is not None:
        command = node_command(ray, nodes[0], address=address, shared_machine=False)
        os.execve(command[0], command, {**os.environ, **HEALTH_CHECKS, **WORKER_PRESTART})
    path = settings.home / RAY_ENV
    if not path.exists():
        raise InputError(
            f"{path} not found: is `shoal up` running here with its own local cluster?"
            " (to join another cluster, pass its --address)"
        )
    env = LocalRay.read_env(path)
    command = node_command(ray, nodes[0], address=env.pop("RAY_ADDRESS"))
    os.execve(command[0], command, {**os.environ, **HEALTH_CHECKS, **WORKER_PRESTART, **env})
