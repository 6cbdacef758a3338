"""An error as one line of text: its type and message, whitespace collapsed (job errors,
events and the reasons a device is set aside are read in tables and logs)."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
