"""Installing Shoal gives a user one import name, ``shoal``: the parts, kept in their own
folders here (``api/``, ``service/``, ``scheduler/``, ``workers/``), install under it
(``shoal.api``, ...) through the links in ``shoal/``, with their data files; no generic
top-level name (``api``, ``service``, ...) lands in a user's environment."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("api", "service", "scheduler", "workers")


@pytest.mark.unit
def test_each_part_is_a_link_under_shoal_to_its_folder() -> None:
    for part in PARTS:
        link = ROOT / "shoal" / part
        assert link.is_symlink() and link.resolve() == (ROOT / part).resolve(), link


@pytest.mark.integration
def test_the_wheel_holds_shoal_alone_with_every_part_and_its_data(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    built = subprocess.run(
        [*pip, "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("shoal-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {
        "shoal",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    for part in PARTS:
        shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / part).rglob("*.py")}
        assert {f"shoal/{p}" for p in shipped} <= names, f"{part} is missing from the wheel"
    assert "shoal/api/dashboard/index.html" in names
    assert "shoal/service/db/migrations/script.py.mako" in names
    entry = zipfile.ZipFile(wheel).read(wheel.name.split("-py")[0] + ".dist-info/entry_points.txt")
    assert b"shoal = shoal.service.cli:main" in entry
