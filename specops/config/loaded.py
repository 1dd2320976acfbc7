"""A validated profile together with the document it came from.

Kept below the loader (:mod:`specops.config.profile`) and the cross-field rules (:mod:`specops.config.rules`):
the rules take a loaded profile to locate what they find, and the loader runs the rules on the one it builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from specops.config.located import Document, format_path, redact_problems
from specops.config.sections import Profile
from specops.errors import Problem


@dataclass(frozen=True)
class LoadedProfile:
    """A validated profile plus the document it came from (for locating later findings)."""

    profile: Profile
    document: Document
    path: str

    def problem(self, path: tuple, message: str, *, key: bool = False, field: str | None = None) -> Problem:
        """A problem located at field ``path`` (at its key when ``key``) of this profile's source.

        Values that ``${VAR}`` took from the environment are hidden in the message.
        """
        problem = Problem(self.document.locate(path, key=key), format_path(path) if field is None else field, message)
        return redact_problems([problem], self.document.env_texts)[0]
