"""The ``shoal`` command: run Shoal locally, and submit, watch and control its jobs.

Job commands talk to the REST API through ``service.client``; ``up``, ``token`` and ``db``
act on this machine's database through the settings. Every failure is one message on
stderr and a non-zero exit code (1: refused or unreachable, 2: bad input), never a
traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from service.client import ApiError, ShoalClient, resolve_config, write_config
from service.lifecycle import JobState
from service.localray import DeviceSpecError, LocalRay, LocalRayError, free_port, parse_devices
from service.settings import Settings, UnsafeSettings

SPEC_FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
STATE_STYLES = {
    "QUEUED": "yellow",
    "RUNNING": "cyan",
    "RECOVERING": "magenta",
    "SUCCEEDED": "green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
}
Json = dict[str, Any]
F = TypeVar("F", bound=Callable[..., Any])


class InputError(click.ClickException):
    """Bad input from the person at the terminal (a spec file, an option): exit code 2."""

    exit_code = 2


class _ShoalGroup(click.Group):
    """Turns API errors of any subcommand into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as exc:
            raise click.ClickException(exc.message) from None


@click.group(cls=_ShoalGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Shoal: elastic training on heterogeneous, preemptible Ray clusters."""


def main() -> None:
    cli(prog_name="shoal")


# ------------------------------------------------------------------------------ helpers


def _client_options(command: F) -> F:
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


def _json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print the raw JSON answer.")(
        command
    )


def _settings(**overrides: Any) -> Settings:
    """Settings from the environment, with the options that were given on top."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InputError(f"invalid setting: {problems} (see SHOAL_* variables)") from None


def _client(url: str | None, token: str | None) -> ShoalClient:
    config = resolve_config(url, token, _settings())
    return ShoalClient(config.url, config.token)


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        # Piped or captured: keep each table row on one line instead of folding it into 80.
        console.width = max(console.width, 160)
    return console


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2))


def _state(state: str) -> str:
    return f"[{STATE_STYLES.get(state, 'default')}]{state}[/]"


def _when(value: str | None) -> str:
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return value


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _is_terminal(state: str) -> bool:
    return state in JobState.__members__ and JobState(state).is_terminal


def load_spec(path: Path) -> Json:
    """A job spec file decoded (YAML or JSON by extension); ``InputError`` says where it breaks."""
    kind = SPEC_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise InputError(
            f"{path}: unknown extension {path.suffix or '(none)'!r}; use .yaml, .yml or .json"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text; save the spec as UTF-8") from None
    try:
        spec = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise InputError(f"{where}: invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: invalid YAML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if not isinstance(spec, dict):
        raise InputError(
            f"{path}: a job spec is a mapping of fields (name, model, data, steps, ...),"
            f" not {type(spec).__name__}"
        )
    try:
        json.dumps(spec)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: {exc}; quote dates and other special values") from None
    return spec


# --------------------------------------------------------------------------- job commands


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--idempotency-key",
    help="Retrying with the same key never makes a second job [default: file hash + nonce].",
)
@_json_option
@_client_options
def submit(
    file: Path, idempotency_key: str | None, as_json: bool, url: str | None, token: str | None
) -> None:
    """Submit the job spec in FILE (.yaml, .yml or .json)."""
    spec = load_spec(file)
    key = idempotency_key or (
        f"{hashlib.sha256(file.read_bytes()).hexdigest()[:32]}-{secrets.token_hex(8)}"
    )
    with _client(url, token) as client:
        job = client.submit_job(spec, key)
    if as_json:
        _echo_json(job)
        return
    _console().print(
        f"job [bold]{job['id']}[/] ({escape(job['name'])}) {_state(job['state'])}\n"
        f"follow it with: shoal logs -f {job['id']}"
    )


def _table(caption: str, *columns: str) -> Table:
    """A table whose columns named ``>NAME`` are right-aligned; ids never wrap."""
    table = Table(caption=caption, caption_justify="left")
    for column in columns:
        name = column.removeprefix(">")
        table.add_column(name, justify="right" if column != name else "left", no_wrap=name == "ID")
    return table


def _jobs_table(page: Json) -> Table:
    table = _table(
        f"{len(page['items'])} of {page['total']} jobs",
        *("ID", "NAME", "OWNER", "STATE", ">STEP", ">LOSS", ">DEVICES", "CREATED"),
    )
    for job in page["items"]:
        table.add_row(
            job["id"],
            escape(job["name"]),
            escape(job["owner"]),
            _state(job["state"]),
            f"{job['step']}/{job['steps']}",
            _loss(job["last_loss"]),
            str(len(job["devices"])),
            _when(job["created_at"]),
        )
    return table


def _print_job(console: Console, job: Json, checkpoints: list[Json]) -> None:
    details = Table.grid(padding=(0, 2))
    details.add_column(style="bold")
    details.add_column()
    cancelling = job.get("cancel_requested") and not _is_terminal(job["state"])
    rows = [
        ("id", job["id"]),
        ("name", escape(job["name"])),
        ("owner", escape(job["owner"])),
        ("state", _state(job["state"]) + (" (cancel requested)" if cancelling else "")),
        ("step", f"{job['step']}/{job['steps']}"),
        ("last loss", _loss(job["last_loss"])),
        ("attempt", str(job["attempt"])),
        ("priority", str(job["priority"])),
        ("devices", ", ".join(job["devices"]) or "-"),
        ("created", _when(job["created_at"])),
        ("started", _when(job["started_at"])),
        ("finished", _when(job["finished_at"])),
    ]
    if checkpoints:
        latest = checkpoints[-1]
        rows.append(("checkpoints", f"{len(checkpoints)}, latest at step {latest['step']}"))
    for name, value in rows:
        details.add_row(name, value)
    if job["error"]:
        details.add_row("error", f"[red]{escape(job['error'])}[/]")
    console.print(details)
    if job["partition"]:
        stages = len(job["partition"])
        partition = _table(f"pipeline of {stages} stages", "STAGE", "DEVICE", "BLOCKS")
        for stage in job["partition"]:
            start, stop = stage["blocks"]
            partition.add_row(str(stage["stage"]), stage["device_id"], f"{start}..{stop - 1}")
        console.print(partition)


@cli.command()
@click.argument("job_id", required=False)
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in JobState], case_sensitive=False),
    help="Only jobs in this state (repeatable).",
)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 500))
@_json_option
@_client_options
def status(
    job_id: str | None,
    states: tuple[str, ...],
    limit: int,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """List jobs, or show one job (JOB_ID) with its partition and error."""
    if job_id and states:
        raise InputError("--state filters the job list; leave it out when giving a JOB_ID")
    with _client(url, token) as client:
        if job_id is None:
            page = client.list_jobs([s.upper() for s in states], limit=limit)
            _echo_json(page) if as_json else _console().print(_jobs_table(page))
            return
        job = client.get_job(job_id)
        checkpoints = client.checkpoints(job_id)["items"]
    if as_json:
        _echo_json({**job, "checkpoints": checkpoints})
    else:
        _print_job(_console(), job, checkpoints)


class _LogCursor:
    """What `shoal logs` has printed so far: the last event id and metrics step."""

    def __init__(self) -> None:
        self.event_id = 0
        self.step: int | None = None
        self.last_metric: Json | None = None

    def new_lines(self, client: ShoalClient, job_id: str, steps: int) -> list[str]:
        """Events and metrics after the cursor, oldest first, as printable lines."""
        entries: list[tuple[str, int, str]] = []
        while events := client.events(job_id, since_id=self.event_id)["items"]:
            for event in events:
                text = f"{escape(event['kind'])}: {escape(event['message'])}"
                if event["kind"] == "state":
                    text = f"[bold]{text}[/]"
                entries.append((event["time"], 0, text))
            self.event_id = events[-1]["id"]
        while metrics := client.metrics(job_id, since_step=self.step)["items"]:
            for metric in metrics:
                text = (
                    f"step {metric['step']}/{steps} loss {metric['loss']:.4f}"
                    f" {metric['samples_per_s']:.1f} samples/s"
                    f" {metric['step_time_s'] * 1000:.0f} ms/step"
                )
                entries.append((metric["time"], 1, text))
            self.step = metrics[-1]["step"]
            self.last_metric = metrics[-1]
        entries.sort(key=lambda entry: (_sort_time(entry[0]), entry[1]))
        return [f"[dim]{_when(time_)}[/] {text}" for time_, _, text in entries]


def _sort_time(value: str) -> float:
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


@cli.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.0, 60.0),
    help="Seconds between polls with --follow.",
)
@_client_options
def logs(job_id: str, follow: bool, interval: float, url: str | None, token: str | None) -> None:
    """Print a job's events and per-step metrics; with -f, follow it with a progress bar.

    With -f the exit code is 1 if the job ends FAILED.
    """
    console = _console()
    cursor = _LogCursor()
    with _client(url, token) as client:
        job = client.get_job(job_id)
        if not follow:
            for line in cursor.new_lines(client, job_id, job["steps"]):
                console.print(line)
            return
        with _progress(console) as progress:
            task = progress.add_task(escape(job["name"]), total=job["steps"], loss="-", rate="-")
            while True:
                # The job first: once it is terminal, what follows holds its last lines.
                job = client.get_job(job_id)
                for line in cursor.new_lines(client, job_id, job["steps"]):
                    progress.console.print(line)
                last = cursor.last_metric
                progress.update(
                    task,
                    completed=job["step"],
                    loss=_loss(last["loss"] if last else job["last_loss"]),
                    rate=f"{last['samples_per_s']:.1f}" if last else "-",
                )
                if _is_terminal(job["state"]):
                    break
                time.sleep(interval)
    console.print(f"job {job['id']} {_state(job['state'])}")
    if job["error"]:
        console.print(f"[red]{escape(job['error'])}[/]")
    if job["state"] == JobState.FAILED:
        sys.exit(1)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} samples/s"),
        TimeElapsedColumn(),
        console=console,
    )


@cli.command()
@click.argument("job_id")
@_json_option
@_client_options
def cancel(job_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Cancel a job: a queued one at once, a running one at its next step."""
    with _client(url, token) as client:
        job = client.cancel_job(job_id)
    if as_json:
        _echo_json(job)
        return
    pending = job.get("cancel_requested") and not _is_terminal(job["state"])
    note = "; it stops at its next step boundary" if pending else ""
    _console().print(f"job {job['id']} {_state(job['state'])}{note}")


@cli.command()
@click.argument("job_id")
@_json_option
@_client_options
def restart(job_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Requeue a FAILED or CANCELLED job; it resumes from its latest checkpoint."""
    with _client(url, token) as client:
        job = client.restart_job(job_id)
    if as_json:
        _echo_json(job)
        return
    _console().print(f"job {job['id']} {_state(job['state'])} (attempt {job['attempt']})")


@cli.command()
@_json_option
@_client_options
def devices(as_json: bool, url: str | None, token: str | None) -> None:
    """List the devices of the cluster and what runs on them."""
    with _client(url, token) as client:
        answer = client.devices()
    if as_json:
        _echo_json(answer)
        return
    table = _table(
        f"{len(answer['items'])} devices",
        *("ID", "KIND", ">MEMORY", "GPU", "SPOT", "STATE", ">GFLOP/S", "JOB"),
    )
    for device in answer["items"]:
        speed = device["speed_gflops"]
        table.add_row(
            device["id"],
            escape(device["kind"]),
            f"{device['memory_mb']} MB",
            "yes" if device["gpu"] else "no",
            "yes" if device["spot"] else "no",
            escape(device["state"]),
            "-" if speed is None else f"{speed:.1f}",
            device["job_id"] or "-",
        )
    _console().print(table)


# ------------------------------------------------------------------------ server commands


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

    from service.db.session import migrate

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


@cli.group()
def token() -> None:
    """API tokens (acts on the database of this machine's settings)."""


@token.command("create")
@click.option("--user", required=True, help="User name; created if new.")
@click.option("--admin", is_flag=True, help="Make the user an admin (sees every job).")
@_home_option
def token_create(user: str, admin: bool, home: Path | None) -> None:
    """Create a token for USER and print it (it is shown only once)."""
    from service.auth import AuthError, create_token
    from service.db.session import make_engine, make_session_factory

    with _database(_settings(home=home)) as url:
        engine = make_engine(url)
        try:
            secret = create_token(make_session_factory(engine), user=user, admin=admin)
        except AuthError as exc:
            raise InputError(str(exc)) from None
        finally:
            engine.dispose()
    click.echo(secret)


@cli.group()
def db() -> None:
    """The database (acts on the database of this machine's settings)."""


@db.command("upgrade")
@_home_option
def db_upgrade(home: Path | None) -> None:
    """Bring the database schema to the latest version."""
    with _database(_settings(home=home)):
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


@cli.command()
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
    from service.auth import ensure_admin_token
    from service.db.session import make_engine, make_session_factory
    from service.server import serve

    settings = _settings(ray_address=ray_address, devices=devices, host=host, port=port, home=home)
    try:
        settings.check_safe()
        nodes = None if settings.ray_address else parse_devices(settings.devices)
    except (UnsafeSettings, DeviceSpecError) as exc:
        raise InputError(str(exc)) from None
    if settings.port == 0:
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    with _database(settings) as db_url:
        engine = make_engine(db_url)
        try:
            admin_token = ensure_admin_token(settings, make_session_factory(engine))
        finally:
            engine.dispose()
    console = _console()
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    local: LocalRay | None = None
    try:
        if nodes is not None:
            with console.status(f"starting a local Ray cluster of {len(nodes)} nodes"):
                local = LocalRay(nodes, settings.home / "logs").start()
            # The control plane in this process connects with the cluster's own token.
            os.environ.update(local.client_env)
            settings = settings.model_copy(update={"ray_address": local.address})
        url = _client_url(settings.host, settings.port)
        write_config(settings.home, url)
        _print_banner(console, settings, url, admin_token, local)
        serve(settings)
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


def _print_banner(
    console: Console, settings: Settings, url: str, admin_token: str, local: LocalRay | None
) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("API", f"{url}/api/v1  (docs: {url}/api/v1/docs)")
    grid.add_row("dashboard", f"{url}/")
    ray = f"{settings.ray_address}"
    if local is not None:
        ray += f"  (local: {settings.devices}; logs in {settings.home / 'logs'})"
    grid.add_row("Ray", escape(ray))
    grid.add_row("admin token", admin_token)
    grid.add_row("", f"saved in {settings.admin_token_path} (mode 0600); the CLI reads it there")
    grid.add_row("try", "shoal submit examples/mlp-digits.yaml")
    console.print("[bold green]Shoal is up[/]")
    console.print(grid)
    console.print("Ctrl-C stops Shoal" + (" and the local Ray cluster" if local else ""))
