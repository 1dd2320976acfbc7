"""A method the policy has left keeps its last live acceptance, aged toward the surface's: the policy comes back
to try it (a probe) when the surface says it would pay, and a probe that fails doubles the wait. Fake clock,
synthetic surface; the expected times are computed by hand below.

The surface (as in test_goodput.py) at c=1: none 30 tok/s, draft_model k=4 80 tok/s with τ 5.0. With the live
τ 1.2 measured at t0 and a half-life H, the weight of the live τ is w = 0.5^((t − t0)/H), τ = 5 − 3.8·w, and
k=4 predicts 80·τ/5 = 80 − 60.8·w. It beats none's 30 by more than the 5 % hysteresis (1.5) once
w < 48.5/60.8 = 0.79770, i.e. t − t0 > H·log2(1/0.79770) = 0.32609·H.
"""

from __future__ import annotations

import pytest
from support_goodput import IDLE, window

from specops.config.profile import ChainStep
from specops.methods import Method
from specops.watch.decision import KEEP, SWITCH, PolicyConfig
from specops.watch.goodput import GoodputConfig, GoodputModel, Load
from specops.watch.policy import Policy
from specops.watch.surface import Surface

DM = Method.DRAFT_MODEL
SURFACE = {
    "points": [
        {"method": "none", "k": 0, "concurrency": c, "tokens_per_s": v} for c, v in ((1, 30), (4, 100), (16, 200))
    ]
    + [
        {"method": "draft_model", "k": 4, "concurrency": c, "tokens_per_s": v, "mean_acceptance_length": 5.0}
        for c, v in ((1, 80), (4, 110), (16, 120))
    ]
}
PRIMARY = ChainStep(method=DM, draft="d.gguf", num_speculative_tokens=4)
NONE = ChainStep(method=Method.NONE)


def policy(half_life: float = 100.0) -> Policy:
    g = GoodputConfig(
        hysteresis=0.05,
        sustain_s=10.0,
        min_dwell_s=30.0,
        regime_s=100.0,
        switch_cost_s=5.0,
        stale_half_life_s=half_life,
    )
    config = PolicyConfig(mode="goodput", window_s=20.0, min_draft_tokens=100, goodput=g)
    return Policy(config, [PRIMARY, NONE], surface=Surface.from_dict(SURFACE))


def at1() -> Load:
    return Load(concurrency=1, tokens_per_s=None, source="test")


def first_switch(p: Policy, start: int, end: int, stats=IDLE):
    """Tick once a second from ``start``; the first SWITCH decision (its time and decision), else None."""
    for t in range(start, end):
        d = p.observe(stats, float(t), at1())
        if d.action == SWITCH:
            return t, d
    return None


def test_the_expected_acceptance_ages_toward_the_surface():
    m = GoodputModel(Surface.from_dict(SURFACE), stale_half_life_s=100.0)
    assert m.expected_tau(DM, 4, 0.0) == 5.0  # never measured live: the surface's
    m.note_acceptance(DM, 1.2, 4, now=0.0)
    assert m.expected_tau(DM, 4, 0.0) == pytest.approx(1.2)
    assert m.expected_tau(DM, 4, 100.0) == pytest.approx(3.1)  # w 0.5: 5 − 3.8/2
    assert m.expected_tau(DM, 4, 200.0) == pytest.approx(4.05)  # w 0.25
    m.backoff[DM] = 2.0  # a failed probe: the half-life is 200 s
    assert m.expected_tau(DM, 4, 200.0) == pytest.approx(3.1)


def test_a_collapse_is_left_then_probed_and_a_failed_probe_doubles_the_wait():
    p = policy(half_life=100.0)
    # the collapse: τ 1.2 → k=4 predicts 19.2 < none 30; candidate at 20, switch after the 10 s sustain
    assert p.observe(window(1.2), 20.0, at1()).rule == "goodput-sustain"
    d = p.observe(window(1.2), 30.0, at1())
    assert (d.action, d.to_index) == (SWITCH, 1)
    p.on_switched(1, 32.0)
    # on none, the live τ (measured at 30) ages: k=4 beats none by > 1.5 from t > 30 + 32.609 = 62.609; the
    # candidate starts at 63 (62: w 0.8011, 31.30 tok/s, within the hysteresis), the switch 10 s later
    assert p.observe(IDLE, 62.0, at1()).rule == "goodput-hysteresis"
    t, d = first_switch(p, 63, 200)
    assert (t, d.to_index) == (73, 0)
    aged = d.numbers["aged_acceptance"]["draft_model k=4"]
    assert aged["age_s"] == 43.0 and aged["half_life_s"] == 100.0
    assert aged["weight"] == pytest.approx(0.5**0.43, abs=1e-3)
    assert aged["expected_tau"] == pytest.approx(5 - 3.8 * 0.5**0.43, abs=1e-3)
    assert d.numbers["predicted"]["draft_model k=4"] == pytest.approx(80 - 60.8 * 0.5**0.43, abs=0.01)
    assert "a probe" in d.reason
    p.on_switched(0, 75.0)
    assert 0 in p.goodput.probes
    # the probe: the aged prediction (35.8 at 76) keeps it until a fresh window says τ is still 1.2 (at 95);
    # the switch back waits for the sustain (105) and the dwell (75 + 30 = 105)
    assert p.observe(IDLE, 76.0, at1()).rule == "goodput-best"
    t, d = first_switch(p, 95, 200, window(1.2))
    assert (t, d.to_index) == (105, 1)
    p.on_switched(1, 107.0)  # left 32 s after entering: within the regime (100 s) → the half-life doubles
    assert p.goodput.model.half_life(DM) == 200.0
    # the next return: measured at 105, w < 0.79770 once t − 105 > 0.32609 × 200 = 65.2 → candidate at 171,
    # switch at 181: twice the 33 s the first return took
    t, d = first_switch(p, 108, 400)
    assert (t, d.to_index) == (181, 0)
    p.on_switched(0, 183.0)
    # this time acceptance is back (τ 4.8: 76.8 tok/s against 30): the probe lasts a regime and the half-life
    # is the configured one again (at 183 + 100 = 283, not before)
    for t in range(184, 283):
        assert p.observe(window(4.8), float(t), at1()).action == KEEP
    assert p.goodput.model.half_life(DM) == 200.0
    p.observe(window(4.8), 283.0, at1())
    assert p.goodput.model.half_life(DM) == 100.0 and p.goodput.probes == {}


def test_without_aging_a_collapse_is_never_tried_again():
    # a half-life of ~forever: the collapsed τ keeps k=4 at 19.2 < 30 for good (what the policy did before)
    p = policy(half_life=1e12)
    p.observe(window(1.2), 20.0, at1())
    assert p.observe(window(1.2), 30.0, at1()).action == SWITCH
    p.on_switched(1, 32.0)
    assert first_switch(p, 33, 2000) is None


@pytest.mark.parametrize("half_life", [100.0, 1e12])
def test_a_method_left_for_load_comes_back_when_load_falls_not_later(half_life):
    # live τ 5.0 = the surface's: aging changes nothing, so the return is no probe and comes at the same time
    # as without aging
    p = policy(half_life=half_life)
    p.observe(window(5.0), 0.0, Load(16, None, "test"))
    d = p.observe(window(5.0), 10.0, Load(16, None, "test"))
    assert (d.action, d.to_index) == (SWITCH, 1)
    p.on_switched(1, 12.0)
    for t in range(13, 33):  # 20 s at c=16 fill the concurrency window
        p.observe(IDLE, float(t), Load(16, None, "test"))
    # from 33 on, c=1; the window holds the readings of the last 20 s (21 of them). At 48: 5 × 16 + 16 × 1 → 4.57,
    # k=4 110.96 vs none 109.63 (within the hysteresis); at 49: 4 × 16 + 17 → 3.86, 109.21 vs 98.16 (t = log2
    # 3.86 / 2 = 0.974: 80 + 30t and 30 + 70t): the candidate; the switch 10 s of sustain later, at 59
    t, d = first_switch(p, 33, 200)
    assert d.to_index == 0 and "probe" not in d.reason and "aged_acceptance" not in d.numbers
    p.on_switched(0, t + 1.0)
    assert p.goodput.probes == {}
    assert t == 59


def test_the_switch_cost_counts_the_restart_and_half_the_drain():
    # the decider notes the new engine's start (1 s) before the watcher notes the switch (9 s from the decision):
    # 8 s of drain and stop, half of it lost (requests in flight are still served), + 1 s with nothing served
    p = policy()
    p.note_engine_start(1.0)
    p.note_switch_cost(9.0)
    assert p.goodput.switch_cost_s == (5.0, "measured")
    p.note_engine_start(2.0)
    p.note_switch_cost(4.0)  # 2 + 2/2 = 3: the moving average of 5 and 3
    assert p.goodput.switch_cost_s == (4.0, "measured")

    # on none at c = 2^(31/15) ≈ 4.19 (t = (log2 c − 2)/2 = 1/30): k4 110 + 10t = 110.33 vs none 100 + 100t = 103.33, gain 7
    # (> 5 % of 103.33); over the regime (100 s) 700 tokens: more than 5 s × 103.33 = 517, less than the 9 s the
    # switch took (930), which would hold it
    def run(start_s):
        q = policy()
        q.on_switched(1, -100.0)
        if start_s is not None:
            q.note_engine_start(start_s)
        q.note_switch_cost(9.0)
        q.observe(IDLE, 0.0, Load(2 ** (31 / 15), None, "test"))
        return q.observe(IDLE, 10.0, Load(2 ** (31 / 15), None, "test"))

    d = run(1.0)
    assert (d.action, d.to_index, d.numbers["switch_cost_s"]) == (SWITCH, 0, 5.0)
    assert d.numbers["gain_tokens"] == pytest.approx(700, abs=1)
    d = run(None)  # no start noted: the whole 9 s count
    assert (d.rule, d.numbers["cost_tokens"]) == ("goodput-switch-cost", pytest.approx(930, abs=1))
