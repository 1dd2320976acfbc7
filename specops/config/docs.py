"""The documentation's profile reference (docs/reference/profile.md), generated from the pydantic models (a test
keeps the page in sync).

Run ``python -m specops.config.docs`` to print it, or ``python -m specops.config.docs --write`` to replace the section
between the ``<!-- profile-reference:start -->`` and ``<!-- profile-reference:end -->`` markers of that page (or of
the file named after ``--write``).
"""

from __future__ import annotations

import sys
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from specops.config.durations import format_duration
from specops.config.sections import Profile

PAGE = "docs/reference/profile.md"  # relative to the repository root
START = "<!-- profile-reference:start -->"
END = "<!-- profile-reference:end -->"


def _type_name(annotation: Any, metadata: list) -> str:
    if any(getattr(m, "func", None).__name__ == "parse_duration" for m in metadata if hasattr(m, "func")):
        return "duration"
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is None:
        if isinstance(annotation, type):
            if issubclass(annotation, BaseModel):
                return "mapping"
            return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "Method": "method"}.get(
                annotation.__name__, annotation.__name__
            )
        return str(annotation)
    name = getattr(origin, "__name__", str(origin))
    if name in ("Union", "UnionType") or str(origin) == "typing.Union":
        parts = [_type_name(a, []) for a in args if a is not type(None)]
        return " \\| ".join(dict.fromkeys(parts)) + (" \\| null" if type(None) in args else "")
    if name == "Literal":
        return " \\| ".join(f"`{a}`" for a in args)
    if name == "list":
        return f"list of {_type_name(args[0], getattr(args[0], '__metadata__', []))}" if args else "list"
    if name == "tuple":
        return "[" + ", ".join(_type_name(a, []) for a in args) + "]"
    if name == "dict":
        return "mapping"
    if name == "Annotated":
        return _type_name(args[0], list(annotation.__metadata__))
    return name


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`" if value not in ({}, []) else f"`{'{}' if value == {} else '[]'}`"
    value = field.default
    if value is None or value is PydanticUndefined:
        return "unset"
    if any(hasattr(m, "func") and m.func.__name__ == "parse_duration" for m in field.metadata):
        return f"`{format_duration(value)}`"
    if hasattr(value, "value"):
        value = value.value
    return '`""`' if value == "" else f"`{value}`"


def _rows(model: type[BaseModel], prefix: str, out: list[str], sections: list[tuple[str, type[BaseModel]]]):
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        sub = _submodel(annotation)
        if sub is not None:  # a section that is always there: its fields are its rows
            sections.append((path, sub))
            continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{path}` | {_type_name(annotation, list(field.metadata))} | {_default(field)} | {desc} |")
        # an optional section (`X | None`) or a list of entries (`list[X]`, `list[str | X]`): the field has its
        # row, and the entry's own fields a section of their own (`path[]` for a list's entries)
        for inner, suffix in _inner_models(annotation):
            sections.append((path + suffix, inner))


def _submodel(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _inner_models(annotation, suffix: str = "") -> list[tuple[type[BaseModel], str]]:
    """The models inside an optional or list annotation (``X | None``, ``list[X] | None``, ``list[str | X]``),
    each with the suffix its section's path takes (``[]`` inside a list)."""
    if get_origin(annotation) in (list, tuple):
        suffix = "[]"
    found: list[tuple[type[BaseModel], str]] = []
    for arg in get_args(annotation):
        model = _submodel(arg)
        found += [(model, suffix)] if model is not None else _inner_models(arg, suffix)
    return list(dict.fromkeys(found))


def profile_reference() -> str:
    """Markdown tables, one per profile section, from the models' fields and descriptions."""
    lines = [
        "Every field of a profile, generated from the same pydantic models that validate it "
        "(`specops schema` prints the JSON Schema). Durations accept seconds or `500ms`, `30s`, `10m`, `1h30m`.",
        "",
        "| field | type | default | meaning |",
        "|---|---|---|---|",
        "| `extends` | string \\| list of string | unset | Base profile(s) deep-merged under this one "
        "(paths relative to this file, inside its git work tree or a folder in `$SPECOPS_PROFILE_ROOT`; "
        "mappings merge, lists and scalars are replaced). |",
    ]
    sections: list[tuple[str, type[BaseModel]]] = []
    _rows(Profile, "", lines, sections)
    while sections:
        path, model = sections.pop(0)
        doc = (model.__doc__ or "").strip().splitlines()[0]
        rows: list[str] = []
        nested: list[tuple[str, type[BaseModel]]] = []
        _rows(model, f"{path}.", rows, nested)
        lines += ["", f"**`{path}`** — {doc}"]
        if rows:  # a section of subsections only has no table of its own
            lines += ["", "| field | type | default | meaning |", "|---|---|---|---|", *rows]
        sections = nested + sections
    return "\n".join(lines) + "\n"


def replace_section(text: str, body: str) -> str:
    start, end = text.index(START) + len(START), text.index(END)
    return text[:start] + "\n" + body + text[end:]


def main(argv: list[str]) -> int:
    body = profile_reference()
    if argv[:1] == ["--write"] and len(argv) <= 2:
        path = argv[1] if len(argv) == 2 else PAGE
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if START not in text or END not in text:
            sys.stderr.write(f"error: {path}: no {START} ... {END} markers; the reference lives in {PAGE}\n")
            return 1
        with open(path, "w", encoding="utf-8") as f:
            f.write(replace_section(text, body))
        return 0
    sys.stdout.write(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
