"""Settings handed to the processes `shoal up` starts come back whole from their environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from shoal.service.settings import Settings


def test_settings_survive_the_trip_through_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"SHOAL_{name.upper()}", raising=False)
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
