"""The project's floors, read from its imports: ``scheduler`` (pure decisions) under
``workers`` (the engines on Ray) under ``service`` (the control plane, CLI, benches) under
``api`` (the HTTP app) under ``shoal`` (the Python API users import). No module imports a
higher floor, except the ones that compose the whole process (``service.server``,
``service.cli``, ``service.bench``, which may import ``api``), and no modules import each
other in a circle: each can be read and tested from the floors below it. Every import
counts, inside functions and under ``TYPE_CHECKING`` too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("scheduler", "workers", "service", "api", "shoal")
"""Lowest first."""
COMPOSING = ("service.server", "service.cli", "service.bench")
"""Modules (and packages) that assemble the whole process and so may import ``api``."""
RAY_CALLERS = ("workers", "service.cluster", "service.bench")
"""The modules that may call Ray: the engines, the controller's adapter, and the benches
(each starts a Ray of its own and measures the engines on it, as a user's script would)."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int

    def __str__(self) -> str:
        path = self.source.replace(".", "/")
        return f"{self.source} -> {self.target} ({path}.py:{self.line})"


def modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for package in FLOORS:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if "migrations" in parts:
                continue  # Alembic's revision files, loaded by Alembic alone
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """The dotted names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``), by
    the folders' names: ``shoal.service.jobs`` (its installed name) is ``service.jobs``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield by_folder(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield by_folder(node.module), node.lineno
            for alias in node.names:
                yield by_folder(f"{node.module}.{alias.name}"), node.lineno


def by_folder(name: str) -> str:
    top, _, rest = name.partition(".")
    inner = rest.split(".")[0]
    return rest if top == "shoal" and inner in FLOORS[:-1] else name


def edges(found: dict[str, Path]) -> list[Edge]:
    """Each module's imports of the project's other modules (a name resolves to the longest
    module it starts with: ``from a.b import C`` is an import of ``a.b``)."""
    out: dict[tuple[str, str], Edge] = {}
    for source, path in found.items():
        for name, line in imports(path):
            target = name
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != source and (source, target) not in out:
                out[(source, target)] = Edge(source, target, line)
    return list(out.values())


def circles(graph: list[Edge]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan)."""
    after: dict[str, list[str]] = {}
    for e in graph:
        after.setdefault(e.source, []).append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in after.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(after):
        if v not in index:
            visit(v)
    return found


def floor(module: str) -> int:
    return FLOORS.index(module.split(".")[0])


def under(module: str, names: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``names`` or inside one of those packages."""
    return any(module == n or module.startswith(n + ".") for n in names)


def upward(graph: list[Edge]) -> list[Edge]:
    """Imports of a higher floor, less the composing modules' imports of ``api``."""
    return [
        e
        for e in graph
        if floor(e.target) > floor(e.source)
        and not (under(e.source, COMPOSING) and e.target.split(".")[0] == "api")
    ]


@pytest.fixture(scope="module")
def graph() -> list[Edge]:
    return edges(modules())


@pytest.mark.unit
def test_no_modules_import_each_other_in_a_circle(graph: list[Edge]) -> None:
    found = circles(graph)
    assert not found, "import circles (break each with a module both sides can import):\n" + (
        "\n".join(
            " <-> ".join(c)
            + "\n  "
            + "\n  ".join(str(e) for e in graph if {e.source, e.target} <= set(c))
            for c in found
        )
    )


@pytest.mark.unit
def test_no_module_imports_a_higher_floor(graph: list[Edge]) -> None:
    bad = upward(graph)
    assert not bad, (
        f"imports from a lower floor to a higher one (floors, lowest first: {FLOORS}):\n"
        + "\n".join(str(e) for e in bad)
    )


@pytest.mark.unit
def test_nothing_in_workers_imports_the_actor_module(graph: list[Edge]) -> None:
    """``workers.actors`` starts the engines' top actors; inside ``workers/`` it would close
    a circle through the engine it starts."""
    bad = [e for e in graph if e.target == "workers.actors" and e.source.startswith("workers")]
    assert not bad, "\n".join(str(e) for e in bad)


@pytest.mark.unit
def test_only_the_engines_the_controllers_adapter_and_the_benches_import_ray() -> None:
    """Decisions stay pure and the control plane reaches the cluster through one adapter."""
    bad = [
        f"{module} imports {name} ({path.relative_to(ROOT)}:{line})"
        for module, path in modules().items()
        for name, line in imports(path)
        if name.split(".")[0] == "ray" and not under(module, RAY_CALLERS)
    ]
    assert not bad, f"Ray imported outside {RAY_CALLERS}:\n" + "\n".join(bad)


@pytest.mark.unit
def test_the_checks_find_a_circle_and_an_upward_import() -> None:
    """The checks themselves, on a made-up graph: a circle of three and an upward edge."""
    made = [
        Edge("scheduler.a", "scheduler.b", 1),
        Edge("scheduler.b", "scheduler.c", 1),
        Edge("scheduler.c", "scheduler.a", 1),
        Edge("workers.x", "service.y", 1),
        Edge("service.cli.z", "api.app", 1),
        Edge("service.jobs", "api.app", 1),
    ]
    assert circles(made) == [["scheduler.a", "scheduler.b", "scheduler.c"]]
    assert [str(e.target) for e in upward(made)] == ["service.y", "api.app"]
    assert [e.source for e in upward(made)] == ["workers.x", "service.jobs"]
