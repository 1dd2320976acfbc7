"""Errors the CLI reports as clear lines, never as tracebacks.

Anything a user can cause by a foreseeable mistake (a malformed profile, a missing engine, a draft that
does not fit) raises a subclass of :class:`SpecopsError`; the CLI prints it and exits with its code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class SpecopsError(Exception):
    """A failure with a message fit for an operator; exit code 1 unless a subclass says otherwise."""

    exit_code = 1


@dataclass(frozen=True, order=True)
class Location:
    """A place in a source file, 1-based like editors and compilers print it."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Problem:
    """One located problem in a profile: where, which field, what is wrong."""

    location: Location | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        field = f"{self.field}: " if self.field else ""
        return f"{where}{field}{self.message}"

    def to_dict(self) -> dict[str, Any]:
        loc = self.location
        return {
            "file": loc.file if loc else None,
            "line": loc.line if loc else None,
            "column": loc.column if loc else None,
            "field": self.field,
            "message": self.message,
        }


class ProfileError(SpecopsError):
    """A profile that cannot be used; carries every problem found, each with its location."""

    def __init__(self, problems: list[Problem]):
        self.problems = sorted(problems, key=lambda p: (p.location or Location("", 0, 0), p.field))
        super().__init__("\n".join(str(p) for p in self.problems))


class UsageError(SpecopsError):
    """The command line itself is wrong (exit code 2, like click's own usage errors)."""

    exit_code = 2
