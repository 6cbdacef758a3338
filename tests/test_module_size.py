"""Modules a reader can hold in mind: none of the packages' modules runs past 500
lines (a module that grows past it is split along a seam, each part with one job)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "workers", "service", "api", "shoal")
MOST_LINES = 500


def too_long(root: Path, most: int) -> dict[str, int]:
    """Python modules under ``root``'s packages with more than ``most`` lines, by path."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > most:
                found[str(path.relative_to(root))] = lines
    return found


@pytest.mark.unit
def test_no_module_runs_past_500_lines() -> None:
    assert too_long(ROOT, MOST_LINES) == {}, "split these along a seam"


@pytest.mark.unit
def test_the_check_finds_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "long.py").write_text("x = 1\n" * 501)
    (tmp_path / "service" / "short.py").write_text("x = 1\n" * 500)
    assert too_long(tmp_path, MOST_LINES) == {"service/long.py": 501}
