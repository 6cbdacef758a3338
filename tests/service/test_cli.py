"""The `shoal` command and its REST client, against a stub API served over real HTTP."""

from __future__ import annotations

import json
import re
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from click.testing import CliRunner, Result
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from shoal import Client
from shoal.service.cli import cli
from shoal.service.cli.specfile import load_spec
from shoal.service.client import ApiError, ClientConfig, ShoalClient, resolve_config, write_config
from shoal.service.server import serving
from shoal.service.settings import Settings

TOKEN = "shoal_test-token"
EPOCH = datetime(2030, 1, 1, tzinfo=UTC)


# ----------------------------------------------------------------------------- stub API


@dataclass
class StubJob:
    """A job that advances one step each time it is read, until ``fail_at`` or the end."""

    job: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    fail_at: int | None = None


@dataclass
class Stub:
    jobs: dict[str, StubJob] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    clock: int = 0

    devices: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "n1-cpu-fast-0": {
                "id": "n1-cpu-fast-0",
                "node_id": "n1",
                "kind": "cpu-fast",
                "memory_mb": 2048,
                "gpu": False,
                "spot": False,
                "state": "alive",
                "speed_gflops": 12.5,
                "overhead_mb": 612,
                "job_id": "0" * 32,
                "draining": False,
                "drain_reason": None,
            },
            "n2-cpu-slow-0": {
                "id": "n2-cpu-slow-0",
                "node_id": "n2",
                "kind": "cpu-slow",
                "memory_mb": 1024,
                "gpu": False,
                "spot": True,
                "state": "alive",
                "speed_gflops": None,
                "job_id": None,
                "draining": True,
                "drain_reason": "device n2-cpu-slow-0 was set aside: its worker failed",
            },
        }
    )

    def device(self, device_id: str) -> dict[str, Any]:
        if device_id not in self.devices:
            raise HTTPException(404, f"no device {device_id!r}; GET /api/v1/devices lists them")
        return self.devices[device_id]

    def now(self) -> str:
        self.clock += 1
        return (EPOCH + timedelta(seconds=self.clock)).isoformat()

    def add_job(self, name: str, steps: int = 3, fail_at: int | None = None) -> StubJob:
        job_id = f"{len(self.jobs) + 1:032x}"
        stub = StubJob(
            {
                "id": job_id,
                "name": name,
                "owner": "admin",
                "state": "QUEUED",
                "step": 0,
                "steps": steps,
                "last_loss": None,
                "devices": [],
                "partition": [],
                "error": None,
                "cancel_requested": False,
                "attempt": 1,
                "priority": 0,
                "num_blocks": 3,
                "created_at": self.now(),
                "updated_at": self.now(),
                "started_at": None,
                "finished_at": None,
                "spec": {"name": name, "steps": steps},
            },
            fail_at=fail_at,
        )
        self.jobs[job_id] = stub
        self.event(stub, "state", "queued", {"to": "QUEUED"})
        return stub

    def event(self, stub: StubJob, kind: str, message: str, data: dict[str, Any]) -> None:
        stub.events.append(
            {
                "id": len(stub.events) + 1,
                "time": self.now(),
                "kind": kind,
                "message": message,
                "data": data,
            }
        )

    def move(self, stub: StubJob, state: str, error: str | None = None) -> None:
        self.event(
            stub,
            "state",
            f"{stub.job['state']} -> {state}",
            {"from": stub.job["state"], "to": state},
        )
        stub.job.update(state=state, error=error)

    def advance(self, stub: StubJob) -> None:
        job = stub.job
        if job["state"] == "QUEUED":
            job["devices"] = ["n1-cpu-0", "n1-cpu-1", "n1-cpu-2"]
            job["partition"] = [
                {"stage": 0, "device_id": "n1-cpu-0", "blocks": [0, 2]},
                # Split over two devices (parallelism.tensor: 2).
                {
                    "stage": 1,
                    "device_id": "n1-cpu-1",
                    "blocks": [2, 3],
                    "tensor_devices": ["n1-cpu-2"],
                },
            ]
            self.move(stub, "RUNNING")
        elif job["state"] == "RUNNING":
            if stub.fail_at is not None and job["step"] == stub.fail_at:
                self.move(stub, "FAILED", "stage 1 ran out of memory; lower batch_size")
                return
            job["step"] += 1
            job["last_loss"] = 2.0 / job["step"]
            stub.metrics.append(
                {
                    "step": job["step"],
                    "time": self.now(),
                    "loss": job["last_loss"],
                    "samples_per_s": 100.0 * job["step"],
                    "step_time_s": 0.25,
                    "stages": [],
                    "mfu": 0.125 * job["step"] if job["step"] > 1 else None,
                }
            )
            if job["step"] == job["steps"]:
                self.move(stub, "SUCCEEDED")


def _stub_app(stub: Stub) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        stub.requests.append((request.method, str(request.url), dict(request.headers)))
        return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "errors": []}, status_code=exc.status_code)

    def principal(authorization: Annotated[str | None, Header()] = None) -> None:
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(401, "invalid or revoked token")

    def find(job_id: str) -> StubJob:
        if job_id not in stub.jobs:
            raise HTTPException(404, f"job {job_id} not found")
        return stub.jobs[job_id]

    api = "/api/v1"
    auth = [Depends(principal)]

    @app.post(f"{api}/jobs", status_code=201, dependencies=auth)
    def submit(spec: dict[str, Any]) -> Any:
        if "steps" not in spec:
            return JSONResponse(
                {
                    "detail": "steps: Field required; name: too long",
                    "errors": [
                        {"field": "steps", "message": "Field required"},
                        {"field": "name", "message": "too long"},
                    ],
                },
                status_code=422,
            )
        return stub.add_job(spec["name"], spec["steps"]).job

    @app.get(f"{api}/jobs", dependencies=auth)
    def list_jobs(
        state: Annotated[list[str] | None, Query()] = None, limit: int = 50, offset: int = 0
    ) -> Any:
        items = [s.job for s in stub.jobs.values() if not state or s.job["state"] in state]
        return {
            "items": items[offset : offset + limit],
            "total": len(items),
            "limit": limit,
            "offset": offset,
        }

    @app.get(f"{api}/jobs/{{job_id}}", dependencies=auth)
    def get_job(job_id: str) -> Any:
        found = find(job_id)
        stub.advance(found)
        return found.job

    @app.post(f"{api}/jobs/{{job_id}}/cancel", dependencies=auth)
    def cancel(job_id: str) -> Any:
        found = find(job_id)
        if found.job["state"] == "QUEUED":
            stub.move(found, "CANCELLED")
        elif found.job["state"] == "RUNNING":
            found.job["cancel_requested"] = True
        else:
            raise HTTPException(409, f"job {job_id} is {found.job['state']}; nothing to cancel")
        return found.job

    @app.post(f"{api}/jobs/{{job_id}}/restart", dependencies=auth)
    def restart(job_id: str) -> Any:
        found = find(job_id)
        found.job["attempt"] += 1
        stub.move(found, "QUEUED")
        return found.job

    @app.get(f"{api}/jobs/{{job_id}}/metrics", dependencies=auth)
    def metrics(job_id: str, since_step: int = -1) -> Any:
        return {"items": [m for m in find(job_id).metrics if m["step"] > since_step]}

    @app.get(f"{api}/jobs/{{job_id}}/events", dependencies=auth)
    def events(job_id: str, since_id: int = 0) -> Any:
        return {"items": [e for e in find(job_id).events if e["id"] > since_id]}

    @app.get(f"{api}/jobs/{{job_id}}/checkpoints", dependencies=auth)
    def checkpoints(job_id: str) -> Any:
        find(job_id)
        return {
            "items": [{"step": 2, "name": "step-00000002", "nbytes": 10, "created_at": stub.now()}]
        }

    @app.get(f"{api}/devices", dependencies=auth)
    def devices() -> Any:
        return {"items": list(stub.devices.values())}

    @app.post(f"{api}/devices/{{device_id}}/drain", dependencies=auth)
    def drain(device_id: str) -> Any:
        device = stub.device(device_id)
        device.update(draining=True, drain_reason=device["drain_reason"] or "drained by admin")
        return device

    @app.delete(f"{api}/devices/{{device_id}}/drain", dependencies=auth)
    def undrain(device_id: str) -> Any:
        device = stub.device(device_id)
        device.update(draining=False, drain_reason=None)
        return device

    return app


@pytest.fixture
def stub() -> Stub:
    return Stub()


@pytest.fixture
def api_url(stub: Stub) -> Iterator[str]:
    """The stub API on a real socket."""
    with serving(_stub_app(stub)) as url:
        yield url


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty SHOAL_HOME, and no SHOAL_* variables from the machine running the tests."""
    for name in (
        "SHOAL_URL",
        "SHOAL_TOKEN",
        "SHOAL_DATABASE_URL",
        "SHOAL_DEVICES",
        "SHOAL_HOST",
        "SHOAL_PORT",
        "SHOAL_RAY_ADDRESS",
        "SHOAL_AUTH",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def api(api_url: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The stub API, found through SHOAL_URL and SHOAL_TOKEN as a user would set them."""
    monkeypatch.setenv("SHOAL_URL", api_url)
    monkeypatch.setenv("SHOAL_TOKEN", TOKEN)
    return api_url


def shoal(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input)


def cells(text: str) -> str:
    """Table output with the box drawing gone, so a row reads as words and spaces."""
    return re.sub(r"[│┃]", " ", text)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


GOOD_SPEC = """\
name: digits
model: {builtin: mlp}
data: {builtin: digits}
steps: 3
"""


# ---------------------------------------------------------------------------- spec files


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad.yaml",
            "name: x\nmodel: {builtin: mlp\nsteps: 3\n",
            r"bad\.yaml:3:6: invalid YAML: expected ',' or '}', but got ':'",
        ),
        ("tabs.yml", "name: x\n\tsteps: 3\n", r"tabs\.yml:2:1: invalid YAML: found character"),
        (
            "bad.json",
            '{"name": "x",\n "steps": }',
            r"bad\.json:2:11: invalid JSON: Expecting value",
        ),
        ("list.yaml", "- name: x\n", r"list\.yaml: a job spec is a mapping .* not list"),
        ("empty.yaml", "", r"empty\.yaml: a job spec is a mapping .* not NoneType"),
        ("num.json", "3", r"num\.json: a job spec is a mapping .* not int"),
        (
            "spec.toml",
            "name = 'x'",
            r"spec\.toml: unknown extension '\.toml'; use \.yaml, \.yml or \.json",
        ),
        ("spec", "name: x", r"spec: unknown extension '\(none\)'"),
        (
            "when.yaml",
            "name: x\nsteps: 3\nwhen: 2030-01-01\n",
            r"when\.yaml: .*not JSON serializable; quote dates",
        ),
    ],
)
def test_bad_spec_files_are_one_line_errors_with_exit_code_2(
    home: Path, tmp_path: Path, name: str, text: str, message: str
) -> None:
    result = shoal("submit", str(write(tmp_path / name, text)), "--url", "http://127.0.0.1:9")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.output


@pytest.mark.unit
@pytest.mark.parametrize("name", ["mlp-digits.yaml", "gpt-pysource.yaml"])
def test_examples_are_valid_job_specs(name: str) -> None:
    from shoal.service.specs import complete_job_spec, parse_job_spec

    spec = load_spec(Path(__file__).parents[2] / "examples" / name)
    accepted = complete_job_spec(parse_job_spec(spec), allowed_factories=[])
    assert accepted.spec.name == name.removesuffix(".yaml")
    assert accepted.num_blocks == 4


@pytest.mark.unit
def test_non_utf8_spec_file_is_refused(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "latin.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    result = shoal("submit", str(path))
    assert result.exit_code == 2
    assert "latin.yaml: not UTF-8 text; save the spec as UTF-8" in result.stderr


@pytest.mark.unit
def test_missing_spec_file_is_a_usage_error(home: Path, tmp_path: Path) -> None:
    result = shoal("submit", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "does not exist" in result.stderr


# ------------------------------------------------------------------------ client errors


def _answer(status: int, body: Any = None, text: str | None = None) -> ShoalClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if text is not None:
            return httpx.Response(status, text=text)
        return httpx.Response(status, json=body)

    return ShoalClient("http://shoal.test", TOKEN, transport=httpx.MockTransport(handler))


def _raise(exc: Exception) -> ShoalClient:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return ShoalClient("http://shoal.test", TOKEN, transport=httpx.MockTransport(handler))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("client", "status", "message"),
    [
        (_answer(404, {"detail": "job abc not found"}), 404, "job abc not found"),
        (
            _answer(
                422,
                {
                    "detail": "steps: Field required; too many",
                    "errors": [
                        {"field": "steps", "message": "Field required"},
                        {"field": "", "message": "too many"},
                    ],
                },
            ),
            422,
            "steps: Field required\ntoo many",
        ),
        (_answer(422, {"detail": "bad", "errors": []}), 422, "bad"),
        (_answer(409, {"detail": ["a", 1]}), 409, '["a", 1]'),
        (
            _answer(401, {"detail": "invalid or revoked token"}),
            401,
            "invalid or revoked token; pass --token or set SHOAL_TOKEN"
            " (`shoal token create` makes one)",
        ),
        (
            _answer(502, text="<html>Bad Gateway</html>"),
            502,
            "HTTP 502 from http://shoal.test/api/v1/jobs/x: <html>Bad Gateway</html>",
        ),
        (
            _answer(500, text=""),
            500,
            "HTTP 500 from http://shoal.test/api/v1/jobs/x: Internal Server Error",
        ),
        (
            _answer(200, ["not", "an", "object"]),
            200,
            "GET /jobs/x answered with something other than a JSON object;"
            " is http://shoal.test a Shoal server?",
        ),
        (
            _raise(httpx.ConnectError("refused")),
            None,
            "cannot reach Shoal at http://shoal.test; is `shoal up` running? (set SHOAL_URL)",
        ),
        (
            _raise(httpx.ReadTimeout("slow")),
            None,
            "Shoal at http://shoal.test did not answer GET /jobs/x in time; try again",
        ),
        (
            _raise(httpx.RemoteProtocolError("garbage")),
            None,
            "GET http://shoal.test/api/v1/jobs/x failed: garbage",
        ),
    ],
)
def test_client_errors_carry_the_server_message(
    client: ShoalClient, status: int | None, message: str
) -> None:
    with client, pytest.raises(ApiError) as caught:
        client.get_job("x")
    assert (caught.value.status, caught.value.message) == (status, message)


@pytest.mark.unit
def test_job_ids_cannot_reach_other_routes() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(200, json={})

    with ShoalClient("http://shoal.test/", None, transport=httpx.MockTransport(handler)) as client:
        client.cancel_job("../devices")
    assert seen == ["/api/v1/jobs/..%2Fdevices/cancel"]


@pytest.mark.unit
def test_unreachable_server_is_one_line_and_exit_code_1(home: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = shoal("status", "--url", url)
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: cannot reach Shoal at {url}; is `shoal up` running? (set SHOAL_URL)\n"
    )


@pytest.mark.unit
def test_config_prefers_explicit_values_then_what_shoal_up_wrote(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    assert resolve_config(None, None, settings) == ClientConfig("http://127.0.0.1:8000", None)
    write_config(tmp_path, "http://10.0.0.5:9000")
    (tmp_path / "admin.token").write_text("shoal_admin\n")
    config = resolve_config(None, None, settings)
    assert (config.url, config.token) == ("http://10.0.0.5:9000", "shoal_admin")
    config = resolve_config("http://other:1/", "shoal_mine", settings)
    assert (config.url, config.token) == ("http://other:1", "shoal_mine")


@pytest.mark.unit
def test_unreadable_client_config_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "client.json").write_text("{not json")
    with pytest.raises(
        ApiError, match=r"cannot read .*client\.json .*; delete it or set SHOAL_URL"
    ):
        resolve_config(None, None, Settings(home=tmp_path))


# ------------------------------------------------------------------------- job commands


@pytest.mark.unit
def test_submit_prints_the_job_and_sends_a_fresh_idempotency_key(
    api: str, stub: Stub, tmp_path: Path
) -> None:
    spec = write(tmp_path / "job.yaml", GOOD_SPEC)
    first, _ = shoal("submit", str(spec)), shoal("submit", str(spec))
    assert first.exit_code == 0, first.output
    assert first.stdout == (
        f"job {'1':0>32} (digits) QUEUED\nfollow it with: shoal logs -f {'1':0>32}\n"
    )
    keys = [h["idempotency-key"] for m, u, h in stub.requests if m == "POST"]
    assert len(keys) == 2 and keys[0] != keys[1]
    assert all(re.fullmatch(r"[0-9a-f]{32}-[0-9a-f]{16}", key) for key in keys)
    assert keys[0][:32] == keys[1][:32]  # the same file content
    assert [h["authorization"] for _, _, h in stub.requests] == [f"Bearer {TOKEN}"] * 2


@pytest.mark.unit
def test_submit_json_spec_with_explicit_key_and_options(
    api_url: str, home: Path, stub: Stub, tmp_path: Path
) -> None:
    spec = write(tmp_path / "job.json", json.dumps({"name": "j", "steps": 5}))
    result = shoal(
        "submit",
        str(spec),
        "--idempotency-key",
        "k-1",
        "--json",
        "--url",
        api_url,
        "--token",
        TOKEN,
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 5
    assert stub.requests[-1][2]["idempotency-key"] == "k-1"


@pytest.mark.unit
def test_refused_spec_lists_each_field_on_its_own_line(api: str, tmp_path: Path) -> None:
    result = shoal("submit", str(write(tmp_path / "job.yaml", "name: x\n")))
    assert result.exit_code == 1
    assert result.stderr == "Error: steps: Field required\nname: too long\n"


@pytest.mark.unit
def test_wrong_token_says_how_to_get_one(api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_TOKEN", "shoal_wrong")
    result = shoal("devices")
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: invalid or revoked token; pass --token or set SHOAL_TOKEN"
        " (`shoal token create` makes one)\n"
    )


@pytest.mark.unit
def test_token_and_url_come_from_shoal_home_when_not_given(
    api_url: str, home: Path, stub: Stub
) -> None:
    write_config(home, api_url)
    (home / "admin.token").write_text(TOKEN + "\n")
    result = shoal("devices")
    assert result.exit_code == 0, result.output
    assert stub.requests[-1][2]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.unit
def test_python_client_without_arguments_uses_what_shoal_up_wrote_in_shoal_home(
    api_url: str, home: Path, stub: Stub
) -> None:
    """README: `shoal.Client()` needs no arguments: with no SHOAL_URL/SHOAL_TOKEN set it
    goes where `shoal up` serves (client.json) as its admin (admin.token)."""
    write_config(home, api_url)
    (home / "admin.token").write_text(TOKEN + "\n")
    with Client() as client:
        assert [d["id"] for d in client.devices()] == list(stub.devices)
    method, url, headers = stub.requests[-1]
    assert (method, url) == ("GET", f"{api_url}/api/v1/devices")
    assert headers["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.unit
def test_python_client_without_arguments_takes_shoal_url_and_shoal_token_first(
    api_url: str, home: Path, stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the CLI: SHOAL_URL and SHOAL_TOKEN before what `shoal up` wrote in SHOAL_HOME."""
    write_config(home, "http://127.0.0.1:9")
    (home / "admin.token").write_text("shoal_not_this_one\n")
    monkeypatch.setenv("SHOAL_URL", api_url)
    monkeypatch.setenv("SHOAL_TOKEN", TOKEN)
    with Client() as client:
        assert [d["id"] for d in client.devices()] == list(stub.devices)
    assert stub.requests[-1][2]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.unit
def test_status_lists_jobs_and_filters_by_state(api: str, stub: Stub) -> None:
    stub.add_job("alpha")
    stub.move(stub.add_job("beta"), "FAILED")
    result = shoal("status")
    assert result.exit_code == 0, result.output
    out = cells(result.stdout)
    assert re.search(r"0{31}1\s+alpha\s+admin\s+QUEUED\s+0/3\s+-\s+0\s+20\d\d-\d\d-\d\d ", out)
    assert re.search(r"0{31}2\s+beta\s+admin\s+FAILED\s+0/3", out)
    assert "2 of 2 jobs" in out
    result = shoal("status", "--state", "failed", "--state", "CANCELLED", "--limit", "5")
    assert result.exit_code == 0, result.output
    assert "beta" in result.stdout and "alpha" not in result.stdout
    assert stub.requests[-1][1].endswith("/jobs?state=FAILED&state=CANCELLED&limit=5&offset=0")
    page = json.loads(shoal("status", "--json").stdout)
    assert [job["name"] for job in page["items"]] == ["alpha", "beta"]


@pytest.mark.unit
def test_status_without_a_limit_lists_the_latest_50_jobs(api: str, stub: Stub) -> None:
    """README: plain `shoal status` lists your latest 50 jobs (`--limit` for another count)."""
    for n in range(51):
        stub.add_job(f"job-{n}")
    result = shoal("status")
    assert result.exit_code == 0, result.output
    assert stub.requests[-1][1].endswith("/jobs?limit=50&offset=0")
    assert "50 of 51 jobs" in cells(result.stdout)


@pytest.mark.unit
def test_status_of_one_job_shows_partition_error_and_checkpoints(api: str, stub: Stub) -> None:
    job = stub.add_job("gamma", steps=5, fail_at=1)
    result = shoal("status", job.job["id"])  # each read advances the stub: now RUNNING
    assert result.exit_code == 0, result.output
    out = cells(result.stdout)
    assert re.search(r"state\s+RUNNING", out)
    assert re.search(r"0\s+n1-cpu-0\s+0\.\.1", out)
    assert re.search(r"1\s+n1-cpu-1, n1-cpu-2\s+2\.\.2", out), out
    assert re.search(r"checkpoints\s+1, latest at step 2", out)
    shoal("status", job.job["id"])  # step 1
    failed = shoal("status", job.job["id"], "--json")
    answer = json.loads(failed.stdout)
    assert answer["state"] == "FAILED" and answer["checkpoints"][0]["name"] == "step-00000002"
    assert "stage 1 ran out of memory; lower batch_size" in shoal("status", job.job["id"]).stdout


@pytest.mark.unit
def test_status_refuses_state_with_a_job_id(api: str) -> None:
    result = shoal("status", "abc", "--state", "RUNNING")
    assert result.exit_code == 2
    assert "--state filters the job list" in result.stderr


@pytest.mark.unit
def test_unknown_job_is_the_server_message_without_traceback(api: str) -> None:
    for command in ("status", "logs", "cancel", "restart"):
        result = shoal(command, "f" * 32)
        assert result.exit_code == 1
        assert result.stderr == f"Error: job {'f' * 32} not found\n"


@pytest.mark.unit
def test_logs_prints_events_and_metrics_in_time_order(api: str, stub: Stub) -> None:
    job = stub.add_job("delta", steps=2)
    for _ in range(3):
        stub.advance(job)
    result = shoal("logs", job.job["id"])
    assert result.exit_code == 0, result.output
    lines = [re.sub(r"^\S+ \S+ ", "", line) for line in result.stdout.splitlines()]
    assert lines == [
        "state: queued",
        "state: QUEUED -> RUNNING",
        "step 1/2 loss 2.0000 100.0 samples/s 250 ms/step",
        "step 2/2 loss 1.0000 200.0 samples/s 250 ms/step MFU 25%",
        "state: RUNNING -> SUCCEEDED",
    ]


@pytest.mark.unit
def test_logs_follow_runs_until_the_job_succeeds(api: str, stub: Stub) -> None:
    job = stub.add_job("epsilon", steps=4)
    result = shoal("logs", "-f", "--interval", "0", job.job["id"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.count("samples/s 250 ms/step") == 4
    assert "step 4/4 loss 0.5000 400.0 samples/s" in out
    assert re.search(r"epsilon .* 4/4 loss 0\.5 400\.0 samples/s", out)  # the progress bar
    assert out.rstrip().endswith(f"job {job.job['id']} SUCCEEDED")
    assert out.index("RUNNING -> SUCCEEDED") < out.index(f"job {job.job['id']} SUCCEEDED")


@pytest.mark.unit
def test_logs_follow_of_a_failed_job_shows_the_error_and_exits_1(api: str, stub: Stub) -> None:
    job = stub.add_job("zeta", steps=4, fail_at=2)
    result = shoal("logs", "--follow", "--interval", "0", job.job["id"])
    assert result.exit_code == 1
    assert "step 2/4" in result.stdout and "step 3/4" not in result.stdout
    assert result.stdout.rstrip().endswith(
        f"job {job.job['id']} FAILED\nstage 1 ran out of memory; lower batch_size"
    )


@pytest.mark.unit
def test_cancel_and_restart(api: str, stub: Stub) -> None:
    queued = stub.add_job("eta")
    result = shoal("cancel", queued.job["id"])
    assert (result.exit_code, result.stdout) == (0, f"job {queued.job['id']} CANCELLED\n")
    result = shoal("restart", queued.job["id"])
    assert (result.exit_code, result.stdout) == (
        0,
        f"job {queued.job['id']} QUEUED (attempt 2)\n",
    )
    stub.advance(queued)
    result = shoal("cancel", queued.job["id"], "--json")
    assert json.loads(result.stdout)["cancel_requested"] is True
    result = shoal("cancel", queued.job["id"])
    assert result.stdout.endswith("RUNNING; it stops at its next step boundary\n")
    done = stub.add_job("theta")
    stub.move(done, "SUCCEEDED")
    result = shoal("cancel", done.job["id"])
    assert result.exit_code == 1
    assert result.stderr == f"Error: job {done.job['id']} is SUCCEEDED; nothing to cancel\n"


@pytest.mark.unit
def test_devices_table_and_json(api: str) -> None:
    result = shoal("devices")
    assert result.exit_code == 0, result.output
    out = cells(result.stdout)
    assert re.search(
        r"n1-cpu-fast-0\s+cpu-fast\s+2048 MB \(612 held\)\s+no\s+no\s+alive\s+12\.5\s+0{32}",
        out,
    )
    assert re.search(
        r"n2-cpu-slow-0\s+cpu-slow\s+1024 MB\s+no\s+yes\s+alive, draining\s+-\s+-", out
    )
    assert len(json.loads(shoal("devices", "--json").stdout)["items"]) == 2


@pytest.mark.unit
def test_drain_and_undrain_say_what_the_device_does_now(api: str, stub: Stub) -> None:
    result = shoal("drain", "n1-cpu-fast-0")
    assert result.exit_code == 0, result.output
    assert result.stdout == "device n1-cpu-fast-0 is draining: drained by admin\n"
    assert stub.requests[-1][:2] == ("POST", f"{api}/api/v1/devices/n1-cpu-fast-0/drain")
    result = shoal("undrain", "n2-cpu-slow-0", "--json")
    assert json.loads(result.stdout)["draining"] is False
    assert stub.requests[-1][:2] == ("DELETE", f"{api}/api/v1/devices/n2-cpu-slow-0/drain")
    assert shoal("undrain", "n2-cpu-slow-0").stdout == "device n2-cpu-slow-0 takes jobs\n"
    missing = shoal("drain", "nope")
    assert missing.exit_code == 1
    assert missing.stderr == "Error: no device 'nope'; GET /api/v1/devices lists them\n"


# ------------------------------------------------------------------------ server commands


@pytest.mark.integration
def test_token_create_makes_a_working_token_and_db_upgrade_is_idempotent(home: Path) -> None:
    from shoal.service.auth import authenticate
    from shoal.service.db.session import make_engine, make_session_factory

    assert shoal("db", "upgrade").stdout == "the database schema is up to date\n"
    result = shoal("token", "create", "--user", "ada")
    assert result.exit_code == 0, result.output
    secret = result.stdout.strip()
    admin = shoal("token", "create", "--user", "root", "--admin", "--home", str(home)).stdout
    engine = make_engine(f"sqlite:///{home / 'shoal.db'}")
    with make_session_factory(engine)() as session:
        ada, root = authenticate(session, secret), authenticate(session, admin.strip())
    engine.dispose()
    assert ada is not None and (ada.name, ada.is_admin) == ("ada", False)
    assert root is not None and (root.name, root.is_admin) == ("root", True)
    assert shoal("db", "upgrade").exit_code == 0


@pytest.mark.integration
def test_token_revoke_takes_the_token_from_stdin_and_refuses_it_from_then_on(
    home: Path,
) -> None:
    from shoal.service.auth import authenticate
    from shoal.service.db.session import make_engine, make_session_factory

    secret = shoal("token", "create", "--user", "ada").stdout.strip()
    revoked = shoal("token", "revoke", input=secret + "\n")
    assert revoked.exit_code == 0, revoked.output
    assert revoked.stdout == f"token {secret[:12]}… revoked\n" and secret not in revoked.stdout
    engine = make_engine(f"sqlite:///{home / 'shoal.db'}")
    with make_session_factory(engine)() as session:
        assert authenticate(session, secret) is None
    engine.dispose()
    again = shoal("token", "revoke", secret)
    assert again.exit_code == 2 and "unknown or revoked already" in again.stderr
    assert shoal("token", "revoke", input="\n").exit_code == 2


@pytest.mark.integration
def test_token_create_refuses_a_bad_user_name(home: Path) -> None:
    result = shoal("token", "create", "--user", "Not Valid")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: user name 'Not Valid' is invalid; use 1-64 lower-case")


@pytest.mark.unit
def test_unusable_database_is_one_clear_error(home: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = shoal("db", "upgrade", "--home", str(tmp_path / "file" / "below"))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot use the database sqlite:///")
    assert "Traceback" not in result.output


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--devices", "2xcpu"],
            "device group '2xcpu': it does not start with COUNTxKIND:MEMORY_MB",
        ),
        (["--devices", ""], "the device spec is empty"),
        (["--host", "0.0.0.0"], None),
        (["--port", "70000"], "invalid setting: port: Input should be less than or equal to 65535"),
        (["--port", "{taken}"], "--port: the API cannot listen on 127.0.0.1:{taken} (Address"),
    ],
)
def test_up_refuses_bad_options_before_starting_anything(
    home: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str | None
) -> None:
    if message is None:
        monkeypatch.setenv("SHOAL_AUTH", "false")
        message = "SHOAL_AUTH=false with SHOAL_HOST=0.0.0.0"
    taken = socket.socket()  # a port another process listens on
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    with taken:
        result = shoal("up", *[a.replace("{taken}", port) for a in args])
    message = message.replace("{taken}", port)
    assert result.exit_code == 2
    assert message in result.stderr
    assert not home.exists()


@pytest.mark.unit
def test_up_serves_on_port_8000_with_its_state_in_dot_shoal_by_default(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: `shoal up` serves http://127.0.0.1:8000 and SHOAL_HOME defaults to ~/.shoal."""
    from shoal.service import server
    from shoal.service.cli import server as commands

    monkeypatch.delenv("SHOAL_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    bound: list[tuple[str, int]] = []
    started: list[Settings] = []

    def listen(host: str, port: int) -> socket.socket:
        bound.append((host, port))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        return sock

    def up(settings: Settings, nodes: object, sock: socket.socket) -> None:
        started.append(settings)

    monkeypatch.setattr(server, "listen", listen)
    monkeypatch.setattr(commands, "_up", up)
    result = shoal("up")
    assert result.exit_code == 0, result.output
    assert bound == [("127.0.0.1", 8000)]
    (settings,) = started
    assert settings.home == tmp_path / ".shoal"
    assert settings.admin_token_path == tmp_path / ".shoal" / "admin.token"


@pytest.mark.integration
def test_up_with_a_ray_address_prepares_home_and_serves(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.service import server

    served: list[Settings] = []

    def serve(settings: Settings, sock: socket.socket) -> None:
        # The API's socket was bound before anything started, on the port the banner names.
        assert sock.getsockname() == ("127.0.0.1", settings.port)
        socket.create_connection(("127.0.0.1", settings.port), timeout=5).close()  # listening
        served.append(settings)
        raise KeyboardInterrupt  # Ctrl-C: `up` ends quietly

    monkeypatch.setattr(server, "serve", serve)
    result = shoal("up", "--ray-address", "10.0.0.9:6379", "--port", "0", "--host", "127.0.0.1")
    assert result.exit_code == 0, result.output
    (settings,) = served
    assert settings.ray_address == "10.0.0.9:6379" and settings.port > 0
    url = f"http://127.0.0.1:{settings.port}"
    assert json.loads((home / "client.json").read_text()) == {"url": url}
    token_path = home / "admin.token"
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    admin_token = token_path.read_text().strip()
    out = cells(result.stdout)
    assert re.search(rf"API\s+{url}/api/v1", out) and re.search(rf"dashboard\s+{url}/", out)
    assert re.search(rf"admin token\s+{admin_token}", out)
    assert re.search(rf"saved in {token_path} \(mode 0600\)", out)
    assert re.search(r"Ray\s+10\.0\.0\.9:6379\s", out)
    assert out.rstrip().endswith("Shoal stopped")
    # A second `up` keeps the admin token.
    assert shoal("up", "--ray-address", "10.0.0.9:6379").exit_code == 0
    assert token_path.read_text().strip() == admin_token


@pytest.mark.unit
@pytest.mark.parametrize(
    ("group", "message"),
    [
        ("2xcpu", "device group '2xcpu': it does not start with COUNTxKIND:MEMORY_MB"),
        ("1xcpu:64,1xgpu:64", "GROUP '1xcpu:64,1xgpu:64' names 2 nodes; give one group per node"),
        ("1xcpu:64", "ray.env not found: is `shoal up` running here with its own local cluster?"),
    ],
)
def test_node_refuses_bad_groups_and_a_home_without_a_local_cluster(
    home: Path, group: str, message: str
) -> None:
    result = shoal("node", group, "--home", str(home))
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.unit
@pytest.mark.parametrize("joins", ["address", "local"])
def test_a_node_joins_with_its_workers_prestarted_and_quick_health_checks(
    home: Path, monkeypatch: pytest.MonkeyPatch, joins: str
) -> None:
    """`shoal node` runs `ray start` with the settings that start its Python workers as the
    node starts, Shoal's actor code imported (README: a node that joins), and the cluster's
    health checks; to `shoal up`'s local cluster (its ray.env) or to any at --address."""
    from shoal.service.localray import HEALTH_CHECKS, RAY_ENV, WORKER_PRESTART

    ran: list[tuple[list[str], dict[str, str]]] = []

    def replaced(path: str, argv: list[str], env: dict[str, str]) -> None:
        ran.append((argv, env))
        raise SystemExit(0)  # the process is `ray start` from here on

    monkeypatch.setattr("os.execve", replaced)
    if joins == "local":
        home.mkdir(parents=True, exist_ok=True)
        (home / RAY_ENV).write_text("RAY_ADDRESS=127.0.0.1:6390\n")
        result = shoal("node", "1xcpu:64", "--home", str(home))
    else:
        result = shoal("node", "1xcpu:64", "--home", str(home), "--address", "10.0.0.9:6379")
    assert result.exit_code == 0, result.output
    ((argv, env),) = ran
    assert argv[1:3] == ["start", "--block"], argv
    assert f"--address={'127.0.0.1:6390' if joins == 'local' else '10.0.0.9:6379'}" in argv
    assert {**HEALTH_CHECKS, **WORKER_PRESTART}.items() <= env.items(), env
