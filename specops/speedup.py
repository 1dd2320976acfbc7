"""The performance model of speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv:2211.17192, §3), exact at its limits.

With a per-token acceptance probability α (each draft token is accepted independently with probability α,
and drafting stops at the first rejection) and k draft tokens per step, one target pass yields on average

    τ(α, k) = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)

tokens (the accepted prefix plus the target's own "bonus" token). If a draft pass costs ``c`` of a target
pass, a step costs 1 + k·c target passes, so the speedup over plain decoding is

    S(α, k, c) = τ(α, k) / (1 + k·c).

τ is computed as the finite geometric sum, never as the closed-form quotient: that is exact at α = 1
(τ = k + 1), at α = 0 (τ = 1) and stable just below 1, where the quotient loses every digit.

What engines report is not α but the *acceptance rate* ``accepted / drafted``; under the same model that
is ``(α + α² + … + α^k) / k``, which is lower than α for k > 1 (a later position is only reached when every
earlier one was accepted). :func:`alpha_from_acceptance_rate` inverts it. When the number of drafts is
known, the *mean acceptance length* ``1 + accepted / drafts`` measures τ directly and needs no model.
"""

from __future__ import annotations

import math

#: Draft cost ratio assumed when neither the profile nor a measurement gives one (profile default).
DEFAULT_DRAFT_COST = 0.05


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:  # also rejects NaN
        raise ValueError(f"acceptance probability must be within [0, 1], got {alpha!r}")
    return alpha


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (draft tokens per step) must be an integer >= 0, got {k!r}")
    return k


def _check_c(c: float) -> float:
    c = float(c)
    if not c >= 0.0 or math.isinf(c):
        raise ValueError(f"draft cost ratio must be a finite number >= 0, got {c!r}")
    return c


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """τ(α, k) = Σ_{i=0..k} α^i: tokens one target pass yields on average (1 at α = 0, k + 1 at α = 1)."""
    alpha, k = _check_alpha(alpha), _check_k(k)
    return math.fsum(alpha**i for i in range(k + 1))


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """S(α, k, c) = τ(α, k) / (1 + k·c): speedup over decoding without speculation (1.0 at k = 0)."""
    k, c = _check_k(k), _check_c(c)
    return expected_tokens_per_step(alpha, k) / (1.0 + k * c)


def speedup_from_length(mean_length: float, k: float, c: float) -> float:
    """Speedup from a *measured* mean acceptance length τ and mean draft length k: τ / (1 + k·c)."""
    c = _check_c(c)
    if not mean_length >= 1.0:
        raise ValueError(f"mean acceptance length is at least 1, got {mean_length!r}")
    if not k >= 0.0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    return float(mean_length) / (1.0 + float(k) * c)


def best_k(alpha: float, c: float, k_max: int = 8) -> int:
    """The k in 0..k_max with the highest expected speedup; ties go to the smaller k.

    0 means no k beats decoding without speculation (S(α, 0, c) = 1): speculation does not pay.
    """
    alpha, c, k_max = _check_alpha(alpha), _check_c(c), _check_k(k_max)
    best, best_s = 0, 1.0
    for k in range(1, k_max + 1):
        s = expected_speedup(alpha, k, c)
        if s > best_s * (1 + 1e-12):  # strictly better (beyond rounding), so ties keep the smaller k
            best, best_s = k, s
    return best


def acceptance_rate(alpha: float, k: int) -> float:
    """The acceptance rate engines report, accepted / drafted = (α + … + α^k) / k, for α and k >= 1."""
    alpha, k = _check_alpha(alpha), _check_k(k)
    if k == 0:
        raise ValueError("the acceptance rate needs k >= 1 (nothing is drafted at k = 0)")
    return (expected_tokens_per_step(alpha, k) - 1.0) / k


def alpha_from_acceptance_rate(rate: float, k: int) -> float:
    """The per-token α whose acceptance rate at k draft tokens is ``rate`` (inverse of :func:`acceptance_rate`).

    Exact at the ends (0 → 0, 1 → 1, and α = rate when k = 1); otherwise bisection to 1e-12, the rate
    being strictly increasing in α.
    """
    rate, k = _check_alpha(rate), _check_k(k)
    if k == 0:
        raise ValueError("the acceptance rate needs k >= 1")
    if k == 1 or rate in (0.0, 1.0):
        return rate
    lo, hi = rate, 1.0  # rate(α) <= α for every α, so α >= rate
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        if acceptance_rate(mid, k) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
