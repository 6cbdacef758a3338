"""Shared fixtures: seeded RNGs, one Ray instance per session, SQLite and PostgreSQL databases."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

RAY_NAMESPACE = "shoal-test"
TEST_DEVICES = 4


@pytest.fixture(autouse=True)
def _seed_rngs() -> None:
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One local Ray head for the whole session, on a free port, with virtual devices.

    The head declares ``TEST_DEVICES`` virtual devices of kind ``cpu`` (custom resource
    ``shoal_device`` plus node labels). Tests that need several nodes start their own
    ``ray.cluster_utils.Cluster`` instead.
    """
    import ray

    from shoal.scheduler.devices import DEVICE_RESOURCE, LABEL_KIND, LABEL_MEMORY_MB

    context = ray.init(
        address="local",
        num_cpus=4,
        resources={DEVICE_RESOURCE: TEST_DEVICES},
        labels={LABEL_KIND: "cpu", LABEL_MEMORY_MB: "2048"},
        include_dashboard=False,
        namespace=RAY_NAMESPACE,
        log_to_driver=False,
    )
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()


def _postgres_admin_url() -> str | None:
    return os.environ.get("SHOAL_TEST_POSTGRES_URL") or (
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )


@contextmanager
def _fresh_postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database (dropped afterwards); its URL.

    Skips when no server is reachable, unless ``SHOAL_REQUIRE_POSTGRES=1`` (CI), where an
    unreachable server is a failure.
    """
    import sqlalchemy as sa

    from shoal.service.db.scratch import create_database, drop_database

    admin_url = _postgres_admin_url()
    assert admin_url is not None
    try:
        url = create_database(admin_url, "shoal_test")
    except sa.exc.OperationalError as exc:
        if os.environ.get("SHOAL_REQUIRE_POSTGRES") == "1":
            raise
        pytest.skip(f"PostgreSQL not reachable at {admin_url}: {exc.orig}")
    try:
        yield url
    finally:
        drop_database(admin_url, url)


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """The session's PostgreSQL database (emptied by ``session_factory`` for each test)."""
    with _fresh_postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of each backend that nothing was ever written to (migration tests)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    with _fresh_postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database URL per backend: a new SQLite file, or the session's PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'shoal.db'}"
    url: str = request.getfixturevalue("postgres_server_url")
    return url


@pytest.fixture
def session_factory(database_url: str) -> Iterator[object]:
    """A migrated, empty database (SQLite file or PostgreSQL) and its session factory."""
    import sqlalchemy as sa

    from shoal.service.db.models import Base
    from shoal.service.db.session import make_engine, make_session_factory, migrate

    migrate(database_url)
    engine = make_engine(database_url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(sa.delete(table))
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on a real Ray run on both databases runs on SQLite only: PostgreSQL is covered
    by the test's in-process variant where it has one (the controller's database code does
    not depend on the backend), by the PostgreSQL-only end-to-end tests (tests/integration:
    the chaos test loses, drains and suspends jobs on PostgreSQL), and every Ray variant
    costs seconds of actor start-up and training."""
    ids = {item.nodeid for item in items}
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_ray = "ray" in params.values() or "ray_address" in getattr(item, "fixturenames", ())
        twin = item.nodeid.replace("postgresql", "sqlite")
        both = params.get("database_url") == "postgresql" and on_ray and twin in ids
        (dropped if both else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    _skip_gpu_tests_without_cuda(items)


def _skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: skipped, saying so, where there is none."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in gpu:
        item.add_marker(skip)
