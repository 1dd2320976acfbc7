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

:class:`GoodputPolicy` turns predictions into decisions with hysteresis (a relative margin), a sustain time (the
better option must stay better), a minimum dwell after a switch, and a cost test: the predicted gain over the
expected regime duration (at least as long as the regime has lasted) must exceed the tokens lost while
switching (the measured restart, and half the drain before it, × the current tokens/s). A return to a
method that aging lifted (its live τ was below the surface's) is a **probe**: if the policy leaves it again
within ``regime``, that method's half-life doubles (the next return waits twice as long); a probe that lasts
a regime resets it. So a collapse that persists costs a few ever rarer probes, not a flip-flop.

:func:`per_batch_schedule` turns a surface into vLLM's ``num_speculative_tokens_per_batch_size`` ranges
(k = 0 where speculation loses), so an engine that takes one follows load without restarts.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.errors import ProfileError, SpecopsError
from specops.methods import Method
from specops.speedup import expected_tokens_per_step

SURFACE_VERSION = 1
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
#: The largest batch size a schedule is rendered for when the profile gives none.
DEFAULT_MAX_BATCH = 256


def option_label(method: Method, k: int | None) -> str:
    """``none``, or ``method k=K`` (the same words as ``specops tune``'s settings)."""
    return "none" if method is Method.NONE else f"{method.value} k={k}"


@dataclass(frozen=True)
class SurfacePoint:
    """One measured point: ``method`` with ``k`` draft tokens (0 for none) at ``concurrency`` clients."""

    method: Method
    k: int
    concurrency: int
    tokens_per_s: float
    mean_acceptance_length: float | None = None

    @property
    def label(self) -> str:
        return option_label(self.method, self.k)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method.value,
            "k": self.k,
            "concurrency": self.concurrency,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mean_acceptance_length": None
            if self.mean_acceptance_length is None
            else round(self.mean_acceptance_length, 3),
        }


def _interp_log2(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation in log2(x) between sorted points; flat outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lx = math.log2(x)
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            l0, l1 = math.log2(x0), math.log2(x1)
            return y0 + (y1 - y0) * ((lx - l0) / (l1 - l0) if l1 > l0 else 0.0)
    return ys[-1]  # pragma: no cover - unreachable for sorted xs


@dataclass
class Surface:
    """Measured tokens/s per option and concurrency, with where it was measured (``meta``: date, engine,
    engine version, draft sha)."""

    points: list[SurfacePoint]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by: dict[tuple[Method, int], list[SurfacePoint]] = {}
        for p in sorted(self.points, key=lambda p: p.concurrency):
            self._by.setdefault((p.method, p.k), []).append(p)

    # ---- reading and writing
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Surface:
        """From the ``surface`` entry of a tune record; raises ValueError naming what is wrong."""
        if not isinstance(data, Mapping) or not isinstance(data.get("points"), list):
            raise ValueError("a surface is a mapping with a list of points")
        points = []
        for i, p in enumerate(data["points"]):
            try:
                method = Method(p["method"])
                k = 0 if method is Method.NONE else int(p["k"])
                c = int(p["concurrency"])
                tps = float(p["tokens_per_s"])
                tau = p.get("mean_acceptance_length")
                tau = None if tau is None else float(tau)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"surface point {i}: {exc}") from None
            if c < 1 or k < 0 or not math.isfinite(tps) or tps < 0:
                raise ValueError(f"surface point {i}: concurrency >= 1, k >= 0 and finite tokens/s >= 0 are needed")
            points.append(SurfacePoint(method, k, c, tps, tau))
        if not points:
            raise ValueError("the surface has no points")
        meta = {k: v for k, v in data.items() if k != "points"}
        return cls(points, meta)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SURFACE_VERSION,
            **{k: v for k, v in self.meta.items() if k != "version"},
            "levels": self.levels(),
            "points": [p.to_dict() for p in sorted(self.points, key=lambda p: (p.label, p.concurrency))],
            "crossover": {label: c for label, c in self.crossovers().items()},
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Surface | None:
        """The surface of a tune record or of a lock file's ``tune`` entry; None when it holds none."""
        data = record.get("surface")
        if data is None and isinstance(record.get("tune"), Mapping):
            data = record["tune"].get("surface")
        return None if data is None else cls.from_dict(data)

    # ---- questions
    def levels(self) -> list[int]:
        return sorted({p.concurrency for p in self.points})

    def options(self) -> list[tuple[Method, int]]:
        return sorted(self._by, key=lambda o: (o[0] is not Method.NONE, o[0].value, o[1]))

    def ks(self, method: Method) -> list[int]:
        return sorted(k for m, k in self._by if m is method)

    def has(self, method: Method, k: int) -> bool:
        return (method, 0 if method is Method.NONE else k) in self._by

    def tokens_per_s(self, method: Method, k: int | None, concurrency: float) -> float | None:
        """Interpolated tokens/s of ``method`` at ``k`` (ignored for none) and ``concurrency``; None if unmeasured
        there: outside the option's own measured levels it is held flat only past the surface's lowest or highest
        level (an option that tune pruned after one level says nothing about the others)."""
        pts = self._by.get((method, 0 if method is Method.NONE else int(k or 0)))
        if not pts:
            return None
        c = max(1.0, concurrency)
        levels = self.levels()
        if (c < pts[0].concurrency and pts[0].concurrency > levels[0]) or (
            c > pts[-1].concurrency and pts[-1].concurrency < levels[-1]
        ):
            return None
        return _interp_log2([p.concurrency for p in pts], [p.tokens_per_s for p in pts], c)

    def tau(self, method: Method, k: int | None) -> float | None:
        """The mean acceptance length the option had when measured (the median over its levels)."""
        vals = sorted(
            p.mean_acceptance_length
            for p in self._by.get((method, int(k or 0)), ())
            if p.mean_acceptance_length is not None
        )
        return vals[len(vals) // 2] if vals else None

    def crossover(self, method: Method, k: int, *, max_concurrency: float | None = None) -> float | None:
        """The lowest concurrency (on a grid of 1/8 octaves, where both were measured) at which ``method`` at
        ``k`` stops beating ``none``: 1.0 when it never wins; None when it wins everywhere both were measured
        (or ``none`` was not measured)."""
        top = max_concurrency or max(self.levels())
        steps = int(math.ceil(math.log2(max(top, 1.0)) * 8)) + 1
        for i in range(steps):
            c = 2 ** (i / 8)
            spec, none = self.tokens_per_s(method, k, c), self.tokens_per_s(Method.NONE, 0, c)
            if spec is not None and none is not None and spec <= none:
                return round(c, 2)
        return None

    def crossovers(self) -> dict[str, float | None]:
        """Each speculating option's :meth:`crossover`; empty when ``none`` was not measured (unknown, not
        "pays everywhere": a tune whose budget ran out before its baseline)."""
        options = self.options()
        if (Method.NONE, 0) not in options:
            return {}
        return {option_label(m, k): self.crossover(m, k) for m, k in options if m is not Method.NONE and k > 0}


def _read_surface(p: Path) -> Surface:
    """The surface in the record at ``p``; raises ValueError saying why not (without the field's name)."""
    try:
        record = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {p}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{p} is not JSON: {exc}") from None
    try:
        surface = Surface.from_record(record) if isinstance(record, Mapping) else None
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
    if surface is None:
        raise ValueError(f"{p} holds no measured surface (run `specops tune` on the profile first)")
    return surface


def load_surface(path: str | Path) -> Surface:
    """The surface in a tune record (``<profile>.tune.json``) or lock file; raises SpecopsError saying why not."""
    try:
        return _read_surface(Path(path))
    except ValueError as exc:
        raise SpecopsError(f"fallback.goodput.surface: {exc}") from None


SURFACE_FIELD = ("fallback", "goodput", "surface")


def surface_file(value: str, profile_file: str | Path | None) -> Path:
    """Where ``fallback.goodput.surface`` points: ``~`` expanded, a relative path taken from the folder of
    ``profile_file`` (the profile that wrote it), so the deployment reads the same file from any folder."""
    p = Path(value).expanduser()
    if p.is_absolute() or profile_file is None:
        return p
    return Path(profile_file).parent / p


def profile_surface(loaded: Any) -> Surface | None:
    """The surface that a loaded profile's ``fallback.goodput.surface`` names (None when unset): a relative
    path is read from the folder of the profile file that wrote it (the base file, for a value from
    ``extends``); a missing or wrong file raises a ProfileError located at the field."""
    value = loaded.profile.fallback.goodput.surface
    if not value:
        return None
    where = loaded.document.locate(SURFACE_FIELD)
    written_in = where.file if where is not None and Path(where.file).is_file() else loaded.path
    try:
        return _read_surface(surface_file(value, written_in))
    except ValueError as exc:
        relative = "" if Path(value).expanduser().is_absolute() else f" (relative to {Path(written_in).parent})"
        raise ProfileError([loaded.problem(SURFACE_FIELD, f"{exc}{relative}")]) from None


# ---------------------------------------------------------------------------------------------- schedule


def per_batch_schedule(
    surface: Surface, method: Method, *, max_batch: int | None = None, ks: Iterable[int] | None = None
) -> list[list[int]]:
    """vLLM ``num_speculative_tokens_per_batch_size`` from the surface: ``[[start, end, k], ...]`` covering
    batch sizes 1..``max_batch`` (default: the largest measured level, at least 1), each size getting the k of
    ``method`` with the most tokens/s there, or 0 where drafting nothing beats every k. Ranges with the same k
    merge. Raises ValueError when the surface has no point of ``method``.

    What k 0 yields is the surface's ``method`` at k 0 where it was measured (the draft loaded, drafting
    nothing), else ``none``'s tokens/s. The two differ: at k 0 vLLM still runs the draft's forward pass over
    each step's tokens to keep the draft's KV cache in step (``llm_base_proposer.py``: "No draft tokens
    requested (e.g. Dynamic SD decided K=0)"), which a draft model pays in full."""
    candidates = sorted(set(ks) if ks is not None else set(surface.ks(method)))
    candidates = [k for k in candidates if k > 0 and surface.has(method, k)]
    if not candidates:
        raise ValueError(f"the surface has no measurement of {method.value}")
    top = max(1, int(max_batch or max(surface.levels())))
    idle = method if surface.has(method, 0) else Method.NONE
    out: list[list[int]] = []
    for b in range(1, top + 1):
        best_k, best = 0, surface.tokens_per_s(idle, 0, b)
        for k in candidates:
            v = surface.tokens_per_s(method, k, b)
            if v is not None and (best is None or v > best):
                best_k, best = k, v
        if out and out[-1][2] == best_k:
            out[-1][1] = b
        else:
            out.append([b, b, best_k])
    return out


def scheduled_k(schedule: Sequence[Sequence[int]], batch: float) -> int | None:
    """The k a ``per_batch_size`` schedule gives at ``batch`` (rounded, at least 1); None outside its ranges."""
    b = max(1, round(batch))
    for start, end, k in schedule:
        if start <= b <= end:
            return k
    return None


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


class GoodputModel:
    """Predicts tokens/s per option at a concurrency from a surface, live acceptance and online correction."""

    def __init__(self, surface: Surface | None, stale_half_life_s: float = DEFAULT_STALE_HALF_LIFE_S):
        self.surface = surface
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

    def raw(self, option: Option, concurrency: float, now: float | None = None) -> float | None:
        """The prediction before the per-bucket correction (``now`` ages a left method's acceptance)."""
        if option.per_batch:
            k = scheduled_k(option.per_batch, concurrency)
            k = option.k if k is None else k  # outside the ranges the engine drafts the step's k
            if k == 0 and not (self.surface is not None and self.surface.has(option.method, 0)):
                return self.raw(Option(Method.NONE, 0), concurrency, now)  # the idle draft unmeasured: as none
            return self.raw(Option(option.method, k), concurrency, now)
        base = self.surface.tokens_per_s(option.method, option.k, concurrency) if self.surface else None
        if base is None:
            return self.learned.get((option.label, bucket(concurrency)))
        return base * self._acceptance_factor(option.method, option.k, now)

    def predict(self, option: Option, concurrency: float, now: float | None = None) -> float | None:
        raw = self.raw(option, concurrency, now)
        return None if raw is None else raw * self.correction.get(bucket(concurrency), 1.0)

    def observe(
        self, option: Option, concurrency: float, tokens_per_s: float, now: float | None = None
    ) -> float | None:
        """A live reading of ``option`` at ``concurrency``: update the bucket's correction (or, without a surface
        point, learn the option's tokens/s there). Returns the bucket's correction factor."""
        b = bucket(concurrency)
        raw = self.raw(option, concurrency, now)
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
    def choose(self, current: int, load: Load | None, now: float) -> Choice:
        cfg = self.config
        if load is not None and load.concurrency is not None:
            self.samples.append((now, float(load.concurrency)))
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
        cost_s, cost_basis = self.switch_cost_s
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
