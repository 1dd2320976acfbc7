"""``specops advise``: what the performance model (specops.speedup) says about a draft, from one acceptance number.

The arithmetic lives in :mod:`specops.speedup`; this module decides *which* number goes in and says so:

- ``alpha`` — the per-token acceptance probability α of the model (each draft token accepted with
  probability α, drafting stops at the first rejection);
- ``acceptance_rate`` — what engines report, accepted / drafted. At k draft tokens it equals
  (α + … + α^k) / k, which is *lower* than α for k > 1; α is recovered with
  :func:`specops.speedup.alpha_from_acceptance_rate` at the k it was measured at;
- ``mean_length`` — the measured mean acceptance length τ = 1 + accepted / drafts (tokens per target
  pass). It needs no model at the k it was measured at; α for other k follows from its rate (τ − 1) / k.

Live readings (a running ``specops up`` instance's window, an engine's ``/metrics``, Prometheus) give a
rate and, when the engine counts drafts, a mean acceptance length and the mean draft length (the k in
effect, measured).

The model is for a memory-bound target (batch 1): one target pass costs the same for 1 or k + 1 tokens,
and a draft pass costs ``c`` of it — unless a verification-cost curve was measured on this machine for the
engine and model (``specops bench --probe-verify``, :mod:`specops.perf.verifycost`): then a step costs
k·c + c_verify(k + 1) target steps (a CPU's grows with k), and the advice says which of the two it used. With more concurrent sequences the target becomes compute-bound,
verifying k + 1 tokens per sequence is no longer free, and the benefit fades — hence the batch-size
caveat and, for vLLM, a ``num_speculative_tokens_per_batch_size`` schedule to start from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from specops.errors import SpecopsError
from specops.speedup import (
    DEFAULT_DRAFT_COST,
    VerifyCost,
    acceptance_rate,
    alpha_from_acceptance_rate,
    best_k,
    cost_basis,
    expected_speedup,
    expected_tokens_per_step,
    speedup_from_length,
)

#: Below this α the draft usually costs more than it gains (published rule of thumb).
LOW_ALPHA = 0.6
#: Concurrency from which the batch-size caveat becomes a concrete suggestion.
HIGH_CONCURRENCY = 8
#: Published speedups of one setup (70B target + EAGLE-2) by batch size: how fast the benefit fades.
PUBLISHED_FADING = ((1, 3.1), (8, 1.8), (32, 1.2), (64, 1.1))
DEFAULT_K = 4
K_MAX = 8


@dataclass(frozen=True)
class AcceptanceInput:
    """The acceptance number advise works from, what kind it is, and where it came from."""

    alpha: float  # per-token α used by the model
    given: str  # "alpha" | "acceptance_rate" | "mean_length"
    value: float  # the number as given / read
    source: str  # e.g. "--alpha", "instance llama-noisy (window 60s)"
    measured_k: int | None = None  # k the rate / length was measured at
    acceptance_rate: float | None = None  # accepted / drafted, when measured or given
    mean_acceptance_length: float | None = None  # 1 + accepted / drafts, when measured or given
    mean_draft_length: float | None = None  # drafted / drafts (measured k), when the engine counts drafts
    draft_tokens: float | None = None  # how much evidence a live reading rests on

    def to_dict(self) -> dict:
        return {
            "alpha": self.alpha,
            "given": self.given,
            "value": self.value,
            "source": self.source,
            "measured_k": self.measured_k,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "mean_draft_length": self.mean_draft_length,
            "draft_tokens": self.draft_tokens,
        }


def _check_unit(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:  # also NaN
        raise SpecopsError(f"{name} must be within [0, 1], got {value:g}")
    return value


def _check_k(k: int, what: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SpecopsError(f"{what} must be an integer >= 1, got {k!r}")
    return k


def from_alpha(alpha: float, source: str = "--alpha") -> AcceptanceInput:
    """α given directly."""
    alpha = _check_unit("α (--alpha)", alpha)
    return AcceptanceInput(alpha=alpha, given="alpha", value=alpha, source=source)


def from_acceptance_rate(rate: float, k: int, source: str = "--acceptance-rate", **measured) -> AcceptanceInput:
    """An engine's acceptance rate (accepted / drafted) measured at ``k`` draft tokens per step."""
    rate = _check_unit("the acceptance rate", rate)
    k = _check_k(k, "the k the acceptance rate was measured at")
    return AcceptanceInput(
        alpha=alpha_from_acceptance_rate(rate, k),
        given="acceptance_rate",
        value=rate,
        source=source,
        measured_k=k,
        acceptance_rate=rate,
        **measured,
    )


def from_mean_length(length: float, k: int, source: str = "--mean-length", **measured) -> AcceptanceInput:
    """A measured mean acceptance length τ = 1 + accepted / drafts at ``k`` draft tokens per step."""
    k = _check_k(k, "the k the mean acceptance length was measured at")
    length = float(length)
    if not 1.0 <= length <= k + 1:
        raise SpecopsError(f"a mean acceptance length at k={k} lies within [1, {k + 1}], got {length:g}")
    rate = (length - 1.0) / k
    measured.setdefault("mean_acceptance_length", length)
    return AcceptanceInput(
        alpha=alpha_from_acceptance_rate(rate, k),
        given="mean_length",
        value=length,
        source=source,
        measured_k=k,
        acceptance_rate=rate,
        **measured,
    )


def from_window(stats, k: int | None, source: str) -> AcceptanceInput:
    """A live reading (:class:`specops.watch.window.WindowStats`): the mean length when drafts are counted, else
    the rate. ``k`` is the configured k; without it the measured mean draft length (rounded) is used."""
    if stats.status != "ok" or stats.acceptance is None:
        why = stats.reason or stats.status
        raise SpecopsError(f"{source}: no acceptance to advise from ({stats.status}: {why})")
    draft_len = stats.mean_draft_length
    if k is None:
        if draft_len is None:
            raise SpecopsError(f"{source} does not say how many tokens are drafted per step: pass --k")
        k = max(1, round(draft_len))
    k = _check_k(int(k), "k")
    rate = min(max(float(stats.acceptance), 0.0), 1.0)
    length = stats.mean_acceptance_length
    # α from the measured rate (accepted/drafted) at the configured k; τ as measured (drafts may be shorter
    # than k near the end of a sequence, so (τ − 1)/k would understate the rate)
    return AcceptanceInput(
        alpha=alpha_from_acceptance_rate(rate, k),
        given="mean_length" if length is not None else "acceptance_rate",
        value=length if length is not None else rate,
        source=source,
        measured_k=k,
        acceptance_rate=rate,
        mean_acceptance_length=length,
        mean_draft_length=draft_len,
        draft_tokens=stats.draft_tokens,
    )


# ---------------------------------------------------------------------------------------------------
# the advice


@dataclass
class Advice:
    acceptance: AcceptanceInput
    k: int
    c: float
    batch_size: int
    k_max: int
    backend: str | None = None
    tokens_per_pass: float = 0.0
    speedup: float = 0.0
    measured_speedup: float | None = None  # τ measured / (1 + k_measured·c), no α model involved
    best_k: int = 0
    best_speedup: float = 1.0
    table: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    batch_caveat: str = ""
    per_batch_size: list[list[int]] | None = None
    notes: list[str] = field(default_factory=list)
    #: from a measured goodput surface (``specops tune``): where each option stops beating no speculation
    crossover: dict[str, float | None] | None = None
    surface: dict | None = None  # where the surface was measured (date, engine version, draft sha, levels)
    verify_cost: VerifyCost | None = None  # measured on this machine; None: c_verify ≡ 1 assumed

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def to_dict(self) -> dict:
        return {
            "acceptance": self.acceptance.to_dict(),
            "alpha": self.alpha,
            "k": self.k,
            "draft_cost_ratio": self.c,
            "batch_size": self.batch_size,
            "backend": self.backend,
            "cost_model": {
                "tokens_per_pass": "(1 - alpha^(k+1)) / (1 - alpha)",
                "speedup": "(1 - alpha^(k+1)) / ((1 - alpha) * (k*c + c_verify(k+1)))",
                "verify_cost": cost_basis(self.verify_cost),
                "verify_cost_curve": None if self.verify_cost is None else self.verify_cost.to_dict(),
                "assumes": "a draft pass costs c of a target pass; verifying k+1 tokens costs c_verify(k+1) target "
                "passes (1 when no curve was measured: a memory-bound target at batch 1)",
            },
            "tokens_per_pass": self.tokens_per_pass,
            "speedup": self.speedup,
            "measured_speedup": self.measured_speedup,
            "best_k": self.best_k,
            "best_speedup": self.best_speedup,
            "table": self.table,
            "warnings": self.warnings,
            "batch_caveat": self.batch_caveat,
            "per_batch_size": self.per_batch_size,
            "notes": self.notes,
            "crossover": self.crossover,
            "surface": self.surface,
        }


def per_batch_size_schedule(k: int, max_batch: int | None = None) -> list[list[int]] | None:
    """A starting ``num_speculative_tokens_per_batch_size`` for vLLM: k up to batch 4, about half up to 16,
    1 up to 64, then none — the shape of the published fading (3.1x, 1.8x, 1.2x, 1.1x at 1/8/32/64).

    vLLM reads the ranges as inclusive, needs the first to start at 1, carries the last k on to larger
    batches and caps every k at ``num_speculative_tokens``. ``max_batch`` (the deployment's most
    concurrent sequences) trims the bands; unknown, the last band ends at 256. None when speculation does
    not pay even at batch 1 (k = 0).
    """
    if k < 1:
        return None
    top = max(1, int(max_batch)) if max_batch else 256
    bands = [(1, 4, k), (5, 16, max(1, math.ceil(k / 2))), (17, 64, 1), (65, max(65, top), 0)]
    out: list[list[int]] = []
    for start, end, kk in bands:
        if start > top:
            break
        if out and out[-1][2] == kk:  # merge equal neighbours (k = 1 or 2)
            out[-1][1] = min(end, top)
        else:
            out.append([start, min(end, top), kk])
    return out


def advise(
    acc: AcceptanceInput,
    *,
    k: int = DEFAULT_K,
    c: float = DEFAULT_DRAFT_COST,
    batch_size: int = 1,
    k_max: int = K_MAX,
    backend: str | None = None,
    max_batch: int | None = None,
    min_acceptance: float | None = None,
    surface=None,
    verify_cost: VerifyCost | None = None,
) -> Advice:
    """The model's answer for ``acc`` at ``k`` draft tokens with draft cost ratio ``c``.

    ``max_batch`` is the most concurrent sequences the deployment serves (profile ``server.parallel``);
    with ``batch_size`` it decides whether the batch caveat comes with a per-batch-size schedule.
    ``min_acceptance`` (the profile's fallback threshold, on the acceptance *rate*) adds a note when
    the threshold watcher would act against the model. ``surface`` (a measured
    :class:`specops.watch.surface.Surface`) adds the measured crossover concurrency of every option and, for
    engines that take it, a per-batch-size schedule rendered from the measurements instead of the published shape.
    ``verify_cost`` (a curve measured here for the engine and model) prices verification; None: c_verify ≡ 1.
    """
    k = _check_k(k)
    c = _check_settings(k_max, c, batch_size)
    adv = Advice(
        acceptance=acc,
        k=k,
        c=c,
        batch_size=batch_size,
        k_max=max(k_max, k),
        backend=backend,
        verify_cost=verify_cost,
    )
    _model_numbers(adv)
    _warnings(adv, min_acceptance)
    _batch_advice(adv, max_batch)
    if surface is not None:
        _surface_advice(adv, surface, max_batch)
    return adv


def _surface_advice(adv: Advice, surface, max_batch: int | None) -> None:
    """The measured crossovers, and the schedule from the measured surface (replacing the published shape)."""
    from specops.methods import Method
    from specops.watch.surface import per_batch_schedule

    adv.crossover = surface.crossovers()
    adv.surface = {
        **{k: surface.meta.get(k) for k in ("date", "backend", "engine_version", "draft_sha")},
        "levels": surface.levels(),
    }
    where = (
        f"measured {surface.meta.get('date') or '(undated)'} on {surface.meta.get('engine_version') or 'the engine'}, "
        f"concurrency {', '.join(map(str, surface.levels()))}"
    )
    top = max(surface.levels())
    for label, c in adv.crossover.items():
        if c is None:
            adv.notes.append(f"{label} beats no speculation at every measured concurrency up to {top} ({where})")
        elif c <= 1:
            adv.notes.append(f"{label} does not beat no speculation even at concurrency 1 ({where})")
        else:
            adv.notes.append(f"{label} stops beating no speculation at concurrency {c:g} ({where})")
    be = _backend(adv.backend)
    methods = [m for m, _ in surface.options() if m is not Method.NONE]
    if be is not None and be.takes_per_batch_size(None) and methods:
        method = methods[0]
        adv.per_batch_size = per_batch_schedule(surface, method, max_batch=max_batch or top)
        adv.notes.append(
            f"speculative.per_batch_size from the measured surface ({method.value}): {adv.per_batch_size} "
            "(k 0 where no speculation was faster)"
        )


def find_surface(profile_path: str | None, profile=None):
    """The goodput surface recorded for a profile: ``fallback.goodput.surface`` (relative to the profile's
    folder), else ``<profile>.tune.json``,
    else the lock file's ``tune`` entry; None when none holds one (a broken file raises SpecopsError)."""
    from pathlib import Path

    from specops.watch.surface import Surface, load_surface, surface_file

    named = getattr(getattr(getattr(profile, "fallback", None), "goodput", None), "surface", None)
    if named:  # a relative path is the profile's neighbour, as `specops up` reads it
        return load_surface(surface_file(named, profile_path))
    if not profile_path:
        return None
    p = Path(profile_path)
    for candidate in (p.with_name(p.stem + ".tune.json"), p.with_name(p.stem + ".lock.json")):
        if candidate.is_file():
            try:
                record = json.loads(candidate.read_text(encoding="utf-8"))
                found = Surface.from_record(record) if isinstance(record, dict) else None
            except ValueError as exc:
                raise SpecopsError(f"{candidate}: {exc}") from None
            if found is not None:
                return found
    return None


def _check_settings(k_max: int, c: float, batch_size: int) -> float:
    """Raise for a k_max, c or batch size the model cannot use; ``c`` as a float."""
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise SpecopsError(f"--k-max must be an integer >= 1, got {k_max!r}")
    c = float(c)
    if not 0.0 <= c <= 1.0:
        raise SpecopsError(f"the draft cost ratio c must be within [0, 1], got {c:g}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SpecopsError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    return c


def _model_numbers(adv: Advice) -> None:
    """Tokens per pass and speedup at k, the best k, the table over 1..k_max, and the measured speedup."""
    acc, a, k, c, curve = adv.acceptance, adv.alpha, adv.k, adv.c, adv.verify_cost
    adv.tokens_per_pass = expected_tokens_per_step(a, k)
    adv.speedup = expected_speedup(a, k, c, curve)
    adv.best_k = best_k(a, c, adv.k_max, curve)
    adv.best_speedup = expected_speedup(a, adv.best_k, c, curve)
    for kk in range(1, adv.k_max + 1):
        adv.table.append(
            {
                "k": kk,
                "tokens_per_pass": expected_tokens_per_step(a, kk),
                "acceptance_rate": acceptance_rate(a, kk),
                "speedup": expected_speedup(a, kk, c, curve),
                "current": kk == k,
                "best": kk == adv.best_k,
            }
        )
    if acc.mean_acceptance_length is not None:
        draft_len = acc.mean_draft_length if acc.mean_draft_length else float(acc.measured_k or k)
        adv.measured_speedup = speedup_from_length(acc.mean_acceptance_length, draft_len, c, curve)


def _warnings(adv: Advice, min_acceptance: float | None) -> None:
    """A draft too weak to pay, a k slower than none, a thin reading, and a threshold that contradicts the model."""
    acc, a, k, c = adv.acceptance, adv.alpha, adv.k, adv.c
    if a < LOW_ALPHA:
        adv.warnings.append(
            f"α = {a:.3f} is below {LOW_ALPHA}: the draft is wrong too often for speculation to "
            "pay reliably; try another draft (or n-gram for copy-heavy traffic) or turn it off"
        )
    if adv.best_k == 0:
        adv.warnings.append(
            f"no k in 1..{adv.k_max} beats decoding without speculation at c = {c:g}: "
            "turn speculation off (method: none)"
        )
    elif adv.speedup < 1.0:
        adv.warnings.append(
            f"at k = {k} speculation is slower than none ({adv.speedup:.2f}x); "
            f"k = {adv.best_k} would give {adv.best_speedup:.2f}x"
        )
    if acc.draft_tokens is not None and acc.draft_tokens < 200:
        adv.warnings.append(f"the reading rests on only {acc.draft_tokens:g} drafted tokens: treat it as rough")
    if acc.measured_k is not None and acc.measured_k != k:
        adv.notes.append(f"the acceptance was measured at k = {acc.measured_k}; α is what carries over to k = {k}")
    if min_acceptance is not None and adv.best_k > 0 and adv.speedup > 1.0:
        rate_here = acceptance_rate(a, k)
        if rate_here < min_acceptance:
            adv.notes.append(
                f"at k = {k} this α gives an acceptance rate of {rate_here:.3f}, below the profile's "
                f"fallback.min_acceptance {min_acceptance:g}: the threshold watcher would fall back "
                f"although the model predicts {adv.speedup:.2f}x (the rate falls as k grows); "
                "use fallback.mode: model or a lower min_acceptance"
            )


def _batch_advice(adv: Advice, max_batch: int | None) -> None:
    """The batch caveat, and under high concurrency the backend's advice (vLLM: a per-batch-size schedule)."""
    batch_size = adv.batch_size
    fading = ", ".join(f"{s:g}x at {b}" for b, s in PUBLISHED_FADING)
    adv.batch_caveat = (
        f"these numbers assume a memory-bound target (batch 1). With more concurrent sequences "
        f"the target becomes compute-bound and verifying k+1 tokens per sequence is no longer "
        f"free: the benefit fades (one published 70B + EAGLE-2 setup: {fading}). "
        f"Measure at your concurrency with `specops bench`."
    )
    high = max(batch_size, max_batch or 0) >= HIGH_CONCURRENCY
    if high and adv.best_k > 0:
        be = _backend(adv.backend)
        if be is not None and be.takes_per_batch_size(None):
            adv.per_batch_size = per_batch_size_schedule(adv.best_k, max_batch)
            adv.notes.append(
                f"for {be.engine_name} under high concurrency, draft less as the batch grows: "
                f"num_speculative_tokens: {adv.best_k} with speculative.per_batch_size: "
                f"{adv.per_batch_size} (vLLM's num_speculative_tokens_per_batch_size: inclusive "
                "[start_bs, end_bs, k] ranges, each k capped at num_speculative_tokens) is a "
                "starting point"
            )
        elif be is not None and be.concurrency_note:
            adv.notes.append(be.concurrency_note)
    if batch_size > 1:
        adv.notes.append(f"batch size {batch_size}: expect less than the {adv.speedup:.2f}x above")


def _backend(name: str | None):
    """The installed backend ``name`` (None: the default backend), or None when it is not installed."""
    from specops.backends import DEFAULT_BACKEND
    from specops.plugins import get_registry

    return get_registry().backends.get(name or DEFAULT_BACKEND)


# ---------------------------------------------------------------------------------------------------
# printing


def format_advice(adv: Advice) -> str:
    acc, a = adv.acceptance, adv.alpha
    lines = []
    if acc.given == "alpha":
        lines.append(f"acceptance   α = {a:.4f} per draft token ({acc.source})")
    elif acc.given == "acceptance_rate":
        lines.append(
            f"acceptance   rate {acc.value:.4f} (accepted/drafted) at k = {acc.measured_k} "
            f"→ α = {a:.4f} per draft token ({acc.source})"
        )
    else:
        lines.append(
            f"acceptance   mean acceptance length {acc.value:.3f} tokens/pass at k = "
            f"{acc.measured_k} (rate {acc.acceptance_rate:.4f}) → α = {a:.4f} ({acc.source})"
        )
    if acc.draft_tokens is not None:
        extra = f", {acc.mean_draft_length:.2f} drafted per step" if acc.mean_draft_length else ""
        lines.append(f"evidence     {acc.draft_tokens:g} drafted tokens{extra}")
    lines.append(
        f"cost model   τ(α,k) = (1 − α^(k+1)) / (1 − α) tokens per target pass; speedup "
        f"S = τ / (k·c + c_verify(k+1)), c = {adv.c:g} (a draft pass costs {adv.c:g} of a target pass)"
    )
    lines.append(f"verify cost  {cost_basis(adv.verify_cost)}")
    if adv.verify_cost is not None:
        costs = ", ".join(f"{n}: {adv.verify_cost.at(n):.2f}" for n, _ in adv.verify_cost.points)
        lines.append(
            f"             decode steps per pass over n tokens: {costs}; plus {adv.verify_cost.per_token:.2f} "
            "per token kept (sampling, …: a decode step's time outside its pass)"
        )
    lines.append("")
    lines.append(
        f"at k = {adv.k}: {adv.tokens_per_pass:.3f} tokens per target pass, expected speedup {adv.speedup:.2f}x"
    )
    if adv.measured_speedup is not None:
        lines.append(
            f"         from the measured mean acceptance length "
            f"{acc.mean_acceptance_length:.3f}: {adv.measured_speedup:.2f}x (no α model)"
        )
    if adv.best_k == 0:
        lines.append("best k: none (speculation does not pay at this acceptance and cost)")
    else:
        lines.append(f"best k: {adv.best_k} ({adv.best_speedup:.2f}x)")
    lines.append("")
    lines.append("   k   tokens/pass   acceptance rate   speedup")
    for row in adv.table:
        mark = " ◀ best" if row["best"] else ""
        mark += " (now)" if row["current"] else ""
        lines.append(
            f"  {row['k']:2d}   {row['tokens_per_pass']:11.3f}   {row['acceptance_rate']:15.3f}   "
            f"{row['speedup']:6.2f}x{mark}"
        )
    lines.append("  (acceptance rate: what the engine reports at that k, accepted/drafted)")
    lines.append("")
    lines.append(f"batch size {adv.batch_size}: {adv.batch_caveat}")
    for note in adv.notes:
        lines.append(f"note: {note}")
    for w in adv.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# live readings


def read_instance(name: str, state_dir: str | None = None):
    """The acceptance window of a running ``specops up`` instance → (WindowStats, state dict)."""
    from specops.run.identity import owner_problem
    from specops.run.instance import InstancePaths, read_state
    from specops.watch.window import WindowStats

    paths = InstancePaths.for_profile(name, state_dir)
    state = read_state(paths)
    if state is None:
        raise SpecopsError(f"no instance named {name!r} (no {paths.state})")
    stale = owner_problem(state)  # the same check as `specops status`: a reused pid is not this instance
    if stale:
        raise SpecopsError(f"instance {name!r} is not running (stale {paths.state}: {stale})")
    acc = state.get("acceptance")
    if not isinstance(acc, dict):
        raise SpecopsError(f"instance {name!r} has no acceptance reading yet (state {state.get('state')})")
    fields = {
        k: acc.get(k)
        for k in (
            "status",
            "window_s",
            "start",
            "end",
            "acceptance",
            "mean_acceptance_length",
            "draft_tokens",
            "accepted",
            "drafts",
            "reason",
            "source",
        )
    }
    fields["window_s"] = fields["window_s"] or 0.0
    fields["status"] = fields["status"] or "no-data"
    fields = {k: v for k, v in fields.items() if v is not None or k in ("acceptance",)}
    return WindowStats(**fields), state


def read_scrape(
    url: str,
    registry,
    model_name: str | None = None,
    window: float = 0.0,
    backend_name: str | None = None,
    headers: dict | None = None,
):
    """Acceptance from an engine's ``/metrics``: lifetime totals (``window`` 0) or the increase over
    ``window`` seconds between two scrapes. The backend is detected from the series when not named."""
    import time

    from specops.perf.launch import acceptance_between
    from specops.watch.sources import ScrapeSource, SourceError
    from specops.watch.window import Sample, window_stats

    backends = [registry.backend(backend_name)] if backend_name else list(registry.backends.values())

    def read():
        try:
            text, om = ScrapeSource(url, "x:", model_name, 5.0, headers).fetch()
        except SourceError as exc:
            raise SpecopsError(str(exc)) from None
        for b in backends:
            if not getattr(b, "metric_prefix", ""):
                continue
            try:
                counters = b.acceptance_counters(text, model_name, om)
            except ValueError as exc:
                raise SpecopsError(f"{url}: {exc}") from None
            if counters is not None:
                return b, counters
        return None, None

    backend, first = read()
    if first is None:
        raise SpecopsError(
            f"{url} has no speculative-decoding series: speculation is off, stats are "
            "disabled, or the model name matches nothing"
        )
    if window <= 0:
        return window_stats([Sample(0.0, None), Sample(1.0, first)], 1.0, 1.0), backend
    time.sleep(window)
    _, second = read()
    return acceptance_between(first, second), backend


def read_prometheus(url: str, prefix: str, labels: dict, window: float):
    """Acceptance over ``window`` from Prometheus (``sum(increase(...))`` per series, as the watcher does)."""
    import time

    from specops.watch.sources import PromQLSource, SourceError

    src = PromQLSource(url, prefix, labels, window)
    try:
        return src.read(now=time.time())
    except SourceError as exc:
        raise SpecopsError(str(exc)) from None
    finally:
        src.close()
