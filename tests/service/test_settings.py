"""Settings handed to the processes `shoal up` starts come back whole from their environment;
what `shoal up` starts and bounds where nothing is set."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from shoal.service.code_checks import code_checks
from shoal.service.devicespec import VirtualNode, parse_devices
from shoal.service.settings import Settings


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SHOAL_* variables from the machine running the tests."""
    for name in Settings.model_fields:
        monkeypatch.delenv(f"SHOAL_{name.upper()}", raising=False)


@pytest.mark.usefixtures("unset")
def test_settings_survive_the_trip_through_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    given = Settings(
        home=tmp_path,
        database_url="postgresql+psycopg://shoal@db:5432/shoal",
        auth=False,
        allowed_factories=["my.models", "my.data"],
        rate_limit_per_s=12.5,
        user_max_jobs=3,
        api_workers=2,
        admin_token=SecretStr("shoal_" + "a" * 40),
        metrics_token="m" * 20,
    )
    env = given.environment()
    assert "SHOAL_CHECKPOINT_ROOT" not in env  # unset stays unset
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings() == given


@pytest.mark.usefixtures("unset")
def test_unset_a_local_cluster_has_two_fast_and_two_slow_devices_and_code_checks_are_bounded(
    tmp_path: Path,
) -> None:
    """README: with no Ray address `shoal up` starts four virtual devices, two `cpu-fast`
    and two `cpu-slow` (emulated 2x slower); a spec's uploaded code is checked under a time
    and a memory limit, the settings' own."""
    settings = Settings(home=tmp_path)
    assert settings.ray_address is None
    assert parse_devices(settings.devices) == [
        VirtualNode(2, "cpu-fast", 2048),
        VirtualNode(2, "cpu-slow", 2048, slowdown=2.0),
    ]
    checks = code_checks(settings)
    assert (checks.timeout_s, checks.memory_bytes) == (120.0, 4096 * 2**20)
    bounded = code_checks(Settings(home=tmp_path, code_check_timeout_s=7, code_check_memory_mb=300))
    assert (bounded.timeout_s, bounded.memory_bytes) == (7.0, 300 * 2**20)
