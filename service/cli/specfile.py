"""Spec files as ``shoal submit`` and ``shoal sweep`` read them: YAML or JSON, decoded with
clear errors."""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path
from typing import Any, Literal

import yaml

from shoal.service.cli.options import InputError

SPEC_FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
SPEC_FIELDS = {"job": "name, model, data, steps, ...", "sweep": "name, base, space, ..."}


def load_spec(path: Path, what: Literal["job", "sweep"] = "job") -> dict[str, Any]:
    """A spec file decoded (YAML or JSON by extension); ``InputError`` says where it breaks."""
    kind = SPEC_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise InputError(
            f"{path}: unknown extension {path.suffix or '(none)'!r}; use .yaml, .yml or .json"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text; save the spec as UTF-8") from None
    try:
        spec = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise InputError(f"{where}: invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: invalid YAML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if not isinstance(spec, dict):
        raise InputError(
            f"{path}: a {what} spec is a mapping of fields ({SPEC_FIELDS[what]}),"
            f" not {type(spec).__name__}"
        )
    try:
        json.dumps(spec)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: {exc}; quote dates and other special values") from None
    return spec


def submission_key(path: Path, given: str | None) -> str:
    """The ``Idempotency-Key`` of submitting ``path``: ``given``, or the file's hash and a
    nonce (the client's retries of this submission reuse it; a new run makes a new one)."""
    return given or f"{hashlib.sha256(path.read_bytes()).hexdigest()[:32]}-{secrets.token_hex(8)}"
