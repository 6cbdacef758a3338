"""Job and sweep names over the API: no trailing newline or other control character, and a
sweep's name leaves room for the ``-<number>`` its trials' job names add."""

from __future__ import annotations

import pytest

from shoal.service.specs import MAX_NAME
from tests.api.conftest import Api
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/jobs", job_spec(name="run\n")),
        ("/api/v1/jobs", job_spec(name="run\r\n")),
        ("/api/v1/sweeps", sweep_spec(name="lr\n")),
        # Trial 999 of a 97-character sweep would be a 101-character job name.
        ("/api/v1/sweeps", sweep_spec(name="s" * 97, max_trials=1000)),
    ],
    ids=["job-newline", "job-crlf", "sweep-newline", "sweep-too-long-for-its-trials"],
)
def test_bad_names_are_a_422_on_name(api: Api, path: str, body: dict[str, object]) -> None:
    r = api.client.post(path, json=body, headers=api.token("alice"))
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["name"], r.text


def test_the_longest_sweep_name_is_accepted(api: Api) -> None:
    name = "s" * 96
    assert len(f"{name}-999") == MAX_NAME
    r = api.client.post("/api/v1/sweeps", json=sweep_spec(name=name), headers=api.token("alice"))
    assert r.status_code == 201, r.text
    assert r.json()["name"] == name
