"""``code:module:function`` factories load only modules of the job's uploaded code: found
in its folder, never an installed module of the same name, and forgotten after a local
build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shoal.workers.factories import FactoryError, check_allowed, load_callable
from shoal.workers.uploaded_code import CodeRunFailed, JobCode, call_with_code, local_code


def folder(tmp_path: Path, body: str = "def build(config, meta):\n    return []\n") -> Path:
    code = tmp_path / "code"
    (code / "ownpkg").mkdir(parents=True)
    (code / "ownpkg" / "__init__.py").write_text("")
    (code / "ownpkg" / "nets.py").write_text(body)
    return code


def test_a_code_factory_loads_from_the_codes_folder_and_is_forgotten_after(
    tmp_path: Path,
) -> None:
    with local_code(folder(tmp_path)):
        fn = load_callable("code:ownpkg.nets:build", [])
        assert fn({}, None) == [] and "ownpkg.nets" in sys.modules
    assert "ownpkg.nets" not in sys.modules and "ownpkg" not in sys.modules
    other = folder(tmp_path / "other", "def build(config, meta):\n    return ['other']\n")
    with local_code(other):
        assert load_callable("code:ownpkg.nets:build", [])({}, None) == ["other"]


def test_a_code_factory_never_names_an_installed_module(tmp_path: Path) -> None:
    with pytest.raises(FactoryError, match="not a module of the job's uploaded code"):
        load_callable("code:tests.factories:job_spec", [])
    with local_code(folder(tmp_path)):
        with pytest.raises(FactoryError, match="not a module of the job's uploaded code"):
            load_callable("code:tests.factories:job_spec", [])
        with pytest.raises(FactoryError, match="cannot be imported"):
            load_callable("code:ownpkg.missing:build", [])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("code:ownpkg", "code:module:function"),
        ("code:own pkg:build", "code:module:function"),
        ("code:ownpkg.nets:_private", "private name"),
    ],
)
def test_a_malformed_code_factory_is_refused_before_any_import(name: str, message: str) -> None:
    with pytest.raises(FactoryError, match=message):
        check_allowed(name, [])
    assert check_allowed("code:ownpkg.nets:build", []) == ("ownpkg.nets", "build")


def test_code_that_cannot_be_shipped_fails_the_check_with_the_reason(tmp_path: Path) -> None:
    gone = JobCode("sha256:" + "c" * 64, str(tmp_path / "gone.zip"))
    with pytest.raises(CodeRunFailed, match="could not be shipped to the Ray cluster"):
        call_with_code(print, (), gone, timeout_s=5, memory_bytes=2**20)
