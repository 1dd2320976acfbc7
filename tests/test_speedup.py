"""The §8 performance model: exact limits, known values, best k, and the rate ↔ α inverse."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specops.speedup import (
    acceptance_rate,
    alpha_from_acceptance_rate,
    best_k,
    expected_speedup,
    expected_tokens_per_step,
    speedup_from_length,
)

alphas = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
ks = st.integers(min_value=0, max_value=16)
costs = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def closed_form(alpha: float, k: int) -> float:
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def test_limits_are_exact():
    for k in range(0, 10):
        assert expected_tokens_per_step(1.0, k) == k + 1
        assert expected_tokens_per_step(0.0, k) == 1.0
        assert expected_speedup(1.0, k, 0.0) == k + 1
        assert expected_speedup(0.0, k, 0.1) == pytest.approx(1 / (1 + 0.1 * k))
    assert expected_speedup(0.7, 0, 0.3) == 1.0  # k = 0 is decoding without speculation


def test_close_to_one_is_stable():
    # the closed form loses every digit here; the sum does not
    a = 1 - 1e-13
    assert expected_tokens_per_step(a, 4) == pytest.approx(5.0, abs=1e-11)
    assert expected_speedup(a, 4, 0.0) < 5.0


def test_known_values():
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(closed_form(0.8, 4))  # 3.3616
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert expected_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)


@given(alphas.filter(lambda a: a < 0.999), ks)
def test_sum_matches_closed_form(alpha, k):
    assert expected_tokens_per_step(alpha, k) == pytest.approx(closed_form(alpha, k), rel=1e-9)


@given(alphas, ks, costs)
def test_speedup_bounds(alpha, k, c):
    s = expected_speedup(alpha, k, c)
    assert 0 < s <= k + 1
    assert s == pytest.approx(expected_tokens_per_step(alpha, k) / (1 + k * c))


def test_best_k():
    assert best_k(0.0, 0.05) == 0  # nothing is accepted: do not speculate
    assert best_k(1.0, 0.0, k_max=8) == 8  # free drafts, all accepted: as many as allowed
    assert best_k(0.8, 0.05) == 8  # S rises to k = 8 (3.092) and falls after
    assert best_k(0.8, 0.05, k_max=12) == 8
    assert best_k(0.6, 0.1) == 3
    assert best_k(0.9, 0.0, k_max=0) == 0
    # tie between k=1 and more at α=1, c=1: every k gives exactly speedup 1 -> the smallest, 0
    assert best_k(1.0, 1.0) == 0


@given(alphas, costs, st.integers(min_value=0, max_value=12))
@settings(max_examples=200)
def test_best_k_is_the_argmax(alpha, c, k_max):
    k = best_k(alpha, c, k_max)
    assert 0 <= k <= k_max
    best = expected_speedup(alpha, k, c)
    for other in range(0, k_max + 1):
        assert expected_speedup(alpha, other, c) <= best * (1 + 1e-9)


def test_acceptance_rate_and_inverse():
    assert acceptance_rate(0.8, 1) == pytest.approx(0.8)
    assert acceptance_rate(0.8, 4) == pytest.approx((0.8 + 0.64 + 0.512 + 0.4096) / 4)
    assert alpha_from_acceptance_rate(0.0, 4) == 0.0
    assert alpha_from_acceptance_rate(1.0, 4) == 1.0
    assert alpha_from_acceptance_rate(0.37, 1) == 0.37
    # a reported rate of 0.59 at k = 4 means a per-token α near 0.8, not 0.59
    assert alpha_from_acceptance_rate(acceptance_rate(0.8, 4), 4) == pytest.approx(0.8, abs=1e-9)


@given(alphas, st.integers(min_value=1, max_value=12))
def test_inverse_roundtrip(alpha, k):
    assert alpha_from_acceptance_rate(acceptance_rate(alpha, k), k) == pytest.approx(alpha, abs=1e-8)


def test_speedup_from_measured_length():
    assert speedup_from_length(3.0, 4, 0.05) == pytest.approx(2.5)
    assert speedup_from_length(1.0, 2.5, 0.0) == 1.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_step(1.2, 3),
        lambda: expected_tokens_per_step(math.nan, 3),
        lambda: expected_tokens_per_step(0.5, -1),
        lambda: expected_tokens_per_step(0.5, 2.0),
        lambda: expected_speedup(0.5, 2, -0.1),
        lambda: expected_speedup(0.5, 2, math.inf),
        lambda: acceptance_rate(0.5, 0),
        lambda: alpha_from_acceptance_rate(0.5, 0),
        lambda: speedup_from_length(0.5, 2, 0.1),
        lambda: best_k(0.5, 0.1, k_max=-1),
    ],
)
def test_invalid_inputs(call):
    with pytest.raises(ValueError):
        call()
