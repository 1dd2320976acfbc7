"""Profile files: read with bounds, ``extends`` overlays resolved and merged into one located document.

A profile is a regular file of at most :data:`MAX_PROFILE_BYTES`; ``extends`` may only name files inside
the profile's tree (:func:`profile_roots`), and a file it names is quoted in messages only once it reads as
a profile (a YAML mapping of profile fields), so ``extends: /etc/shadow`` can never print a line of it.
Overlays deep-merge (overlay wins, lists replaced whole); each file is parsed by
:mod:`specops.config.located`, so every value still points at its file, line and column.
"""

from __future__ import annotations

import difflib
import errno
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specops.config.located import (
    Document,
    Path_,
    build_document,
    compose,
    location,
    parse,
    quote_value,
    redact_problems,
    shown_path,
)
from specops.config.sections import TOP_LEVEL_FIELDS
from specops.errors import Location, Problem, ProfileError

MAX_EXTENDS_DEPTH = 16
#: Profiles are a few KiB; anything larger is refused before it is parsed (and /dev/zero is no file).
MAX_PROFILE_BYTES = 1 << 20
#: Extra folders ``extends`` may read from (``os.pathsep``-separated), besides the profile's own tree.
PROFILE_ROOT_ENV = "SPECOPS_PROFILE_ROOT"


def read_text(path: Path, display: str, where: Location | None = None, field_: str = "") -> str:
    """Read a profile as UTF-8: a regular file of at most :data:`MAX_PROFILE_BYTES`, with a bounded read.

    Devices (``/dev/zero``), FIFOs and directories are refused before anything is read; I/O failures
    (a symlink loop, no permission) become located problems.
    """
    msg = ""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        msg = f"file not found: {display}"
    except IsADirectoryError:
        msg = f"is a directory, not a file: {display}"
    except ValueError as exc:  # a NUL byte in the name
        msg = f"cannot read {display!r}: {exc}"
    except OSError as exc:
        why = "symlink loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        msg = f"cannot read {display}: {why}"
    else:
        try:
            with os.fdopen(fd, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if stat.S_ISDIR(mode):
                    msg = f"is a directory, not a file: {display}"
                elif not stat.S_ISREG(mode):
                    msg = f"not a regular file: {display}"
                else:
                    data = f.read(MAX_PROFILE_BYTES + 1)
                    if len(data) > MAX_PROFILE_BYTES:
                        msg = f"{display} is larger than {MAX_PROFILE_BYTES >> 20} MiB; a profile is a few KiB"
                    else:
                        try:
                            return data.decode("utf-8")
                        except UnicodeDecodeError:
                            msg = f"not UTF-8 text: {display}"
        except OSError as exc:
            msg = f"cannot read {display}: {exc.strerror or exc}"
    raise ProfileError([Problem(where or Location(display, 1, 1), field_, msg)])


def profile_roots(path: Path, env: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """Folders ``extends`` may read from when loading ``path``.

    The git work tree that contains the profile (the nearest folder above it with a ``.git``), else the
    profile's own folder; plus every folder listed in ``$SPECOPS_PROFILE_ROOT`` (``os.pathsep``-separated).
    """
    real = path.resolve()
    tree = real.parent
    for folder in (real.parent, *real.parent.parents):
        try:
            if (folder / ".git").exists():
                tree = folder
                break
        except OSError:
            break
    roots = [tree]
    extra = (os.environ if env is None else env).get(PROFILE_ROOT_ENV) or ""
    for item in extra.split(os.pathsep):
        if item.strip():
            try:
                roots.append(Path(item.strip()).expanduser().resolve())
            except (OSError, ValueError, RuntimeError):
                continue
    return tuple(roots)


@dataclass
class _LoadContext:
    env: Mapping[str, str] | None
    top: Path
    fields: frozenset[str] | None
    _roots: tuple[Path, ...] | None = None

    def roots(self) -> tuple[Path, ...]:
        if self._roots is None:
            self._roots = profile_roots(self.top, self.env)
        return self._roots


def load(
    path: str | os.PathLike,
    env: Mapping[str, str] | None = None,
    *,
    roots: Iterable[str | os.PathLike] | None = None,
    fields: Iterable[str] | None = None,
) -> Document:
    """Load a profile file and everything it ``extends``, merged into one located document.

    ``roots`` overrides :func:`profile_roots`; ``fields`` are the top-level keys a file named by
    ``extends`` may have (default: the profile's fields).
    """
    ctx = _LoadContext(
        env,
        Path(path),
        frozenset(fields) if fields is not None else None,
        tuple(Path(r).resolve() for r in roots) if roots is not None else None,
    )
    return _load(Path(path), str(path), ctx, stack=(), base_of=None)


def _parse_base(text: str, display: str, ctx: _LoadContext, where: Location | None, name: str) -> Document:
    """Parse a file named by ``extends``; until it reads as a profile, no key or value of it is quoted."""

    def refuse(what: str, loc: Location | None = None, field_: str = "extends") -> ProfileError:
        return ProfileError([Problem(loc or where, field_, what)])

    name = shown_path(name)
    try:
        node = compose(text, display)
    except ProfileError as exc:
        if exc.problems[0].message == "the file is empty":
            raise
        loc = exc.problems[0].location
        at = f" at line {loc.line}, column {loc.column}" if loc else ""
        raise refuse(
            f"{name} is not a specops profile: not valid YAML{at} (details are not shown for a file "
            f"that does not read as a profile)"
        ) from None
    fields = ctx.fields if ctx.fields is not None else TOP_LEVEL_FIELDS
    if not isinstance(node, yaml.MappingNode) or node.tag != "tag:yaml.org,2002:map":
        raise refuse(f"{name} is not a specops profile (a profile is a YAML mapping of profile fields)")
    keys = [k for k, _v in node.value]
    unknown = [k for k in keys if not (isinstance(k, yaml.ScalarNode) and k.value in fields)]
    if unknown and len(unknown) == len(keys):
        raise refuse(f"{name} is not a specops profile (none of its top-level keys is a profile field)")
    if unknown:
        key = unknown[0]
        hint = (
            difflib.get_close_matches(key.value, sorted(fields), n=1, cutoff=0.6)
            if isinstance(key, yaml.ScalarNode)
            else []
        )
        raise refuse(
            "unknown top-level field"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + " (not quoted: files named by `extends` are quoted only once they read as profiles)",
            location(display, key.start_mark),
            "",
        )
    return build_document(node, display, ctx.env)


def _load(
    path: Path, display: str, ctx: _LoadContext, stack: tuple[Path, ...], base_of: tuple[Location | None, str] | None
) -> Document:
    if base_of is None:
        doc = parse(read_text(path, display), display, ctx.env)
    else:
        where, name = base_of
        doc = _parse_base(read_text(path, display, where, "extends"), display, ctx, where, name)
    try:
        return _extend(doc, path, ctx, stack)
    except ProfileError as exc:
        if not doc.env_texts:
            raise
        raise ProfileError(redact_problems(exc.problems, doc.env_texts)) from None


def _extend(doc: Document, path: Path, ctx: _LoadContext, stack: tuple[Path, ...]) -> Document:
    """``doc`` merged onto the files its ``extends`` names (in order, each later one winning), ``extends`` gone."""
    parents = doc.data.pop("extends", None)
    if parents is None:
        return doc
    ext_loc = doc.keys.get(("extends",))
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise _refuse(ext_loc, "must be a file path or a list of file paths")
    if len(stack) >= MAX_EXTENDS_DEPTH:
        raise _refuse(ext_loc, f"more than {MAX_EXTENDS_DEPTH} levels of extends")
    merged: Document | None = None
    for i, parent in enumerate(parents):
        where = doc.values.get(("extends", i) if (("extends", i) in doc.values) else ("extends",), ext_loc)
        parent_path, resolved = _parent_file(path, parent, where, ctx, stack)
        base = _load(parent_path, os.path.relpath(parent_path), ctx, stack + (resolved,), (where, parent))
        merged = base if merged is None else merge(merged, base)
    for p in [k for k in doc.values if k and k[0] == "extends"]:
        doc.values.pop(p)
    doc.keys.pop(("extends",), None)
    return doc if merged is None else merge(merged, doc)  # `extends: []` extends nothing


def _refuse(where: Location | None, message: str) -> ProfileError:
    return ProfileError([Problem(where, "extends", message)])


def _parent_file(
    path: Path, parent: str, where: Location | None, ctx: _LoadContext, stack: tuple[Path, ...]
) -> tuple[Path, Path]:
    """The file that ``parent`` (written in ``path``'s extends) names, and ``path`` resolved.

    Refused when it cannot be a path, lies outside the profile's tree, closes a cycle, or is no regular file.
    """
    parent_path = path.parent / parent
    resolved, roots, parent_resolved = _resolved(path, parent_path, parent, where, ctx)
    if not any(parent_resolved.is_relative_to(root) for root in roots):
        raise _refuse(
            where,
            f"{quote_value(parent)} is outside the profile's tree "
            f"({roots[0]}); extends may only name files inside it (or under "
            f"${PROFILE_ROOT_ENV})",
        )
    if parent_resolved in stack + (resolved,):
        chain = " -> ".join([p.name for p in stack + (resolved,)] + [parent_path.name])
        raise _refuse(where, f"extends cycle: {chain}")
    try:
        parent_is_file = parent_path.is_file()
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise _refuse(where, f"cannot use {quote_value(parent)} as a file path: {why}") from None
    if not parent_is_file:
        what = "not a regular file" if parent_path.exists() else "file not found"
        raise _refuse(where, f"{what}: {shown_path(parent)} (relative to {path.parent or '.'})")
    return parent_path, resolved


def _resolved(
    path: Path, parent_path: Path, parent: str, where: Location | None, ctx: _LoadContext
) -> tuple[Path, tuple[Path, ...], Path]:
    """``path`` resolved, the roots ``extends`` may read from, and ``parent_path`` resolved (refused if it cannot be)."""
    try:
        return path.resolve(), ctx.roots(), parent_path.resolve()
    except RuntimeError:  # Python 3.11's Path.resolve on a symlink loop
        raise _refuse(where, f"cannot use {quote_value(parent)} as a file path: symlink loop") from None
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the file system, …
        why = "symlink loop" if getattr(exc, "errno", None) == errno.ELOOP else (getattr(exc, "strerror", None) or exc)
        raise _refuse(where, f"cannot use {quote_value(parent)} as a file path: {why}") from None


def merge(base: Document, overlay: Document) -> Document:
    """Deep-merge ``overlay`` onto ``base``: mappings merge, everything else is replaced whole."""
    values = dict(base.values)
    keys = dict(base.keys)

    def drop(prefix: Path_) -> None:
        for table in (values, keys):
            for p in [p for p in table if p[: len(prefix)] == prefix and len(p) > len(prefix)]:
                del table[p]

    def walk(b: Any, o: Any, path: Path_) -> Any:
        if isinstance(b, dict) and isinstance(o, dict):
            out = dict(b)
            for k, v in o.items():
                sub = path + (k,)
                if k in b:
                    out[k] = walk(b[k], v, sub)
                else:
                    out[k] = v
                    _copy(sub)
                keys[sub] = overlay.keys.get(sub, keys.get(sub))
            values[path] = overlay.values.get(path, values.get(path))
            return out
        drop(path)
        _copy(path)
        return o

    def _copy(prefix: Path_) -> None:
        for table, src in ((values, overlay.values), (keys, overlay.keys)):
            for p, loc in src.items():
                if p[: len(prefix)] == prefix:
                    table[p] = loc

    data = walk(base.data, overlay.data, ())
    keys = {k: v for k, v in keys.items() if v is not None}
    values = {k: v for k, v in values.items() if v is not None}
    return Document(
        data,
        values,
        keys,
        base.files + [f for f in overlay.files if f not in base.files],
        base.env_texts + overlay.env_texts,
        base.raw_texts + overlay.raw_texts,
    )
