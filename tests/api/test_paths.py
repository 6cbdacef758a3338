"""No answer of the API contains a server filesystem path: checkpoint listings give names,
and paths that reached events, errors or streams are shown by their setting's name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from shoal.api.paths import HidePaths, server_roots
from shoal.service.db.models import Checkpoint, Job
from shoal.service.db.session import SessionFactory, transaction
from shoal.service.jobs import add_event
from shoal.service.settings import Settings
from tests.api.conftest import Api, _serve
from tests.factories import job_spec


@pytest.fixture
def api_at_home(session_factory: SessionFactory, tmp_path: Path) -> Iterator[Api]:
    """A server whose state directory has a name JSON escapes (``ü``)."""
    settings = Settings(home=tmp_path / "shoal-hüme", database_url="unused://")
    yield from _serve(session_factory, settings)


def _leaks(text: str, root: Path) -> list[str]:
    forms = {str(root), json.dumps(str(root))[1:-1], json.dumps(str(root), ensure_ascii=False)}
    return [form for form in forms if form.strip('"') in text]


@pytest.mark.integration
def test_no_answer_names_a_server_path(api_at_home: Api) -> None:
    api, home = api_at_home, api_at_home.settings.home
    admin = api.token("root", admin=True)
    job_id = api.client.post("/api/v1/jobs", json=job_spec(), headers=admin).json()["id"]
    step_dir = f"{home}/checkpoints/{job_id}/step-00000005"
    with transaction(api.factory) as session:
        session.add(Checkpoint(job_id=job_id, step=5, path=step_dir, nbytes=10))
        add_event(session, job_id, "checkpoint", "checkpoint at step 5", {"path": step_dir})
        add_event(
            session,
            job_id,
            "resumed",
            f"resumed (passed over as unusable: step 6: {step_dir}/manifest.json is corrupt)",
            {"path": step_dir},
        )
        job = session.get(Job, job_id)
        assert job is not None
        job.error = f"[Errno 28] No space left on device: '{home}/shoal.db'"
    reads = [
        "/api/v1/jobs",
        f"/api/v1/jobs/{job_id}",
        f"/api/v1/jobs/{job_id}/events",
        f"/api/v1/jobs/{job_id}/checkpoints",
    ]
    answers = {path: api.client.get(path, headers=admin) for path in reads}
    for path, answer in answers.items():
        assert answer.status_code == 200, (path, answer.text)
        assert not _leaks(answer.text, home), (path, answer.text)
    checkpoints = answers[f"/api/v1/jobs/{job_id}/checkpoints"].json()["items"]
    assert [(c["step"], c["name"]) for c in checkpoints] == [(5, "step-00000005")]
    events = answers[f"/api/v1/jobs/{job_id}/events"].json()["items"]
    shown = f"$SHOAL_CHECKPOINT_ROOT/{job_id}/step-00000005"
    assert [e["data"].get("path") for e in events if e["kind"] == "checkpoint"] == [shown]
    assert f"{shown}/manifest.json is corrupt" in events[-1]["message"]


def _app(body: str) -> Starlette:
    async def one(_: Request) -> JSONResponse:
        return JSONResponse({"detail": body})

    async def text(_: Request) -> PlainTextResponse:
        return PlainTextResponse(body)

    async def stream(_: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for i in range(3):
                yield f"event: x\ndata: {json.dumps({'i': i, 'at': body})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/one", one), Route("/text", text), Route("/stream", stream)]
    return Starlette(routes=routes)


@pytest.mark.unit
def test_json_and_event_streams_are_cleaned_with_their_length_set_again(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "häme", database_url=None, checkpoint_root="/srv/ck")
    where = f"{tmp_path / 'häme'}/logs and /srv/ck/j1/step-00000001 and {tmp_path}/other"
    app = HidePaths(_app(where), server_roots(settings))
    with TestClient(app) as client:  # type: ignore[arg-type]
        one = client.get("/one")
        assert one.json()["detail"] == (
            f"$SHOAL_HOME/logs and $SHOAL_CHECKPOINT_ROOT/j1/step-00000001 and {tmp_path}/other"
        )
        assert int(one.headers["content-length"]) == len(one.content)
        lines = [ln for ln in client.get("/stream").text.splitlines() if ln.startswith("data:")]
        assert len(lines) == 3 and all("$SHOAL_HOME/logs" in ln for ln in lines), lines
        assert all(str(tmp_path / "häme") not in ln and "\\u00e4" not in ln for ln in lines)
        # Only JSON and event streams are rewritten: files and text pass as they are.
        assert client.get("/text").text == where


@pytest.mark.unit
def test_the_root_directory_is_never_a_root_to_hide() -> None:
    settings = Settings(home=Path("/"), database_url="sqlite:////x.db", checkpoint_root="/")
    app = HidePaths(_app("/api/v1/jobs"), server_roots(settings))
    with TestClient(app) as client:  # type: ignore[arg-type]
        assert client.get("/one").json()["detail"] == "/api/v1/jobs"
