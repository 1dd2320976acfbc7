"""YAML text as plain data that remembers where every value (and every mapping key) was written.

Profiles are kept in git and reviewed by people, so an error must point at the exact file, line and
column: :func:`parse` turns one YAML document into a :class:`Document` (data plus a map from field path to
source location), interpolates ``${ENV}``, and never lets a parser exception escape as anything but a
located :class:`ProfileError`. Text that ``${VAR}`` put into a value is remembered
(:class:`~specops.redact.EnvText`) so every printed form can hide it, and so is every string as written
(:class:`RawText`), for :mod:`specops.config.credentials` to refuse secrets written into a profile. Reading
files and ``extends`` are :mod:`specops.config.yamlsource`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from specops.errors import Location, Problem, ProfileError
from specops.redact import EnvText, public_vars, redact_message

Path_ = tuple  # a field path: ("speculative", "ngram", "min") or ("fallback", "chain", 1)

#: ``${VAR}``, ``${VAR:-default}`` (groups: name, default) or ``$$`` (a literal ``$``, no groups).
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\$")
#: What a shell user may write besides: ``$VAR``, or ``${...}`` in a form ENV_REFERENCE does not take
#: (``${VAR-x}``, ``${VAR:=x}``, ``${VAR:?x}``, ...): groups bare name, or the braces' text and the ``}``.
OTHER_REFERENCE = re.compile(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([^}]*)(\}?))")
#: A profile is a few dozen values; these bounds stop hostile YAML (deep nesting, "billion laughs" alias
#: bombs, self-referencing aliases) from exhausting the stack or the CPU of a CI runner.
MAX_DEPTH = 32
MAX_VALUES = 10_000
_PLAIN_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


@dataclass(frozen=True)
class RawText:
    """A string of a profile as written, before ``${VAR}`` was filled in (only strings with ``$`` or ``@``)."""

    path: Path_
    location: Location
    text: str
    #: the variables it reads that are not on the public allow-list (:func:`specops.redact.public_vars`)
    private_vars: tuple[str, ...] = ()


@dataclass
class Document:
    """Plain data from YAML plus where each value (and each mapping key) was written."""

    data: Any
    values: dict[Path_, Location] = field(default_factory=dict)
    keys: dict[Path_, Location] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    #: values that ``${VAR}`` filled from the environment (variables on the public allow-list excluded)
    env_texts: list[EnvText] = field(default_factory=list)
    #: strings with ``$`` or ``@`` as written, of every file merged in (overridden values included)
    raw_texts: list[RawText] = field(default_factory=list)

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


def shown_path(text: str) -> str:
    """A path from a profile as messages print it: as written, unless it is long or has odd characters."""
    return text if len(text) <= 200 and text.isprintable() else quote_value(text)


def redact_problems(problems: Iterable[Problem], texts: Iterable[EnvText]) -> list[Problem]:
    """``problems`` with every secret value that ``${VAR}`` interpolated hidden in their messages."""
    texts = list(texts)
    return [Problem(p.location, p.field, redact_message(p.message, p.field, texts, _format_field)) for p in problems]


def _format_field(path: Path_) -> str:
    return format_path(path)


def location(file: str, mark: yaml.Mark | None) -> Location:
    """Where a YAML node starts, 1-based (line 1, column 1 when the parser gave no mark)."""
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
        self.raw_texts: list[RawText] = []
        self.values: dict[Path_, Location] = {}
        self.keys: dict[Path_, Location] = {}
        self.problems: list[Problem] = []
        self._constructor = yaml.SafeLoader("")  # only used to construct scalars (ints, bools, …)
        self._open: set[int] = set()  # collections being built (to refuse recursive aliases)
        self._count = 0

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.values[path] = location(self.file, node.start_mark)
        self._count += 1
        if self._count > MAX_VALUES:
            raise ProfileError(
                [
                    Problem(
                        location(self.file, node.start_mark),
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
                self.keys[path + (key,)] = location(self.file, key_node.start_mark)
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
        if isinstance(value, str) and ("$" in value or "@" in value):
            names = [m.group(1) for m in ENV_REFERENCE.finditer(value) if m.group(1)]
            private = tuple(dict.fromkeys(n for n in names if n not in self.public))
            self.raw_texts.append(RawText(path, location(self.file, node.start_mark), value, private))
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
        stays whole, ``0123`` and ``yes`` stay strings (a numeric field still converts ``"8000"``). As in a
        shell, ``:-`` takes the default when the variable is unset or empty. Every other form a shell reads
        (``$VAR``, ``${VAR-x}``, ``${VAR:=x}``, ``${VAR:?x}``, ...) is a located problem naming the supported
        one: kept as text, ``api_key: $KEY`` would make the guessable text ``$KEY`` the key.
        """
        missing: list[str] = []
        out: list[str] = []
        spans: list[tuple[int, int, str]] = []
        length, pos = 0, 0
        for m in ENV_REFERENCE.finditer(text):
            self._refuse_other_references(text[pos : m.start()], node, path)
            out.append(text[pos : m.start()])
            length += m.start() - pos
            pos = m.end()
            if m.group(0) == "$$":
                piece = "$"
            else:
                name, default = m.group(1), m.group(2)
                if name in self.env and (str(self.env[name]) or default is None):
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
        self._refuse_other_references(text[pos:], node, path)
        out.append(text[pos:])
        result = "".join(out)
        for name in missing:
            self._problem(
                path, node, f"environment variable ${{{name}}} is not set (set it, or write ${{{name}:-default}})"
            )
        if spans:
            self.env_texts.append(EnvText(path, result, tuple(spans)))
        return result

    def _refuse_other_references(self, text: str, node: yaml.Node, path: Path_) -> None:
        """A problem for each reference in ``text`` (the text between supported ones) that specops does not
        interpolate; a default is never quoted (it may be a secret)."""
        for m in OTHER_REFERENCE.finditer(text):
            bare, braced, closed = m.groups()
            op = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(:?[-=?+])", braced or "")
            if bare:
                why = f"${bare} is not interpolated: write ${{{bare}}} (or $${bare} for the text ${bare})"
            elif not closed or op is None:
                why = "a ${ that is not ${VAR} or ${VAR:-default}: write one of them ($$ for a literal $)"
            else:
                name, sign = op.groups()
                instead = {
                    "-": f"${{{name}:-…}} (the default is taken when {name} is unset or empty)",
                    "=": f"${{{name}:-…}}: specops never sets a variable",
                    "?": f"${{{name}}}: an unset variable is already an error",
                    "+": "the text itself",
                }[sign[-1]]
                why = f"${{{name}{sign}…}} is not supported: write {instead}"
            self._problem(path, node, why)

    def _problem(self, path: Path_, node: yaml.Node, message: str) -> None:
        self.problems.append(Problem(location(self.file, node.start_mark), format_path(path), message))


def compose(text: str, file: str) -> yaml.Node:
    """The YAML node tree of one document; every syntax error becomes a located ProfileError."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "invalid YAML"
        raise ProfileError([Problem(location(file, mark), "", f"YAML syntax error: {what}")]) from None
    except yaml.YAMLError as exc:  # e.g. several documents in one file
        raise ProfileError([Problem(Location(file, 1, 1), "", f"YAML error: {exc}")]) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProfileError([Problem(Location(file, 1, 1), "", f"cannot read YAML: {exc}")]) from None
    except RecursionError:
        raise ProfileError([Problem(Location(file, 1, 1), "", "YAML nested too deeply")]) from None
    if node is None:
        raise ProfileError([Problem(Location(file, 1, 1), "", "the file is empty")])
    return node


def build_document(node: yaml.Node, file: str, env: Mapping[str, str] | None) -> Document:
    """The data of a composed profile document with its locations; every problem found is raised together."""
    builder = _Builder(file, os.environ if env is None else env)
    data = builder.build(node, ())
    if builder.problems:
        raise ProfileError(builder.problems)
    if not isinstance(data, dict):
        raise ProfileError(
            [
                Problem(
                    location(file, node.start_mark),
                    "",
                    f"a profile must be a mapping of fields, not {type(data).__name__}",
                )
            ]
        )
    return Document(data, builder.values, builder.keys, [file], builder.env_texts, builder.raw_texts)


def parse(text: str, file: str, env: Mapping[str, str] | None = None) -> Document:
    """Parse one YAML document; every syntax error becomes a located ProfileError."""
    return build_document(compose(text, file), file, env)
