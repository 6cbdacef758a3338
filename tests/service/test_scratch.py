"""Scratch databases: a name that is not a plain identifier never reaches SQL text."""

from __future__ import annotations

import pytest

from shoal.service.db.scratch import create_database, drop_database

pytestmark = pytest.mark.unit

NOWHERE = "postgresql+psycopg://postgres@nowhere.invalid:5432/postgres"


@pytest.mark.parametrize("prefix", ['x"; DROP DATABASE postgres; --', "Shoal", "a-b", "1st"])
def test_a_prefix_that_makes_no_identifier_is_refused_before_connecting(prefix: str) -> None:
    with pytest.raises(ValueError, match="not a scratch database's name"):
        create_database(NOWHERE, prefix)


@pytest.mark.parametrize("database", ['shoal"x', "postgres-1", None])
def test_only_an_identifier_is_dropped(database: str | None) -> None:
    url = "postgresql+psycopg://postgres@nowhere.invalid:5432" + (
        f"/{database}" if database else ""
    )
    with pytest.raises(ValueError, match="not a scratch database's name"):
        drop_database(NOWHERE, url)
