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

**The cost of verification.** Leviathan et al. assume a memory-bound target: verifying k + 1 tokens costs one
target step. That holds on a GPU until the batch is compute-bound; on a CPU it is false (llama.cpp on 2 cores:
verifying 17–22 tokens cost several steps, and drafts the formula scored 6–10x ran at 0.9x). With a measured
:class:`VerifyCost` curve c_verify(n) (the cost of one target pass over n tokens, in target steps), a step costs
k·c + c_verify(k + 1) target steps and

    S(α, k, c, c_verify) = τ(α, k) / (k·c + c_verify(k + 1)),

where c_verify(k + 1) is the forward pass over k + 1 tokens plus, for each of the τ tokens kept, what a decode
step pays per token outside its pass (sampling over the vocabulary: on Gemma 3's 262,144 tokens most of a CPU
step), which speculation does not amortize (see :class:`VerifyCost`).

Without a curve c_verify ≡ 1 (:data:`FLAT`), which is the formula above: the documented fallback, and every
prediction says which of the two it used (:func:`cost_basis`). The curve is probed on a running engine by
:mod:`specops.perf.verifycost`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class VerifyCost:
    """A measured verification-cost curve: the time of one forward pass over ``n`` new tokens (on top of a cached
    context) in target decode steps, at a few ``n`` (1, 2, 4, … 64), and where it was measured (``source``).

    A decode step is a forward pass over one token plus what is paid per token outside it (sampling over the
    vocabulary, detokenizing, streaming): :attr:`per_token` = 1 − cost(1). Speculation amortizes the pass, not
    that: a step that yields τ tokens samples τ of them. So a speculative step costs
    k·c + :meth:`at` (k + 1) + τ·per_token decode steps (:func:`step_cost`). Where the pass over one token costs
    *more* than a decode step (an engine's prompt path with more overhead than its decode path, on a tiny model),
    the curve is normalized to its first point instead and per_token is 0. Either way a step without speculation
    (k = 0, τ = 1) costs exactly one step.

    :meth:`at` interpolates linearly in n between the points and extrapolates past the last one along the last
    segment (a CPU's cost keeps growing with n).

    :attr:`idle` is what a step of the speculative engine costs when it found no draft, in decode steps: the
    engine's proposer and speculative bookkeeping run on every step (vLLM-CPU's n-gram path took 1.14 steps at
    one request and 1.24 at four on Gemma 3 270M, 2026-12-07); 1 where it was not measured.
    """

    points: tuple[tuple[int, float], ...]
    source: str = "measured"
    idle: float = 1.0

    def __post_init__(self) -> None:
        pts = tuple(sorted((int(n), float(v)) for n, v in self.points))
        if not pts or pts[0][0] != 1:
            raise ValueError("a verification-cost curve needs a point at n = 1")
        if len({n for n, _ in pts}) != len(pts) or any(not (v > 0 and math.isfinite(v)) for _, v in pts):
            raise ValueError(f"a verification-cost curve needs distinct n and finite costs > 0, got {pts}")
        idle = float(self.idle)
        if not (idle > 0 and math.isfinite(idle)):
            raise ValueError(f"a draftless step's cost must be a finite number > 0, got {self.idle!r}")
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "idle", idle)

    @classmethod
    def from_mapping(
        cls, costs: Mapping[int | str, float | int | str], source: str = "measured", idle: float = 1.0
    ) -> VerifyCost:
        """From ``{n: relative cost}`` (keys may be the strings JSON gives); raises ValueError saying what is wrong."""
        try:
            return cls(tuple((int(n), float(v)) for n, v in costs.items()), source, float(idle))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a verification-cost curve ({{n: cost}}): {exc}") from None

    @property
    def _scale(self) -> float:
        return max(1.0, self.points[0][1])

    @property
    def per_token(self) -> float:
        """Decode steps paid per sampled token outside the forward pass (0 where the pass costs a whole step)."""
        return max(0.0, 1.0 - self.points[0][1])

    def _interpolated(self, n: float) -> float:
        pts = self.points
        if n <= 1 or len(pts) == 1:
            return pts[0][1] / self._scale
        for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
            if n <= n1:
                return (v0 + (v1 - v0) * (n - n0) / (n1 - n0)) / self._scale
        (n0, v0), (n1, v1) = pts[-2], pts[-1]
        return max(v1, v1 + (v1 - v0) * (n - n1) / (n1 - n0)) / self._scale

    def at(self, n: float) -> float:
        """The forward pass over n new tokens, in decode steps; never below the pass over one (a point measured
        lower is noise: more tokens do not cost less)."""
        return max(self._interpolated(n), self.points[0][1] / self._scale)

    def to_dict(self) -> dict[str, object]:
        return {"points": {str(n): v for n, v in self.points}, "source": self.source, "idle": self.idle}


#: What a prediction without a measured curve assumes: verifying k + 1 tokens costs one target step.
FLAT = "c_verify ≡ 1 (assumed: verifying k+1 tokens costs one target step; no curve measured)"


def cost_basis(curve: VerifyCost | None) -> str:
    """Which verification cost a prediction used, in words (every output that predicts says it)."""
    return FLAT if curve is None else f"c_verify measured ({curve.source})"


def verify_cost(n: float, tau: float, curve: VerifyCost | None = None) -> float:
    """c_verify: decode steps to verify n tokens of which τ are kept (the pass, and τ tokens' sampling); 1 without
    a curve (:data:`FLAT`)."""
    return 1.0 if curve is None else curve.at(n) + tau * curve.per_token


def step_cost(k: float, c: float, tau: float, curve: VerifyCost | None = None) -> float:
    """Decode steps one speculative step costs: k drafts at c each plus verifying k + 1 tokens yielding τ."""
    return float(k) * c + verify_cost(float(k) + 1.0, tau, curve)


def expected_speedup(alpha: float, k: int, c: float, curve: VerifyCost | None = None) -> float:
    """S = τ(α, k) / (k·c + c_verify(k + 1)): speedup over decoding without speculation (1.0 at k = 0).

    Without ``curve`` c_verify ≡ 1, i.e. τ / (1 + k·c)."""
    k, c = _check_k(k), _check_c(c)
    tau = expected_tokens_per_step(alpha, k)
    return tau / step_cost(k, c, tau, curve)


def speedup_from_length(mean_length: float, k: float, c: float, curve: VerifyCost | None = None) -> float:
    """Speedup from a *measured* mean acceptance length τ and mean draft length k (what bench and the
    engines' counters give): τ / (k·c + c_verify(k + 1)); without ``curve`` τ / (1 + k·c)."""
    c = _check_c(c)
    if not mean_length >= 1.0:
        raise ValueError(f"mean acceptance length is at least 1, got {mean_length!r}")
    if not k >= 0.0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    return float(mean_length) / step_cost(k, c, float(mean_length), curve)


def workload_speedup(
    tokens: float,
    requests: float,
    drafts: float,
    accepted: float,
    k: float,
    c: float,
    curve: VerifyCost,
    *,
    batch: int = 1,
    prefill_steps: float = 0.0,
    draft_prefill: float = 0.0,
) -> float:
    """Speedup of a measured workload, whole requests: ``tokens`` generated by ``requests`` requests, of which
    ``drafts`` speculative steps accepted ``accepted`` drafts in all (mean draft length ``k``, each draft token
    costing ``c`` target steps), decoded ``batch`` at a time.

    A request costs its prompt pass (``prefill_steps`` target steps; with speculation the draft model reads
    the prompt too, ``draft_prefill`` of it) and its decode steps; a speculative step costs k·c + c_verify(k+1)
    and yields its accepted drafts and one token, a step that found no draft costs ``curve.idle`` steps (the
    speculative engine's proposer runs on it too) and yields one token. :func:`speedup_from_length` prices
    drafting steps only, which over-states prompt lookup (most steps of an answer that copies nothing draft
    nothing) and a draft model that must read every prompt."""
    c = _check_c(c)
    decoded = max(0.0, float(tokens) - float(requests))  # the first token of each answer comes with its prompt pass
    plain = max(0.0, decoded - float(drafts) - float(accepted))
    per_request = float(requests) * prefill_steps * float(batch)  # a prompt pass holds up the whole batch
    base = per_request + decoded
    spec = (
        per_request * (1.0 + draft_prefill)
        + float(drafts) * step_cost(k, c, 1.0 + accepted / max(drafts, 1), curve)
        + plain * curve.idle
    )
    return base / spec if spec > 0 else 1.0


def best_k(alpha: float, c: float, k_max: int = 8, curve: VerifyCost | None = None) -> int:
    """The k in 0..k_max with the highest expected speedup; ties go to the smaller k.

    0 means no k beats decoding without speculation (S(α, 0, c) = 1): speculation does not pay.
    """
    alpha, c, k_max = _check_alpha(alpha), _check_c(c), _check_k(k_max)
    best, best_s = 0, 1.0
    for k in range(1, k_max + 1):
        s = expected_speedup(alpha, k, c, curve)
        if s > best_s * (1 + 1e-12):  # strictly better (beyond rounding), so ties keep the smaller k
            best, best_s = k, s
    return best


def max_paying_k(c: float, curve: VerifyCost | None, k_max: int) -> int:
    """The largest k in 0..k_max that could beat no speculation at all: even with every draft token accepted
    (τ = k + 1) a longer draft costs more to verify than it yields. ``k_max`` without a curve."""
    c, k_max = _check_c(c), _check_k(k_max)
    if curve is None:
        return k_max if c < 1.0 else 0
    return max((k for k in range(k_max + 1) if (k + 1) / step_cost(k, c, k + 1, curve) > 1.0 + 1e-12), default=0)


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
