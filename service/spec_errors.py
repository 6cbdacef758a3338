"""A spec's errors: (dotted field, message) pairs, from pydantic or from Shoal's own checks."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError


class SpecError(ValueError):
    """A spec is invalid. ``errors`` lists (dotted field, message) pairs."""

    def __init__(self, errors: Sequence[tuple[str, str]]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{f}: {m}" if f else m for f, m in self.errors))

    def __reduce__(self) -> tuple[type[SpecError], tuple[list[tuple[str, str]]]]:
        # Pickled whole: a check of uploaded code raises it in a Ray worker process.
        return SpecError, (self.errors,)


def pydantic_errors(exc: ValidationError) -> list[tuple[str, str]]:
    errors = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
        message = str(err["msg"]).removeprefix("Value error, ")
        errors.append((".".join(loc), message))
    return errors
