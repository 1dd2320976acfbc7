"""Per-request routing against hostile clients (security review round three, issue 37, items 1, 3, 10 and 11).

Real parts: `specops up` wired as in production (support_standin.py: the stand-in engine, a `none` twin beside the
ngram primary, an API key, learned classes keyed on `X-Task`, one system-prompt rule, `client_choice: forbid`),
attacked from this process over loopback; `specops validate` and `specops status` run as the CLI;
the router built from a profile loaded by the real loader.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess

import pytest
from support_hostile_routing import AUTH, HostileUp, attacked, chat, exchange, get_text, raw_request, system_body
from support_up import SPECOPS, write_profile

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    run = HostileUp(tmp_path_factory.mktemp("r3"))
    try:
        run.wait(lambda s: len(s.get("engines", [])) == 2 and all(e["live"] for e in s["engines"]), "two engines")
        yield run
    finally:
        run.stop()


# ------------------------------------------------------------------------- item 1: a pattern that freezes the proxy


def test_a_hostile_system_prompt_does_not_hold_the_proxy(up):
    """300 KB of `You are a ` on GET /health without the key, and on an authenticated chat request: another
    client's /health answers within 100 ms (a backtracking `re` held the event loop for tens of seconds)."""
    body = system_body(300_000)
    health = raw_request("GET", "/health", body, "X-Task: probe\r\n")
    waited, status = asyncio.run(attacked(up.port, health))
    assert status == 200 and waited < 100, (waited, status)
    post = raw_request("POST", "/v1/chat/completions", body, AUTH + "X-Task: probe\r\n")
    waited, status = asyncio.run(attacked(up.port, post))
    assert status == 200 and waited < 100, (waited, status)


def test_a_rule_sees_only_the_first_8192_characters_of_the_system_prompt(tmp_path):
    """The rule's pattern is searched in a bounded prefix (documented with the field): text past it never matches."""
    from support_routing import request_headers

    from specops.config.profile import load_profile
    from specops.proxy.router import EngineInfo, Router

    path = tmp_path / "p.yaml"
    path.write_text(
        "name: t\nbackend: llamacpp\nmodel: {id: /models/t.gguf}\nspeculative: {method: ngram}\n"
        "fallback: {chain: [none]}\nrouting:\n  twins: [none]\n"
        "  rules: [{match: {system: 'You are a (.*) assistant'}, speculation: off}]\n"
    )
    routing = load_profile(path).profile.routing
    router = Router(routing, [EngineInfo(0, "ngram", True), EngineInfo(1, "none", False)])

    def reason(system: str) -> str:
        body = json.dumps({"messages": [{"role": "system", "content": system}]}).encode()
        return router.route("/v1/chat/completions", request_headers(), body, [True, True]).reason

    assert reason("You are a code assistant") == "rule 0"
    assert reason("x" * (8192 - 30) + "You are a code assistant") == "rule 0"
    assert reason("x" * 8192 + "You are a code assistant") == "default"  # past the documented 8192 characters
    assert reason("You are a \ud800 assistant") == "rule 0"  # a lone surrogate from JSON: no error


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", r"invalid escape sequence: \1"),
        ("(?=You)You are", "invalid perl operator: (?="),
        ("(?<!not )helpful", "invalid perl operator: (?<"),
        (r"assistant\Z", r"invalid escape sequence: \Z"),
    ],
)
def test_validate_refuses_a_pattern_re2_cannot_run_located_with_its_reason(tmp_path, pattern, reason):
    profile = write_profile(
        tmp_path / "p.yaml",
        {
            "name": "t",
            "backend": "llamacpp",
            "model": {"id": "/models/t.gguf"},
            "speculative": {"method": "ngram"},
            "fallback": {"chain": ["none"]},
            "routing": {"twins": ["none"], "rules": [{"match": {"system": pattern}, "speculation": "off"}]},
        },
    )
    done = subprocess.run(SPECOPS + ["validate", str(profile)], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in out, out
    line = next((ln for ln in out.splitlines() if "routing.rules[0].match.system" in ln), None)
    assert line is not None and re.search(r"p\.yaml:\d+:\d+", line), out
    assert reason in line and "RE2" in line and "lookarounds" in line, line


# ------------------------------------------------------------------------- item 3: keyless writes to the classes


def test_keyless_health_requests_neither_touch_the_classes_nor_add_labels(up):
    """100 keyless GET /health with distinct X-Task values: all answered, the authenticated class stays, no label
    appears; a class key that is long or odd is named by its hash in the labels and status."""
    assert chat(up.port, "legit-code")[0] == 200
    assert "legit-code" in up.classes()

    async def flood() -> list[int]:
        out = []
        for i in range(100):
            req = raw_request("GET", "/health", headers=f"X-Task: attacker-{i}-/home/alice/secret-token-abc\r\n")
            out.append((await exchange(up.port, req))[0])
        return out

    assert asyncio.run(flood()) == [200] * 100
    classes = up.classes()
    assert "legit-code" in classes and not [c for c in classes if "attacker" in c]
    metrics = get_text(up.port, "/specops/metrics")
    assert "attacker" not in metrics and 'cls="legit-code"' in metrics

    odd = "a b;c=" + "z" * 80  # a space, punctuation, longer than 64
    assert chat(up.port, odd)[0] == 200
    labels = set(re.findall(r'cls="([^"]*)"', get_text(up.port, "/specops/metrics")))
    assert labels <= {"legit-code", "probe"} | {c for c in up.classes() if re.fullmatch(r"h:[0-9a-f]{12}", c)}
    assert any(re.fullmatch(r"h:[0-9a-f]{12}", c) for c in labels) and "zzzz" not in str(labels)


# ------------------------------------------------------------------------- item 10: client_choice: forbid


def test_fresh_class_keys_do_not_reach_the_speculating_engine_under_forbid(up):
    """Once the deployment fell back to the `none` twin, a client that may not choose gets no speculation by
    sending a fresh class key per request: at most 8 new classes are measured per window; the rest take the default
    route (the step in effect), and the table keeps the learned class."""
    for _ in range(3):  # traffic the primary drafts for (0.2 accepted): its window falls back to the none twin
        assert chat(up.port, "chat")[0] == 200
    up.wait(lambda s: any(e.get("current") and e["method"] == "none" for e in s.get("engines", [])), "the route change")
    served = [chat(up.port, f"fresh-{i}") for i in range(20)]
    assert {status for status, _ in served} == {200}
    on_ngram = sum(engine == "ngram" for _, engine in served)
    assert on_ngram <= 8 and sum(engine == "none" for _, engine in served) >= 12, served
    assert "chat" in up.classes()
    metrics = get_text(up.port, "/specops/metrics")
    assert re.search(r'specops_routed_requests_total\{engine="1:none",reason="class-default"\} 1\d\.0', metrics)


def test_under_forbid_a_new_class_pushes_out_no_class_seen_within_the_window():
    """The table's side of item 10: past its capacity a new class is admitted only in place of a class not seen for
    a whole window, and at most 8 new classes a window."""
    from specops.watch.classes import ClassTable

    table = ClassTable(2, 10.0)
    table.touch("a", 0.0)
    table.touch("b", 5.0)
    assert table.admits("a", 6.0) and not table.admits("c", 6.0)  # full: a was seen 6 s ago
    assert table.admits("c", 10.5)  # a was not seen for a whole window: c may take its place
    many = ClassTable(64, 10.0)
    for i in range(8):
        assert many.admits(f"k{i}", 1.0)
        many.touch(f"k{i}", 1.0)
    assert not many.admits("k8", 10.9) and many.admits("k8", 11.1)


# ------------------------------------------------------------------------- item 11: status prints client text


def test_status_escapes_control_and_bidi_characters_of_class_keys(tmp_path):
    """A state file whose class keys hold a C1 control (U+009B, a CSI on many terminals) and a bidi override
    (U+202E): `specops status` prints them escaped, never raw."""
    state_dir = tmp_path / "state"
    (state_dir / "odd").mkdir(parents=True)
    key = "code\u009b31m\u202eevil"
    state = {
        "name": "odd",
        "state": "stopped",  # as an instance that ran leaves it
        "pid": 999_999,
        "engines": [{"engine": 0, "method": "ngram\u202e", "live": False, "routed": 1, "in_flight": 0}],
        "routing": {"class_key": "header", "classes": [{"class": key, "speculate": None}]},
    }
    (state_dir / "odd" / "state.json").write_text(json.dumps(state))
    done = subprocess.run(
        SPECOPS + ["status", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\u009b" not in out and "\u202e" not in out, repr(out)
    assert "code\\x9b31m\\u202eevil: learning" in out and "ngram\\u202e" in out, out
