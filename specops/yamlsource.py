"""YAML documents that remember where every value came from.

Profiles are kept in git and reviewed by people, so an error must point at the exact file, line and
column. This module turns YAML into plain Python data plus a map from field path to source location,
resolves ``extends:`` overlays (deep merge, overlay wins, lists replaced whole) and ``${ENV}``
interpolation, and never lets a parser exception escape as anything but a located :class:`ProfileError`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import Location, Problem, ProfileError

Path_ = tuple  # a field path: ("speculative", "ngram", "min") or ("fallback", "chain", 1)

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\$")
MAX_EXTENDS_DEPTH = 16
#: A profile is a few dozen values; these bounds stop hostile YAML (deep nesting, "billion laughs" alias
#: bombs, self-referencing aliases) from exhausting the stack or the CPU of a CI runner.
MAX_DEPTH = 32
MAX_VALUES = 10_000
_PLAIN_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


@dataclass
class Document:
    """Plain data from YAML plus where each value (and each mapping key) was written."""

    data: Any
    values: dict[Path_, Location] = field(default_factory=dict)
    keys: dict[Path_, Location] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

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


def _loc(file: str, mark: yaml.Mark | None) -> Location:
    if mark is None:
        return Location(file, 1, 1)
    return Location(file, mark.line + 1, mark.column + 1)


class _Builder:
    """Converts a composed node tree to data, recording locations and interpolating ``${VAR}``."""

    def __init__(self, file: str, env: Mapping[str, str]):
        self.file = file
        self.env = env
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
            raise ProfileError([Problem(_loc(self.file, node.start_mark), format_path(path),
                                        f"more than {MAX_VALUES} values: is an alias expanded many times?")])
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
                    self._problem(path + (key,), key_node,
                                  f"duplicate key {key!r} (first defined at line {first.line})")
                    continue
                self.keys[path + (key,)] = _loc(self.file, key_node.start_mark)
                out[key] = self.build(value_node, path + (key,))
            return out
        return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]

    def _scalar(self, node: yaml.ScalarNode, path: Path_) -> Any:
        try:
            value = self._constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError:
            self._problem(path, node, f"unsupported YAML tag {node.tag!r}; remove the tag (quote the value "
                                      f"to keep it as text)")
            return None
        except Exception:  # PyYAML's scalar constructors fail in many ways (`!!int ''` raises IndexError)
            self._problem(path, node, f"{node.value!r} is not a valid {node.tag.rsplit(':', 1)[-1]}")
            return None
        if isinstance(value, str) and "$" in value:
            return self._interpolate(value, node, path)
        if not isinstance(value, (str, int, float, bool, type(None))):
            # timestamps, binary, sets: profiles never need them and they would surprise later code
            self._problem(path, node, f"unsupported YAML value of type {type(value).__name__}; quote it")
            return str(node.value)
        return value

    def _interpolate(self, text: str, node: yaml.Node, path: Path_) -> Any:
        missing: list[str] = []

        def sub(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            name, default = m.group(1), m.group(2)
            if name in self.env:
                return self.env[name]
            if default is not None:
                return default
            missing.append(name)
            return ""

        result = _ENV.sub(sub, text)
        for name in missing:
            self._problem(path, node, f"environment variable ${{{name}}} is not set "
                                      f"(set it, or write ${{{name}:-default}})")
        if result != text and _ENV.fullmatch(text):
            # a value that is only `${VAR}` takes the type YAML would give the text (port: ${PORT} → int)
            try:
                typed = yaml.safe_load(result) if result.strip() else result
            except Exception:  # not valid YAML on its own: keep the text
                return result
            return typed if isinstance(typed, (str, int, float, bool)) else result
        return result

    def _problem(self, path: Path_, node: yaml.Node, message: str) -> None:
        self.problems.append(Problem(_loc(self.file, node.start_mark), format_path(path), message))


def parse(text: str, file: str, env: Mapping[str, str] | None = None) -> Document:
    """Parse one YAML document; every syntax error becomes a located ProfileError."""
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
    builder = _Builder(file, os.environ if env is None else env)
    data = builder.build(node, ())
    if builder.problems:
        raise ProfileError(builder.problems)
    if not isinstance(data, dict):
        raise ProfileError([Problem(_loc(file, node.start_mark), "",
                                    f"a profile must be a mapping of fields, not {type(data).__name__}")])
    return Document(data, builder.values, builder.keys, [file])


def read_text(path: Path, display: str, where: Location | None = None, field_: str = "") -> str:
    """Read a file as UTF-8, turning I/O failures into located problems."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        msg = f"file not found: {display}"
    except IsADirectoryError:
        msg = f"is a directory, not a file: {display}"
    except UnicodeDecodeError:
        msg = f"not UTF-8 text: {display}"
    except OSError as exc:
        msg = f"cannot read {display}: {exc.strerror or exc}"
    raise ProfileError([Problem(where or Location(display, 1, 1), field_, msg)])


def load(path: str | os.PathLike, env: Mapping[str, str] | None = None) -> Document:
    """Load a profile file and everything it ``extends``, merged into one located document."""
    return _load(Path(path), str(path), env, stack=())


def _load(path: Path, display: str, env, stack: tuple[Path, ...]) -> Document:
    text = read_text(path, display)
    doc = parse(text, display, env)
    parents = doc.data.pop("extends", None)
    if parents is None:
        return doc
    ext_loc = doc.keys.get(("extends",))
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ProfileError([Problem(ext_loc, "extends", "must be a file path or a list of file paths")])
    resolved = path.resolve()
    if len(stack) >= MAX_EXTENDS_DEPTH:
        raise ProfileError([Problem(ext_loc, "extends", f"more than {MAX_EXTENDS_DEPTH} levels of extends")])
    merged: Document | None = None
    for i, parent in enumerate(parents):
        parent_path = (path.parent / parent)
        where = doc.values.get(("extends", i) if (("extends", i) in doc.values) else ("extends",), ext_loc)
        try:
            parent_resolved, parent_is_file = parent_path.resolve(), parent_path.is_file()
        except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the file system, …
            raise ProfileError([Problem(where, "extends", f"cannot use {parent!r} as a file path: "
                                                          f"{getattr(exc, 'strerror', None) or exc}")]) from None
        if parent_resolved in stack + (resolved,):
            chain = " -> ".join([p.name for p in stack + (resolved,)] + [parent_path.name])
            raise ProfileError([Problem(where, "extends", f"extends cycle: {chain}")])
        if not parent_is_file:
            raise ProfileError([Problem(where, "extends", f"file not found: {parent} "
                                                          f"(relative to {path.parent or '.'})")])
        base = _load(parent_path, os.path.relpath(parent_path), env, stack + (resolved,))
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
    return Document(data, values, keys, base.files + [f for f in overlay.files if f not in base.files])
