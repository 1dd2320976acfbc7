"""The fallback policy under a fake clock: every rule, and invariants over many synthetic traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specops.backends.counters import SpecCounters
from specops.config.profile import ChainStep, Profile
from specops.methods import Method
from specops.speedup import expected_speedup
from specops.watch.decision import HOLD, KEEP, RETRY, SWITCH, Decision, PolicyConfig, step_k
from specops.watch.policy import Policy
from specops.watch.window import NO_DATA, OK, SPEC_OFF, Sample, SampleBuffer, WindowStats

EAGLE = ChainStep(method=Method.EAGLE3, draft="org/eagle3-head", num_speculative_tokens=4)
NGRAM = ChainStep(method=Method.NGRAM)
NONE = ChainStep(method=Method.NONE)
CHAIN = [EAGLE, NGRAM, NONE]
W = 60.0


def cfg(**kw) -> PolicyConfig:
    base = dict(
        window_s=W,
        min_draft_tokens=200,
        consecutive_windows=2,
        cooldown_s=600,
        max_switches_per_hour=4,
        min_acceptance=0.6,
    )
    base.update(kw)
    return PolicyConfig(**base)


def win(
    acceptance: float,
    end: float,
    tokens: float = 1000,
    drafts: float | None = None,
    full: bool = True,
    coarse: bool = False,
) -> WindowStats:
    """A full OK window ending at ``end``."""
    accepted = acceptance * tokens
    return WindowStats(
        OK,
        window_s=W,
        start=end - W,
        end=end,
        acceptance=acceptance,
        draft_tokens=tokens,
        accepted=accepted,
        drafts=drafts,
        mean_acceptance_length=(1 + accepted / drafts) if drafts else None,
        full=full,
        coarse=coarse,
        reason="test window",
    )


def low_until_switch(p: Policy, start: float, acceptance: float = 0.3) -> tuple[Decision, float]:
    """Feed disjoint low windows from ``start`` until the policy acts; returns the decision and its time."""
    t = start
    for _ in range(100):
        t += W
        d = p.observe(win(acceptance, t), t)
        if d.action != KEEP:
            return d, t
    raise AssertionError("the policy never acted")


# ---------------------------------------------------------------------------------------------------
# the basic rules


def test_threshold_with_hysteresis():
    p = Policy(cfg(), CHAIN)
    d1 = p.observe(win(0.4, 60), 60)
    assert (d1.action, d1.rule) == (KEEP, "hysteresis")
    assert d1.numbers["streak"] == 1 and d1.numbers["acceptance"] == pytest.approx(0.4)
    d2 = p.observe(win(0.4, 120), 120)
    assert (d2.action, d2.rule) == (SWITCH, "threshold")
    assert d2.from_method is Method.EAGLE3 and d2.to_step == NGRAM and d2.to_index == 1
    assert d2.numbers["streak"] == 2 and d2.numbers["min_acceptance"] == 0.6
    assert "below min_acceptance 0.6 for 2 consecutive windows" in d2.reason
    assert d2.acts and d2.notable
    assert d2.to_dict()["to"] == "ngram" and d2.to_dict()["from"] == "eagle3"


def test_a_good_window_resets_the_streak():
    p = Policy(cfg(), CHAIN)
    assert p.observe(win(0.4, 60), 60).rule == "hysteresis"
    good = p.observe(win(0.75, 120), 120)
    assert (good.action, good.rule, good.numbers["streak"]) == (KEEP, "above-threshold", 0)
    assert p.observe(win(0.4, 180), 180).rule == "hysteresis"
    assert p.observe(win(0.4, 240), 240).action == SWITCH


def test_threshold_is_strict():
    p = Policy(cfg(consecutive_windows=1), CHAIN)
    assert p.observe(win(0.6, 60), 60).rule == "above-threshold"
    assert p.observe(win(0.5999, 120), 120).action == SWITCH


def test_overlapping_windows_do_not_count_twice():
    p = Policy(cfg(), CHAIN)
    assert p.observe(win(0.3, 60), 60).rule == "hysteresis"
    for t in (65, 90, 115):  # windows starting before 60 overlap the one that counted
        d = p.observe(win(0.3, t), t)
        assert (d.action, d.rule) == (KEEP, "not-fresh")
    assert p.observe(win(0.3, 120), 120).action == SWITCH


def test_min_draft_tokens_gate():
    p = Policy(cfg(consecutive_windows=1, min_draft_tokens=200), CHAIN)
    d = p.observe(win(0.1, 60, tokens=199), 60)
    assert (d.action, d.rule) == (KEEP, "min-draft-tokens") and "199" in d.reason
    assert p.observe(win(0.1, 61, tokens=200), 61).action == SWITCH


def test_partial_window_waits():
    p = Policy(cfg(consecutive_windows=1), CHAIN)
    d = p.observe(win(0.1, 30, full=False), 30)
    assert (d.action, d.rule) == (KEEP, "window-filling")


def test_idle_and_spec_off_never_decide():
    p = Policy(cfg(consecutive_windows=1), CHAIN)
    idle = WindowStats(NO_DATA, window_s=W, start=0, end=60, draft_tokens=0.0, reason="nothing drafted (idle)")
    for t in range(60, 6000, 60):
        d = p.observe(idle, t)
        assert (d.action, d.rule) == (KEEP, "no-data")
    off = WindowStats(SPEC_OFF, window_s=W, end=60, reason="no speculative series")
    first = p.observe(off, 6000)
    assert first.rule == "spec-off" and first.warning and "eagle3" in first.warning
    second = p.observe(off, 6060)
    assert second.rule == "spec-off" and second.warning is None  # warned once per method
    assert p.index == 0 and p.pending is None


def test_source_unavailable_warns_once_and_notes_recovery():
    p = Policy(cfg(consecutive_windows=1), CHAIN)
    down1 = p.observe(WindowStats.unavailable(60, "connection refused"), 60)
    assert (down1.action, down1.rule) == (KEEP, "source-unavailable") and "connection refused" in down1.warning
    down2 = p.observe(WindowStats.unavailable(65, "connection refused"), 65)
    assert down2.rule == "source-unavailable" and down2.warning is None and down2.numbers["down_s"] == 5
    back = p.observe(win(0.9, 130), 130)
    assert back.rule == "above-threshold" and "recovered after 70s" in back.reason and back.numbers["recovered"]
    assert p.observe(win(0.2, 190), 190).action == SWITCH  # deciding again once it is back


def test_pending_switch_is_not_repeated():
    p = Policy(cfg(consecutive_windows=1), CHAIN)
    assert p.observe(win(0.2, 60), 60).action == SWITCH
    d = p.observe(win(0.2, 120), 120)
    assert (d.action, d.rule) == (KEEP, "switch-pending")
    p.on_switched(1, 130)
    assert p.current == NGRAM and p.pending is None


def test_refused_switch_is_decided_again_on_the_next_window():
    p = Policy(cfg(consecutive_windows=2), CHAIN)
    p.observe(win(0.2, 60), 60)
    assert p.observe(win(0.2, 120), 120).action == SWITCH
    p.cancel_pending()
    assert p.observe(win(0.2, 150), 150).rule == "not-fresh"
    d = p.observe(win(0.2, 180), 180)
    assert d.action == SWITCH and d.numbers["streak"] == 3


def test_windows_from_before_a_switch_are_ignored():
    p = Policy(cfg(consecutive_windows=1, cooldown_s=0), CHAIN)
    assert p.observe(win(0.2, 60), 60).action == SWITCH
    p.on_switched(1, 100)
    stale = p.observe(win(0.2, 150), 150)  # starts at 90 < 100: still the old engine's samples
    assert stale.rule == "not-fresh"
    assert p.observe(win(0.2, 160), 160).action == SWITCH


def test_cooldown_after_a_switch():
    p = Policy(cfg(consecutive_windows=1, cooldown_s=600), CHAIN)
    assert p.observe(win(0.2, 60), 60).action == SWITCH
    p.on_switched(1, 60)
    t = 60
    for _ in range(9):  # 120 .. 600: inside the cooldown
        t += W
        d = p.observe(win(0.2, t), t)
        assert (d.action, d.rule) == (KEEP, "cooldown") and d.numbers["cooldown_until"] == 660
    d = p.observe(win(0.2, 660), 660)
    assert (d.action, d.to_step) == (SWITCH, NONE)


def test_chain_end_and_method_none():
    p = Policy(cfg(consecutive_windows=1, cooldown_s=0), [NGRAM], current=0)
    d = p.observe(win(0.1, 60), 60)
    assert (d.action, d.rule) == (HOLD, "chain-end") and d.to_step is None and "no fallback" in d.warning
    at_none = Policy(cfg(consecutive_windows=1), CHAIN, current=Method.NONE)
    assert at_none.current == NONE
    off = WindowStats(SPEC_OFF, window_s=W, end=60)
    for stats in (off, win(0.1, 60)):
        d = at_none.observe(stats, 60)
        assert (d.action, d.rule) == (KEEP, "no-speculation")


def test_fallback_disabled_only_reports():
    p = Policy(cfg(consecutive_windows=1, enabled=False), CHAIN)
    d = p.observe(win(0.1, 60), 60)
    assert (d.action, d.rule) == (HOLD, "fallback-disabled") and "would switch to ngram" in d.reason
    assert p.pending is None and p.index == 0


def test_flap_guard_holds_and_warns():
    steps = [
        ChainStep(method=m)
        for m in (Method.EAGLE3, Method.EAGLE, Method.MTP, Method.MEDUSA, Method.DRAFT_MODEL, Method.NGRAM, Method.NONE)
    ]
    p = Policy(cfg(consecutive_windows=1, cooldown_s=0, max_switches_per_hour=3), steps)
    t = 0.0
    for _ in range(3):
        d, t = low_until_switch(p, t)
        assert d.action == SWITCH
        p.on_switched(d.to_index, t)
    d, t2 = low_until_switch(p, t)
    assert (d.action, d.rule) == (HOLD, "flap-guard") and d.numbers["switches_last_hour"] == 3
    assert "flap guard" in d.warning and p.index == 3
    # an hour after the first switch the guard lets one more through
    first_switch = p.switch_times[0]
    t3 = first_switch + 3600
    d = p.observe(win(0.2, t3), t3)
    assert d.action == SWITCH and d.to_index == 4


def test_on_failed_start_moves_on():
    p = Policy(cfg(), CHAIN)
    d = p.on_failed_start(0, 10)
    assert (d.action, d.rule, d.to_step) == (SWITCH, "failed-start", NGRAM)
    last = p.on_failed_start(2, 20)
    assert (last.action, last.rule) == (HOLD, "chain-end") and last.warning


# ---------------------------------------------------------------------------------------------------
# retry with doubling back-off


def retry_policy(**kw) -> Policy:
    return Policy(
        cfg(
            consecutive_windows=1,
            cooldown_s=0,
            retry_enabled=True,
            retry_after_s=1800,
            retry_max_after_s=7200,
            max_switches_per_hour=100,
            **kw,
        ),
        CHAIN,
    )


def test_retry_after_backoff_then_success_resets_it():
    p = retry_policy()
    assert p.observe(win(0.2, 60), 60).action == SWITCH
    p.on_switched(1, 60)
    assert p.retry_due == 1860
    assert p.observe(win(0.9, 1800), 1800).rule == "above-threshold"
    d = p.observe(win(0.9, 1860), 1860)
    assert (d.action, d.rule, d.to_index) == (RETRY, "retry", 0) and d.numbers["retry_backoff_s"] == 1800
    p.on_switched(0, 1870)
    assert p.retry_origin == 1
    ok = p.observe(win(0.8, 1940), 1940)
    assert ok.rule == "retry-succeeded" and p.retry_backoff == 1800 and p.retry_origin is None


def test_retry_backoff_doubles_on_each_failure_and_is_capped():
    p = retry_policy()
    assert p.observe(win(0.2, 60), 60).action == SWITCH
    p.on_switched(1, 60)
    t = 60.0
    waits = []
    for _ in range(4):
        due = p.retry_due
        waits.append(due - t)
        d = p.observe(win(0.9, due), due)
        assert d.action == RETRY
        p.on_switched(0, due)
        t = due + W
        fail = p.observe(win(0.2, t), t)  # the better method is still bad: back to where it came from
        assert (fail.action, fail.rule, fail.to_index) == (SWITCH, "retry-failed", 1)
        p.on_switched(1, t)
    assert waits == [1800, 3600, 7200, 7200]


def test_retry_that_does_not_start_goes_back_and_doubles():
    p = retry_policy()
    p.observe(win(0.2, 60), 60)
    p.on_switched(1, 60)
    d = p.observe(win(0.9, 1860), 1860)
    assert d.action == RETRY
    back = p.on_failed_start(0, 1900)
    assert (back.action, back.rule, back.to_index) == (SWITCH, "retry-failed-start", 1)
    assert p.retry_backoff == 3600 and p.retry_due == 1900 + 3600 and p.index == 1


def test_retry_respects_the_flap_guard():
    p = Policy(
        cfg(consecutive_windows=1, cooldown_s=0, retry_enabled=True, retry_after_s=60, max_switches_per_hour=1), CHAIN
    )
    p.observe(win(0.2, 60), 60)
    p.on_switched(1, 60)
    d = p.observe(win(0.9, 200), 200)
    assert d.action == KEEP  # due, but one switch this hour already
    d = p.observe(win(0.9, 3700), 3700)
    assert d.action == RETRY


def test_no_retry_when_disabled():
    p = Policy(cfg(consecutive_windows=1, cooldown_s=0), CHAIN)
    p.observe(win(0.2, 60), 60)
    p.on_switched(1, 60)
    assert p.retry_due is None
    assert p.observe(win(0.9, 100_000), 100_000).action == KEEP


# ---------------------------------------------------------------------------------------------------
# model-based mode


def test_model_mode_uses_predicted_speedup():
    p = Policy(cfg(mode="model", consecutive_windows=1, draft_cost_ratio=0.2), CHAIN)
    # acceptance 0.45 is below the 0.6 threshold, but at k = 4 and c = 0.2 it still pays: keep
    d = p.observe(win(0.45, 60), 60)
    assert (d.action, d.rule) == (KEEP, "speedup-above-1")
    assert d.numbers["predicted_speedup"] > 1 and d.numbers["k"] == 4 and d.numbers["draft_cost_ratio"] == 0.2
    expect = expected_speedup(d.numbers["alpha"], 4, 0.2)
    assert d.numbers["predicted_speedup"] == pytest.approx(expect)
    low = p.observe(win(0.15, 120), 120)
    assert (low.action, low.rule) == (SWITCH, "model") and low.numbers["predicted_speedup"] < 1
    assert "predicted speedup" in low.reason and "α=" in low.reason


def test_model_mode_prefers_measured_mean_length():
    p = Policy(cfg(mode="model", consecutive_windows=1, draft_cost_ratio=0.1), CHAIN)
    # 1000 draft tokens over 500 drafts: k measured = 2; accepted 300 → τ = 1.6; speedup 1.6 / 1.2 > 1
    d = p.observe(win(0.3, 60, tokens=1000, drafts=500), 60)
    assert d.numbers["k"] == 2 and d.numbers["k_measured"] is True
    assert d.numbers["tokens_per_step"] == pytest.approx(1.6)
    assert d.numbers["predicted_speedup"] == pytest.approx(1.6 / 1.2) and d.action == KEEP


def test_model_mode_default_cost():
    p = Policy(cfg(mode="model", consecutive_windows=1), CHAIN)
    d = p.observe(win(0.5, 60), 60)
    assert d.numbers["draft_cost_ratio"] == 0.05


def test_coarse_is_reported_not_acted_on_unless_asked():
    p = Policy(cfg(consecutive_windows=1), CHAIN)
    d = p.observe(win(0.2, 60, coarse=True), 60)
    assert (d.action, d.rule) == (KEEP, "coarse") and "lifetime" in d.warning
    q = Policy(cfg(consecutive_windows=1, act_on_coarse=True), CHAIN)
    assert q.observe(win(0.2, 60, coarse=True), 60).action == SWITCH


# ---------------------------------------------------------------------------------------------------
# from a profile


def test_from_profile():
    prof = Profile.model_validate(
        {
            "name": "t",
            "backend": "vllm",
            "model": {"id": "org/m"},
            "speculative": {"method": "eagle3", "draft": "org/head", "num_speculative_tokens": 5},
            "fallback": {
                "min_acceptance": 0.55,
                "window": "2m",
                "consecutive_windows": 3,
                "cooldown": "5m",
                "mode": "model",
                "draft_cost_ratio": 0.1,
                "retry": {"enabled": True, "after": "10m"},
            },
        }
    )
    c = PolicyConfig.from_profile(prof)
    assert (c.min_acceptance, c.window_s, c.consecutive_windows, c.cooldown_s) == (0.55, 120.0, 3, 300.0)
    assert (c.mode, c.draft_cost_ratio, c.retry_enabled, c.retry_after_s) == ("model", 0.1, True, 600.0)
    p = Policy.from_profile(prof)
    assert [s.method for s in p.steps] == [Method.EAGLE3, Method.NGRAM, Method.NONE]
    assert step_k(p.steps[0]) == 5 and step_k(p.steps[1]) == 4 and step_k(p.steps[2]) == 0
    assert prof.steps[0].draft == "org/head"


def test_invalid_config():
    with pytest.raises(ValueError):
        PolicyConfig(mode="vibes")
    with pytest.raises(ValueError):
        Policy(cfg(), [])
    with pytest.raises(ValueError):
        Policy(cfg(), CHAIN, current=7)


# ---------------------------------------------------------------------------------------------------
# synthetic traces through the real window code, with invariants

TICK = 5.0


def simulate(
    config: PolicyConfig,
    steps,
    acceptance,
    duration: float,
    outages=frozenset(),
    idle=frozenset(),
    tokens_per_tick: float = 400.0,
    k: int = 4,
):
    """A synthetic engine: each tick drafts ``tokens_per_tick`` tokens (none while idle) and accepts
    ``acceptance(method, t)`` of them; a tick in ``outages`` cannot be read. Switches are confirmed at once
    and restart the engine (counters from zero, buffer cleared). Returns every decision made."""
    policy = Policy(config, steps)
    buf = SampleBuffer(config.window_s)
    tokens = accepted = drafts = 0.0
    decisions = []
    t = 0.0
    while t <= duration:
        tick = int(t // TICK)
        method = policy.current.method
        if method is not Method.NONE and tick not in idle:
            tokens += tokens_per_tick
            accepted += acceptance(method, t) * tokens_per_tick
            drafts += tokens_per_tick / k
        if tick in outages:
            stats = WindowStats.unavailable(t, "connection refused", config.window_s)
        else:
            counters = None if method is Method.NONE else SpecCounters(tokens, accepted, drafts)
            buf.add(Sample(t, counters))
            stats = buf.stats(t)
        d = policy.observe(stats, t)
        decisions.append((t, stats, d))
        if d.acts:
            policy.on_switched(d.to_index, t)
            buf.clear()
            tokens = accepted = drafts = 0.0
        t += TICK
    return policy, decisions


def test_trace_eagle_degrades_then_ngram_holds():
    acc = lambda m, t: {Method.EAGLE3: 0.8 if t < 600 else 0.3, Method.NGRAM: 0.7}[m]
    policy, decisions = simulate(cfg(), CHAIN, acc, 3000)
    acts = [(t, d) for t, _, d in decisions if d.acts]
    assert len(acts) == 1
    t, d = acts[0]
    assert d.to_step == NGRAM and d.rule == "threshold"
    assert 600 + 2 * W <= t <= 600 + 3 * W + TICK  # two disjoint low windows after the drop
    assert policy.current == NGRAM


def test_trace_all_bad_walks_the_chain_with_cooldown():
    policy, decisions = simulate(cfg(), CHAIN, lambda m, t: 0.1, 4000)
    acts = [(t, d) for t, _, d in decisions if d.acts]
    assert [d.to_step.method for _, d in acts] == [Method.NGRAM, Method.NONE]
    assert acts[1][0] - acts[0][0] >= 600
    assert decisions[-1][2].rule == "no-speculation"


def test_trace_outage_never_switches_and_recovers():
    outages = frozenset(range(10, 40))  # ticks 50 s .. 195 s unreadable
    policy, decisions = simulate(cfg(), CHAIN, lambda m, t: 0.2, 400, outages=outages)
    during = [d for t, _, d in decisions if int(t // TICK) in outages]
    assert all(d.action == KEEP and d.rule == "source-unavailable" for d in during)
    assert sum(1 for d in during if d.warning) == 1
    after = [d for t, _, d in decisions if int(t // TICK) == 40]
    assert "recovered" in after[0].reason
    assert any(d.acts for t, _, d in decisions if t > 200)


def test_trace_idle_engine_never_decides():
    idle = frozenset(range(0, 10_000))
    policy, decisions = simulate(cfg(), CHAIN, lambda m, t: 0.0, 3000, idle=idle)
    assert not any(d.acts or d.action == HOLD for _, _, d in decisions)
    assert {d.rule for _, _, d in decisions} <= {"no-data"}


segments = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0)), min_size=1, max_size=6
)


@given(
    segments,
    st.integers(1, 3),
    st.sampled_from([0.0, 120.0, 600.0]),
    st.integers(1, 4),
    st.sampled_from(["threshold", "model"]),
    st.booleans(),
    st.frozensets(st.integers(0, 600), max_size=150),
)
@settings(max_examples=100, deadline=None)
def test_invariants_over_random_traces(segs, n, cooldown, max_per_hour, mode, retry, outages):
    seg_len = 600.0
    config = cfg(
        consecutive_windows=n,
        cooldown_s=cooldown,
        max_switches_per_hour=max_per_hour,
        mode=mode,
        retry_enabled=retry,
        retry_after_s=300,
        retry_max_after_s=1200,
    )

    def acc(method, t):
        i = min(int(t // seg_len), len(segs) - 1)
        return segs[i][0] if method is Method.EAGLE3 else segs[i][1]

    duration = seg_len * len(segs)
    policy, decisions = simulate(config, CHAIN, acc, duration, outages=outages)
    again = simulate(config, CHAIN, acc, duration, outages=outages)[1]
    assert [d for _, _, d in decisions] == [d for _, _, d in again]  # deterministic

    switch_times = [t for t, _, d in decisions if d.acts]
    for t in switch_times:  # flap guard
        assert sum(1 for u in switch_times if t - 3600 < u <= t) <= max_per_hour
    for a, b in zip(switch_times, switch_times[1:]):  # cooldown
        assert b - a >= cooldown
    for _, stats, d in decisions:
        if d.action == SWITCH:  # never on no data / outage
            assert stats.status == OK and stats.full
            assert d.numbers["low"] and d.numbers["streak"] >= n  # hysteresis
            assert stats.draft_tokens >= config.min_draft_tokens
            assert d.to_index > d.from_index or d.rule == "retry-failed"
        if d.action == RETRY:  # time-based: any readable tick
            assert retry and d.to_index == 0 and stats.status != "unavailable"
        if d.rule == "source-unavailable":
            assert not d.acts
