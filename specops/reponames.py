"""Names that come from outside (the Hub, a lock file, the HF cache) and end up in paths and commands.

One validator for every repo file name specops takes from the Hub (``siblings``, paths-info answers, the
catalog's file lists, files listed in the HF cache) and from a lock file read back: a GGUF sibling named
``../../../../tmp/x-Q4_K_M.gguf`` must never be picked, pinned, rendered as ``-hff`` or joined under the
HF cache's ``snapshots/``. A name is accepted only when it is a relative POSIX path whose every segment
is a plain name: no leading ``/``, no backslash, no NUL or other control character, no empty segment
(``a//b``, a trailing ``/``), no ``.`` or ``..`` segment, no drive prefix (``C:``), and at most
:data:`MAX_NAME_LENGTH` characters. Repo ids and revisions get the same treatment (a revision is joined
under ``refs/`` in the cache; a commit sha must be hex).

Pure functions, no imports from the rest of specops: anything (the profile loader, a backend) may reuse
:func:`check_repo_file`.
"""

from __future__ import annotations

import re

#: Longest repo file name accepted (the Hub's own limit is lower in practice).
MAX_NAME_LENGTH = 1024
#: ``namespace/name`` or a legacy ``name``: letters, digits, ``_``, ``-``, ``.``; 96 characters each side.
_REPO_ID = re.compile(
    r"(?:[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?/)?[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?", re.ASCII
)
_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UnsafeName(ValueError):
    """A name from outside that cannot be used as a repo file name, repo id or revision."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "…"


def repo_file_problem(name: object) -> str | None:
    """Why ``name`` is not a safe repo file name (None when it is)."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"longer than {MAX_NAME_LENGTH} characters"
    if "\x00" in name:
        return "contains a NUL byte"
    if _CONTROL.search(name):
        return "contains a control character"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    if re.match(r"[A-Za-z]:", name):
        return "starts with a drive letter"
    for seg in name.split("/"):
        if seg == "":
            return "has an empty path segment"
        if seg in (".", ".."):
            return f"has a {seg!r} path segment"
    return None


def check_repo_file(name: object, what: str = "repo file name") -> str:
    """``name`` when it is a safe repo file name; raises :class:`UnsafeName` (one line) otherwise."""
    problem = repo_file_problem(name)
    if problem is not None:
        raise UnsafeName(f"unsafe {what} {_show(name)}: {problem}")
    return name  # type: ignore[return-value]


def is_safe_repo_file(name: object) -> bool:
    return repo_file_problem(name) is None


def repo_id_problem(repo_id: object) -> str | None:
    """Why ``repo_id`` is not a Hub repo id like ``namespace/name`` (None when it is)."""
    if not isinstance(repo_id, str):
        return f"not a string ({type(repo_id).__name__})"
    if not _REPO_ID.fullmatch(repo_id):
        return "not of the form namespace/name (letters, digits, '-', '_', '.'; at most 96 each)"
    if "--" in repo_id or ".." in repo_id:
        return "contains '--' or '..'"
    return None


def check_repo_id(repo_id: object, what: str = "repo id") -> str:
    problem = repo_id_problem(repo_id)
    if problem is not None:
        raise UnsafeName(f"invalid {what} {_show(repo_id)}: {problem}")
    return repo_id  # type: ignore[return-value]


def is_repo_id(repo_id: object) -> bool:
    return repo_id_problem(repo_id) is None


def revision_problem(revision: object) -> str | None:
    """Why ``revision`` (a branch, tag or commit sha) cannot be used (None when it can)."""
    if not isinstance(revision, str):
        return f"not a string ({type(revision).__name__})"
    if len(revision) > 255:
        return "longer than 255 characters"
    problem = repo_file_problem(revision)
    if problem is not None:
        return problem
    if revision.startswith("-"):
        return "starts with '-'"
    return None


def check_revision(revision: object, what: str = "revision") -> str:
    problem = revision_problem(revision)
    if problem is not None:
        raise UnsafeName(f"invalid {what} {_show(revision)}: {problem}")
    return revision  # type: ignore[return-value]


def is_commit_sha(value: object) -> bool:
    """A full commit sha as the Hub gives it (40 hex characters; 64 for sha256 repositories)."""
    return isinstance(value, str) and _SHA.fullmatch(value) is not None
