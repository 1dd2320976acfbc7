"""Twins, second slice: one truth for the step in effect, the reconnect rule for every upstream, the fallback's
hysteresis per class, the crossover load as a route, a reload that changes the routing rules.

Real parts: profiles loaded from YAML by the real loader, the real decider and policy, the real TwinEngines and
router, a real Proxy forwarding to stand-in engine processes (support_upstream.py) speaking llama-server's API.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support_goodput import Events
from support_procs import stop_group
from support_routing import request_headers

from specops.config.profile import load_profile
from specops.methods import Method
from specops.run.events import EngineReady, StepChanged
from specops.watch.decide import FallbackDecider
from specops.watch.window import OK, WindowStats

pytestmark = pytest.mark.timeout(60)

BASE = """\
name: t
backend: llamacpp
model: {id: /models/target.gguf}
speculative: {method: ngram}
fallback: {chain: [none], consecutive_windows: 2}
routing:
  twins: [none]
"""


def _profile(tmp_path, extra: str = "", base: str = BASE):
    path = tmp_path / "p.yaml"
    path.write_text(base + extra)
    return load_profile(path)


def _twins(tmp_path, loaded, events=None, surface=None):
    """TwinEngines as `specops up` builds them (their supervisors are built, never run), the real decider."""
    from specops.serve.twins import TwinEngines

    events = events or Events()
    decider = FallbackDecider.from_profile(loaded.profile, events=events, say=lambda m: None, surface=surface)
    twins = TwinEngines(
        loaded.profile,
        decider=decider,
        events=events,
        say=lambda m: None,
        render_twin=lambda profile, step, port: lambda index: None,
        log_path=lambda name: tmp_path / f"{name}.log",
        health_interval=0.1,
        launch_problem=None,
    )
    return twins, decider


def _one_truth(twins, decider) -> tuple[int, int]:
    """(the policy's step, the step of the engine the default route goes to): equal when there is one truth."""
    return decider.policy.index, twins.router.engines[twins.router.current].step


def _primary(twins, decider, event) -> None:
    """The primary supervisor's listeners, in the order `specops up` registers them (decider first)."""
    decider.on_event(event)
    twins.on_primary_event(event)


# ------------------------------------------------------------------------------------------ one truth


def test_the_primary_restarting_or_falling_back_keeps_one_step_in_effect(tmp_path):
    from specops.proxy import Proxy

    async def body():
        twins, decider = _twins(tmp_path, _profile(tmp_path))
        proxy = Proxy("127.0.0.1", 0, queue_size=8, queue_timeout=5.0, drain_timeout=5.0)
        proxy.set_upstream("http://127.0.0.1:9")
        twins.attach(proxy)
        twins.upstreams.handle(1).release("http://127.0.0.1:8")
        _primary(twins, decider, EngineReady(0, Method.NGRAM, None, 1.0))
        assert twins.route_to(1, "acceptance low")
        assert _one_truth(twins, decider) == (1, 1)
        # the primary crashes and its supervisor restarts it on its own step, while the twin serves the route:
        # the step in effect stays the twin's (it was the policy's that moved back to ngram)
        _primary(twins, decider, EngineReady(0, Method.NGRAM, None, 1.0))
        assert _one_truth(twins, decider) == (1, 1)
        # the primary's supervisor falls back by itself (a failed start) to the twin's step: still one truth
        _primary(twins, decider, StepChanged(0, 1, Method.NGRAM, Method.NONE, "crash loop", False))
        _primary(twins, decider, EngineReady(1, Method.NONE, None, 1.0))
        assert _one_truth(twins, decider) == (1, 1)
        # a retry of ngram: no engine runs step 0 now, so the primary restarts into it (a requested switch);
        # the default route follows the primary from the moment it moves, and the policy runs ngram once ready
        assert not twins.route_to(0, "retry")
        _primary(twins, decider, StepChanged(1, 0, Method.NONE, Method.NGRAM, "retry", True))
        assert twins.router.current == 0
        _primary(twins, decider, EngineReady(0, Method.NGRAM, None, 1.0))
        assert _one_truth(twins, decider) == (0, 0)
        routes = [f for kind, f in twins.events.lines if kind == "route"]
        assert routes[-1]["to"] == "ngram" and "follows the step in effect" in routes[-1]["reason"]

    asyncio.run(body())


# ------------------------------------------------------------------------------------------ reconnect


def test_a_stale_pooled_connection_to_a_twin_is_reconnected_not_retried(tmp_path):
    import aiohttp
    from support_upstream import Upstream, check_completion, running_proxy

    async def body(primary, twin):
        twins, _ = _twins(tmp_path, _profile(tmp_path))
        async with running_proxy(primary.url) as proxy, aiohttp.ClientSession() as s:
            twins.attach(proxy)
            twins.upstreams.handle(1).release(twin.url)
            off = {"X-Specops-Speculation": "off"}
            async with s.post(proxy.url + "/v1/completions", headers=off, json={"prompt": "p", "max_tokens": 2}) as r:
                assert r.status == 200 and check_completion(await r.json(), 2) == "T"
            # the twin closes the pooled connection after its answer, without `Connection: close`
            async with s.get(proxy.url + "/debug/echo", headers={**off, "X-Test-Close-After": "0.05"}) as r:
                assert r.status == 200
            async with s.post(
                proxy.url + "/v1/completions",
                headers={**off, "X-Test-Token-Delay": "0.05"},
                json={"prompt": "p", "max_tokens": 4},
            ) as r:
                assert r.status == 200 and check_completion(await r.json(), 4) == "T"
            st = proxy.stats()
            assert (st["reconnects"], st["retried"], st["upstream_errors"]) == (1, 0, 0)
            assert twins.upstreams.live() == [True, True]

    with Upstream.start("P", acceptance=0.5) as primary, Upstream.start("T") as twin:
        asyncio.run(asyncio.wait_for(body(primary, twin), 30))


# ------------------------------------------------------------------------------------------ hysteresis


def _window(acceptance: float, start: float, end: float) -> WindowStats:
    return WindowStats(
        OK,
        window_s=end - start,
        start=start,
        end=end,
        full=True,
        acceptance=acceptance,
        draft_tokens=1000.0,
        accepted=1000.0 * acceptance,
    )


def test_a_class_verdict_changes_only_after_consecutive_disjoint_windows(tmp_path):
    loaded = _profile(tmp_path, "  classes: {key: header, header: X-Task, window: 10s, min_draft_tokens: 50}\n")
    twins, _ = _twins(tmp_path, loaded)
    table = twins.classes
    table.touch("chat", 0.0)
    # first look: a class not decided yet takes its verdict at once (acceptance 0.2 < 0.6: off)
    table.note("chat", 1.0, speculative=True, draft_tokens=100, accepted=20)
    assert twins.decide_classes(5.0, 50) == 1 and table.get("chat").speculate is False
    # the class turns good; the explored share measures it. One window against the verdict is not enough
    table.note("chat", 12.0, speculative=True, draft_tokens=1000, accepted=950)
    assert twins.decide_classes(16.0, 50) == 0 and table.get("chat").speculate is False
    assert "window 1 of 2" in table.get("chat").reason or table.get("chat").streak == 1
    # an overlapping window does not count twice
    assert twins.decide_classes(17.0, 50) == 0 and table.get("chat").streak == 1
    table.note("chat", 24.0, speculative=True, draft_tokens=1000, accepted=950)
    assert twins.decide_classes(27.0, 50) == 1 and table.get("chat").speculate is True
    assert "for 2 consecutive windows" in table.get("chat").reason
    # a good window in between resets the streak
    table.note("chat", 38.0, speculative=True, draft_tokens=1000, accepted=100)
    twins.decide_classes(38.5, 50)
    table.note("chat", 49.0, speculative=True, draft_tokens=1000, accepted=950)
    twins.decide_classes(49.5, 50)
    table.note("chat", 60.0, speculative=True, draft_tokens=1000, accepted=100)
    twins.decide_classes(60.5, 50)
    assert table.get("chat").speculate is True and table.get("chat").streak == 1


# ------------------------------------------------------------------------------------------ crossover load


def test_above_the_measured_crossover_every_class_goes_to_the_twin(tmp_path):
    from specops.watch.goodput import Load
    from specops.watch.surface import Surface

    # ngram (k 4) beats none up to 4 clients, none wins from 8 on: the crossover lies between
    points = [
        {"method": m, "k": k, "concurrency": c, "tokens_per_s": tps}
        for m, k, rows in (
            ("ngram", 4, ((1, 30), (4, 80), (8, 90), (16, 100))),
            ("none", 0, ((1, 20), (4, 60), (8, 120), (16, 200))),
        )
        for c, tps in rows
    ]
    surface = Surface.from_dict({"points": points})
    loaded = _profile(
        tmp_path,
        "  classes: {key: header, header: X-Task, min_draft_tokens: 50}\n",
        base=BASE.replace("fallback: {", "fallback: {mode: goodput, "),
    )
    twins, decider = _twins(tmp_path, loaded, surface=surface)
    live = (True, True)
    table = twins.classes
    table.touch("code", 0.0)
    table.note("code", 1.0, speculative=True, draft_tokens=300, accepted=270)
    idle = WindowStats("no_data", window_s=60.0, reason="idle")
    decider.observe(idle, 2.0, Load(concurrency=1.0, source="proxy"))
    twins.decide_classes(2.0, 50)
    assert twins.router.route("/v1/completions", request_headers(x_task="code"), b"{}", live).engine == 0
    for t in range(3, 80):  # 16 clients for a while: the mean load passes the crossover
        decider.observe(idle, float(t), Load(concurrency=16.0, source="proxy"))
    twins.decide_classes(80.0, 50)
    code = twins.router.route("/v1/completions", request_headers(x_task="code"), b"{}", live)
    other = twins.router.route("/v1/completions", request_headers(x_task="new"), b"{}", live)
    assert (code.engine, code.reason, other.engine) == (1, "load", 1)
    assert twins.router.route("/x", request_headers(x_specops_speculation="on"), b"{}", live).engine == 0  # asked: on
    [event] = [f for kind, f in twins.events.lines if kind == "route" and f.get("scope") == "load"]
    assert event["speculate"] is False and "crossover" in event["reason"]
    twins.decide_classes(1000.0, 50)  # no load reading in the window: the route stays as it was
    assert twins.router.load_off is True
    for t in range(81, 200):
        decider.observe(idle, float(t), Load(concurrency=1.0, source="proxy"))
    twins.decide_classes(200.0, 50)
    assert twins.router.route("/v1/completions", request_headers(x_task="code"), b"{}", live).engine == 0
    assert json.dumps(twins.snapshot()["routing"]["load_off"]) == "false"


def test_goodput_prices_a_switch_to_a_live_twin_as_a_route_change(tmp_path):
    """The decider's goodput policy asks the twins which steps a live engine runs: the `none` twin, once released
    and while live; the primary only while the proxy serves."""
    loaded = _profile(tmp_path, base=BASE.replace("fallback: {", "fallback: {mode: goodput, "))
    twins, decider = _twins(tmp_path, loaded)
    warm = decider.policy.goodput.warm
    assert warm() == set()  # nothing started yet
    twins.upstreams.handle(1).release("http://127.0.0.1:8")
    assert warm() == {1}
    twins.upstreams.handle(1).upstream_failed("killed")  # the twin died: a switch to none is a restart again
    assert warm() == set()


# ------------------------------------------------------------------------------------------ reload


@pytest.mark.timeout(150)
def test_standin_reload_changes_rules_and_adds_and_removes_a_twin(tmp_path):
    """`specops up` with the stand-in engine (support_standin.py): a reloaded profile's route rule takes effect;
    a reload without the twin drains and stops it; one that lists it again starts a new one."""
    import time
    import urllib.request

    from support_ports import free_port
    from support_up import standin_up, write_profile

    from specops.run.process import group_members

    state_dir, port = tmp_path / "state", free_port()
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    doc = {
        "name": "twins",
        "backend": "llamacpp",
        "model": {"id": str(tmp_path / "target.gguf")},
        "speculative": {"method": "ngram"},
        "gpus": {"devices": []},
        "server": {"port": port},
        "fallback": {"enabled": False, "chain": ["none"]},
        "monitor": {"interval": 0.1, "timeout": 1},
        "supervisor": {"state_dir": str(state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
        "routing": {"twins": ["none"]},
    }
    profile = write_profile(tmp_path / "twins.yaml", doc)

    def ask(model: str = "m", headers: dict | None = None) -> str:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"model": model, "prompt": "x", "max_tokens": 5}).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["system_fingerprint"]

    def state() -> dict:
        try:
            return json.loads((state_dir / "twins" / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def reloads() -> list[dict]:
        lines = (state_dir / "twins" / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == "route" and e.get("scope") == "reload"]

    def wait(pred, what: str, timeout: float = 40) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = state()
            if st and pred(st):
                return st
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {state()}")

    def serving(n: int):
        return lambda s: (
            s.get("state") == "ready"
            and len(s.get("engines", [])) == n
            and all(e["live"] and e.get("state", "ready") == "ready" for e in s["engines"])
        )

    proc = standin_up(tmp_path, profile, "support_standin.py")
    pids: list[int] = []
    try:
        st = wait(serving(2), "two engines")
        twin_pid, primary_pid = st["engines"][1]["engine_pid"], st["engine_pid"]
        pids = [twin_pid]
        assert ask("poems") == "ngram"
        # 1. a route rule: requests for the model `poems` go to the twin; the twin's engine is the same process
        doc["routing"] = {"twins": ["none"], "rules": [{"match": {"model": "poems"}, "speculation": "off"}]}
        write_profile(profile, doc)
        # the primary restarts on the reloaded profile (the twin serves meanwhile): wait for its new engine
        st = wait(lambda s: len(reloads()) == 1 and s["engine_pid"] != primary_pid and serving(2)(s), "the reload")
        pids.append(st["engine_pid"])
        assert "route rules" in reloads()[0]["changes"]
        assert ask("poems") == "none" and ask("code") == "ngram"
        assert state()["engines"][1]["engine_pid"] == twin_pid
        # 2. no twins any more: the twin stops; everything goes to the primary (a header asking off included)
        doc["routing"] = {"twins": []}
        write_profile(profile, doc)
        primary_pid = st["engine_pid"]
        st = wait(lambda s: len(reloads()) == 2 and s["engine_pid"] != primary_pid and serving(1)(s), "no twin")
        pids.append(st["engine_pid"])
        assert "twin none removed" in reloads()[1]["changes"]
        deadline = time.monotonic() + 20
        while group_members(twin_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_members(twin_pid)
        assert ask("poems", {"X-Specops-Speculation": "off"}) == "ngram"
        # 3. the twin again: a new engine starts beside the primary and takes the requests asked off
        doc["routing"] = {"twins": ["none"]}
        write_profile(profile, doc)
        primary_pid = st["engine_pid"]
        st = wait(lambda s: len(reloads()) == 3 and s["engine_pid"] != primary_pid and serving(2)(s), "a twin")
        assert reloads()[2]["changes"] == ["twin none added"]
        pids.append(st["engines"][1]["engine_pid"])
        assert pids[1] != twin_pid and ask("x", {"X-Specops-Speculation": "off"}) == "none"
        pids.append(st["engine_pid"])
    finally:
        proc.terminate()  # SIGTERM to specops up alone, as `specops down` sends it: it stops its engines
        try:
            rc = proc.wait(timeout=60)
        finally:
            stop_group(proc, timeout=5)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert all(not group_members(pid) for pid in pids if pid)


# ------------------------------------------------------------------------------------------ vLLM per-request counters

VLLM = """\
name: v
backend: vllm
model: {id: org/target}
speculative: {method: ngram}
fallback: {chain: [none]}
routing:
  twins: [none]
"""


def _vllm_argv(tmp_path, extra: str, version: str, step: int = 0) -> list[str]:
    from specops.backends.render import render_plan
    from specops.config.profile import LoadedProfile
    from specops.plugins import get_registry

    path = tmp_path / "v.yaml"
    path.write_text(VLLM + extra)
    loaded = load_profile(path, env={})
    at = LoadedProfile(loaded.profile.at_step(step), loaded.document, loaded.path)
    return list(render_plan(at, get_registry(), backend_version=version, probe=False).argv)


def test_vllm_per_request_spec_metrics_are_rendered_when_classes_need_them(tmp_path):
    classes = "  classes: {key: model}\n"
    argv = _vllm_argv(tmp_path, classes, "0.32.0")
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"
    # not without learned routing, not on the twin without speculation (vLLM refuses it), not before the gate
    assert "--per-request-spec-decode-metrics" not in _vllm_argv(tmp_path, "", "0.32.0")
    assert "--per-request-spec-decode-metrics" not in _vllm_argv(tmp_path, classes, "0.32.0", step=1)
    assert "--per-request-spec-decode-metrics" not in _vllm_argv(tmp_path, classes, "0.27.1")
    # a canary's acceptance is the sum of its answers' own counters: it needs them without classes too
    canary = _vllm_argv(tmp_path, "  canary: {enabled: true}\n", "0.32.0")
    assert canary[canary.index("--per-request-spec-decode-metrics") + 1] == "summary"
    # the operator's own choice stays
    mine = _vllm_argv(
        tmp_path, classes + "server: {extra_args: [--per-request-spec-decode-metrics=detailed]}\n", "0.32.0"
    )
    assert mine.count("--per-request-spec-decode-metrics=detailed") == 1 and "summary" not in mine


def test_vllm_engines_side_by_side_are_not_pinned_to_the_same_cores(tmp_path):
    """vLLM-CPU's default thread binding puts every engine on the same cores: with twins each engine is rendered
    unbound (from the version that has the setting), unless the operator chose a binding; a remote twin shares no
    cores, so it changes nothing; a canary does."""
    from specops.backends.render import render_plan
    from specops.config.profile import LoadedProfile
    from specops.plugins import get_registry

    def env(extra: str, version: str, step: int, base: str = VLLM) -> dict:
        path = tmp_path / "v.yaml"
        path.write_text(base + extra)
        loaded = load_profile(path, env={})
        at = LoadedProfile(loaded.profile.at_step(step), loaded.document, loaded.path)
        return dict(render_plan(at, get_registry(), backend_version=version, probe=False).env)

    twins = [env("", "0.32.0", step) for step in (0, 1)]
    assert [e.get("VLLM_CPU_OMP_THREADS_BIND") for e in twins] == ["nobind", "nobind"]
    assert [e.get("OMP_WAIT_POLICY") for e in twins] == ["PASSIVE", "PASSIVE"]  # no spinning beside the other
    old = env("", "0.27.1", 0)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in old and old["OMP_WAIT_POLICY"] == "PASSIVE"
    alone = env("", "0.32.0", 0, base=VLLM.replace("routing:\n  twins: [none]\n", ""))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in alone and "OMP_WAIT_POLICY" not in alone
    # a remote twin is another deployment: no second engine here shares the cores
    remote = env(
        "", "0.32.0", 0, base=VLLM.replace("twins: [none]", 'twins: [{url: "http://v-plain:8000", method: none}]')
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in remote and "OMP_WAIT_POLICY" not in remote
    # ... but a canary runs here beside its primary, whatever the twins
    canary = env(
        "  canary: {enabled: true}\n",
        "0.32.0",
        0,
        base=VLLM.replace("twins: [none]", 'twins: [{url: "http://v-plain:8000", method: none}]'),
    )
    assert (canary["VLLM_CPU_OMP_THREADS_BIND"], canary["OMP_WAIT_POLICY"]) == ("nobind", "PASSIVE")
    mine = env("server: {env: {VLLM_CPU_OMP_THREADS_BIND: '0|1', OMP_WAIT_POLICY: ACTIVE}}\n", "0.32.0", 0)
    assert (mine["VLLM_CPU_OMP_THREADS_BIND"], mine["OMP_WAIT_POLICY"]) == ("0|1", "ACTIVE")


def test_a_vllm_answer_with_its_own_counters_feeds_its_class_window(tmp_path):
    import time

    from aiohttp import web

    from specops.proxy.forward import Flight, Generation

    twins, _ = _twins(tmp_path, _profile(tmp_path, "  classes: {key: model, min_draft_tokens: 10}\n"))
    route = twins.router.route("/v1/completions", {}, b'{"model": "code"}', (True, True), 1.0)
    # the shape of vLLM 0.32.0's answer with --per-request-spec-decode-metrics summary (its protocol model)
    answer = {
        "choices": [{"text": "x"}],
        "metrics": {
            "speculative_decoding": {
                "mean_acceptance_length": 2.5,
                "draft_acceptance_rate": 0.375,
                "acceptance_histogram": [2, 1, 1, 0, 1],
                "num_spec_steps": 8,
                "num_accepted_draft_tokens": 12,
                "num_draft_tokens": 32,
                "num_spec_tokens": 4,
            }
        },
    }
    primary = Generation(1, "http://127.0.0.1:9")  # the speculating engine answered
    twins.upstreams.finished(route, Flight(primary), True, web.Response(body=json.dumps(answer).encode()))
    stats = twins.classes.stats("code", time.monotonic())  # the windows run on the monotonic clock
    assert (stats.draft_tokens, stats.accepted) == (32.0, 12.0)
    # an answer without them (or a malformed one) adds no draft counts
    for body in (b'{"choices": []}', b'{"metrics": {"speculative_decoding": {"num_draft_tokens": "9"}}}'):
        twins.upstreams.finished(route, Flight(primary), True, web.Response(body=body))
    assert twins.classes.stats("code", time.monotonic()).draft_tokens == 32.0


def test_a_vllm_stream_feeds_its_class_window_from_its_usage_event(tmp_path):
    """A stream's counters come in its last event (``stream_options.include_usage``): the flight keeps the
    stream's end and the window reads it; a stream whose client asked for no usage adds nothing."""
    import time

    from aiohttp import web

    from specops.proxy.forward import STREAM_TAIL, Flight, Generation

    twins, _ = _twins(tmp_path, _profile(tmp_path, "  classes: {key: model, min_draft_tokens: 10}\n"))
    route = twins.router.route("/v1/completions", {}, b'{"model": "code"}', (True, True), 1.0)
    spec = {"num_draft_tokens": 40, "num_accepted_draft_tokens": 30, "mean_acceptance_length": 3.0}
    usage = {"prompt_tokens": 5, "completion_tokens": 47, "total_tokens": 52}
    events = [{"choices": [{"index": 0, "text": "tok"}]}] * 3 + [
        {"choices": [], "usage": usage, "metrics": {"speculative_decoding": spec}}
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    primary = Generation(1, "http://127.0.0.1:9")
    flight = Flight(primary)
    flight.tail = (b"x" * STREAM_TAIL + stream)[-STREAM_TAIL:]  # what _stream keeps: the stream's end
    seen = []
    twins.upstreams.on_route, on_route = (lambda *a: seen.append(a[3:5])), twins.upstreams.on_route
    twins.upstreams.finished(route, flight, True, web.StreamResponse())
    assert seen[0][0] == 47 and seen[0][1] > 0  # the tokens the stream generated, and its wall time
    twins.upstreams.on_route = on_route
    twins.upstreams.finished(route, flight, True, web.StreamResponse())
    stats = twins.classes.stats("code", time.monotonic())
    assert (stats.draft_tokens, stats.accepted) == (40.0, 30.0)
    plain = Flight(primary)
    plain.tail = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events[:3]) + b"data: [DONE]\n\n"
    twins.upstreams.finished(route, plain, True, web.StreamResponse())
    assert twins.classes.stats("code", time.monotonic()).draft_tokens == 40.0


def test_only_answers_of_the_engine_in_effect_feed_the_fallback_window(tmp_path):
    """The fallback window (``on_timings``) measures the step in effect: a canary's answers (another draft) are
    counted by the proxy but kept out of it, as a speculating twin's are until a route change makes its step the
    one in effect."""
    import aiohttp
    from support_upstream import Upstream, running_proxy

    from specops.proxy.router import EngineInfo
    from specops.proxy.routes import EngineUpstream

    base = BASE.replace("chain: [none]", "chain: [ngram, none]")
    base = base.replace("speculative: {method: ngram}", "speculative: {method: draft_model, draft: /d.gguf}")
    window: list[tuple[int, int]] = []

    def seen() -> tuple[int, int]:
        return sum(n for n, _ in window), sum(a for _, a in window)

    async def body(primary, twin, canary):
        twins, _ = _twins(tmp_path, _profile(tmp_path, base=base.replace("twins: [none]", "twins: [ngram]")))
        async with running_proxy(primary.url, on_timings=lambda n, a: window.append((n, a))) as proxy:
            twins.attach(proxy)
            twins.upstreams.handle(1).release(twin.url)
            async with aiohttp.ClientSession() as s:

                async def ask() -> None:
                    async with s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 8}) as r:
                        assert r.status == 200, await r.text()

                await ask()  # the primary, in effect, accepts every draft token
                drafted, accepted = seen()
                assert drafted > 0 and accepted == drafted
                # a canary that gets every request placed on the primary, and accepts nothing
                at = twins.router.start_canary(EngineInfo(0, "canary", True), 1.0)
                up = EngineUpstream(at)
                twins.upstreams.upstreams.append(up)
                up.release(canary.url)
                proxied = proxy.stats()["timings_draft_n"]
                await ask()
                assert proxy.stats()["timings_draft_n"] > proxied  # the proxy saw the canary's drafts ...
                assert seen() == (drafted, accepted)  # ... and the window did not
                twins.router.end_canary()
                twins.upstreams.upstreams.remove(up)
                assert twins.route_to(1, "test")  # the twin (n-gram, accepting nothing) is the step in effect
                await ask()
                assert seen()[0] > drafted and seen()[1] == accepted  # now its drafts are the window's

    with (
        Upstream.start("P", acceptance=1.0) as primary,
        Upstream.start("T", acceptance=0.0) as twin,
        Upstream.start("C", acceptance=0.0) as canary,
    ):
        asyncio.run(asyncio.wait_for(body(primary, twin, canary), 30))
