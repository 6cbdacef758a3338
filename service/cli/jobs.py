"""The job commands (submit, status, logs, cancel, restart, export): clients of the REST API."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

import click
from rich.markup import escape

from shoal.service.cli.options import (
    InputError,
    client_options,
    code_option,
    idempotency_option,
    json_option,
    make_client,
)
from shoal.service.cli.render import (
    Json,
    echo_json,
    format_loss,
    format_when,
    is_terminal,
    jobs_table,
    make_console,
    print_job,
    progress_bar,
    styled_state,
)
from shoal.service.cli.specfile import load_spec, submission_key
from shoal.service.client import ShoalClient
from shoal.service.lifecycle import JobState


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@idempotency_option("job")
@code_option
@json_option
@client_options
def submit(
    file: Path,
    idempotency_key: str | None,
    code: Path | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """Submit the job spec in FILE (.yaml, .yml or .json)."""
    spec = load_spec(file)
    with make_client(url, token) as client:
        job = client.submit_job(spec, submission_key(file, idempotency_key), code)
    if as_json:
        echo_json(job)
        return
    make_console().print(
        f"job [bold]{job['id']}[/] ({escape(job['name'])}) {styled_state(job['state'])}\n"
        f"follow it with: shoal logs -f {job['id']}"
    )


@click.command()
@click.argument("job_id", required=False)
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in JobState], case_sensitive=False),
    help="Only jobs in this state (repeatable).",
)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 500))
@json_option
@client_options
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
    with make_client(url, token) as client:
        if job_id is None:
            page = client.list_jobs([s.upper() for s in states], limit=limit)
            echo_json(page) if as_json else make_console().print(jobs_table(page))
            return
        job = client.get_job(job_id)
        checkpoints = client.checkpoints(job_id)["items"]
    if as_json:
        echo_json({**job, "checkpoints": checkpoints})
    else:
        print_job(make_console(), job, checkpoints)


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
                if metric.get("mfu") is not None:
                    text += f" MFU {metric['mfu'] * 100:.3g}%"
                entries.append((metric["time"], 1, text))
            self.step = metrics[-1]["step"]
            self.last_metric = metrics[-1]
        entries.sort(key=lambda entry: (_sort_time(entry[0]), entry[1]))
        return [f"[dim]{format_when(time_)}[/] {text}" for time_, _, text in entries]


def _sort_time(value: str) -> float:
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


@click.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.0, 60.0),
    help="Seconds between polls with --follow.",
)
@client_options
def logs(job_id: str, follow: bool, interval: float, url: str | None, token: str | None) -> None:
    """Print a job's events and per-step metrics; with -f, follow it with a progress bar.

    With -f the exit code is 1 if the job ends FAILED.
    """
    console = make_console()
    cursor = _LogCursor()
    with make_client(url, token) as client:
        job = client.get_job(job_id)
        if not follow:
            for line in cursor.new_lines(client, job_id, job["steps"]):
                console.print(line)
            return
        with progress_bar(console) as progress:
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
                    loss=format_loss(last["loss"] if last else job["last_loss"]),
                    rate=f"{last['samples_per_s']:.1f}" if last else "-",
                )
                if is_terminal(job["state"]):
                    break
                time.sleep(interval)
    console.print(f"job {job['id']} {styled_state(job['state'])}")
    if job["error"]:
        console.print(f"[red]{escape(job['error'])}[/]")
    if job["state"] == JobState.FAILED:
        sys.exit(1)


@click.command()
@click.argument("job_id")
@json_option
@client_options
def cancel(job_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Cancel a job: a queued one at once, a running one at its next step."""
    with make_client(url, token) as client:
        job = client.cancel_job(job_id)
    if as_json:
        echo_json(job)
        return
    pending = job.get("cancel_requested") and not is_terminal(job["state"])
    note = "; it stops at its next step boundary" if pending else ""
    make_console().print(f"job {job['id']} {styled_state(job['state'])}{note}")


@click.command()
@click.argument("job_id")
@json_option
@client_options
def restart(job_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Requeue a FAILED or CANCELLED job; it resumes from its latest checkpoint."""
    with make_client(url, token) as client:
        job = client.restart_job(job_id)
    if as_json:
        echo_json(job)
        return
    make_console().print(f"job {job['id']} {styled_state(job['state'])} (attempt {job['attempt']})")


@click.command()
@click.argument("job_id")
@click.option(
    "--step",
    type=click.IntRange(0),
    help="The checkpoint's step [default: the latest].",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The file to write [default: JOB_ID-step-STEP.safetensors here].",
)
@client_options
def export(
    job_id: str, step: int | None, output: Path | None, url: str | None, token: str | None
) -> None:
    """Write a job's trained model (a checkpoint's) as one safetensors file: tensors named
    {block}.{name}, loadable into the same model in plain PyTorch (docs/user-guide.md)."""
    if output is not None and not output.parent.is_dir():
        raise InputError(f"-o/--output: the folder {output.parent} does not exist; create it first")
    with make_client(url, token) as client:
        if step is None:
            listed = client.checkpoints(job_id)["items"]
            step = listed[-1]["step"] if listed else None
        dest = output or Path(f"{job_id}-step-{step}.safetensors")
        size = client.export_model(job_id, dest, step)
    make_console().print(f"wrote {escape(str(dest))} ({size:,} bytes) from job {job_id}")
