"""The docs can be followed: every relative link in the README and ``docs/`` reaches a file
(and a heading, where it names one), and every ``shoal`` command and ``make`` target they
show in code exists."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from shoal.service.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
SHOAL = re.compile(r"(?:^[ \t]*|/|\(|&& |; |\$ |=\S* )shoal((?: [a-z][a-z0-9-]*)+)", re.M)
"""``shoal`` where a command starts: a line's first word, a path's last (``.venv/bin/shoal``),
after ``(``, ``&&``, ``;``, a prompt or an environment assignment (not ``kubectl -n shoal``)."""
MAKE = re.compile(r"(?:^|[\s(`])make ([a-z][a-z0-9.-]*)")

pytestmark = pytest.mark.unit


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def code(text: str) -> list[str]:
    """The code in a Markdown text: its fenced blocks and inline spans."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return blocks + SPAN.findall(FENCE.sub("", text))


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a URL: not checked offline
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            bad.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            bad.append(f"{target}: {where.name} has no heading #{anchor}")
    return bad


def unknown_commands(text: str) -> list[str]:
    """``shoal ...`` words in code that name no command: the words are followed through the
    CLI's groups until one is a command (what comes after is its arguments)."""
    bad = []
    for snippet in code(text):
        for match in SHOAL.finditer(snippet):
            command: click.Command = cli
            for word in match.group(1).split():
                if not isinstance(command, click.Group):
                    break
                sub = command.commands.get(word)
                if sub is None:
                    bad.append(f"shoal{match.group(1)}: {word!r} is no command of {command.name}")
                    break
                command = sub
    return bad


def unknown_targets(text: str) -> list[str]:
    targets = set(re.findall(r"^([a-z][a-z0-9.-]*):", (ROOT / "Makefile").read_text(), re.M))
    return [
        f"make {t}" for snippet in code(text) for t in MAKE.findall(snippet) if t not in targets
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(path: Path) -> None:
    assert not broken_links(path)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_exists(path: Path) -> None:
    text = path.read_text()
    assert not unknown_commands(text) + unknown_targets(text)


def test_the_readme_stays_short() -> None:
    """A user reads it in five minutes; the rest is in ``docs/``."""
    assert len((ROOT / "README.md").read_bytes()) < 12 * 1024


def test_the_checks_find_a_broken_link_an_unknown_command_and_target(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Far away\n")
    doc.write_text("# Here\n[ok](b.md#far-away) [x](c.md) [y](b.md#near) [z](#here)\n")
    assert broken_links(doc) == ["c.md: no such file", "b.md#near: b.md has no heading #near"]
    text = (
        "`shoal bench sharp --json` `shoal bench nothing` `shoal frobnicate` `make test`"
        " `kubectl -n shoal get pods`"
    )
    assert unknown_commands(text) == [
        "shoal bench nothing: 'nothing' is no command of bench",
        "shoal frobnicate: 'frobnicate' is no command of cli",
    ]
    assert unknown_targets(text + " `make nothing`") == ["make nothing"]
