"""``shoal.Client`` and the handles it gives: a ``Job`` and a ``Sweep`` by id, over the same
REST client the CLI uses (``service.client.ShoalClient``: its errors, its retries)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import click

from shoal.service.cli.specfile import load_spec, submission_key
from shoal.service.client import Closing, ShoalClient, resolve_config
from shoal.service.lifecycle import JobState
from shoal.service.settings import Settings

Json = dict[str, Any]
POLL_S = 1.0
"""How often ``wait`` asks for the state."""


class Client(Closing):
    """A connection to one Shoal API; a context manager (``close`` ends it).

    ``url`` and ``token`` default as the CLI's do: ``SHOAL_URL`` and ``SHOAL_TOKEN``, then
    what `shoal up` wrote in ``$SHOAL_HOME`` (its address and admin token)."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        try:
            settings = Settings()
        except ValueError as exc:  # a SHOAL_* variable that does not parse
            raise ValueError(f"invalid SHOAL_* setting: {exc}") from None
        url = url if url is not None else os.environ.get("SHOAL_URL") or None
        token = token if token is not None else os.environ.get("SHOAL_TOKEN") or None
        config = resolve_config(url, token, settings)
        self.rest = ShoalClient(config.url, config.token)
        """The REST client underneath: one method per endpoint, answers as JSON objects."""

    def close(self) -> None:
        self.rest.close()

    def submit(
        self,
        spec: Mapping[str, Any] | str | Path,
        key: str | None = None,
        code: str | Path | None = None,
    ) -> Job:
        """Queue a job from its spec (a mapping, or a .yaml/.yml/.json file); the same ``key``
        (an Idempotency-Key; a file's default is its hash and a nonce) never makes two.
        ``code``: a folder of your modules, uploaded with it (``code:module:function``
        factories name them; needs the code permission)."""
        body, key = _spec(spec, "job", key)
        return Job(self.rest, self.rest.submit_job(body, key, _folder(code))["id"])

    def job(self, job_id: str) -> Job:
        return Job(self.rest, job_id)

    def jobs(self, *states: str, limit: int = 50) -> list[Json]:
        """Your jobs, newest first (only those in ``states`` when given)."""
        items: list[Json] = self.rest.list_jobs(states, limit=limit)["items"]
        return items

    def sweep(
        self,
        spec: Mapping[str, Any] | str | Path,
        key: str | None = None,
        code: str | Path | None = None,
    ) -> Sweep:
        """Start a sweep from its spec (a mapping or a file), as ``submit`` a job."""
        body, key = _spec(spec, "sweep", key)
        return Sweep(self.rest, self.rest.submit_sweep(body, key, _folder(code))["id"])

    def devices(self) -> list[Json]:
        items: list[Json] = self.rest.devices()["items"]
        return items


class _Handle:
    """A job or a sweep, by id: each method asks the server afresh."""

    def __init__(self, rest: ShoalClient, given_id: str) -> None:
        self._rest = rest
        self.id = given_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def get(self) -> Json:
        raise NotImplementedError

    def wait(self, timeout_s: float | None = None, poll_s: float = POLL_S) -> Json:
        """It, once it has ended (SUCCEEDED, FAILED or CANCELLED: its ``state`` and ``error``
        say which and why); ``TimeoutError`` naming its state after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            now = self.get()
            if JobState(now["state"]).is_terminal:  # a sweep's states are a job's
                return now
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self!r} is still {now['state']} after {timeout_s} s; wait longer or"
                    " look at its events"
                )
            time.sleep(poll_s)


class Job(_Handle):
    """One job."""

    def get(self) -> Json:
        """The job as ``GET /jobs/{id}`` answers: state, step, devices, spec, ..."""
        return self._rest.get_job(self.id)

    def metrics(self, since_step: int | None = None) -> list[Json]:
        """Its per-step metrics (loss, samples/s, stage timings), oldest first."""
        items: list[Json] = self._rest.metrics(self.id, since_step)["items"]
        return items

    def events(self) -> list[Json]:
        """Every event of the job so far (state changes, placements, checkpoints, ...)."""
        events: list[Json] = []
        while True:
            page = self._rest.events(self.id, events[-1]["id"] if events else 0)["items"]
            if not page:
                return events
            events.extend(page)

    def checkpoints(self) -> list[Json]:
        items: list[Json] = self._rest.checkpoints(self.id)["items"]
        return items

    def cancel(self) -> Json:
        """Cancel it: a queued job at once, a running one at its next step."""
        return self._rest.cancel_job(self.id)

    def export(self, path: str | Path, step: int | None = None) -> Path:
        """Write its model at the checkpoint of ``step`` (the latest when None) to ``path``
        as a safetensors file (docs/user-guide.md, "Taking the trained model out")."""
        dest = Path(path)
        self._rest.export_model(self.id, dest, step)
        return dest


class Sweep(_Handle):
    """One sweep."""

    def get(self) -> Json:
        """The sweep with every trial, as ``GET /sweeps/{id}`` answers."""
        return self._rest.get_sweep(self.id)

    def best_trial(self) -> Json | None:
        """The best completed trial (number, job id, parameters, objective); None before one
        ends."""
        best: Json | None = self.get()["best"]
        return best

    def trial_job(self, trial: Mapping[str, Any]) -> Job:
        """A trial's job (its metrics, its model: ``export``)."""
        return Job(self._rest, str(trial["job_id"]))

    def cancel(self) -> Json:
        return self._rest.cancel_sweep(self.id)


def _folder(code: str | Path | None) -> Path | None:
    return None if code is None else Path(code)


def _spec(
    spec: Mapping[str, Any] | str | Path, what: Literal["job", "sweep"], key: str | None
) -> tuple[Json, str | None]:
    """The spec's body and Idempotency-Key: a file's is read as the CLI reads it (its
    problems a ``ValueError`` with the CLI's message)."""
    if isinstance(spec, Mapping):
        return dict(spec), key
    path = Path(spec)
    try:
        body = load_spec(path, what)
    except click.ClickException as exc:
        raise ValueError(exc.message) from None
    return body, submission_key(path, key)
