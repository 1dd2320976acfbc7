"""YAML documents that remember where every value came from.

Profiles are kept in git and reviewed by people, so an error must point at the exact file, line and
column. This module turns YAML into plain Python data plus a map from field path to source location,
resolves ``extends:`` overlays (deep merge, overlay wins, lists replaced whole) and ``${ENV}``
interpolation, and never lets a parser exception escape as anything but a located :class:`ProfileError`.

Reading is bounded: a profile is a regular file of at most :data:`MAX_PROFILE_BYTES`; ``extends`` may only
name files inside the profile's tree (:func:`profile_roots`), and a file it names is quoted in messages only
once it reads as a profile (a YAML mapping of profile fields), so ``extends: /etc/shadow`` can never print
a line of it. Text that ``${VAR}`` put into a value is remembered (:class:`~specops.redact.EnvText`) so every
printed form can hide it.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specops.errors import Location, Problem, ProfileError
from specops.redact import EnvText, public_vars, redact_message

Path_ = tuple  # a field path: ("speculative", "ngram", "min") or ("fallback", "chain", 1)

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\$")
MAX_EXTENDS_DEPTH = 16
#: A profile is a few dozen values; these bounds stop hostile YAML (deep nesting, "billion laughs" alias
#: bombs, self-referencing aliases) from exhausting the stack or the CPU of a CI runner.
MAX_DEPTH = 32
MAX_VALUES = 10_000
#: Profiles are a few KiB; anything larger is refused before it is parsed (and /dev/zero is no file).
MAX_PROFILE_BYTES = 1 << 20
#: Extra folders ``extends`` may read from (``os.pathsep``-separated), besides the profile's own tree.
PROFILE_ROOT_ENV = "SPECOPS_PROFILE_ROOT"
_PLAIN_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


@dataclass
class Document:
    """Plain data from YAML plus where each value (and each mapping key) was written."""

    data: Any
    values: dict[Path_, Location] = field(default_factory=dict)
    keys: dict[Path_, Location] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    #: values that ``${VAR}`` filled from the environment (variables on the public allow-list excluded)
    env_texts: list[EnvText] = field(default_factory=list)

    def locate(self, path: Path_, *, key: bool = False) -> Location | None:
        """The most precise known location for ``path``: the value itself, else its nearest parent."""
        path = tuple(path)
        if key and path in self.keys:
            return self.keys[path]
        while True:
            if path in self.values:
                return self.values[path]
            if path in self.keys:
                return self.keys[path]
            if not path:
                return None
            path = path[:-1]


def format_path(path: Path_) -> str:
    """``("fallback", "chain", 1)`` → ``fallback.chain[1]``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def quote_value(value: str, limit: int = 40) -> str:
    """``repr(value)`` for a message, shortened: a 5000-digit number must not flood a CI log."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…" + text[0]


def _shown_path(text: str) -> str:
    """A path from a profile as messages print it: as written, unless it is long or has odd characters."""
    return text if len(text) <= 200 and text.isprintable() else quote_value(text)


def redact_problems(problems: Iterable[Problem], texts: Iterable[EnvText]) -> list[Problem]:
    """``problems`` with every secret value that ``${VAR}`` interpolated hidden in their messages."""
    texts = list(texts)
    return [Problem(p.location, p.field, redact_message(p.message, p.field, texts, _format_field)) for p in problems]


def _format_field(path: Path_) -> str:
    return format_path(path)


def _loc(file: str, mark: yaml.Mark | None) -> Location:
    if mark is None:
        return Location(file, 1, 1)
    return Location(file, mark.line + 1, mark.column + 1)


class _Builder:
    """Converts a composed node tree to data, recording locations and interpolating ``${VAR}``."""

    def __init__(self, file: str, env: Mapping[str, str]):
        self.file = file
        self.env = env
        self.public = public_vars(env)
        self.env_texts: list[EnvText] = []
        self.values: dict[Path_, Location] = {}
        self.keys: dict[Path_, Location] = {}
        self.problems: list[Problem] = []
        self._constructor = yaml.SafeLoader("")  # only used to construct scalars (ints, bools, …)
        self._open: set[int] = set()  # collections being built (to refuse recursive aliases)
        self._count = 0

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.values[path] = _loc(self.file, node.start_mark)
        self._count += 1
        if self._count > MAX_VALUES:
            raise ProfileError(
                [
                    Problem(
                        _loc(self.file, node.start_mark),
                        format_path(path),
                        f"more than {MAX_VALUES} values: is an alias expanded many times?",
                    )
                ]
            )
        if len(path) > MAX_DEPTH:
            self._problem(path, node, f"nested more than {MAX_DEPTH} levels deep")
            return None
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if node.tag not in _PLAIN_COLLECTION_TAGS:  # !!set, !!omap, !!python/..., !custom
                self._problem(path, node, f"unsupported YAML tag {node.tag!r}; remove the tag")
                return None
            if id(node) in self._open:
                self._problem(path, node, "an alias refers to a value that contains it (recursive alias)")
                return None
            self._open.add(id(node))
            try:
                return self._collection(node, path)
            finally:
                self._open.discard(id(node))
        return self._scalar(node, path)

    def _collection(self, node: yaml.Node, path: Path_) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    self._problem(path, key_node, "YAML merge keys (<<) are not supported; use `extends:`")
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    self._problem(path, key_node, "mapping keys must be plain strings")
                    continue
                key = key_node.value
                if key in out:
                    first = self.keys[path + (key,)]
                    self._problem(
                        path + (key,), key_node, f"duplicate key {key!r} (first defined at line {first.line})"
                    )
                    continue
                self.keys[path + (key,)] = _loc(self.file, key_node.start_mark)
                out[key] = self.build(value_node, path + (key,))
            return out
        return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]

    def _scalar(self, node: yaml.ScalarNode, path: Path_) -> Any:
        try:
            value = self._constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError:
            self._problem(
                path, node, f"unsupported YAML tag {node.tag!r}; remove the tag (quote the value to keep it as text)"
            )
            return None
        except Exception:  # PyYAML's scalar constructors fail in many ways (`!!int ''` raises IndexError)
            self._problem(path, node, f"{quote_value(node.value)} is not a valid {node.tag.rsplit(':', 1)[-1]}")
            return None
        if isinstance(value, str) and "$" in value:
            return self._interpolate(value, node, path)
        if not isinstance(value, (str, int, float, bool, type(None))):
            # timestamps, binary, sets: profiles never need them and they would surprise later code
            self._problem(path, node, f"unsupported YAML value of type {type(value).__name__}; quote it")
            return str(node.value)
        return value

    def _interpolate(self, text: str, node: yaml.Node, path: Path_) -> str:
        """``text`` with ``${VAR}``, ``${VAR:-default}`` and ``$$`` replaced; the result is always text.

        The values go into the scalar's text, never back through the YAML parser: ``API_KEY="s3cret #prod"``
        stays whole, ``0123`` and ``yes`` stay strings (a numeric field still converts ``"8000"``).
        """
        missing: list[str] = []
        out: list[str] = []
        spans: list[tuple[int, int, str]] = []
        length, pos = 0, 0
        for m in _ENV.finditer(text):
            out.append(text[pos : m.start()])
            length += m.start() - pos
            pos = m.end()
            if m.group(0) == "$$":
                piece = "$"
            else:
                name, default = m.group(1), m.group(2)
                if name in self.env:
                    piece = str(self.env[name])
                    if piece and name not in self.public:
                        spans.append((length, length + len(piece), name))
                elif default is not None:
                    piece = default
                else:
                    missing.append(name)
                    piece = ""
            out.append(piece)
            length += len(piece)
        out.append(text[pos:])
        result = "".join(out)
        for name in missing:
            self._problem(
                path, node, f"environment variable ${{{name}}} is not set (set it, or write ${{{name}:-default}})"
            )
        if spans:
            self.env_texts.append(EnvText(path, result, tuple(spans)))
        return result

    def _problem(self, path: Path_, node: yaml.Node, message: str) -> None:
        self.problems.append(Problem(_loc(self.file, node.start_mark), format_path(path), message))


def _compose(text: str, file: str) -> yaml.Node:
    """The YAML node tree of one document; every syntax error becomes a located ProfileError."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "invalid YAML"
        raise ProfileError([Problem(_loc(file, mark), "", f"YAML syntax error: {what}")]) from None
    except yaml.YAMLError as exc:  # e.g. several documents in one file
        raise ProfileError([Problem(Location(file, 1, 1), "", f"YAML error: {exc}")]) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProfileError([Problem(Location(file, 1, 1), "", f"cannot read YAML: {exc}")]) from None
    except RecursionError:
        raise ProfileError([Problem(Location(file, 1, 1), "", "YAML nested too deeply")]) from None
    if node is None:
        raise ProfileError([Problem(Location(file, 1, 1), "", "the file is empty")])
    return node


def _build(node: yaml.Node, file: str, env: Mapping[str, str] | None) -> Document:
    builder = _Builder(file, os.environ if env is None else env)
    data = builder.build(node, ())
    if builder.problems:
        raise ProfileError(builder.problems)
    if not isinstance(data, dict):
        raise ProfileError(
            [
                Problem(
                    _loc(file, node.start_mark), "", f"a profile must be a mapping of fields, not {type(data).__name__}"
                )
            ]
        )
    return Document(data, builder.values, builder.keys, [file], builder.env_texts)


def parse(text: str, file: str, env: Mapping[str, str] | None = None) -> Document:
    """Parse one YAML document; every syntax error becomes a located ProfileError."""
    return _build(_compose(text, file), file, env)


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


def _profile_fields() -> frozenset[str]:
    from specops.config.profile import Profile  # here: profile imports this module

    return frozenset(Profile.model_fields) | {"extends"}


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

    name = _shown_path(name)
    try:
        node = _compose(text, display)
    except ProfileError as exc:
        if exc.problems[0].message == "the file is empty":
            raise
        loc = exc.problems[0].location
        at = f" at line {loc.line}, column {loc.column}" if loc else ""
        raise refuse(
            f"{name} is not a specops profile: not valid YAML{at} (details are not shown for a file "
            f"that does not read as a profile)"
        ) from None
    fields = ctx.fields if ctx.fields is not None else _profile_fields()
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
            _loc(display, key.start_mark),
            "",
        )
    return _build(node, display, ctx.env)


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
    parents = doc.data.pop("extends", None)
    if parents is None:
        return doc
    ext_loc = doc.keys.get(("extends",))
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ProfileError([Problem(ext_loc, "extends", "must be a file path or a list of file paths")])
    if len(stack) >= MAX_EXTENDS_DEPTH:
        raise ProfileError([Problem(ext_loc, "extends", f"more than {MAX_EXTENDS_DEPTH} levels of extends")])
    merged: Document | None = None
    for i, parent in enumerate(parents):
        parent_path = path.parent / parent
        where = doc.values.get(("extends", i) if (("extends", i) in doc.values) else ("extends",), ext_loc)
        try:
            resolved = path.resolve()
            roots = ctx.roots()
            parent_resolved = parent_path.resolve()
        except RuntimeError:  # Python 3.11's Path.resolve on a symlink loop
            raise ProfileError(
                [Problem(where, "extends", f"cannot use {quote_value(parent)} as a file path: symlink loop")]
            ) from None
        except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the file system, …
            why = (
                "symlink loop"
                if getattr(exc, "errno", None) == errno.ELOOP
                else (getattr(exc, "strerror", None) or exc)
            )
            raise ProfileError(
                [Problem(where, "extends", f"cannot use {quote_value(parent)} as a file path: {why}")]
            ) from None
        if not any(parent_resolved.is_relative_to(root) for root in roots):
            raise ProfileError(
                [
                    Problem(
                        where,
                        "extends",
                        f"{quote_value(parent)} is outside the profile's tree "
                        f"({roots[0]}); extends may only name files inside it (or under "
                        f"${PROFILE_ROOT_ENV})",
                    )
                ]
            )
        if parent_resolved in stack + (resolved,):
            chain = " -> ".join([p.name for p in stack + (resolved,)] + [parent_path.name])
            raise ProfileError([Problem(where, "extends", f"extends cycle: {chain}")])
        try:
            parent_is_file = parent_path.is_file()
        except (OSError, ValueError) as exc:
            raise ProfileError(
                [
                    Problem(
                        where,
                        "extends",
                        f"cannot use {quote_value(parent)} as a file path: {getattr(exc, 'strerror', None) or exc}",
                    )
                ]
            ) from None
        if not parent_is_file:
            what = "not a regular file" if parent_path.exists() else "file not found"
            raise ProfileError(
                [Problem(where, "extends", f"{what}: {_shown_path(parent)} (relative to {path.parent or '.'})")]
            )
        base = _load(parent_path, os.path.relpath(parent_path), ctx, stack + (resolved,), (where, parent))
        merged = base if merged is None else merge(merged, base)
    for p in [k for k in doc.values if k and k[0] == "extends"]:
        doc.values.pop(p)
    doc.keys.pop(("extends",), None)
    return doc if merged is None else merge(merged, doc)  # `extends: []` extends nothing


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
    )
