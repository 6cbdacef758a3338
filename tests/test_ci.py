"""CI runs every test: the README's test command, ``make test``, leaves the end-to-end
scenarios to ``make scenarios`` (so that the default suite stays near 20 minutes), and
``.ci/run`` runs both."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_args(target: str) -> list[str]:
    """The arguments the Makefile's ``target`` gives pytest (its recipe's one pytest line)."""
    lines = iter((ROOT / "Makefile").read_text().splitlines())
    next(line for line in lines if line.startswith(f"{target}:"))
    recipe = []
    for line in lines:
        if not line.startswith("\t"):
            break
        recipe.append(shlex.split(line))
    ((_, *args),) = [words for words in recipe if words[0].endswith("/pytest")]
    return args


@pytest.mark.unit
def test_ci_runs_the_suite_and_the_scenarios_it_leaves_out() -> None:
    ignored = [a.split("=", 1)[1] for a in pytest_args("test") if a.startswith("--ignore=")]
    scenarios = [a for a in pytest_args("scenarios") if not a.startswith("-")]
    assert ignored and ignored == scenarios, (ignored, scenarios)
    assert all((ROOT / path).is_dir() for path in scenarios), scenarios
    steps = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    ran = [step for step in steps if step in ("make test", "make scenarios")]
    assert ran == ["make test", "make scenarios"], steps


@pytest.mark.unit
def test_make_test_runs_lint_and_types_then_the_suite() -> None:
    """README: `make test` runs lint, types and the suite (after installing, where needed)."""
    dry = subprocess.run(
        ["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    steps = ["ruff check .", "ruff format --check .", "mypy shoal", "pytest -q --ignore="]
    at = [next((i for i, line in enumerate(dry) if step in line), -1) for step in steps]
    assert -1 not in at and at == sorted(at), (steps, dry)
