"""Routing per request: the profile's ``routing`` section, the pure router, the per-class windows.

Real parts throughout: profiles are loaded from YAML files by the real loader (errors located at
file:line:column), the router decides on real header mappings and JSON bodies, the class windows are fed the
counters llama-server writes in each response's ``timings``.
"""

from __future__ import annotations

import json

import pytest

from specops.config.profile import load_profile
from specops.errors import ProfileError

BASE = """\
name: t
backend: llamacpp
model: {id: /models/target.gguf}
speculative: {method: ngram}
fallback: {chain: [none]}
"""


def _load(tmp_path, extra: str, base: str = BASE):
    path = tmp_path / "p.yaml"
    path.write_text(base + extra)
    return load_profile(path)


def _problems(tmp_path, extra: str, base: str = BASE) -> str:
    with pytest.raises(ProfileError) as err:
        _load(tmp_path, extra, base)
    return str(err.value)


# ------------------------------------------------------------------------------------------------ profile


def test_profile_without_routing_has_no_twins(tmp_path):
    routing = _load(tmp_path, "").profile.routing
    assert routing.twins == [] and not routing.enabled
    assert routing.client_choice == "allow" and routing.classes.key == "none"


def test_routing_section_loads(tmp_path):
    loaded = _load(
        tmp_path,
        "routing:\n"
        "  twins: [none]\n"
        "  client_choice: forbid\n"
        "  rules:\n"
        "    - {match: {path: /v1/completions}, speculation: on}\n"
        "    - {match: {system: '(?i)poem'}, speculation: off}\n"
        "  classes: {key: header, header: X-Tenant, max_classes: 8, explore: 0.1, window: 2m}\n",
    )
    r = loaded.profile.routing
    assert [m.value for m in r.twins] == ["none"] and r.enabled
    assert r.rules[0].speculation == "on" and r.rules[1].match.system == "(?i)poem"
    assert r.classes.window == 120.0 and r.classes.max_classes == 8


@pytest.mark.parametrize(
    ("extra", "where", "says"),
    [
        (
            "routing:\n  twins: [none]\n  rules:\n    - {match: {system: '(open'}, speculation: on}\n",
            "p.yaml:9:",
            "routing.rules[0].match.system: not a regular expression",
        ),
        ("routing:\n  twins: [none]\n  client_choice: maybe\n", "p.yaml:8:", "routing.client_choice"),
        (
            "routing:\n  twins: [none]\n  rules:\n    - {speculation: sometimes}\n",
            "p.yaml:9:",
            "routing.rules[0].speculation: invalid value 'sometimes'",
        ),
        ("routing:\n  twins: [eagle]\n", "p.yaml:7:", "not a step of the fallback chain"),
        ("routing:\n  twins: [ngram]\n", "p.yaml:7:", "the primary method"),
        ("routing:\n  twins: [none, none]\n", "p.yaml:7:", "listed twice"),
        ("routing:\n  twins: [none]\nproxy: {enabled: false}\n", "p.yaml:7:", "set proxy.enabled: true"),
        (
            "routing:\n  twins: [none]\n  classes: {key: model, max_classes: 100000}\n",
            "p.yaml:8:",
            "routing.classes.max_classes: Input should be less than or equal to 4096",
        ),
        ("routing:\n  twins: [none]\n  classes: {key: header}\n", "p.yaml:8:", "`key: header` needs `header`"),
        ("routing:\n  rules:\n    - {speculation: on}\n", "p.yaml:8:", "route rules need an engine to route to"),
        ("routing:\n  classes: {key: model}\n", "p.yaml:7:", "learned routing needs an engine"),
        ("routing:\n  twins: [none]\n  classes: {key: header, header: 'bad header'}\n", "p.yaml:8:", "header name"),
    ],
)
def test_routing_problems_are_located(tmp_path, extra, where, says):
    text = _problems(tmp_path, extra)
    line = next((ln for ln in text.splitlines() if says in ln), None)
    assert line is not None, text
    assert where in line, text


# ------------------------------------------------------------------------------------------------ helpers


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()
