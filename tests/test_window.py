"""Windowed acceptance from counter samples: deltas, resets, idle, absent series, coarse, the buffer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specops.backends.counters import SpecCounters
from specops.watch.window import NO_DATA, OK, SPEC_OFF, UNAVAILABLE, Sample, SampleBuffer, WindowStats, window_stats


def c(tokens, accepted, drafts=None, per_pos=(), **kw) -> SpecCounters:
    return SpecCounters(
        draft_tokens=float(tokens),
        accepted=float(accepted),
        drafts=None if drafts is None else float(drafts),
        per_position=tuple(float(x) for x in per_pos),
        **kw,
    )


def test_acceptance_and_mean_length_from_deltas():
    samples = [
        Sample(0, c(1000, 900, 250, [240, 220, 200, 180])),
        Sample(30, c(1200, 1000, 300, [260, 240, 210, 190])),
        Sample(60, c(1400, 1100, 350, [280, 260, 220, 200])),
    ]
    s = window_stats(samples, now=60, window_s=60)
    assert s.status == OK and s.full
    assert (s.draft_tokens, s.accepted, s.drafts) == (400.0, 200.0, 100.0)
    assert s.acceptance == pytest.approx(0.5)
    assert s.mean_acceptance_length == pytest.approx(3.0)
    assert s.mean_draft_length == pytest.approx(4.0)
    assert s.per_position == pytest.approx((0.4, 0.4, 0.2, 0.2))
    assert (s.start, s.end, s.samples, s.resets) == (0, 60, 3, 0)


def test_baseline_is_newest_sample_at_or_before_window_start():
    samples = [Sample(t, c(100 * t, 50 * t)) for t in range(0, 101, 10)]
    s = window_stats(samples, now=100, window_s=35)
    assert s.start == 60 and s.end == 100 and s.full  # 60 <= 100 - 35 < 70
    assert s.draft_tokens == 4000.0


def test_short_history_is_not_full():
    samples = [Sample(0, c(0, 0)), Sample(5, c(500, 400))]
    s = window_stats(samples, now=5, window_s=60)
    assert s.status == OK and not s.full and s.acceptance == pytest.approx(0.8)


def test_idle_engine_is_no_data_never_zero():
    samples = [Sample(t, c(5000, 4000, 1000)) for t in (0, 20, 40, 60)]
    s = window_stats(samples, now=60, window_s=60)
    assert s.status == NO_DATA and s.acceptance is None and "idle" in s.reason
    assert s.draft_tokens == 0.0


def test_absent_series_is_spec_off():
    s = window_stats([Sample(0, None), Sample(10, None)], now=10, window_s=60)
    assert s.status == SPEC_OFF and s.acceptance is None


def test_too_few_samples():
    assert window_stats([], now=10, window_s=60).status == NO_DATA
    s = window_stats([Sample(0, c(10, 5))], now=10, window_s=60)
    assert s.status == NO_DATA and "two" in s.reason


def test_future_samples_are_ignored():
    samples = [Sample(0, c(0, 0)), Sample(60, c(100, 90)), Sample(61, c(1000, 100))]
    s = window_stats(samples, now=60, window_s=60)
    assert s.acceptance == pytest.approx(0.9) and s.end == 60


def test_counter_reset_mid_window():
    # the engine restarted between t=30 and t=45: counters start again from zero
    samples = [
        Sample(0, c(10_000, 9_000, 2_500)),
        Sample(30, c(10_400, 9_100, 2_600)),
        Sample(45, c(100, 20, 25)),
        Sample(60, c(300, 60, 75)),
    ]
    s = window_stats(samples, now=60, window_s=60)
    assert s.status == OK and s.resets == 1
    assert s.draft_tokens == 400 + 100 + 200  # before, the restart's new totals, after
    assert s.accepted == 100 + 20 + 40
    assert s.acceptance == pytest.approx(160 / 700)
    assert "restarted" in s.reason
    assert 0.0 <= s.acceptance <= 1.0


def test_reset_then_idle_is_no_data():
    samples = [Sample(0, c(500, 400)), Sample(30, c(0, 0)), Sample(60, c(0, 0))]
    s = window_stats(samples, now=60, window_s=60)
    assert s.status == NO_DATA and s.resets == 1


def test_series_appearing_counts_from_zero():
    # llama-server may only show its counters once the first request finished
    samples = [Sample(0, None), Sample(30, c(115, 80, 40)), Sample(60, c(230, 160, 80))]
    s = window_stats(samples, now=60, window_s=60)
    assert s.status == OK and s.draft_tokens == 230 and s.acceptance == pytest.approx(160 / 230)


def test_without_drafts_no_mean_length():
    s = window_stats([Sample(0, c(0, 0)), Sample(60, c(115, 80))], now=60, window_s=60)
    assert s.acceptance == pytest.approx(80 / 115)
    assert s.drafts is None and s.mean_acceptance_length is None and s.per_position == ()


def test_accepted_above_drafted_is_clamped():
    s = window_stats([Sample(0, c(0, 0)), Sample(60, c(100, 120))], now=60, window_s=60)
    assert s.acceptance == 1.0 and "clamped" in s.reason


def test_coarse_v0_uses_lifetime_ratio_and_hides_counts():
    v0 = lambda tok, life: c(tok, tok * 0.9, coarse=True, lifetime_acceptance=life, source="vllm-v0")
    s = window_stats([Sample(0, v0(1000, 0.7)), Sample(60, v0(5000, 0.65))], now=60, window_s=60)
    assert s.status == OK and s.coarse and s.acceptance == 0.65
    assert s.draft_tokens is None and s.accepted is None
    idle = window_stats([Sample(0, v0(1000, 0.7)), Sample(60, v0(1000, 0.7))], now=60, window_s=60)
    assert idle.status == NO_DATA
    no_ratio = window_stats([Sample(0, v0(0, None)), Sample(60, v0(10, None))], now=60, window_s=60)
    assert no_ratio.status == NO_DATA


def test_unavailable_constructor():
    s = WindowStats.unavailable(12.0, "connection refused", 60)
    assert s.status == UNAVAILABLE and s.end == 12.0 and s.acceptance is None
    assert s.to_dict()["reason"] == "connection refused"


def test_invalid_window():
    with pytest.raises(ValueError):
        window_stats([], now=0, window_s=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), -1, 0, "60", None, True])
def test_non_finite_windows_are_refused_with_one_line(bad):
    from specops.watch.window import WindowError

    with pytest.raises(WindowError) as exc:
        window_stats([], now=0, window_s=bad)
    assert "\n" not in str(exc.value)
    with pytest.raises(WindowError):
        SampleBuffer(window_s=bad)


def test_sample_buffer_keeps_only_what_the_window_needs():
    buf = SampleBuffer(window_s=30)
    for t in range(0, 101, 5):
        buf.add(Sample(t, c(10 * t, 7 * t)))
    times = [s.t for s in buf]
    assert times[0] == 70 and times[-1] == 100  # 70 = newest sample at or before 100 - 30
    s = buf.stats(100)
    assert s.full and s.draft_tokens == 300 and s.acceptance == pytest.approx(0.7)
    with pytest.raises(ValueError):
        buf.add(Sample(50, None))
    buf.clear()
    assert len(buf) == 0 and buf.stats(100).status == NO_DATA


@st.composite
def traces(draw):
    """Random counter traces: increments (some idle) with occasional restarts."""
    n = draw(st.integers(min_value=2, max_value=25))
    tokens = accepted = 0
    samples, true_tok, true_acc = [], 0, 0
    hidden = False
    t = 0.0
    for i in range(n):
        if i and draw(st.integers(0, 9)) == 0:  # restart: counters from zero, then some new work
            new_t = draw(st.integers(0, 50))
            new_a = draw(st.integers(0, new_t))
            hidden |= new_t >= tokens and new_a >= accepted  # no counter fell: invisible, as in Prometheus
            tokens, accepted = new_t, new_a
            true_tok += new_t
            true_acc += new_a
        elif i:
            dt = draw(st.integers(0, 200))
            da = draw(st.integers(0, dt))
            tokens += dt
            accepted += da
            true_tok += dt
            true_acc += da
        samples.append(Sample(t, c(tokens, accepted)))
        t += draw(st.floats(min_value=0.5, max_value=10))
    return samples, true_tok, true_acc, hidden


@given(traces())
@settings(max_examples=300)
def test_windows_over_whole_trace_count_every_token(trace):
    samples, true_tok, true_acc, hidden = trace
    end = samples[-1].t
    s = window_stats(samples, now=end, window_s=end - samples[0].t + 1)
    # a restart whose new totals are not below the old ones is invisible (as for Prometheus): undercount
    assert s.draft_tokens <= true_tok
    if not hidden:
        assert (s.draft_tokens, s.accepted) == (true_tok, true_acc)
    if s.status == OK:
        assert 0.0 <= s.acceptance <= 1.0
        assert s.acceptance == pytest.approx(s.accepted / s.draft_tokens)
    else:
        assert s.status == NO_DATA and s.acceptance is None and s.draft_tokens == 0


@given(traces(), st.floats(min_value=0.5, max_value=60))
@settings(max_examples=300)
def test_buffer_equals_full_history(trace, window):
    samples = trace[0]
    buf = SampleBuffer(window_s=window)
    for s in samples:
        buf.add(s)
        assert buf.stats(s.t) == window_stats(samples[: samples.index(s) + 1], now=s.t, window_s=window)
