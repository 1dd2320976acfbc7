"""The goodput policy on a fake clock and a synthetic surface; every expected choice is computed by hand below.

The surface (tokens/s; levels 1, 4, 16; interpolation is linear in log2(concurrency)):

    option             c=1   c=4   c=16   mean acceptance length
    none                30   100    200
    draft_model k=2     60   120    150   3.0
    draft_model k=4     80   110    120   5.0

At c=2 (halfway between 1 and 4 in log2): none 65, k=2 90, k=4 95.
draft_model k=4 vs none between 4 and 16 (t = (log2 c − 2) / 2): 110 + 10t = 100 + 100t at t = 1/9; the first
1/8-octave grid point at or past log2 c = 2.222 is 2.25, c = 2^2.25 = 4.76.
draft_model k=2 vs none: 120 + 30t = 100 + 100t at t = 2/7, log2 c = 2.571 → grid 2.625, c = 2^2.625 = 6.17.
"""

from __future__ import annotations

import json
import math

import pytest
from support_goodput import IDLE, Events, window

from specops.config.profile import ChainStep, load_profile
from specops.errors import ProfileError, SpecopsError
from specops.methods import Method
from specops.speedup import expected_tokens_per_step
from specops.watch.decide import FallbackDecider
from specops.watch.decision import HOLD, KEEP, SWITCH, PolicyConfig
from specops.watch.goodput import GoodputConfig, GoodputModel, Load, Option, alpha_from_length, bucket
from specops.watch.policy import Policy
from specops.watch.surface import Surface, load_surface, per_batch_schedule, scheduled_k
from specops.watch.watcher import Reading, Watcher, engine_load

DM = Method.DRAFT_MODEL
SURFACE = {
    "date": "2026-12-01",
    "engine_version": "test",
    "draft_sha": "abc",
    "points": [
        {"method": "none", "k": 0, "concurrency": c, "tokens_per_s": v} for c, v in ((1, 30), (4, 100), (16, 200))
    ]
    + [
        {"method": "draft_model", "k": 2, "concurrency": c, "tokens_per_s": v, "mean_acceptance_length": 3.0}
        for c, v in ((1, 60), (4, 120), (16, 150))
    ]
    + [
        {"method": "draft_model", "k": 4, "concurrency": c, "tokens_per_s": v, "mean_acceptance_length": 5.0}
        for c, v in ((1, 80), (4, 110), (16, 120))
    ],
}
PRIMARY = ChainStep(method=DM, draft="d.gguf", num_speculative_tokens=4)
NONE = ChainStep(method=Method.NONE)


def surface() -> Surface:
    return Surface.from_dict(SURFACE)


def policy(per_batch=None, **goodput) -> Policy:
    g = dict(hysteresis=0.05, sustain_s=10.0, min_dwell_s=30.0, regime_s=100.0, switch_cost_s=5.0)
    g.update(goodput)
    config = PolicyConfig(mode="goodput", window_s=20.0, min_draft_tokens=100, goodput=GoodputConfig(**g))
    return Policy(config, [PRIMARY, NONE], surface=surface(), per_batch=per_batch)


def at(c: float, tps: float | None = None) -> Load:
    return Load(concurrency=c, tokens_per_s=tps, source="test")


# ---------------------------------------------------------------------------------------------- surface


def test_surface_interpolates_in_log2_and_holds_flat_outside():
    s = surface()
    assert s.tokens_per_s(Method.NONE, 0, 2) == pytest.approx(65)
    assert s.tokens_per_s(DM, 2, 2) == pytest.approx(90)
    assert s.tokens_per_s(DM, 4, 2) == pytest.approx(95)
    assert s.tokens_per_s(DM, 4, 64) == 120  # past the last level: flat
    assert s.tokens_per_s(DM, 3, 2) is None  # never measured
    assert s.tau(DM, 4) == 5.0


def test_crossover_concurrency_per_option():
    s = surface()
    assert s.crossover(DM, 4) == pytest.approx(4.76, abs=0.01)
    assert s.crossover(DM, 2) == pytest.approx(6.17, abs=0.01)
    assert s.crossovers() == {"draft_model k=2": s.crossover(DM, 2), "draft_model k=4": s.crossover(DM, 4)}


def test_without_a_baseline_the_crossover_is_unknown_not_never():
    # a tune whose budget ran out before `none`: no crossover is claimed (None would read "pays everywhere")
    only = Surface.from_dict(
        {"points": [{"method": "draft_model", "k": 4, "concurrency": c, "tokens_per_s": 10.0 * c} for c in (1, 8)]}
    )
    assert only.crossover(DM, 4) is None and only.crossovers() == {}
    assert only.to_dict()["crossover"] == {}


def test_schedule_from_the_surface():
    # b=1: k4 80 best; b=2: k4 95 > k2 90; b=3 (t=0.79): k2 107.5 > k4 103.8 > none 85.5; b=5: k2 124.8 > none
    # 116.1; b=6 (t=0.29): none 129.25 > k2 128.8 → k 0 up to 16
    assert per_batch_schedule(surface(), DM, max_batch=16) == [[1, 2, 4], [3, 5, 2], [6, 16, 0]]
    assert per_batch_schedule(surface(), DM, max_batch=16, ks=[4]) == [[1, 4, 4], [5, 16, 0]]
    with pytest.raises(ValueError, match="no measurement of ngram"):
        per_batch_schedule(surface(), Method.NGRAM)
    assert scheduled_k([[1, 2, 4], [3, 5, 2], [6, 16, 0]], 4.4) == 2
    assert scheduled_k([[1, 2, 4]], 9) is None


def test_a_surface_that_is_wrong_says_where(tmp_path):
    bad = {"points": [{"method": "draft_model", "k": 2, "concurrency": 0, "tokens_per_s": 1}]}
    with pytest.raises(ValueError, match="surface point 0"):
        Surface.from_dict(bad)
    with pytest.raises(ValueError, match="surface point 0: 'tokens_per_s'"):
        Surface.from_dict({"points": [{"method": "none", "k": 0, "concurrency": 1}]})
    f = tmp_path / "p.tune.json"
    f.write_text(json.dumps({"tune_version": 1}))
    with pytest.raises(SpecopsError, match="holds no measured surface"):
        load_surface(f)
    with pytest.raises(SpecopsError, match="file not found"):
        load_surface(tmp_path / "missing.json")
    f.write_text(json.dumps({"tune": {"surface": SURFACE}}))  # a lock file's tune entry
    assert load_surface(f).levels() == [1, 4, 16]


def test_alpha_from_length_inverts_the_expected_length():
    for alpha, k in ((0.5, 4), (0.9, 3), (0.1, 8)):
        assert alpha_from_length(expected_tokens_per_step(alpha, k), k) == pytest.approx(alpha, abs=1e-6)
    assert [bucket(c) for c in (0, 1, 1.4, 1.5, 3, 5.5, 5.9, 16)] == [1, 1, 1, 2, 4, 4, 8, 16]  # nearest in log2


# ---------------------------------------------------------------------------------------------- the policy


def test_load_step_above_the_crossover_switches_to_none_after_sustain():
    p = policy()
    # c=16: k4 120, none 200; gain 80 > 5% of 120; sustain 10 s; cost 5 s × 120 = 600 tokens < 80 × 100 s
    d = p.observe(IDLE, 0.0, at(16))
    assert (d.action, d.rule) == (KEEP, "goodput-sustain")
    assert d.numbers["predicted"] == {"draft_model k=4": 120.0, "none": 200.0}
    assert d.numbers["surface"] == {"none": 200.0, "draft_model k=2": 150.0, "draft_model k=4": 120.0}
    assert p.observe(IDLE, 9.0, at(16)).rule == "goodput-sustain"
    d = p.observe(IDLE, 10.0, at(16))
    assert (d.action, d.rule, d.to_index) == (SWITCH, "goodput", 1)
    assert d.numbers["gain_tokens"] == pytest.approx(8000)
    assert d.numbers["cost_tokens"] == pytest.approx(600)
    assert d.numbers["switch_cost_basis"] == "configured"
    assert "concurrency 16.00" in d.reason and "200.0 tok/s" in d.reason
    assert p.observe(IDLE, 11.0, at(16)).rule == "switch-pending"


def test_load_falls_back_below_the_crossover_after_the_dwell():
    p = policy()
    p.observe(IDLE, 0.0, at(16))
    assert p.observe(IDLE, 10.0, at(16)).action == SWITCH
    p.on_switched(1, 12.0)
    # c=1 on none: k4 80 vs none 30; candidate since 13; sustained at 23 but the dwell lasts until 12 + 30 = 42
    assert p.observe(IDLE, 13.0, at(1)).rule == "goodput-sustain"
    d = p.observe(IDLE, 23.0, at(1))
    assert (d.rule, d.numbers["dwell_until"]) == ("goodput-dwell", 42.0)
    assert p.observe(IDLE, 41.9, at(1)).rule == "goodput-dwell"
    d = p.observe(IDLE, 42.0, at(1))
    assert (d.action, d.to_index) == (SWITCH, 0)


def test_a_short_burst_does_not_switch():
    p = policy()
    assert p.observe(IDLE, 0.0, at(16)).rule == "goodput-sustain"
    # the window mean falls below the crossover (16, 1, 1, 1 → 4.75 at 6 s: k4 110.1 vs none 112.3 → still
    # better by 2%, within the 5% hysteresis): the candidate is dropped, and the clock starts again
    for t in (2.0, 4.0, 6.0):
        d = p.observe(IDLE, t, at(1))
    assert d.rule == "goodput-hysteresis"
    assert p.goodput.candidate is None
    # back to 16: the window mean (16+1+1+1+16)/5 = 7 (k4 114.0, none 140.4) makes none the candidate again,
    # from 12 s on: the sustain time counts from there, not from 0
    d = p.observe(IDLE, 12.0, at(16))
    assert (d.rule, p.goodput.candidate_since) == ("goodput-sustain", 12.0)


def test_hysteresis_keeps_a_small_gain():
    p = policy(hysteresis=0.15)
    p.on_switched(1, -100.0)  # running none
    # c=4: k4 110 vs none 100: gain 10 ≤ 15% of 100
    d = p.observe(IDLE, 0.0, at(4))
    assert (d.rule, d.numbers["gain_tokens_per_s"]) == ("goodput-hysteresis", pytest.approx(10))


def test_the_switch_cost_must_be_earned_over_the_regime():
    p = policy(switch_cost_s=200.0)
    # c=16: cost 200 s × 120 = 24000 tokens; gain 80 tok/s × max(100, sustained) s
    p.observe(IDLE, 0.0, at(16))
    d = p.observe(IDLE, 10.0, at(16))
    assert (d.rule, d.numbers["gain_tokens"], d.numbers["cost_tokens"]) == (
        "goodput-switch-cost",
        pytest.approx(8000),
        pytest.approx(24000),
    )
    assert p.observe(IDLE, 300.0, at(16)).rule == "goodput-switch-cost"  # 80 × 300 = 24000: not more
    d = p.observe(IDLE, 305.0, at(16))  # the regime has lasted 305 s: 24400 > 24000
    assert (d.action, d.to_index) == (SWITCH, 1)


def test_a_switch_to_a_warm_engine_costs_no_start():
    """A twin already runs none: the same gain that could not pay for a 200 s restart switches at once (a route
    change), and only while that engine is live."""
    p = policy(switch_cost_s=200.0)
    warm: set[int] = set()
    p.goodput.warm = lambda: warm
    p.observe(IDLE, 0.0, at(16))
    assert p.observe(IDLE, 10.0, at(16)).rule == "goodput-switch-cost"  # the twin is down: a restart's price
    warm.add(1)
    d = p.observe(IDLE, 12.0, at(16))
    assert (d.action, d.to_index, d.numbers["switch_cost_s"], d.numbers["switch_cost_basis"]) == (
        SWITCH,
        1,
        0.0,
        "warm engine: a route change",
    )


def test_the_load_counts_while_the_engine_metrics_are_unreadable():
    """The concurrency is the proxy's: a tick whose acceptance source timed out decides nothing, but its load
    still enters the window's mean (the crossover route reads it)."""
    from specops.watch.window import WindowStats

    p = policy()
    for t in (0.0, 1.0, 2.0):
        d = p.observe(WindowStats.unavailable(t, "timed out", 60.0), t, at(16))
        assert d.rule == "source-unavailable"
    assert p.goodput.concurrency(2.0) == 16.0


def test_a_measured_switch_replaces_the_configured_cost():
    p = policy(switch_cost_s=None)
    assert p.goodput.switch_cost_s == (30.0, "default")
    p.note_engine_start(12.0)
    assert p.goodput.switch_cost_s == (12.0, "engine start")
    p.note_switch_cost(4.0)
    p.note_switch_cost(2.0)
    assert p.goodput.switch_cost_s == (3.0, "measured")


def test_a_window_without_a_count_of_drafts_still_shows_the_collapse():
    # llama-server's per-request timings give drafted and accepted tokens, not drafts: acceptance 0.05 at k=4
    # → τ = 1 + 0.05 × 4 = 1.2, the same prediction as a window with drafts: 80 × 1.2 / 5 = 19.2 < none 30
    p = policy()
    live = window(1.2, drafts=False)
    d = p.observe(live, 20.0, at(1))
    assert d.numbers["predicted"]["draft_model k=4"] == pytest.approx(19.2)
    assert d.numbers["mean_acceptance_length"] == pytest.approx(1.2) and d.rule == "goodput-sustain"
    assert "no count of drafts" in d.numbers["mean_acceptance_length_basis"]


def test_live_acceptance_collapse_makes_none_the_best_at_low_load():
    p = policy()
    # live mean acceptance length 1.2 at k=4 (recorded 5.0): k4 predicts 80 × 1.2 / 5 = 19.2 < none 30
    low = window(1.2)
    d = p.observe(low, 20.0, at(1))
    assert d.numbers["predicted"]["draft_model k=4"] == pytest.approx(19.2)
    assert d.rule == "goodput-sustain"
    assert p.observe(low, 30.0, at(1)).to_index == 1


def test_live_tokens_per_s_corrects_every_option_of_the_bucket():
    p = policy()
    p.on_switched(1, -100.0)  # none runs at c=1: predicted 30, live 15 → correction 0.5 for bucket 1
    d = p.observe(IDLE, 0.0, at(1, tps=15.0))
    assert d.numbers["correction"] == pytest.approx(0.5)
    assert d.numbers["predicted"] == {"draft_model k=4": 40.0, "none": 15.0}
    d = p.observe(IDLE, 1.0, at(1, tps=30.0))  # ratio 1.0: 0.5 + 0.3 × (1.0 − 0.5)
    assert d.numbers["correction"] == pytest.approx(0.65)


def test_a_per_batch_schedule_follows_load_without_restarts():
    p = policy(per_batch=[[1, 2, 4], [3, 5, 2], [6, 16, 0]])
    # c=16: the schedule drafts 0 there, so the primary predicts none's 200: nothing to gain by a restart
    d = p.observe(IDLE, 0.0, at(16))
    assert (d.rule, d.numbers["predicted"]["draft_model k=4 per batch size"]) == ("goodput-best", 200.0)
    assert p.observe(IDLE, 60.0, at(16)).action == KEEP


def test_a_schedule_s_k_0_range_is_predicted_from_the_idle_draft_when_measured():
    # vLLM still runs the draft's forward pass at k 0: with the idle draft measured (115 at 16, below none's 200)
    # the schedule at c=16 predicts 115, so restarting to none gains 85 tok/s: goodput-sustain, then a switch
    idle = [{"method": "draft_model", "k": 0, "concurrency": c, "tokens_per_s": v} for c, v in ((1, 25), (16, 115))]
    s = Surface.from_dict({**SURFACE, "points": SURFACE["points"] + idle})
    assert s.crossovers().keys() == {"draft_model k=2", "draft_model k=4"}  # k 0 drafts nothing: no crossover
    assert per_batch_schedule(s, DM, max_batch=16, ks=[4]) == [[1, 16, 4]]  # k4 120 > 115 at 16: no k 0
    g = dict(hysteresis=0.05, sustain_s=10.0, min_dwell_s=30.0, regime_s=100.0, switch_cost_s=5.0)
    config = PolicyConfig(mode="goodput", window_s=20.0, min_draft_tokens=100, goodput=GoodputConfig(**g))
    p = Policy(config, [PRIMARY, NONE], surface=s, per_batch=[[1, 2, 4], [3, 16, 0]])
    d = p.observe(IDLE, 0.0, at(16))
    assert d.rule == "goodput-sustain" and d.numbers["predicted"]["draft_model k=4 per batch size"] == 115.0
    assert p.observe(IDLE, 11.0, at(16)).action == SWITCH
    assert GoodputModel(s).raw(Option(DM, 4, per_batch=((1, 16, 0),)), 1) == 25.0  # the idle draft at 1 too


def test_without_a_load_reading_nothing_is_decided():
    d = policy().observe(IDLE, 0.0, None)
    assert (d.action, d.rule) == (KEEP, "goodput-no-load")


def test_fallback_disabled_and_the_flap_guard_hold():
    p = policy()
    p.config = PolicyConfig(**{**p.config.__dict__, "enabled": False})
    p.observe(IDLE, 0.0, at(16))
    assert p.observe(IDLE, 10.0, at(16)).action == HOLD
    p = policy()
    p.switch_times = [-10.0, -20.0, -30.0, -40.0]
    p.observe(IDLE, 0.0, at(16))
    d = p.observe(IDLE, 10.0, at(16))
    assert (d.action, d.rule) == (HOLD, "flap-guard")


# ---------------------------------------------------------------------------------------------- wiring


def test_decider_logs_each_change_of_verdict_and_shows_the_numbers():
    events = Events()
    decider = FallbackDecider(policy(), events=events, say=lambda m: None, clock=lambda: 0.0, wall=lambda: 0.0)
    for t in (0.0, 5.0, 10.0):
        decider.observe(IDLE, t, at(16))
    kinds = [(k, kw["rule"]) for k, kw in events.lines]
    assert kinds == [("goodput", "goodput-sustain"), ("decision", "goodput")]
    snap = decider.snapshot(10.0)
    assert snap["last_goodput"]["predicted"] == {"draft_model k=4": 120.0, "none": 200.0}
    assert snap["last_goodput"]["switch_cost_s"] == 5.0
    assert snap["policy"]["goodput"]["surface"]["crossover"]["draft_model k=4"] == pytest.approx(4.76, abs=0.01)


def test_watcher_prefers_the_proxys_in_flight_over_engine_gauges(tmp_path):
    class B:
        metric_prefix = "llamacpp:"

    text = "llamacpp:requests_processing 3\nllamacpp:requests_deferred 2\n"
    assert engine_load(B(), text) == 5.0
    assert engine_load(B(), "llamacpp:n_decode_total 9\n") is None

    class P:
        class monitor:
            interval = 1.0

    loaded = load_profile(_profile(tmp_path, "  chain: [none]\n"))
    decider = FallbackDecider.from_profile(loaded, events=Events(), say=lambda m: None)
    w = Watcher(P(), reader=None, decider=decider, say=print, concurrency=lambda: 7)
    assert w.load(Reading(IDLE, 10.0, engine_load=5.0)) == Load(7, 10.0, "proxy in flight + waiting")
    w.concurrency = lambda: None
    assert w.load(Reading(IDLE, 10.0, engine_load=5.0)) == Load(5.0, 10.0, "engine running + waiting")
    # a twin serves the step in effect (a route change): the watched primary idles, its tokens/s is not the step's
    decider.on_route_change(1, "test")
    assert w.load(Reading(IDLE, 10.0, engine_load=5.0)) == Load(5.0, None, "engine running + waiting")


def _profile(tmp_path, fallback: str):
    f = tmp_path / "p.yaml"
    f.write_text(
        "name: g\nbackend: llamacpp\nmodel: {id: /m/t.gguf}\n"
        "speculative: {method: draft_model, draft: /m/d.gguf, num_speculative_tokens: 4}\n"
        f"fallback:\n{fallback}",
        encoding="utf-8",
    )
    return f


def test_profile_goodput_fields_are_validated_with_locations(tmp_path):
    with pytest.raises(ProfileError) as info:
        load_profile(_profile(tmp_path, "  mode: goodput\n  goodput:\n    hysteresis: 2\n    sustian: 3s\n"), env={})
    text = "\n".join(str(p) for p in info.value.problems)
    assert "p.yaml:8:" in text and "fallback.goodput.hysteresis" in text
    assert "fallback.goodput.sustian" in text and "sustain" in text  # did you mean
    with pytest.raises(ProfileError, match="fallback.mode"):
        load_profile(_profile(tmp_path, "  mode: goodputt\n"), env={})


def test_decider_from_a_profile_reads_the_surface_it_names(tmp_path):
    rec = tmp_path / "p.tune.json"
    rec.write_text(json.dumps({"surface": SURFACE}))
    loaded = load_profile(
        _profile(tmp_path, f"  mode: goodput\n  chain: [none]\n  goodput: {{surface: {rec}, min_dwell: 2m}}\n"), env={}
    )
    decider = FallbackDecider.from_profile(loaded.profile, events=Events(), say=print)
    g = decider.policy.goodput
    assert g is not None and g.config.min_dwell_s == 120.0
    assert [o.label for o in g.options] == ["draft_model k=4", "none"]
    assert math.isclose(g.model.predict(g.options[0], 16), 120.0)
    bad = load_profile(_profile(tmp_path, "  mode: goodput\n  goodput: {surface: /nonexistent.json}\n"), env={})
    with pytest.raises(SpecopsError, match="file not found: /nonexistent.json"):
        FallbackDecider.from_profile(bad.profile, events=Events(), say=print)
