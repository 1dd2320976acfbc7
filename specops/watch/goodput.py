"""Goodput: which step of the chain serves the most output tokens/s at the live load. Pure: no clock, no I/O
(except :func:`load_surface`, which reads a record file once).

Acceptance alone does not decide whether speculation pays: verification grows with the batch, so a draft that
is always right can still lose at high concurrency. The **surface** is what ``specops tune`` measured on the
deployment: output tokens/s per option (a method and its k; ``none``) per concurrency level, with the mean
acceptance length each option had. :class:`GoodputModel` predicts every option's tokens/s at a concurrency:

1. the surface, interpolated linearly in log2(concurrency) between the measured levels (held flat outside);
2. scaled by live acceptance: a speculative option's tokens/s is proportional to its tokens per target pass,
   so the recorded number is multiplied by τ_live(k) / τ_recorded(k) (τ_live(k) from the α that the live
   mean acceptance length gives at the k it was measured at; the method's last live window counts). A method
   that no longer runs has no live window: what it last measured (perhaps the collapse that made the policy
   leave it) ages, weighing half as much after each ``stale_half_life`` and the surface's τ the rest, so the
   policy comes back to try it when the surface says it would pay, not never and not at once;
3. corrected online: each tick that serves a known option at a known concurrency, the ratio of the live
   tokens/s to the prediction for it goes into a per-bucket (powers of two) moving average that multiplies
   every option in that bucket, so the surface stays true when the workload drifts.

An option the surface did not measure at its k (a chain step's other k, a per-batch-size k) is predicted from
the speedup model only where the surface carries a verification-cost curve measured on the machine
(``verify_cost``: :meth:`specops.speedup.VerifyCost.to_dict`): ``none``'s tokens/s × τ(k) / (k·c + c_verify(k+1)),
τ(k) from the method's live or recorded acceptance. Without a curve no such prediction is made (c_verify ≡ 1
would price a CPU's long drafts as free): the option is learned from live readings, as before. Measured
points always win over the model, and the online correction learns only from measured ones.

:class:`GoodputPolicy` turns predictions into decisions with hysteresis (a relative margin), a sustain time (the
better option must stay better), a minimum dwell after a switch, and a cost test: the predicted gain over the
expected regime duration (at least as long as the regime has lasted) must exceed the tokens lost while
switching (the measured restart, and half the drain before it, × the current tokens/s). A return to a
method that aging lifted (its live τ was below the surface's) is a **probe**: if the policy leaves it again
within ``regime``, that method's half-life doubles (the next return waits twice as long); a probe that lasts
a regime resets it. So a collapse that persists costs a few ever rarer probes, not a flip-flop.

The surface itself, and the vLLM per-batch-size schedule rendered from it, are in :mod:`specops.watch.surface`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specops.methods import Method
from specops.speedup import DEFAULT_DRAFT_COST, VerifyCost, expected_tokens_per_step, speedup_from_length
from specops.watch.surface import Surface, option_label, scheduled_k

#: Weight of a new tick in the per-bucket correction (an exponential moving average).
CORRECTION_WEIGHT = 0.3
#: The correction stays within [1/x, x]: a live reading far off the surface is a measurement problem.
CORRECTION_BOUND = 4.0
#: Seconds lost per switch before anything was measured or configured.
DEFAULT_SWITCH_COST_S = 30.0
#: Seconds after which a left method's last live acceptance weighs half (the surface's τ the other half).
DEFAULT_STALE_HALF_LIFE_S = 600.0
#: An acceptance weight at or above this (measured within ~1 % of a half-life) is fresh.
FRESH_WEIGHT = 0.99


# ---------------------------------------------------------------------------------------------- model


def bucket(concurrency: float) -> int:
    """The correction bucket of a concurrency: the nearest power of two (1, 2, 4, ...)."""
    return int(2 ** max(0, round(math.log2(max(1.0, concurrency)))))


def alpha_from_length(tau: float, k: float) -> float:
    """α such that (1 − α^(k+1)) / (1 − α) = ``tau`` (bisection; τ is clamped to [1, k + 1])."""
    k = max(1.0, k)
    tau = min(max(tau, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        val = k + 1.0 if mid >= 1.0 else (1 - mid ** (k + 1)) / (1 - mid)
        lo, hi = (mid, hi) if val < tau else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Option:
    """A way to run the deployment: a chain step's method and k, or ``per_batch`` (a k per batch size)."""

    method: Method
    k: int
    per_batch: tuple[tuple[int, int, int], ...] | None = None

    @property
    def label(self) -> str:
        return option_label(self.method, self.k) + (" per batch size" if self.per_batch else "")


def surface_verify_cost(surface: Surface | None) -> VerifyCost | None:
    """The verification-cost curve a surface carries (``verify_cost`` beside its points), or None."""
    data = surface.meta.get("verify_cost") if surface is not None else None
    if not isinstance(data, Mapping) or not isinstance(data.get("points"), Mapping):
        return None
    try:
        return VerifyCost.from_mapping(data["points"], str(data.get("source") or "measured"))
    except ValueError:
        return None


class GoodputModel:
    """Predicts tokens/s per option at a concurrency from a surface, live acceptance and online correction."""

    def __init__(
        self,
        surface: Surface | None,
        stale_half_life_s: float = DEFAULT_STALE_HALF_LIFE_S,
        draft_cost: float = DEFAULT_DRAFT_COST,
    ):
        self.surface = surface
        self.verify_cost = surface_verify_cost(surface)  # None: no model predictions (see the module's doc)
        self.draft_cost = draft_cost
        self.correction: dict[int, float] = {}
        self.live_tau: dict[Method, tuple[float, float]] = {}  # method -> (mean acceptance length, k it ran at)
        self.measured_at: dict[Method, float] = {}  # method -> when its live acceptance was last noted
        self.stale_half_life_s = stale_half_life_s
        self.backoff: dict[Method, float] = {}  # method -> half-life multiplier after failed probes
        self.learned: dict[tuple[str, int], float] = {}  # (option label, bucket) -> live tokens/s (no surface)

    def note_acceptance(self, method: Method, tau: float, k: float, now: float | None = None) -> None:
        self.live_tau[method] = (tau, k)
        if now is not None:
            self.measured_at[method] = now

    def half_life(self, method: Method) -> float:
        return self.stale_half_life_s * self.backoff.get(method, 1.0)

    def acceptance_weight(self, method: Method, now: float | None) -> float:
        """How much the method's last live acceptance still counts (1 fresh, → 0 with age) against the surface's."""
        at = self.measured_at.get(method)
        if now is None or at is None or method not in self.live_tau:
            return 1.0
        return 0.5 ** (max(0.0, now - at) / self.half_life(method))

    def expected_tau(self, method: Method, k: int, now: float | None = None) -> float | None:
        """The mean acceptance length predicted for ``method`` at ``k``: the live one (translated to ``k``), aged
        toward the surface's; None without a recorded τ."""
        rec = self.surface.tau(method, k) if self.surface is not None and method is not Method.NONE else None
        if not rec:
            return None
        live_k = self.live_tau_at(method, k)
        return rec if live_k is None else rec + (live_k - rec) * self.acceptance_weight(method, now)

    def live_tau_at(self, method: Method, k: int) -> float | None:
        """The last live mean acceptance length of ``method``, translated to ``k`` drafted tokens."""
        if method not in self.live_tau:
            return None
        tau, k_live = self.live_tau[method]
        return expected_tokens_per_step(alpha_from_length(tau, k_live), max(1, k)) if k != round(k_live) else tau

    def raised_by_age(self, option: Option, now: float) -> bool:
        """Whether aging lifts the option's predicted τ above what it last measured (a return is then a probe)."""
        live, aged = self.live_tau_at(option.method, option.k), self.expected_tau(option.method, option.k, now)
        return live is not None and aged is not None and aged > live * 1.01

    def _acceptance_factor(self, method: Method, k: int, now: float | None) -> float:
        if not k:  # nothing drafted (none; a draft idle at k 0): acceptance does not enter
            return 1.0
        tau = self.expected_tau(method, k, now)
        rec = self.surface.tau(method, k) if tau is not None and self.surface is not None else None
        return tau / rec if tau is not None and rec else 1.0

    def raw(self, option: Option, concurrency: float, now: float | None = None, *, model: bool = True) -> float | None:
        """The prediction before the per-bucket correction (``now`` ages a left method's acceptance): measured,
        else learned live, else (``model``) the speedup model on the surface's verification-cost curve."""
        if option.per_batch:
            k = scheduled_k(option.per_batch, concurrency)
            k = option.k if k is None else k  # outside the ranges the engine drafts the step's k
            if k == 0 and not (self.surface is not None and self.surface.has(option.method, 0)):
                return self.raw(Option(Method.NONE, 0), concurrency, now, model=model)  # the idle draft: as none
            return self.raw(Option(option.method, k), concurrency, now, model=model)
        base = self.surface.tokens_per_s(option.method, option.k, concurrency) if self.surface else None
        if base is None:
            learned = self.learned.get((option.label, bucket(concurrency)))
            return learned if learned is not None or not model else self.modelled(option, concurrency, now)
        return base * self._acceptance_factor(option.method, option.k, now)

    def modelled(self, option: Option, concurrency: float, now: float | None = None) -> float | None:
        """``none``'s measured tokens/s × the model's speedup of ``option`` on the measured verification cost;
        None without a curve, a measured ``none`` there, or an acceptance of the method at any k."""
        if self.verify_cost is None or self.surface is None or option.method is Method.NONE or option.k < 1:
            return None
        none = self.surface.tokens_per_s(Method.NONE, 0, concurrency)
        tau = self.live_tau_at(option.method, option.k)
        if tau is None:
            recorded = [(k, self.surface.tau(option.method, k)) for k in self.surface.ks(option.method) if k]
            recorded = [(k, t) for k, t in recorded if t]
            if recorded:
                k0, t0 = min(recorded, key=lambda kt: abs(kt[0] - option.k))
                tau = expected_tokens_per_step(alpha_from_length(t0, k0), option.k)
        if none is None or tau is None:
            return None
        return none * speedup_from_length(max(tau, 1.0), option.k, self.draft_cost, self.verify_cost)

    def predict(self, option: Option, concurrency: float, now: float | None = None) -> float | None:
        raw = self.raw(option, concurrency, now)
        return None if raw is None else raw * self.correction.get(bucket(concurrency), 1.0)

    def observe(
        self, option: Option, concurrency: float, tokens_per_s: float, now: float | None = None
    ) -> float | None:
        """A live reading of ``option`` at ``concurrency``: update the bucket's correction (or, without a surface
        point, learn the option's tokens/s there). Returns the bucket's correction factor."""
        b = bucket(concurrency)
        raw = self.raw(option, concurrency, now, model=False)  # the correction learns from measured points only
        if raw is None or self.surface is None or (option.label, b) in self.learned:
            old = self.learned.get((option.label, b))
            self.learned[(option.label, b)] = (
                tokens_per_s if old is None else old + CORRECTION_WEIGHT * (tokens_per_s - old)
            )
            return self.correction.get(b)
        if raw <= 0:
            return self.correction.get(b)
        ratio = min(max(tokens_per_s / raw, 1 / CORRECTION_BOUND), CORRECTION_BOUND)
        old = self.correction.get(b)
        self.correction[b] = ratio if old is None else old + CORRECTION_WEIGHT * (ratio - old)
        return self.correction[b]


# ---------------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class GoodputConfig:
    """The knobs of ``fallback.goodput`` (seconds)."""

    hysteresis: float = 0.05
    sustain_s: float = 30.0
    min_dwell_s: float = 60.0
    regime_s: float = 300.0
    switch_cost_s: float | None = None
    surface: str | None = None
    stale_half_life_s: float = DEFAULT_STALE_HALF_LIFE_S

    @classmethod
    def from_fallback(cls, fb: Any) -> GoodputConfig:
        g = getattr(fb, "goodput", None)
        if g is None:
            return cls()
        half_life = getattr(g, "stale_half_life", DEFAULT_STALE_HALF_LIFE_S)
        return cls(g.hysteresis, g.sustain, g.min_dwell, g.regime, g.switch_cost, g.surface, half_life)


@dataclass(frozen=True)
class Load:
    """What the watcher saw this tick: concurrency (requests in flight, engine running + waiting) and tokens/s."""

    concurrency: float | None = None
    tokens_per_s: float | None = None
    source: str = ""


@dataclass(frozen=True)
class Choice:
    """What :meth:`GoodputPolicy.choose` concluded: ``target`` (a step index) or None to stay, the rule, the
    reason in words, and the numbers behind it."""

    target: int | None
    rule: str
    reason: str
    numbers: dict[str, Any]


def step_options(
    steps: Sequence[Any], default_k: Mapping[Method, int], per_batch: Sequence[Sequence[int]] | None
) -> list[Option]:
    """An :class:`Option` per chain step (``per_batch``: the primary's schedule, when it runs one)."""
    out = []
    for i, st in enumerate(steps):
        k = 0 if st.method is Method.NONE else (st.num_speculative_tokens or default_k.get(st.method, 0))
        pb = tuple((int(r[0]), int(r[1]), int(r[2])) for r in per_batch) if (i == 0 and per_batch) else None
        out.append(Option(st.method, k, pb))
    return out


class GoodputPolicy:
    """Chooses among ``options`` (one per chain step) each tick; pure: ``now`` is always given."""

    def __init__(self, config: GoodputConfig, options: Sequence[Option], model: GoodputModel, window_s: float = 60.0):
        self.config = config
        self.options = list(options)
        self.model = model
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()  # (t, concurrency)
        self.candidate: int | None = None
        self.candidate_since: float | None = None
        self.last_switch: float | None = None
        self.measured_cost_s: float | None = None
        self.start_cost_s: float | None = None
        self.last_start_s: float | None = None  # the latest engine start (the decider notes it before the cost)
        model.stale_half_life_s = config.stale_half_life_s
        self.running: int | None = None  # the option choose() last saw running
        self.probes: dict[int, float] = {}  # option -> when it was entered on aged acceptance
        #: The options a live engine runs right now besides the current one (a warm twin): switching to one is a
        #: route change, which costs no engine start. Set by whoever keeps the engines (twins); empty without.
        self.warm: Callable[[], Collection[int]] = tuple

    # ---- inputs
    def note_switch_cost(self, seconds: float) -> None:
        """A switch took ``seconds`` from the decision until the new engine was ready. The service it cost (a
        moving average): the new engine's start in full (nothing is served) and half of the drain and stop
        before it (the requests in flight are still served while they finish; new ones wait), not the
        whole: a slow drain at low load made small gains look unable to pay for a switch."""
        start = self.last_start_s if self.last_start_s is not None and self.last_start_s <= seconds else None
        lost = seconds if start is None else start + (seconds - start) / 2
        old = self.measured_cost_s
        self.measured_cost_s = lost if old is None else (old + lost) / 2

    def note_start(self, seconds: float) -> None:
        """An engine start took ``seconds`` (the cost estimate until a switch is measured)."""
        if self.start_cost_s is None:
            self.start_cost_s = seconds
        self.last_start_s = seconds

    def switched(self, now: float, to: int | None = None) -> None:
        """The engine now runs option ``to``. Leaving a probe within ``regime`` doubles its method's half-life;
        entering a speculative option on aged acceptance starts a probe."""
        left = self.running
        if left is not None and left in self.probes and left != to:
            method = self.options[left].method
            if now - self.probes.pop(left) < self.config.regime_s:
                self.model.backoff[method] = self.model.backoff.get(method, 1.0) * 2
        if to is not None and 0 <= to < len(self.options):
            if self.options[to].method is not Method.NONE and self.model.raised_by_age(self.options[to], now):
                self.probes[to] = now
        self.running = to
        self.last_switch = now
        self.candidate = self.candidate_since = None
        self.samples.clear()

    def _probe_held(self, current: int, now: float) -> None:
        """A probe that has lasted a regime succeeded: its method's half-life is the configured one again."""
        since = self.probes.get(current)
        if since is not None and now - since >= self.config.regime_s:
            del self.probes[current]
            self.model.backoff.pop(self.options[current].method, None)

    @property
    def switch_cost_s(self) -> tuple[float, str]:
        if self.measured_cost_s is not None:
            return self.measured_cost_s, "measured"
        if self.config.switch_cost_s is not None:
            return self.config.switch_cost_s, "configured"
        if self.start_cost_s is not None:
            return self.start_cost_s, "engine start"
        return DEFAULT_SWITCH_COST_S, "default"

    def concurrency(self, now: float) -> float | None:
        """The mean concurrency over the window (since the last switch), None before any reading."""
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()
        return sum(c for _, c in self.samples) / len(self.samples) if self.samples else None

    # ---- the choice
    def note_load(self, load: Load | None, now: float) -> None:
        """A tick's live concurrency, for the window's mean (also on ticks that decide nothing: the proxy's count
        holds while the engine's metrics are unreadable)."""
        if load is not None and load.concurrency is not None:
            self.samples.append((now, float(load.concurrency)))

    def choose(self, current: int, load: Load | None, now: float) -> Choice:
        """The verdict at ``now`` on the window's load (the caller notes each tick's first: :meth:`note_load`)."""
        cfg = self.config
        conc = self.concurrency(now)
        numbers: dict[str, Any] = {"concurrency": conc, "concurrency_source": load.source if load else ""}
        if conc is None:
            return Choice(None, "goodput-no-load", "no concurrency reading yet: no goodput decision", numbers)
        cur = self.options[current]
        self.running = current
        self._probe_held(current, now)
        if load is not None and load.tokens_per_s is not None and conc >= 1:
            numbers["correction"] = self.model.observe(cur, conc, load.tokens_per_s, now)
            numbers["live_tokens_per_s"] = load.tokens_per_s
        predicted = {i: self.model.predict(o, conc, now) for i, o in enumerate(self.options)}
        numbers["predicted"] = {self.options[i].label: None if v is None else round(v, 2) for i, v in predicted.items()}
        numbers["surface"] = self._surface_numbers(conc, now)
        stale = self._stale_numbers(now)
        if stale:
            numbers["aged_acceptance"] = stale
        known = {i: v for i, v in predicted.items() if v is not None}
        if current not in known or len(known) < 2:
            self.candidate = None
            return Choice(
                None,
                "goodput-unknown",
                f"at concurrency {conc:.2f} the surface predicts too few options "
                f"({', '.join(self.options[i].label for i in known) or 'none'}): keep {cur.label}",
                numbers,
            )
        best = max(known, key=lambda i: (known[i], -abs(i - current)))
        p_cur, p_best = known[current], known[best]
        numbers.update(best=self.options[best].label, predicted_current=p_cur, predicted_best=p_best)
        if best == current:
            self.candidate = None
            return Choice(None, "goodput-best", f"{cur.label} is the best at concurrency {conc:.2f}", numbers)
        gain = p_best - p_cur
        numbers["gain_tokens_per_s"] = gain
        if gain <= cfg.hysteresis * p_cur:
            self.candidate = None
            return Choice(
                None,
                "goodput-hysteresis",
                f"{self.options[best].label} would gain {gain:.1f} tok/s at concurrency {conc:.2f}, within the "
                f"hysteresis of {cfg.hysteresis:.0%} of {p_cur:.1f}",
                numbers,
            )
        if self.candidate != best:
            self.candidate, self.candidate_since = best, now
        sustained = now - (self.candidate_since if self.candidate_since is not None else now)
        numbers["sustained_s"] = sustained
        if sustained < cfg.sustain_s:
            return Choice(
                None,
                "goodput-sustain",
                f"{self.options[best].label} is better at concurrency {conc:.2f} for {sustained:g}s of "
                f"the {cfg.sustain_s:g}s it must last",
                numbers,
            )
        if self.last_switch is not None and now - self.last_switch < cfg.min_dwell_s:
            numbers["dwell_until"] = self.last_switch + cfg.min_dwell_s
            return Choice(
                None,
                "goodput-dwell",
                f"{self.options[best].label} is better, but the last switch was {now - self.last_switch:g}s ago "
                f"(min_dwell {cfg.min_dwell_s:g}s)",
                numbers,
            )
        cost_s, cost_basis = (0.0, "warm engine: a route change") if best in self.warm() else self.switch_cost_s
        regime = max(cfg.regime_s, sustained)
        gain_tokens, cost_tokens = gain * regime, p_cur * cost_s
        numbers.update(
            switch_cost_s=cost_s,
            switch_cost_basis=cost_basis,
            regime_s=regime,
            gain_tokens=gain_tokens,
            cost_tokens=cost_tokens,
        )
        if gain_tokens <= cost_tokens:
            return Choice(
                None,
                "goodput-switch-cost",
                f"{self.options[best].label} would gain {gain:.1f} tok/s × {regime:g}s = {gain_tokens:.0f} tokens, "
                f"not more than the switch costs ({cost_s:g}s × {p_cur:.1f} tok/s = {cost_tokens:.0f} tokens)",
                numbers,
            )
        aged = stale.get(self.options[best].label)
        probe = (
            f"; its acceptance was measured {aged['age_s']:g}s ago and counts {aged['weight']:.2f} against the "
            f"surface's (a probe)"
            if aged
            else ""
        )
        return Choice(
            best,
            "goodput",
            f"at concurrency {conc:.2f} {self.options[best].label} predicts {p_best:.1f} tok/s against "
            f"{p_cur:.1f} for {cur.label} (sustained {sustained:g}s); the gain over {regime:g}s "
            f"({gain_tokens:.0f} tokens) exceeds the switch cost ({cost_s:g}s, {cost_tokens:.0f} tokens){probe}",
            numbers,
        )

    def _stale_numbers(self, now: float) -> dict[str, dict[str, float]]:
        """Options whose predicted τ aging lifted: the live one's age and weight, the half-life, the τ predicted."""
        out = {}
        for o in self.options:
            w = self.model.acceptance_weight(o.method, now)
            if o.method is Method.NONE or w >= FRESH_WEIGHT or not self.model.raised_by_age(o, now):
                continue
            tau = self.model.expected_tau(o.method, o.k, now)
            out[o.label] = {
                "age_s": round(now - self.model.measured_at[o.method], 1),
                "weight": round(w, 3),
                "half_life_s": self.model.half_life(o.method),
                "expected_tau": None if tau is None else round(tau, 3),
            }
        return out

    def _surface_numbers(self, conc: float, now: float | None = None) -> dict[str, float]:
        """Every option the surface measured, predicted at ``conc`` (each k, each method, none)."""
        s = self.model.surface
        if s is None:
            return {}
        out = {}
        for m, k in s.options():
            v = self.model.predict(Option(m, k), conc, now)
            if v is not None:
                out[option_label(m, k)] = round(v, 2)
        return out
