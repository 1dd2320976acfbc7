"""A canary for a new draft (``routing.canary``): the profile setting, the router's share, the decider's verdict,
and `specops up` with stand-in engines (support_canary.py: each draft's acceptance is in its file name) rolling a
worse draft back and a good one out under load, losing no request.

Real parts: profiles loaded by the real loader, the real router and decider, `specops up` as in production
(its proxy, supervisors, reloader) with stand-in engine processes speaking llama-server's API.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support_load import Load
from support_ports import free_port
from support_procs import stop_group
from support_routing import request_headers
from support_up import standin_up, write_profile

from specops.config.profile import load_profile
from specops.errors import ProfileError
from specops.watch.canary import CANARY, CURRENT, CanaryTally
from specops.watch.decide import FallbackDecider

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent

BASE = """\
name: t
backend: llamacpp
model: {id: /models/target.gguf}
speculative: {method: draft_model, draft: /models/draft.gguf}
fallback: {chain: [none]}
"""


def _load(tmp_path, extra: str, base: str = BASE):
    path = tmp_path / "p.yaml"
    path.write_text(base + extra)
    return load_profile(path)


# ------------------------------------------------------------------------------------------------ the setting


def test_canary_setting_loads_with_its_defaults(tmp_path):
    off = _load(tmp_path, "routing: {twins: [none]}\n").profile.routing.canary
    assert not off.enabled
    c = _load(
        tmp_path, "routing:\n  twins: [none]\n  canary: {enabled: true, share: 0.2, max_duration: 2m}\n"
    ).profile.routing.canary
    assert c.enabled and c.share == 0.2 and c.max_duration == 120.0
    assert c.min_draft_tokens == 500 and c.tolerance == 0.05


@pytest.mark.parametrize(
    ("extra", "base", "where", "says"),
    [
        ("routing:\n  canary: {enabled: true}\n", BASE, "p.yaml:7:", "add routing.twins"),
        (
            "routing:\n  twins: [none]\n  canary: {enabled: true, share: 0.9}\n",
            BASE,
            "p.yaml:8:",
            "routing.canary.share: Input should be less than or equal to 0.5",
        ),
        (
            "routing:\n  twins: [none]\n  canary: {enabled: true, tolerance: -1}\n",
            BASE,
            "p.yaml:8:",
            "routing.canary.tolerance",
        ),
        (
            "routing:\n  twins: [none]\n  canary: {enabled: true, max_duration: soon}\n",
            BASE,
            "p.yaml:8:",
            "routing.canary.max_duration",
        ),
        (
            "routing:\n  twins: [ngram]\n  canary: {enabled: true}\n",
            BASE.replace("method: draft_model, draft: /models/draft.gguf", "method: none").replace("[none]", "[ngram]"),
            "p.yaml:8:",
            "the primary does not speculate",
        ),
    ],
)
def test_canary_problems_are_located(tmp_path, extra, base, where, says):
    with pytest.raises(ProfileError) as err:
        _load(tmp_path, extra, base)
    text = str(err.value)
    line = next((ln for ln in text.splitlines() if says in ln), None)
    assert line is not None, text
    assert where in line, text


# ------------------------------------------------------------------------------------------------ the router


def _router(tmp_path, extra: str = ""):
    from specops.proxy.router import EngineInfo, Router

    profile = _load(tmp_path, "routing:\n  twins: [none]\n" + extra).profile
    router = Router(profile.routing, [EngineInfo(0, "draft_model", True), EngineInfo(1, "none", False)])
    return router, EngineInfo


def test_the_canary_gets_its_share_of_the_primarys_requests_evenly(tmp_path):
    router, EngineInfo = _router(tmp_path)
    h, body = request_headers(), b"{}"
    assert router.route("/v1/completions", h, body, (True, True)).engine == 0  # no canary: as before
    at = router.start_canary(EngineInfo(0, "canary", True), 0.25)
    assert at == 2 and router.engine_for_step(0) == 0
    live = (True, True, True)
    routes = [router.route("/v1/completions", h, body, live) for _ in range(40)]
    assert [r.engine for r in routes].count(2) == 10
    assert all(r.reason == "canary" for r in routes if r.engine == 2)
    assert [r.engine for r in routes[:8]] == [0, 0, 0, 2, 0, 0, 0, 2]  # evenly spread, not random
    # requests asked off stay on the engine without speculation; a canary not live takes nothing
    off = request_headers(**{"X-Specops-Speculation": "off"})
    assert {router.route("/", off, body, live).engine for _ in range(8)} == {1}
    assert {router.route("/", h, body, (True, True, False)).engine for _ in range(8)} == {0}
    # the default route on the twin (a fallback): its requests are not the primary's, the canary gets none
    router.current = 1
    assert {router.route("/", h, body, live).engine for _ in range(8)} == {1}
    router.current = 0
    router.end_canary()
    assert router.canary is None and len(router.engines) == 2
    assert {router.route("/", h, body, (True, True)).engine for _ in range(8)} == {0}


def test_while_a_canary_is_measured_a_vllm_answers_own_counters_are_read_without_classes(tmp_path):
    """vLLM reports an answer's draft counters in its body (``metrics.speculative_decoding``), read for learned
    classes; while a canary is measured they are read for every answer, so both sides of the tally get them."""
    from aiohttp import web

    from specops.proxy.forward import Flight, Generation
    from specops.proxy.routes import RoutedUpstreams

    router, _ = _router(tmp_path)
    seen = []
    upstreams = RoutedUpstreams(router, on_route=lambda route, flight, ok, *_: seen.append(flight.totals))
    route = router.route("/v1/completions", request_headers(), b"{}", (True, True))
    assert route.key is None
    answer = {"choices": [{"text": "x"}], "metrics": {"speculative_decoding": {"num_draft_tokens": 32}}}
    answer["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] = 12
    body = json.dumps(answer).encode()
    upstreams.finished(route, Flight(Generation(1, "http://127.0.0.1:9")), True, web.Response(body=body))
    upstreams.counting = True
    upstreams.finished(route, Flight(Generation(1, "http://127.0.0.1:9")), True, web.Response(body=body))
    assert seen == [None, {0: (32, 12)}]


# ------------------------------------------------------------------------------------------------ the decider


def _tally(canary: tuple[int, int], current: tuple[int, int]) -> CanaryTally:
    t = CanaryTally()
    t.note(CANARY, *canary)
    t.note(CURRENT, *current)
    return t


@pytest.mark.parametrize(
    ("canary", "current", "elapsed", "verdict", "says"),
    [
        ((1000, 500), (1000, 990), 10, False, "worse by 0.490, more than tolerance 0.05"),
        ((1000, 950), (1000, 990), 10, True, "not worse by more than tolerance"),  # 0.04 lower: within
        ((1000, 1000), (1000, 900), 10, True, "not worse"),
        ((100, 50), (1000, 990), 10, None, "measuring"),  # the canary has not drafted enough yet
        ((1000, 950), (100, 99), 10, None, "measuring"),  # nor has the current draft
        ((100, 99), (1000, 990), 600, False, "not proven"),  # max_duration passed without the evidence
    ],
)
def test_the_decider_judges_a_canary_on_both_sides_of_the_same_period(
    tmp_path, canary, current, elapsed, verdict, says
):
    decider = FallbackDecider.from_profile(_load(tmp_path, ""), events=None, say=lambda m: None)
    got, why = decider.judge_canary(
        _tally(canary, current), min_draft_tokens=500, tolerance=0.05, elapsed=elapsed, max_duration=600
    )
    assert got is verdict and says in why, why


def test_a_tally_counts_answers_that_did_not_draft_without_their_tokens():
    t = CanaryTally()
    t.note(CANARY, 0, 0)
    t.note(CANARY, 10, 7)
    t.note(CANARY, 5, 9)  # impossible counters (accepted > drafted) are not counted
    assert t.canary.answers == 3 and t.canary.drafting == 1 and t.canary.acceptance == 0.7


# ------------------------------------------------------------------------------------------------ specops up


def _state(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "canary" / "state.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _events(state_dir: Path, kind: str) -> list[dict]:
    try:
        lines = (state_dir / "canary" / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def _start_up(tmp_path, doc: dict):
    profile = write_profile(tmp_path / "canary.yaml", doc)
    proc = standin_up(tmp_path, profile, "support_canary.py")
    state_dir = Path(doc["supervisor"]["state_dir"])

    def wait(pred, what: str, timeout: float = 40) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = _state(state_dir)
            if st and pred(st):
                return st
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.05)
        log = (tmp_path / "up.log").read_text()[-3000:]
        raise AssertionError(f"timed out waiting for {what}: {_state(state_dir)}\n{log}")

    return profile, proc, wait


def _doc(tmp_path, drafts: tuple[str, ...], canary: dict) -> dict:
    for name in ("target.gguf", *drafts):
        (tmp_path / name).write_bytes(b"GGUF")
    return {
        "name": "canary",
        "backend": "llamacpp",
        "model": {"id": str(tmp_path / "target.gguf")},
        "speculative": {"method": "draft_model", "draft": str(tmp_path / drafts[0])},
        "gpus": {"devices": []},
        "server": {"port": free_port()},
        "fallback": {"enabled": False, "chain": ["none"]},
        "monitor": {"interval": 0.2, "timeout": 1},
        "supervisor": {"state_dir": str(tmp_path / "state"), "stop_timeout": 5, "restart_backoff": 0.1},
        "routing": {"twins": ["none"], "canary": {"enabled": True, **canary}},
    }


def test_standin_up_rolls_back_a_draft_that_cannot_start_is_not_proven_or_is_superseded(tmp_path):
    """No load: a draft whose engine exits before it is ready is rolled back at once; a canary a newer file
    replaces is aborted (the newer one is measured instead); one that never drafts `min_draft_tokens` within
    `max_duration` is rolled back as not proven. The primary engine never restarts."""
    import signal

    doc = _doc(
        tmp_path,
        ("draft-0.9.gguf", "draft-broken.gguf", "draft-0.5.gguf", "draft-0.6.gguf"),
        {"min_draft_tokens": 1_000_000, "max_duration": "4s"},
    )
    state_dir = tmp_path / "state"
    profile, proc, wait = _start_up(tmp_path, doc)

    def reload_to(draft: str) -> None:
        doc["speculative"]["draft"] = str(tmp_path / draft)
        write_profile(profile, doc)
        proc.send_signal(signal.SIGHUP)

    try:
        st = wait(lambda s: s.get("state") == "ready" and all(e["live"] for e in s.get("engines", [])), "serving")
        primary_pid = st["engine_pid"]
        reload_to("draft-broken.gguf")
        st = wait(lambda s: s["canary"]["outcomes"]["rolled_back"] == 1, "the broken draft's rollback")
        assert "the canary's engine failed" in st["canary"]["last"]["reason"], st["canary"]
        assert "the new draft was refused live" in st["profile_reload"]["rejected"]["message"]

        reload_to("draft-0.5.gguf")
        wait(lambda s: (s["canary"]["running"] or {}).get("state") == "measuring", "the canary measuring")
        reload_to("draft-0.6.gguf")
        st = wait(lambda s: s["canary"]["outcomes"]["aborted"] == 1, "the abort")
        rejected = [e["message"] for e in _events(state_dir, "reload-rejected")]
        assert "the new draft's canary was aborted" in rejected[1], rejected  # then the newer file was applied
        aborted = _events(state_dir, "canary_aborted")[0]
        assert aborted["draft"].endswith("draft-0.5.gguf") and "newer profile" in aborted["reason"]
        st = wait(lambda s: s["canary"]["outcomes"]["rolled_back"] == 2, "the newer draft's rollback", 30)
        last = st["canary"]["last"]
        assert last["draft"].endswith("draft-0.6.gguf") and "not proven" in last["reason"], last
        assert st["engine_pid"] == primary_pid and len(st["engines"]) == 2
        assert len(_events(state_dir, "reload")) == 3
        said = (tmp_path / "up.log").read_text()
        assert said.count("a canary measures the new draft on live traffic before the primary restarts on it") == 3
        assert "restarting the engine with the new profile" not in said
        assert [e["draft"].rsplit("/", 1)[-1] for e in _events(state_dir, "canary_started")] == [
            "draft-broken.gguf",
            "draft-0.5.gguf",
            "draft-0.6.gguf",
        ]
        # specops stops while a canary measures: its engine stops with the others
        reload_to("draft-0.5.gguf")
        st = wait(lambda s: (s["canary"]["running"] or {}).get("state") == "measuring", "a canary measuring")
        canary_pid = st["engines"][-1]["engine_pid"]
        assert st["engines"][-1]["canary"] and canary_pid
    finally:
        proc.terminate()
        try:
            rc = proc.wait(timeout=60)
        finally:
            stop_group(proc, timeout=5)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    from specops.run.process import group_members

    assert not group_members(canary_pid)
    assert not _events(state_dir, "canary_rolled_back")[2:], "stopping is not a rollback"


def test_standin_up_rolls_a_worse_draft_back_and_a_good_one_out_under_load(tmp_path):
    """`specops up` on stand-in engines (acceptance 0.9 in service): a reload to a draft accepting 0.3 starts a
    canary that gets its share of the traffic, is rolled back (the primary engine never restarts, the reload is
    reported rejected with both acceptances); a reload to a draft accepting 0.88 passes and the primary restarts
    on it; 16 clients lose nothing over the whole run."""
    from specops.run.process import group_members

    state_dir, port = tmp_path / "state", free_port()
    for name in ("target.gguf", "draft-0.9.gguf", "draft-0.3.gguf", "draft-0.88.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    doc = {
        "name": "canary",
        "backend": "llamacpp",
        "model": {"id": str(tmp_path / "target.gguf")},
        "speculative": {"method": "draft_model", "draft": str(tmp_path / "draft-0.9.gguf")},
        "gpus": {"devices": []},
        "server": {"port": port},
        "fallback": {"enabled": False, "chain": ["none"]},
        "monitor": {"interval": 0.2, "timeout": 1},
        "supervisor": {"state_dir": str(state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
        "routing": {
            "twins": ["none"],
            "canary": {"enabled": True, "share": 0.25, "min_draft_tokens": 300, "tolerance": 0.05},
        },
    }
    profile, proc, wait = _start_up(tmp_path, doc)
    pids: list[int] = []
    load = Load(f"http://127.0.0.1:{port}", clients=16, max_tokens=16, request_timeout=30, max_seconds=100)
    try:
        st = wait(lambda s: s.get("state") == "ready" and all(e["live"] for e in s.get("engines", [])), "serving")
        primary_pid = st["engine_pid"]
        pids += [primary_pid, st["engines"][1]["engine_pid"]]
        load.start()
        load.wait_for_answers(20, timeout=30)

        # 1. a worse draft: measured beside the primary, rolled back; the primary never restarted
        doc["speculative"]["draft"] = str(tmp_path / "draft-0.3.gguf")
        write_profile(profile, doc)
        st = wait(lambda s: (s.get("canary") or {}).get("running") is not None, "the canary to start")
        assert st["engines"][-1]["canary"] is True
        back = wait(lambda s: s["canary"]["outcomes"]["rolled_back"] == 1, "the rollback", 60)
        ev = _events(state_dir, "canary_rolled_back")[0]
        # the stand-ins accept int(drafted × acceptance) per answer: a short answer rounds down by up to 1/drafted
        assert ev["canary_acceptance"] == pytest.approx(0.3, abs=0.05)
        assert ev["current_acceptance"] == pytest.approx(0.9, abs=0.05)
        assert ev["tally"]["canary"]["draft_tokens"] >= 300 and ev["draft"].endswith("draft-0.3.gguf")
        assert back["engine_pid"] == primary_pid and len(back["engines"]) == 2
        rejected = back["profile_reload"]["rejected"]
        assert rejected is not None and "the new draft was refused live" in rejected["message"], rejected
        assert back["canary"]["last"]["outcome"] == "rolled_back"
        assert _events(state_dir, "reload-rejected"), "the reload was not reported rejected"
        # what an operator sees: the text status, /specops/status and /specops/metrics say the draft was refused
        text = subprocess.run(
            [sys.executable, "-m", "specops.cli", "status", str(profile)], capture_output=True, text=True, timeout=30
        ).stdout
        assert "canary     last:" in text and re.search(r"rolled_back, live acceptance 0\.[23]", text), text
        assert "the new draft was refused live by its canary" in text, text
        live = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/specops/status", timeout=10).read())
        assert live["canary"]["last"]["outcome"] == "rolled_back"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/specops/metrics", timeout=10).read().decode()
        assert 'specops_canary_outcomes_total{outcome="rolled_back"} 1.0' in metrics, metrics
        assert "specops_profile_reload_failed 1.0" in metrics
        canary_starts = [e for e in _events(state_dir, "start") if e.get("engine") == "canary"]
        assert len(canary_starts) == 1 and "draft-0.3.gguf" in " ".join(canary_starts[0]["argv"])

        # 2. a good draft: measured, passed, the primary restarts on it
        doc["speculative"]["draft"] = str(tmp_path / "draft-0.88.gguf")
        write_profile(profile, doc)
        out = wait(
            lambda s: (
                s["canary"]["outcomes"]["rolled_out"] == 1
                and s.get("engine_pid") not in (None, primary_pid)
                and s.get("state") == "ready"
            ),
            "the rollout",
            60,
        )
        pids.append(out["engine_pid"])
        passed = _events(state_dir, "canary_passed")[0]
        assert passed["canary_acceptance"] == pytest.approx(0.88, abs=0.05)  # rounded down as above
        assert out["profile_reload"]["rejected"] is None and len(out["engines"]) == 2
        starts = [e for e in _events(state_dir, "start") if e.get("engine") is None]
        assert "draft-0.88.gguf" in " ".join(starts[-1]["argv"])
        load.wait_for_answers(20, timeout=30)
    finally:
        if load._thread.is_alive():
            load.stop()
        proc.terminate()
        try:
            rc = proc.wait(timeout=60)
        finally:
            stop_group(proc, timeout=5)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert load.lost == 0 and load.counts["stream_error"] == 0, load.report()
    assert all(not group_members(pid) for pid in pids if pid)
