"""Factories over the API: only a function written in an allowed module is accepted; anything
else is a 422 naming the field, before the module's code is called."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from shoal.service.db.models import Job
from shoal.service.db.session import SessionFactory
from shoal.service.settings import Settings
from tests.api.conftest import Api, _serve
from tests.factories import job_spec

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
HOSTILE = "tests.workers.hostile_factories"
TOYS = "tests.workers.test_factories"
GOOD = {"model": {"factory": f"{HOSTILE}:own_mlp"}, "data": {"factory": f"{HOSTILE}:own_data"}}


@pytest.fixture
def api(session_factory: SessionFactory, tmp_path: Path) -> Iterator[Api]:
    """The operator lists the hostile module and the toy factories' module, nothing above."""
    settings = Settings(
        home=tmp_path,
        database_url="unused://",
        rate_limit_per_s=None,
        allowed_factories=[HOSTILE, TOYS],
    )
    yield from _serve(session_factory, settings)


@pytest.mark.parametrize("part", ["model", "data"])
@pytest.mark.parametrize(
    ("path", "message"),
    [
        (f"{HOSTILE}:ModelClass", "is a class, not a function"),
        (f"{HOSTILE}:DataClass", "is a class, not a function"),
        (f"{HOSTILE}:callable_instance", "is a _CallableModel instance, not a function"),
        (f"{HOSTILE}:bound_method", "is a bound method, not a function"),
        (f"{HOSTILE}:partial_mlp", "is a functools.partial, not a function"),
        (f"{HOSTILE}:system", "is a built-in function, not a function"),
        (f"{HOSTILE}:subprocess", "is a module, not a function"),
        (f"{HOSTILE}:getoutput", "is subprocess.getoutput, imported into"),
        (f"{HOSTILE}:tiny_mlp", f"is {TOYS}.tiny_mlp, imported into"),
        (f"{HOSTILE}:_private_mlp", "names a private name"),
        (f"{HOSTILE}:__getattr__", "names a private name"),
        (f"{HOSTILE}:anything", "has no attribute 'anything'"),
        ("tests.workers:test_factories", "is not allowed"),  # a package above a listed module
        ("tests.workers.hostile_factories.sub:fn", "is not allowed"),  # a submodule
    ],
)
def test_a_factory_that_is_not_a_function_of_an_allowed_module_is_a_422(
    api: Api, part: str, path: str, message: str
) -> None:
    hostile = importlib.import_module(HOSTILE)
    hostile.CALLS.clear()
    body = job_spec(**{**GOOD, part: {"factory": path}})
    r = api.client.post(JOBS, json=body, headers=api.token("alice"))
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == f"{part}.factory" and message in error["message"], error
    assert hostile.CALLS == []  # refused before anything it names ran
    with api.factory() as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Job)) == 0


def test_functions_written_in_allowed_modules_are_accepted(api: Api) -> None:
    alice = api.token("alice")
    r = api.client.post(JOBS, json=job_spec(**GOOD), headers=alice)
    assert r.status_code == 201, r.text
    toys = {"model": {"factory": f"{TOYS}:tiny_mlp"}, "data": {"factory": f"{TOYS}:sum_data"}}
    r = api.client.post(JOBS, json=job_spec(**toys), headers=alice)
    assert r.status_code == 201, r.text
