"""``specops schema``: a usable JSON Schema that accepts every ready-made profile and rejects typos.

The `jsonschema` package is not a dependency, so a small validator for exactly the keywords the schema
uses lives here; a test makes sure the schema uses no keyword it does not understand (so nothing is
silently skipped). When `jsonschema` is installed, it checks the same things independently.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import unavailable
from support_cli import ROOT, ready_made_profiles, run

from specops.config import yamlsource
from specops.paths import builtin_env

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$defs", "deprecated"}
VALIDATION = {
    "$ref",
    "anyOf",
    "type",
    "enum",
    "const",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "properties",
    "required",
    "additionalProperties",
    "minProperties",
    "maxProperties",
}
TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


@pytest.fixture(scope="module")
def schema() -> dict:
    res = run("schema")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def errors(schema: dict, data, node: dict | None = None, path: str = "$") -> list[str]:
    """Every way ``data`` violates ``node`` (default: the whole schema)."""
    node = schema if node is None else node
    out: list[str] = []
    if "$ref" in node:
        out += errors(schema, data, schema["$defs"][node["$ref"].rsplit("/", 1)[-1]], path)
    if "anyOf" in node:
        branches = [errors(schema, data, sub, path) for sub in node["anyOf"]]
        if all(branches):
            out.append(f"{path}: matches no alternative ({'; '.join(b[0] for b in branches)})")
    if "type" in node:
        t = TYPES[node["type"]]
        if not isinstance(data, t) or (node["type"] in ("integer", "number") and isinstance(data, bool)):
            return out + [f"{path}: {data!r} is not {node['type']}"]
    if "enum" in node and data not in node["enum"]:
        out.append(f"{path}: {data!r} not in {node['enum']}")
    if "const" in node and data != node["const"]:
        out.append(f"{path}: {data!r} != {node['const']!r}")
    if isinstance(data, str):
        if "pattern" in node and not re.search(node["pattern"], data):
            out.append(f"{path}: {data!r} does not match {node['pattern']}")
        if len(data) < node.get("minLength", 0) or len(data) > node.get("maxLength", float("inf")):
            out.append(f"{path}: length of {data!r}")
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        for key, ok in (
            ("minimum", lambda lim: data >= lim),
            ("maximum", lambda lim: data <= lim),
            ("exclusiveMinimum", lambda lim: data > lim),
            ("exclusiveMaximum", lambda lim: data < lim),
        ):
            if key in node and not ok(node[key]):
                out.append(f"{path}: {data} violates {key} {node[key]}")
    if isinstance(data, list):
        if not node.get("minItems", 0) <= len(data) <= node.get("maxItems", float("inf")):
            out.append(f"{path}: {len(data)} items")
        prefix = node.get("prefixItems", [])
        for i, item in enumerate(data):
            sub = prefix[i] if i < len(prefix) else node.get("items")
            if sub is not None:
                out += errors(schema, item, sub, f"{path}[{i}]")
    if isinstance(data, dict):
        if not node.get("minProperties", 0) <= len(data) <= node.get("maxProperties", float("inf")):
            out.append(f"{path}: {len(data)} keys")
        props = node.get("properties", {})
        for key in node.get("required", []):
            if key not in data:
                out.append(f"{path}: missing {key}")
        for key, value in data.items():
            if key in props:
                out += errors(schema, value, props[key], f"{path}.{key}")
            elif node.get("additionalProperties") is False:
                out.append(f"{path}: unknown key {key!r}")
            elif isinstance(node.get("additionalProperties"), dict):
                out += errors(schema, value, node["additionalProperties"], f"{path}.{key}")
    return out


def _keywords(node, out: set):
    if isinstance(node, dict):
        for key, value in node.items():
            out.add(key)
            if key in ("properties", "$defs"):
                for sub in value.values():
                    _keywords(sub, out)
            elif key not in ("enum", "const", "default", "examples", "required"):
                _keywords(value, out)
    elif isinstance(node, list):
        for item in node:
            _keywords(item, out)
    return out


def test_schema_is_a_2020_12_object_schema(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert set(schema["required"]) == {"name", "backend", "model"}
    for name in ("extends", "name", "backend", "engine", "model", "speculative", "gpus", "server", "fallback"):
        assert name in schema["properties"], name
    for name, section in schema["$defs"].items():
        if section.get("type") == "object":
            assert section["additionalProperties"] is False, f"{name} must refuse unknown keys, like the loader"


def test_schema_uses_only_understood_keywords(schema):
    unknown = _keywords(schema, set()) - ANNOTATIONS - VALIDATION
    # property names appear as keys of "properties" dicts and are skipped above; what is left are keywords
    assert not unknown, f"the validator in this test does not understand {sorted(unknown)}"


def test_every_ref_resolves(schema):
    refs = set(re.findall(r'"\$ref": "([^"]+)"', json.dumps(schema)))
    assert refs, "expected shared definitions"
    for ref in refs:
        assert ref.startswith("#/$defs/") and ref.rsplit("/", 1)[-1] in schema["$defs"], ref


def _merged(path):
    env = {**builtin_env(), "SPECOPS_API_KEY": "schema-test"}
    return yamlsource.load(path, env).data


@pytest.mark.parametrize("path", ready_made_profiles(), ids=lambda p: str(p.relative_to(ROOT / "profiles")))
def test_every_ready_made_profile_validates_against_the_schema(schema, path):
    assert errors(schema, _merged(path)) == []


@pytest.mark.parametrize(
    "case,needle",
    [
        ("unknown-top-level-key", "unknown key 'speculatve'"),
        ("unknown-nested-key", "unknown key 'num_speculative_token'"),
        ("unknown-method", "'eagel3' not in"),
        ("wrong-type-int", "'four'"),
        ("wrong-type-list", "is not array"),
        ("port-out-of-range", "70000 violates maximum"),
        ("k-zero", "violates minimum 1"),
        ("name-pattern", "does not match"),
        ("bad-duration", "'5 minutes'"),
        ("missing-model", "missing model"),
    ],
)
def test_schema_rejects_what_the_loader_rejects(schema, case, needle):
    data = _merged(ROOT / "tests" / "malformed" / f"{case}.yaml")
    found = errors(schema, data)
    assert any(needle in e for e in found), found


def test_chain_steps_accept_names_and_mappings(schema):
    base = {"name": "x", "backend": "vllm", "model": {"id": "a/b"}}
    ok = {**base, "fallback": {"chain": ["ngram", {"method": "draft_model", "draft": "c/d"}, "none"]}}
    assert errors(schema, ok) == []
    bad = {**base, "fallback": {"chain": [{"method": "ngram", "k": 3}]}}
    assert errors(schema, bad)


def test_with_jsonschema(schema):
    try:
        import jsonschema
    except ImportError:
        unavailable("jsonschema is not installed (pip install 'specops[test]')")
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in ready_made_profiles():
        assert not list(validator.iter_errors(_merged(path))), path


def test_a_bounded_mapping_is_bounded_in_the_schema_too(schema):
    """``routing.aliases`` holds at most 256 names (maxProperties): the loader's bound, seen by an editor too."""
    base = {"name": "x", "backend": "llamacpp", "model": {"id": "a/b"}, "routing": {"twins": ["none"]}}
    ok = {**base, "routing": {**base["routing"], "aliases": {f"m{i}": "on" for i in range(256)}}}
    over = {**base, "routing": {**base["routing"], "aliases": {f"m{i}": "on" for i in range(257)}}}
    assert errors(schema, ok) == []
    assert any("257 keys" in e for e in errors(schema, over)), errors(schema, over)
