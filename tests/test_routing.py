"""Routing per request: the profile's ``routing`` section, the pure router, the per-class windows.

Real parts throughout: profiles are loaded from YAML files by the real loader (errors located at
file:line:column), the router decides on real header mappings and JSON bodies, the class windows are fed the
counters llama-server writes in each response's ``timings``.
"""

from __future__ import annotations

import json

import pytest
from support_procs import stop_group
from support_routing import request_headers

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


def _router(tmp_path, routing: str, base: str = BASE):
    from specops.proxy.router import EngineInfo, Router

    profile = _load(tmp_path, routing, base).profile
    engines = [EngineInfo(0, profile.speculative.method.value, True)] + [
        EngineInfo(profile.steps.index(next(s for s in profile.steps if s.method is m)), m.value, m.value != "none")
        for m in profile.routing.twins
    ]
    return Router(profile.routing, engines), profile


BOTH = (True, True)


# ------------------------------------------------------------------------------------------------ router


def test_router_header_on_off_auto(tmp_path):
    router, _ = _router(tmp_path, "routing: {twins: [none]}\n")
    assert router.route("/v1/completions", request_headers(), b"{}", BOTH).engine == 0  # the step in effect
    off = router.route("/v1/completions", request_headers(x_specops_speculation="off"), b"{}", BOTH)
    assert (off.engine, off.reason) == (1, "header")
    on = router.route("/v1/completions", request_headers(x_specops_speculation=" ON "), b"{}", BOTH)
    assert (on.engine, on.reason) == (0, "header")
    router.current = 1  # a fallback switched to the twin: auto and no header follow it; on still speculates
    assert router.route("/x", request_headers(x_specops_speculation="auto"), b"", BOTH).engine == 1
    assert router.route("/x", request_headers(x_specops_speculation="on"), b"", BOTH).engine == 0


@pytest.mark.parametrize("value", ["maybe", "", "on,off", "1", "yes\x01"])
def test_router_refuses_unknown_header_with_400(tmp_path, value):
    from specops.proxy.router import RouteRefused

    router, _ = _router(tmp_path, "routing: {twins: [none]}\n")
    with pytest.raises(RouteRefused) as err:
        router.route("/v1/completions", request_headers(x_specops_speculation=value), b"{}", BOTH)
    assert err.value.status == 400
    assert "\n" not in str(err.value) and "not one of on, off, auto" in str(err.value)


def test_router_client_choice_forbidden_is_403(tmp_path):
    from specops.proxy.router import RouteRefused

    router, _ = _router(tmp_path, "routing: {twins: [none], client_choice: forbid}\n")
    with pytest.raises(RouteRefused) as err:
        router.route("/v1/completions", request_headers(x_specops_speculation="off"), b"{}", BOTH)
    assert err.value.status == 403 and "client_choice: forbid" in str(err.value)
    assert router.route("/v1/completions", request_headers(), b"{}", BOTH).engine == 0


def test_router_rules_by_path_model_header_and_system_prompt(tmp_path):
    router, _ = _router(
        tmp_path,
        "routing:\n"
        "  twins: [none]\n"
        "  rules:\n"
        "    - {match: {path: /v1/embeddings*}, speculation: off}\n"
        "    - {match: {model: creative}, speculation: off}\n"
        "    - {match: {header: X-Tenant, value: poets}, speculation: off}\n"
        "    - {match: {system: '(?i)write a poem'}, speculation: off}\n"
        "    - {match: {model: coder}, speculation: auto}\n",
    )
    chat = lambda system, model="m": _body(  # noqa: E731
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    )
    assert router.route("/v1/embeddings/x", request_headers(), b"", BOTH).reason == "rule 0"
    assert router.route("/v1/chat/completions", request_headers(), _body(model="creative"), BOTH).engine == 1
    assert router.route("/v1/chat/completions", request_headers(x_tenant="poets"), b"{}", BOTH).reason == "rule 2"
    assert router.route("/v1/chat/completions", request_headers(x_tenant="coders"), b"{}", BOTH).engine == 0
    assert router.route("/v1/chat/completions", request_headers(), chat("Please WRITE A POEM"), BOTH).reason == "rule 3"
    parts = _body(messages=[{"role": "system", "content": [{"type": "text", "text": "write a poem"}]}])
    assert router.route("/v1/chat/completions", request_headers(), parts, BOTH).engine == 1
    # a rule saying auto ends the rules: the default decides; a client's header wins over every rule
    assert router.route("/v1/chat/completions", request_headers(), chat("hello", "coder"), BOTH).reason == "default"
    hdr = router.route(
        "/v1/chat/completions", request_headers(x_specops_speculation="on"), _body(model="creative"), BOTH
    )
    assert (hdr.engine, hdr.reason) == (0, "header")
    # a body that is not JSON matches no body rule
    assert router.route("/v1/chat/completions", request_headers(), b"\xff not json", BOTH).reason == "default"


def test_router_failover_to_a_live_engine(tmp_path):
    router, _ = _router(tmp_path, "routing: {twins: [none]}\n")
    off = router.route("/v1/completions", request_headers(x_specops_speculation="off"), b"{}", (True, False))
    assert (off.engine, off.reason) == (0, "header failover")
    default = router.route("/v1/completions", request_headers(), b"{}", (False, True))
    assert (default.engine, default.reason) == (1, "default failover")
    assert router.route("/v1/completions", request_headers(), b"{}", (False, False)).engine is None


def test_router_learned_classes_measure_decide_and_explore(tmp_path):
    router, _ = _router(
        tmp_path, "routing:\n  twins: [none]\n  classes: {key: header, header: X-Task, explore: 0.25}\n"
    )
    first = router.route("/v1/completions", request_headers(x_task="poems"), b"{}", BOTH)
    assert (first.engine, first.reason, first.key) == (0, "class-learning", "poems")  # measured where it drafts
    router.classes.decide("poems", False, "acceptance 0.1 is below min_acceptance 0.6")
    routes = [router.route("/v1/completions", request_headers(x_task="poems"), b"{}", BOTH) for _ in range(8)]
    assert [r.engine for r in routes].count(1) == 6 and [r.reason for r in routes].count("class-explore") == 2
    assert {r.engine for r in routes if r.reason == "class-explore"} == {0}
    missing = router.route("/v1/completions", request_headers(), b"{}", BOTH)
    assert missing.key == "-"


def test_router_learns_one_class_at_a_time(tmp_path):
    router, _ = _router(
        tmp_path,
        "routing:\n  twins: [none]\n  classes: {key: header, header: X-Task, window: 32s, explore: 0.5, "
        "learn: one_at_a_time}\n",
    )

    def to(task: str, now: float):
        r = router.route("/v1/completions", request_headers(x_task=task), b"{}", BOTH, now)
        return r.engine, r.reason

    assert to("code", 0.0) == (0, "class-learning")  # the first undecided class takes the turn
    assert to("poems", 0.5) == (1, "class-waiting")  # another waits on the engine without speculation
    assert to("code", 1.0) == (0, "class-learning")
    router.classes.decide("code", False, "acceptance 0.1")  # a verdict hands the turn on
    assert to("poems", 1.5) == (0, "class-learning")
    # while poems learns, a class whose verdict is off does not explore onto the speculating engine
    assert [to("code", 2.0 + i / 10) for i in range(4)] == [(1, "class")] * 4
    assert to("chat", 2.6) == (1, "class-waiting")
    # the holder not seen for a bucket (window/16 = 2 s) loses the turn; then code's explore share returns
    assert to("chat", 5.0) == (0, "class-learning")
    router.classes.decide("chat", True, "acceptance 0.9")
    assert router.classes.learner(5.1) is None
    assert (0, "class-explore") in [to("code", 5.2 + i / 10) for i in range(2)]
    # learn: together (the default): every undecided class is measured on the speculating engine at once
    together, _ = _router(tmp_path, "routing:\n  twins: [none]\n  classes: {key: header, header: X-Task}\n")
    reasons = {together.route("/v1/completions", request_headers(x_task=t), b"{}", BOTH).reason for t in "ab"}
    assert reasons == {"class-learning"}


def test_router_class_key_by_system_prompt_is_a_hash(tmp_path):
    router, _ = _router(tmp_path, "routing:\n  twins: [none]\n  classes: {key: system}\n")
    body = _body(messages=[{"role": "system", "content": "secret instructions"}])
    key = router.route("/v1/chat/completions", request_headers(), body, BOTH).key
    assert key.startswith("sys-") and "secret" not in key
    assert router.route("/v1/chat/completions", request_headers(), body, BOTH).key == key


# ------------------------------------------------------------------------------------------------ classes


def test_class_table_is_bounded_lru():
    from specops.watch.classes import ClassTable

    table = ClassTable(max_classes=3, window_s=60)
    for key in ("a", "b", "c"):
        table.touch(key, 0.0)
    table.touch("a", 1.0)  # a is now the most recent: b is the least
    table.touch("d", 2.0)
    assert table.keys() == ["c", "a", "d"] and table.forgotten == 1
    for i in range(100):
        table.touch(f"k{i}", 3.0)
    assert len(table) == 3


def test_class_window_counts_and_ages():
    from specops.watch.classes import ClassTable
    from specops.watch.window import NO_DATA, OK

    table = ClassTable(max_classes=8, window_s=60)
    table.touch("code", 0.0)
    table.note("code", 1.0, speculative=True, draft_tokens=100, accepted=80)
    table.note("code", 2.0, speculative=True, draft_tokens=100, accepted=60)
    table.note("code", 3.0, speculative=False)
    s = table.stats("code", 10.0)
    assert s.status is OK and s.acceptance == pytest.approx(0.7) and s.draft_tokens == 200
    row = table.snapshot(10.0)[0]
    assert (row["served_on"], row["served_off"]) == (2, 1)
    table.note("code", 50.0, speculative=True, draft_tokens=100, accepted=10)
    assert table.stats("code", 55.0).acceptance == pytest.approx(150 / 300)
    # past the window the old responses no longer count
    assert table.stats("code", 100.0).acceptance == pytest.approx(0.1)
    assert table.stats("code", 200.0).status is NO_DATA


def test_decider_routes_a_class_by_the_policy_rule(tmp_path):
    from specops.run.instance import EventLog
    from specops.watch.classes import ClassTable
    from specops.watch.decide import FallbackDecider

    profile = _load(tmp_path, "routing: {twins: [none]}\n").profile
    decider = FallbackDecider.from_profile(profile, events=EventLog(None), say=lambda m: None)
    table = ClassTable(max_classes=8, window_s=60)
    for key, accepted in (("code", 90), ("poems", 20)):
        table.touch(key, 0.0)
        table.note(key, 1.0, speculative=True, draft_tokens=300, accepted=accepted * 3)
    code, why = decider.route_class(table.stats("code", 2.0), min_draft_tokens=200)
    poems, why_poems = decider.route_class(table.stats("poems", 2.0), min_draft_tokens=200)
    assert code is True and poems is False
    assert "min_acceptance 0.6" in why_poems
    undecided, why_few = decider.route_class(table.stats("code", 2.0), min_draft_tokens=1000)
    assert undecided is None and "fewer than min_draft_tokens" in why_few


# ------------------------------------------------------------------------------------------------ end to end


def test_standin_twins_route_learn_and_stop_clean(tmp_path):
    """`specops up` as in production with the stand-in engine (support_standin.py): ngram "accepts" 0.2, so the
    class learns to go to the `none` twin; the header overrides; a bad header is 400; both engines stop."""
    import time
    import urllib.request

    from support_ports import free_port
    from support_up import http_text, standin_up, write_profile

    from specops.run.process import group_members

    state_dir, port = tmp_path / "state", free_port()
    (tmp_path / "target.gguf").write_bytes(b"GGUF")  # the stand-in reads no weights; the launch check wants a file
    profile = write_profile(
        tmp_path / "twins.yaml",
        {
            "name": "twins",
            "backend": "llamacpp",
            "model": {"id": str(tmp_path / "target.gguf")},
            "speculative": {"method": "ngram"},
            "gpus": {"devices": []},
            "server": {"port": port},
            "fallback": {"enabled": False, "chain": ["none"]},
            "monitor": {"interval": 0.1, "timeout": 1},
            "supervisor": {"state_dir": str(state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
            "routing": {
                "twins": ["none"],
                "classes": {"key": "header", "header": "X-Task", "min_draft_tokens": 20, "explore": 0.25},
            },
        },
    )

    def ask(headers: dict) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": "x", "max_tokens": 20}).encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def state() -> dict:
        try:
            return json.loads((state_dir / "twins" / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def wait(pred, what: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = state()
            if pred(st):
                return st
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {state()}")

    proc = standin_up(tmp_path, profile, "support_standin.py")
    pids: list[int] = []
    try:
        st = wait(lambda s: len(s.get("engines", [])) == 2 and all(e["live"] for e in s["engines"]), "two engines")
        pids = [st["engine_pid"], st["engines"][1]["engine_pid"]]
        assert ask({"X-Specops-Speculation": "off"})[1]["system_fingerprint"] == "none"
        assert ask({"X-Specops-Speculation": "on"})[1]["system_fingerprint"] == "ngram"
        status, bad = ask({"X-Specops-Speculation": "fast please"})
        assert status == 400 and bad["error"]["message"].count("\n") == 0
        # a class not decided yet is measured where it drafts; once judged (acceptance 0.2 < 0.6) it goes to none
        assert ask({"X-Task": "chat"})[1]["system_fingerprint"] == "ngram"
        st = wait(lambda s: any(c["speculate"] is False for c in s["routing"]["classes"]), "the class verdict")
        [row] = st["routing"]["classes"]
        assert row["class"] == "chat" and row["acceptance"] == pytest.approx(0.2, abs=0.05)
        served = [ask({"X-Task": "chat"})[1]["system_fingerprint"] for _ in range(8)]
        assert served.count("none") == 6 and served.count("ngram") == 2  # explore: 0.25 of its requests
        route = [json.loads(line) for line in (state_dir / "twins" / "events.jsonl").read_text().splitlines()]
        assert any(e["event"] == "route" and e.get("class") == "chat" and e["speculate"] is False for e in route)
        metrics = http_text(f"http://127.0.0.1:{port}/specops/metrics")
        assert 'specops_class_speculate{cls="chat"} 0.0' in metrics
        assert 'specops_engine_live{engine="1:none"} 1.0' in metrics
    finally:
        proc.terminate()  # SIGTERM to specops up alone, as `specops down` sends it: it stops its engines
        try:
            rc = proc.wait(timeout=60)
        finally:
            stop_group(proc, timeout=5)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert all(not group_members(pid) for pid in pids)  # both engines stopped with specops
