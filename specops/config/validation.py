"""Pydantic validation of a profile document, every error mapped back to the YAML node that caused it.

Besides pydantic's own errors: YAML booleans where a number belongs (pydantic would take ``true`` as 1),
unknown fields with a "did you mean", and enum values with the closest option.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from specops.config.credentials import credential_problems
from specops.config.located import Document, format_path, redact_problems
from specops.config.sections import Profile
from specops.errors import Problem, ProfileError


def validate_document(doc: Document) -> Profile:
    """Pydantic validation with every error mapped back to the YAML node that caused it, and no secret
    written into the profile's text (:mod:`specops.config.credentials`)."""
    problems = _boolean_number_problems(doc)
    profile = None
    try:
        profile = Profile.model_validate(doc.data)
    except ValidationError as exc:
        said = {p.field for p in problems}  # `port: false` is a boolean first, not a port below 1
        problems += [p for p in (_problem_from_pydantic(doc, err) for err in exc.errors()) if p.field not in said]
    said = {p.field for p in problems}  # a field pydantic refused already (spot_check.reference's password)
    problems = [p for p in credential_problems(doc.raw_texts) if p.field not in said] + problems
    if problems:
        raise ProfileError(redact_problems(problems, doc.env_texts))
    return profile


def _strip_annotated(annotation: Any) -> tuple[Any, list]:
    metadata: list = []
    while get_origin(annotation) is Annotated:
        metadata += list(getattr(annotation, "__metadata__", ()))
        annotation = get_args(annotation)[0]
    return annotation, metadata


def _boolean_number_problems(doc: Document) -> list[Problem]:
    """``port: true`` is not the port 1: YAML booleans where a number belongs (pydantic would take them)."""
    out: list[Problem] = []

    def walk(annotation: Any, value: Any, path: tuple, metadata: list) -> None:
        annotation, more = _strip_annotated(annotation)
        metadata = metadata + more
        if any(getattr(getattr(m, "func", None), "__name__", "") == "parse_duration" for m in metadata):
            return  # durations say it themselves
        origin, args = get_origin(annotation), get_args(annotation)
        if isinstance(value, bool):
            members = [_strip_annotated(a)[0] for a in (args if origin in (Union, type(int | None)) else (annotation,))]
            if bool not in members and any(m in (int, float) for m in members):
                kind = "an integer" if int in members else "a number"
                out.append(
                    Problem(
                        doc.locate(path), format_path(path), f"expected {kind}, not the boolean {str(value).lower()}"
                    )
                )
            return
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if isinstance(value, dict):
                for key, item in value.items():
                    f = annotation.model_fields.get(key) if isinstance(key, str) else None
                    if f is not None:
                        walk(f.annotation, item, path + (key,), list(f.metadata))
            return
        if origin in (Union, type(int | None)):
            for member in args:
                inner = _strip_annotated(member)[0]
                if (
                    isinstance(value, dict)
                    and ((isinstance(inner, type) and issubclass(inner, BaseModel)) or get_origin(inner) is dict)
                ) or (isinstance(value, list) and get_origin(inner) in (list, tuple)):
                    walk(member, value, path, [])
                    return
            return
        if origin is list and isinstance(value, list) and args:
            for i, item in enumerate(value):
                walk(args[0], item, path + (i,), [])
        elif origin is tuple and isinstance(value, list) and args and args[-1] is not Ellipsis:
            for i, (member, item) in enumerate(zip(args, value)):
                walk(member, item, path + (i,), [])
        elif origin is dict and isinstance(value, dict) and len(args) == 2:
            for key, item in value.items():
                walk(args[1], item, path + (key,), [])

    if isinstance(doc.data, dict):
        walk(Profile, doc.data, (), [])
    return out


def _problem_from_pydantic(doc: Document, err: dict) -> Problem:
    loc = _field_loc(doc.data, err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _fields_at(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
        msg = f"unknown field {loc[-1]!r}"
        msg += f"; did you mean {hint[0]!r}?" if hint else (f" (allowed: {', '.join(allowed)})" if allowed else "")
        return Problem(doc.locate(loc, key=True), format_path(loc), msg)
    if kind == "missing":
        return Problem(doc.locate(loc), format_path(loc), "required field is missing")
    msg = err["msg"]
    if kind.startswith("enum") or kind == "literal_error":
        got = err.get("input")
        options = re.findall(r"'([^']+)'", msg)
        hint = difflib.get_close_matches(str(got), options, n=1, cutoff=0.6) if options else []
        msg = f"invalid value {got!r}: {msg[0].lower() + msg[1:]}"
        if hint:
            msg += f"; did you mean {hint[0]!r}?"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    elif kind == "string_type" and isinstance(err.get("input"), bool):
        msg = (
            f"expected a string, but YAML reads this as the boolean {str(err['input']).lower()} "
            f"(yes/no/on/off/true/false are booleans): quote it"
        )
    return Problem(doc.locate(loc), format_path(loc), msg)


def _field_loc(data: Any, loc: tuple) -> tuple:
    """Pydantic's error location without its own steps (``function-before[...]``, ``tuple[int, ...]``, a tagged
    union's tag such as ``remote twin``): none is an identifier, as every field name is.

    A step is dropped only where the data has no such key, so a user's key spelled like one still counts.
    """
    out: list = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and not part.isidentifier():
            continue
        else:
            node = None
        out.append(part)
    return tuple(out)


def _fields_at(loc: tuple) -> list[str]:
    """Names of the fields allowed at ``loc`` (for "did you mean"), following nested models and lists."""
    model: Any = Profile
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _inner_model(field.annotation)
    return sorted(getattr(model, "model_fields", {}).keys())


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None
