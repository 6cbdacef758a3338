"""No spec string can reach an interpreter, a shell or SQL text: the product's code has no
``eval``/``exec``, no shell, and no SQL text built from strings at run time (values go in as
bound parameters). Read from the source's syntax trees, so a new module is checked too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]
PACKAGES = ("api", "service", "scheduler", "workers")
SCRATCH_DATABASES = {"service/db/scratch.py"}
"""The maker of scratch databases (benchmarks, tests): a database's name, made from a fixed
prefix and a random hex string and checked to be an identifier (which SQL cannot bind), is
never input."""


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def problems(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        line = f"{where}:{node.lineno}"
        if name in ("eval", "exec", "compile", "os.system", "os.popen"):
            found.append(f"{line}: {name}()")
        if any(
            k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
            for k in node.keywords
        ):
            found.append(f"{line}: a shell")
        if name.split(".")[-1] == "text" and node.args:
            built = isinstance(node.args[0], ast.JoinedStr | ast.BinOp) or (
                isinstance(node.args[0], ast.Call) and _name(node.args[0].func).endswith("format")
            )
            if built and where not in SCRATCH_DATABASES:
                found.append(f"{line}: SQL text built at run time")
    return found


def test_no_interpreter_shell_or_built_sql_in_the_product() -> None:
    found = [
        problem
        for path in modules()
        for problem in problems(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "eval(spec['name'])",
        "subprocess.run(cmd, shell=True)",
        "os.system('rm ' + path)",
        "session.execute(sa.text(f\"SELECT * FROM jobs WHERE name = '{name}'\"))",
        "session.execute(text('SELECT ' + column))",
        "session.execute(sa.text('SELECT {}'.format(column)))",
    ],
)
def test_the_check_catches_each_pattern(source: str) -> None:
    assert problems(source, "x.py")
