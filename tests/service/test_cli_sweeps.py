"""The sweep commands of `shoal` and their client methods, against a stub sweeps API served over
real HTTP whose answers are checked against the API's own response models."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

from shoal.api.schemas import TRIAL_STATES, SweepOut, SweepPage, SweepSummaryOut
from shoal.service.cli.specfile import load_spec
from shoal.service.client import ShoalClient
from shoal.service.server import serving
from tests.factories import sweep_spec
from tests.service.test_cli import TOKEN, cells, shoal, write

pytestmark = pytest.mark.unit

CREATED = "2030-01-01T00:00:00Z"
NO_FIELD = "optimizer has no field 'nope'"


def trial(
    number: int,
    state: str,
    objective: float | None = None,
    reports: tuple[tuple[int, float], ...] = (),
    kept: bool = True,
) -> dict[str, Any]:
    return {
        "number": number,
        "job_id": f"{number + 100:032x}",
        "state": state,
        "params": {"optimizer.lr": 0.0123456 * (number + 1), "batch_size": 32},
        "objective": objective,
        "intermediate": [{"step": s, "value": v} for s, v in reports],
        "checkpoints_kept": kept,
    }


@dataclass
class Stub:
    sweeps: dict[str, dict[str, Any]] = field(default_factory=dict)
    later: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per sweep, what it becomes at each following GET (a sweep that moves on)."""
    requests: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)

    def add(
        self,
        name: str,
        state: str = "QUEUED",
        trials: list[dict[str, Any]] | None = None,
        best: int | None = None,
        max_trials: int = 8,
    ) -> dict[str, Any]:
        trials = trials or []
        counts = dict.fromkeys(TRIAL_STATES, 0)
        for t in trials:
            counts[t["state"]] += 1
        sweep = {
            "id": f"{len(self.sweeps) + 1:032x}",
            "name": name,
            "owner": "admin",
            "state": state,
            "cancel_requested": False,
            "max_trials": max_trials,
            "error": None,
            "created_at": CREATED,
            "updated_at": CREATED,
            "finished_at": None,
            "objective": {"metric": "loss", "direction": "minimize"},
            "trial_counts": counts,
            "best": None if best is None else trials[best],
            "spec": {"name": name},
            "trials": trials,
        }
        self.sweeps[sweep["id"]] = sweep
        return sweep


def _stub_app(stub: Stub) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        body = await request.body()
        stub.requests.append((request.method, str(request.url), dict(request.headers), body))
        return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "errors": []}, status_code=exc.status_code)

    def principal(authorization: Annotated[str | None, Header()] = None) -> None:
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(401, "invalid or revoked token")

    def find(sweep_id: str) -> dict[str, Any]:
        if sweep_id not in stub.sweeps:
            raise HTTPException(404, f"no sweep {sweep_id!r}")
        return stub.sweeps[sweep_id]

    sweeps = "/api/v1/sweeps"
    auth = [Depends(principal)]

    @app.post(sweeps, status_code=201, dependencies=auth, response_model=None)
    def submit(spec: dict[str, Any]) -> SweepOut | JSONResponse:
        if "optimizer.nope" in spec.get("space", {}):
            return JSONResponse(
                {
                    "detail": f"space.optimizer.nope: {NO_FIELD}",
                    "errors": [
                        {
                            "field": "space.optimizer.nope",
                            "message": "optimizer has no field 'nope'",
                        }
                    ],
                },
                status_code=422,
            )
        return SweepOut.model_validate(stub.add(spec["name"], max_trials=spec["max_trials"]))

    @app.get(sweeps, dependencies=auth)
    def list_sweeps(limit: int = 50, offset: int = 0) -> SweepPage:
        items = [SweepSummaryOut.model_validate(s) for s in stub.sweeps.values()]
        return SweepPage(
            items=items[offset : offset + limit], total=len(items), limit=limit, offset=offset
        )

    @app.get(f"{sweeps}/{{sweep_id}}", dependencies=auth)
    def get_sweep(sweep_id: str) -> SweepOut:
        answer = SweepOut.model_validate(find(sweep_id))
        if stub.later.get(sweep_id):
            stub.sweeps[sweep_id] = stub.later[sweep_id].pop(0)
        return answer

    @app.post(f"{sweeps}/{{sweep_id}}/cancel", dependencies=auth)
    def cancel(sweep_id: str) -> SweepOut:
        sweep = find(sweep_id)
        if sweep["state"] == "QUEUED":
            sweep["state"] = "CANCELLED"
        elif sweep["state"] == "RUNNING":
            sweep["cancel_requested"] = True
        else:
            raise HTTPException(
                409, f"sweep {sweep_id} is already {sweep['state']}; there is nothing to cancel"
            )
        return SweepOut.model_validate(sweep)

    return app


@pytest.fixture
def stub() -> Stub:
    return Stub()


@pytest.fixture
def api(stub: Stub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The stub on a real socket (bound before the server starts, so no wait is needed), found
    through SHOAL_URL and SHOAL_TOKEN as a user would set them."""
    for name in ("SHOAL_DATABASE_URL", "SHOAL_AUTH"):
        monkeypatch.delenv(name, raising=False)
    with serving(_stub_app(stub)) as url:
        monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("SHOAL_URL", url)
        monkeypatch.setenv("SHOAL_TOKEN", TOKEN)
        yield url


def running_sweep(stub: Stub) -> dict[str, Any]:
    return stub.add(
        "lr-sweep",
        "RUNNING",
        [
            trial(0, "SUCCEEDED", 0.9, ((5, 1.5), (10, 1.1), (15, 0.9))),
            trial(1, "PRUNED", None, ((5, 2.5),), kept=False),
            trial(2, "SUCCEEDED", 0.4, ((5, 0.8), (10, 0.6), (15, 0.4))),
            trial(3, "RUNNING", None, ((5, 3.0),)),
        ],
        best=2,
    )


# ---------------------------------------------------------------------------- shoal sweep


def test_sweep_submits_the_file_and_prints_the_new_sweep(
    api: str, stub: Stub, tmp_path: Path
) -> None:
    spec = sweep_spec()
    path = write(tmp_path / "sweep.json", json.dumps(spec))
    result = shoal("sweep", str(path))
    assert result.exit_code == 0, result.output
    sweep_id = "1".rjust(32, "0")
    assert result.stdout == (
        f"sweep {sweep_id} (lr-sweep) QUEUED, 8 trials\nfollow it with: shoal sweeps {sweep_id}\n"
    )
    method, url, headers, body = stub.requests[-1]
    assert (method, url) == ("POST", f"{api}/api/v1/sweeps")
    assert headers["authorization"] == f"Bearer {TOKEN}" and json.loads(body) == spec
    assert re.fullmatch(r"[0-9a-f]{32}-[0-9a-f]{16}", headers["idempotency-key"])


def test_sweep_sends_the_given_idempotency_key(api: str, stub: Stub, tmp_path: Path) -> None:
    path = write(tmp_path / "sweep.json", json.dumps(sweep_spec()))
    result = shoal("sweep", str(path), "--idempotency-key", "s-1")
    assert result.exit_code == 0, result.output
    assert stub.requests[-1][2]["idempotency-key"] == "s-1"


def test_sweep_json_prints_the_whole_sweep_from_a_yaml_file(
    api: str, stub: Stub, tmp_path: Path
) -> None:
    path = write(tmp_path / "sweep.yaml", "name: s\nmax_trials: 3\nspace: {}\n")
    result = shoal("sweep", str(path), "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["name"] == "s" and answer["max_trials"] == 3 and answer["trials"] == []
    assert json.loads(stub.requests[-1][3]) == {"name": "s", "max_trials": 3, "space": {}}


def test_a_refused_sweep_names_the_field(api: str, tmp_path: Path) -> None:
    spec = sweep_spec(space={"optimizer.nope": {"type": "uniform", "low": 0, "high": 1}})
    result = shoal("sweep", str(write(tmp_path / "sweep.json", json.dumps(spec))))
    assert result.exit_code == 1
    assert result.stderr == "Error: space.optimizer.nope: optimizer has no field 'nope'\n"


def test_a_sweep_file_that_is_not_a_mapping_is_exit_code_2(api: str, tmp_path: Path) -> None:
    result = shoal("sweep", str(write(tmp_path / "sweep.yaml", "- name: x\n")))
    assert result.exit_code == 2 and result.stdout == ""
    assert re.search(
        r"sweep\.yaml: a sweep spec is a mapping of fields \(name, base, space, \.\.\.\), not list",
        result.stderr,
    )


def test_the_example_sweep_is_valid() -> None:
    from shoal.service.sweepspec import validate_sweep_spec

    path = Path(__file__).parents[2] / "examples" / "sweep-digits.yaml"
    accepted = validate_sweep_spec(load_spec(path, "sweep"), allowed_factories=[])
    assert accepted.spec.name == "digits-sweep" and accepted.trials == 8


# --------------------------------------------------------------------------- shoal sweeps


def test_sweeps_lists_sweeps_with_progress_and_best(api: str, stub: Stub) -> None:
    running = running_sweep(stub)
    stub.add("queued-sweep", max_trials=3)
    result = shoal("sweeps")
    assert result.exit_code == 0, result.output
    out = cells(result.stdout)
    assert re.search(rf"{running['id']}\s+lr-sweep\s+admin\s+RUNNING\s+4/8\s+0\.4\s+20\d\d-", out)
    assert re.search(r"0{31}2\s+queued-sweep\s+admin\s+QUEUED\s+0/3\s+-\s+20\d\d-", out)
    assert "2 of 2 sweeps" in out
    result = shoal("sweeps", "--limit", "1", "--json")
    page = json.loads(result.stdout)
    assert [s["name"] for s in page["items"]] == ["lr-sweep"] and page["total"] == 2
    assert stub.requests[-1][1].endswith("/api/v1/sweeps?limit=1&offset=0")


def test_sweeps_with_an_id_shows_the_trials_and_the_best(api: str, stub: Stub) -> None:
    sweep = running_sweep(stub)
    result = shoal("sweeps", sweep["id"])
    assert result.exit_code == 0, result.output
    out = cells(result.stdout)
    assert re.search(r"(?m)^state\s+RUNNING *$", out)
    assert re.search(r"objective\s+minimize loss", out)
    assert re.search(r"trials\s+4/8 \(1 RUNNING, 2 SUCCEEDED, 1 PRUNED\)", out)
    job = [t["job_id"] for t in sweep["trials"]]
    params = "optimizer.lr={}, batch_size=32"
    rows = [
        rf"0\s+SUCCEEDED\s+{params.format('0.01235')}\s+0\.9\s+0\.9 @ 15\s+{job[0]}",
        rf"1\s+PRUNED\s+{params.format('0.02469')}\s+-\s+2\.5 @ 5\s+{job[1]}",
        rf"2\s+SUCCEEDED\s+{params.format('0.03704')}\s+0\.4\s+0\.4 @ 15\s+{job[2]}",
        rf"3\s+RUNNING\s+{params.format('0.04938')}\s+-\s+3 @ 5\s+{job[3]}",
    ]
    for row in rows:
        assert re.search(row, out), row
    assert out.rstrip().endswith(
        f"best: trial 2, loss 0.4, optimizer.lr=0.03704, batch_size=32 (job {job[2]})"
    )
    answer = json.loads(shoal("sweeps", sweep["id"], "--json").stdout)
    assert answer == sweep


def moved_on(sweep: dict[str, Any], state: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    counts = dict.fromkeys(TRIAL_STATES, 0)
    for t in trials:
        counts[t["state"]] += 1
    return {**sweep, "state": state, "trials": trials, "trial_counts": counts}


def test_sweeps_follow_prints_each_trial_once_as_it_ends_and_the_sweep_at_the_end(
    api: str, stub: Stub
) -> None:
    sweep = running_sweep(stub)
    first = sweep["trials"]
    stub.later[sweep["id"]] = [
        moved_on(sweep, "RUNNING", [*first[:3], trial(3, "PRUNED", None, ((5, 3.0),))]),
        moved_on(
            sweep,
            "SUCCEEDED",
            [*first[:3], trial(3, "PRUNED", None, ((5, 3.0),)), trial(4, "SUCCEEDED", 0.7)],
        ),
    ]
    result = shoal("sweeps", sweep["id"], "--follow", "--interval", "0")
    assert result.exit_code == 0, result.output
    ended = re.findall(r"^trial (\d) (\w+) objective (\S+)", result.stdout, re.MULTILINE)
    assert ended == [
        ("0", "SUCCEEDED", "0.9"),
        ("1", "PRUNED", "-"),
        ("2", "SUCCEEDED", "0.4"),
        ("3", "PRUNED", "-"),
        ("4", "SUCCEEDED", "0.7"),
    ]
    assert re.search(r"state\s+SUCCEEDED", cells(result.stdout))
    best = "best: trial 2, loss 0.4, optimizer.lr=0.03704, batch_size=32"
    assert cells(result.stdout).rstrip().endswith(f"{best} (job {first[2]['job_id']})")
    gets = [r for r in stub.requests if r[0] == "GET"]
    assert len(gets) == 3  # until it ended, not after


def test_sweeps_follow_exits_1_when_the_sweep_failed_and_needs_an_id(api: str, stub: Stub) -> None:
    failed = stub.add("broken", "FAILED", [trial(0, "FAILED")])
    result = shoal("sweeps", failed["id"], "-f")
    assert result.exit_code == 1 and "trial 0 FAILED" in result.stdout
    result = shoal("sweeps", "-f")
    assert result.exit_code == 2 and "--follow needs a SWEEP_ID" in result.stderr


def test_a_sweep_without_trials_says_so(api: str, stub: Stub) -> None:
    sweep = stub.add("fresh")
    result = shoal("sweeps", sweep["id"])
    assert result.exit_code == 0, result.output
    assert re.search(r"(?m)^trials\s+0/8 *$", cells(result.stdout))
    assert result.stdout.rstrip().endswith("no trials yet") and "best:" not in result.stdout


# --------------------------------------------------------------------- shoal sweep-cancel


def test_sweep_cancel_queued_running_and_ended(api: str, stub: Stub) -> None:
    queued, running = stub.add("q"), running_sweep(stub)
    result = shoal("sweep-cancel", queued["id"])
    assert (result.exit_code, result.stdout) == (0, f"sweep {queued['id']} CANCELLED\n")
    result = shoal("sweep-cancel", running["id"])
    assert result.stdout == (
        f"sweep {running['id']} RUNNING; its trials stop at their next step boundary\n"
    )
    assert json.loads(shoal("sweep-cancel", running["id"], "--json").stdout)["cancel_requested"]
    result = shoal("sweep-cancel", queued["id"])
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: sweep {queued['id']} is already CANCELLED; there is nothing to cancel\n"
    )


def test_unknown_sweep_is_the_server_message(api: str) -> None:
    for args in (("sweeps", "f" * 32), ("sweep-cancel", "f" * 32)):
        result = shoal(*args)
        assert result.exit_code == 1
        assert result.stderr == f"Error: no sweep '{'f' * 32}'\n"


def test_sweep_ids_cannot_reach_other_routes() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(200, json={})

    with ShoalClient("http://shoal.test/", None, transport=httpx.MockTransport(handler)) as client:
        client.cancel_sweep("../jobs")
        client.get_sweep("a/b")
    assert seen == ["/api/v1/sweeps/..%2Fjobs/cancel", "/api/v1/sweeps/a%2Fb"]
