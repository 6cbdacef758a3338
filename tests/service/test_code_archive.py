"""The archive a user's code travels in: packed the same way every time, checked without
being unpacked or imported."""

from __future__ import annotations

import io
import stat
import zipfile
from pathlib import Path

import pytest

from shoal.service.code_archive import ArchiveError, inspect_archive, pack_directory
from shoal.service.code_store import CodeNotFound, CodeStore


def folder(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    (code / "mynets").mkdir(parents=True)
    (code / "mynets" / "__init__.py").write_text("")
    (code / "mynets" / "layers.py").write_text("WIDTH = 4\n")
    (code / "train_utils.py").write_text("def f():\n    return 1\n")
    (code / "notes.txt").write_text("not a module")
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "train_utils.cpython-311.pyc").write_bytes(b"\0")
    for skipped in (".git", ".venv/lib"):  # left out of the zip, as the user guide says
        (code / skipped).mkdir(parents=True)
        (code / skipped / "config.py").write_text("LEFT_OUT = True\n")
    return code


def zipped(entries: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_a_folder_packs_to_the_same_bytes_every_time_and_names_its_modules(
    tmp_path: Path,
) -> None:
    code = folder(tmp_path)
    first = pack_directory(code)
    (code / "train_utils.py").touch()  # a newer timestamp changes nothing
    assert pack_directory(code) == first
    names = zipfile.ZipFile(io.BytesIO(first)).namelist()
    assert names == ["mynets/__init__.py", "mynets/layers.py", "notes.txt", "train_utils.py"]
    contents = inspect_archive(first, 10**6)
    assert contents.modules == ("mynets", "train_utils") and contents.files == 4
    (code / "train_utils.py").write_text("def f():\n    return 2\n")
    assert pack_directory(code) != first


def test_a_folder_without_python_or_with_a_link_or_too_big_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.csv").write_text("1,2")
    with pytest.raises(ArchiveError, match=r"holds no \.py file"):
        pack_directory(empty)
    with pytest.raises(ArchiveError, match="is not a directory"):
        pack_directory(tmp_path / "missing")
    code = folder(tmp_path)
    with pytest.raises(ArchiveError, match="over the 100 a code upload may have"):
        pack_directory(code, max_bytes=100)
    (code / "link.py").symlink_to(code / "train_utils.py")
    with pytest.raises(ArchiveError, match="is a symbolic link"):
        pack_directory(code)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"../evil.py": b""}, "not a plain relative path"),
        ({"/etc/evil.py": b""}, "not a plain relative path"),
        ({"readme.txt": b"x"}, "holds no Python module at its root"),
        ({"torch/__init__.py": b""}, "name of an installed module"),
        ({"json.py": b""}, "standard library"),
        ({"big.py": b"x" * 2000}, "unpacks to 2000 bytes"),
    ],
)
def test_an_unsafe_or_unusable_archive_is_refused(entries: dict[str, bytes], message: str) -> None:
    with pytest.raises(ArchiveError, match=message):
        inspect_archive(zipped(entries), 1000)


def test_a_link_inside_an_archive_is_refused() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model.py", b"")
        link = zipfile.ZipInfo("data.py")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, b"/etc/passwd")
    with pytest.raises(ArchiveError, match=r"'data\.py' is a symbolic link"):
        inspect_archive(buffer.getvalue(), 1000)


def test_an_upload_that_is_no_zip_is_refused() -> None:
    with pytest.raises(ArchiveError, match="not a zip archive"):
        inspect_archive(b"PK not really", 1000)


def test_the_store_keeps_an_upload_once_by_its_digest(tmp_path: Path) -> None:
    store = CodeStore(tmp_path / "code-store", max_bytes=10**6)
    data = pack_directory(folder(tmp_path))
    stored = store.put(data)
    assert stored.digest.startswith("sha256:") and stored.bytes == len(data)
    assert store.put(data) == stored
    assert store.path(stored.digest).read_bytes() == data
    assert [p.name for p in (tmp_path / "code-store").iterdir()] == [store.path(stored.digest).name]
    with pytest.raises(CodeNotFound, match="upload it first"):
        store.path("sha256:" + "0" * 64)
    with pytest.raises(ArchiveError):
        store.put(b"nope")
    assert len(list((tmp_path / "code-store").iterdir())) == 1


def test_the_store_takes_an_upload_unpacking_to_4x_its_limit_and_no_more(tmp_path: Path) -> None:
    store = CodeStore(tmp_path / "code-store", max_bytes=1000)
    at_most = zipped({"model.py": b"#" * 4000}, zipfile.ZIP_DEFLATED)
    over = zipped({"model.py": b"#" * 4001}, zipfile.ZIP_DEFLATED)
    assert len(at_most) < 1000 and len(over) < 1000
    assert store.put(at_most).contents.modules == ("model",)
    with pytest.raises(ArchiveError, match="unpacks to 4001 bytes"):
        store.put(over)
