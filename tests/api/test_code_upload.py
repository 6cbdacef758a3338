"""``POST /api/v1/code`` and specs that name uploaded code, up to the point a Ray worker
would check them: the permission, the archive's checks and the spec's."""

from __future__ import annotations

import os
from pathlib import Path

from shoal.service.code_archive import pack_directory
from tests.api.conftest import Api
from tests.factories import job_spec, sweep_spec

ZIP = {"Content-Type": "application/zip"}


def code_zip(tmp_path: Path) -> bytes:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tinynets.py").write_text("def mlp(config, meta):\n    return []\n")
    return pack_directory(tmp_path / "src")


def test_uploading_code_needs_the_code_permission_an_admin_grants(api: Api, tmp_path: Path) -> None:
    data = code_zip(tmp_path)
    alice = api.token("alice")
    refused = api.client.post("/api/v1/code", content=data, headers={**alice, **ZIP})
    assert refused.status_code == 403, refused.text
    detail = refused.json()["detail"]
    assert "lacks the code permission" in detail and "--user alice --code" in detail
    spec = job_spec(code="sha256:" + "a" * 64, model={"factory": "code:tinynets:mlp"})
    assert api.client.post("/api/v1/jobs", json=spec, headers=alice).status_code == 403
    sweep = sweep_spec(base=spec)
    assert api.client.post("/api/v1/sweeps", json=sweep, headers=alice).status_code == 403

    admin = api.token("root", admin=True)
    granted = api.client.put("/api/v1/users/alice/code", json={"allowed": True}, headers=admin)
    assert granted.status_code == 200 and granted.json()["may_upload_code"] is True
    assert (
        api.client.put(
            "/api/v1/users/alice/code", json={"allowed": True}, headers=alice
        ).status_code
        == 403
    )
    alice = api.token("alice")  # a token not yet looked up: the grant applies at once
    stored = api.client.post("/api/v1/code", content=data, headers={**alice, **ZIP})
    assert stored.status_code == 201, stored.text
    answer = stored.json()
    assert answer["digest"].startswith("sha256:") and answer["modules"] == ["tinynets"]
    assert answer["bytes"] == len(data) and answer["files"] == 1
    again = api.client.post("/api/v1/code", content=data, headers={**alice, **ZIP})
    assert again.json() == answer

    taken = api.client.put("/api/v1/users/alice/code", json={"allowed": False}, headers=admin)
    assert taken.json()["may_upload_code"] is False
    alice = api.token("alice")
    assert (
        api.client.post("/api/v1/code", content=data, headers={**alice, **ZIP}).status_code == 403
    )


def test_a_bad_archive_is_a_422_and_a_big_one_a_413(api: Api, tmp_path: Path) -> None:
    bob = api.token("bob", code=True)
    bad = api.client.post("/api/v1/code", content=b"not a zip", headers={**bob, **ZIP})
    assert bad.status_code == 422 and "not a zip archive" in bad.json()["detail"]
    limit = api.settings.code_max_bytes
    big = api.client.post("/api/v1/code", content=b"x" * (limit + 1), headers={**bob, **ZIP})
    assert big.status_code == 413 and "SHOAL_CODE_MAX_BYTES" in big.json()["detail"]
    # Over the body limit of every other route, within the upload's.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.py").write_text("")
    (tmp_path / "src" / "table.bin").write_bytes(os.urandom(api.settings.max_body_bytes + 1))
    body = pack_directory(tmp_path / "src")
    large = api.client.post("/api/v1/code", content=body, headers={**bob, **ZIP})
    assert large.status_code == 201, large.text


def test_a_spec_naming_code_it_does_not_have_is_refused_naming_the_field(api: Api) -> None:
    bob = api.token("bob", code=True)
    unnamed = api.client.post(
        "/api/v1/jobs", json=job_spec(model={"factory": "code:tinynets:mlp"}), headers=bob
    )
    assert unnamed.status_code == 422
    assert "names uploaded code but the spec has none" in unnamed.json()["detail"]
    missing = api.client.post(
        "/api/v1/jobs",
        json=job_spec(code="sha256:" + "b" * 64, model={"factory": "code:tinynets:mlp"}),
        headers=bob,
    )
    assert missing.status_code == 422
    assert missing.json()["errors"][0]["field"] == "code"
    assert "no code was uploaded with digest" in missing.json()["detail"]
    malformed = api.client.post(
        "/api/v1/jobs",
        json=job_spec(code="sha256:" + "b" * 64, model={"factory": "code:x"}),
        headers=bob,
    )
    assert malformed.status_code == 422 and "code:module:function" in malformed.json()["detail"]
