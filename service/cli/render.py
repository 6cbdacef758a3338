"""How ``shoal`` shows things at the terminal: rich tables, the progress bar, and formatting."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shoal.service.lifecycle import JobState
from shoal.service.localray import RAY_ENV

if TYPE_CHECKING:
    from shoal.service.localray import LocalRay
    from shoal.service.settings import Settings

STATE_STYLES = {
    "QUEUED": "yellow",
    "RUNNING": "cyan",
    "RECOVERING": "magenta",
    "SUCCEEDED": "green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
    "PRUNED": "dim yellow",
}
Json = dict[str, Any]


def make_console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        # Piped or captured: keep each table row on one line instead of folding it into 80.
        console.width = max(console.width, 160)
    return console


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2))


def styled_state(state: str) -> str:
    return f"[{STATE_STYLES.get(state, 'default')}]{state}[/]"


def format_when(value: str | None) -> str:
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return value


def format_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def is_terminal(state: str) -> bool:
    return state in JobState.__members__ and JobState(state).is_terminal


def _table(caption: str, *columns: str) -> Table:
    """A table whose columns named ``>NAME`` are right-aligned; ids never wrap."""
    table = Table(caption=caption, caption_justify="left")
    for column in columns:
        name = column.removeprefix(">")
        table.add_column(name, justify="right" if column != name else "left", no_wrap=name == "ID")
    return table


def jobs_table(page: Json) -> Table:
    table = _table(
        f"{len(page['items'])} of {page['total']} jobs",
        *("ID", "NAME", "OWNER", "STATE", ">STEP", ">LOSS", ">DEVICES", "CREATED"),
    )
    for job in page["items"]:
        table.add_row(
            job["id"],
            escape(job["name"]),
            escape(job["owner"]),
            styled_state(job["state"]),
            f"{job['step']}/{job['steps']}",
            format_loss(job["last_loss"]),
            str(len(job["devices"])),
            format_when(job["created_at"]),
        )
    return table


def print_job(console: Console, job: Json, checkpoints: list[Json]) -> None:
    details = Table.grid(padding=(0, 2))
    details.add_column(style="bold")
    details.add_column()
    cancelling = job.get("cancel_requested") and not is_terminal(job["state"])
    rows = [
        ("id", job["id"]),
        ("name", escape(job["name"])),
        ("owner", escape(job["owner"])),
        ("state", styled_state(job["state"]) + (" (cancel requested)" if cancelling else "")),
        ("step", f"{job['step']}/{job['steps']}"),
        ("last loss", format_loss(job["last_loss"])),
        ("attempt", str(job["attempt"])),
        ("priority", str(job["priority"])),
        ("devices", ", ".join(job["devices"]) or "-"),
        ("created", format_when(job["created_at"])),
        ("started", format_when(job["started_at"])),
        ("finished", format_when(job["finished_at"])),
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
            devices = ", ".join([stage["device_id"], *stage.get("tensor_devices", [])])
            partition.add_row(str(stage["stage"]), devices, f"{start}..{stop - 1}")
        console.print(partition)


def format_params(params: Json) -> str:
    """A trial's parameters as ``path=value`` pairs, floats to 4 significant digits."""
    shown = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return escape(", ".join(shown))


def _trials_started(sweep: Json) -> str:
    return f"{sum(sweep['trial_counts'].values())}/{sweep['max_trials']}"


def _best_objective(sweep: Json) -> str:
    best = sweep["best"]
    return "-" if best is None else format_loss(best["objective"])


def sweeps_table(page: Json) -> Table:
    table = _table(
        f"{len(page['items'])} of {page['total']} sweeps",
        *("ID", "NAME", "OWNER", "STATE", ">TRIALS", ">BEST", "CREATED"),
    )
    for sweep in page["items"]:
        table.add_row(
            sweep["id"],
            escape(sweep["name"]),
            escape(sweep["owner"]),
            styled_state(sweep["state"]),
            _trials_started(sweep),
            _best_objective(sweep),
            format_when(sweep["created_at"]),
        )
    return table


def print_sweep(console: Console, sweep: Json) -> None:
    """A sweep's details, its trials by number and its best trial."""
    details = Table.grid(padding=(0, 2))
    details.add_column(style="bold")
    details.add_column()
    cancelling = sweep["cancel_requested"] and not is_terminal(sweep["state"])
    objective = sweep["objective"]
    counts = ", ".join(f"{n} {styled_state(s)}" for s, n in sweep["trial_counts"].items() if n)
    rows = [
        ("id", sweep["id"]),
        ("name", escape(sweep["name"])),
        ("owner", escape(sweep["owner"])),
        ("state", styled_state(sweep["state"]) + (" (cancel requested)" if cancelling else "")),
        ("objective", escape(f"{objective['direction']} {objective['metric']}")),
        ("trials", _trials_started(sweep) + (f" ({counts})" if counts else "")),
        ("created", format_when(sweep["created_at"])),
        ("finished", format_when(sweep["finished_at"])),
    ]
    for name, value in rows:
        details.add_row(name, value)
    if sweep["error"]:
        details.add_row("error", f"[red]{escape(sweep['error'])}[/]")
    console.print(details)
    if not sweep["trials"]:
        console.print("no trials yet")
        return
    trials = _table(
        f"{len(sweep['trials'])} trials",
        *("#", "STATE", "PARAMS", ">OBJECTIVE", ">LAST REPORT", "JOB"),
    )
    for trial in sweep["trials"]:
        last = trial["intermediate"][-1] if trial["intermediate"] else None
        trials.add_row(
            str(trial["number"]),
            styled_state(trial["state"]),
            format_params(trial["params"]),
            format_loss(trial["objective"]),
            "-" if last is None else f"{format_loss(last['value'])} @ {last['step']}",
            trial["job_id"],
        )
    console.print(trials)
    best = sweep["best"]
    if best is not None:
        console.print(
            f"best: trial {best['number']}, {escape(objective['metric'])}"
            f" {format_loss(best['objective'])}, {format_params(best['params'])}"
            f" (job {best['job_id']})"
        )


def _memory(device: Json) -> str:
    """``2048 MB``, or ``2048 MB (612 held)`` once a worker measured the device's overhead."""
    held = device.get("overhead_mb")
    return f"{device['memory_mb']} MB" + (f" ({held} held)" if held else "")


def devices_table(answer: Json) -> Table:
    table = _table(
        f"{len(answer['items'])} devices",
        *("ID", "KIND", ">MEMORY", "GPU", "SPOT", "STATE", ">GFLOP/S", "JOB"),
    )
    for device in answer["items"]:
        speed = device["speed_gflops"]
        table.add_row(
            device["id"],
            escape(device["kind"]),
            _memory(device),
            "yes" if device["gpu"] else "no",
            "yes" if device["spot"] else "no",
            escape(device["state"] + (", draining" if device["draining"] else "")),
            "-" if speed is None else f"{speed:.1f}",
            device["job_id"] or "-",
        )
    return table


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} samples/s"),
        TimeElapsedColumn(),
        console=console,
    )


def sweep_progress(console: Console) -> Progress:
    """Trials ended (done, pruned, failed) of the sweep's total, and the best objective."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("trials ended · best {task.fields[best]}"),
        TimeElapsedColumn(),
        console=console,
    )


def trial_line(trial: Json) -> str:
    """One ended trial: its number, state, objective and hyperparameters."""
    return (
        f"trial {trial['number']} {styled_state(trial['state'])}"
        f" objective {format_loss(trial['objective'])} {format_params(trial['params'])}"
    )


def print_banner(
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
    if local is not None:
        env = settings.home / RAY_ENV
        grid.add_row("", escape(f"`ray` commands reach it with the variables in {env}"))
    # A token the operator chose (a Kubernetes Secret, say) is never echoed into logs.
    grid.add_row("admin token", "from SHOAL_ADMIN_TOKEN" if settings.admin_token else admin_token)
    grid.add_row("", f"saved in {settings.admin_token_path} (mode 0600); the CLI reads it there")
    grid.add_row("try", "shoal submit examples/mlp-digits.yaml")
    console.print("[bold green]Shoal is up[/]")
    console.print(grid)
    console.print("Ctrl-C stops Shoal" + (" and the local Ray cluster" if local else ""))
