"""What ``specops tune`` measured: rounds, per-concurrency results, per-setting results, and the winner.

:class:`TuneResult` holds medians per setting and concurrency, acceptance and mean acceptance length, the
winner (best median at the profile's concurrency), the best per concurrency and, for engines that take
it, a ``per_batch_size`` proposal from the measured surface when the best k differs with load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specops.methods import Method
from specops.perf.stats import median
from specops.perf.tune.settings import Setting, backend_of


def rounded(v: float | None, nd: int = 3) -> float | None:
    """``v`` rounded to ``nd`` digits (None stays None), for the record."""
    return None if v is None else round(v, nd)


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
    draft_tokens: int | None = None  # from per-response timings (llama-server), when reported
    accepted: int | None = None

    def to_dict(self) -> dict:
        return {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "output_tokens": self.output_tokens,
            "requests": self.requests,
            "errors": self.errors,
            "wall_s": round(self.wall_s, 3),
            "ttft_ms": rounded(self.ttft_ms),
            "tpot_ms": rounded(self.tpot_ms),
        }


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
        return median(self.samples)

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
        return {
            "concurrency": self.concurrency,
            "median_tokens_per_s": rounded(self.median),
            "rounds": [round(x, 3) for x in self.samples],
            "requests": sum(r.requests for r in self.rounds),
            "output_tokens": sum(r.output_tokens for r in self.rounds),
            "ttft_ms_median": rounded(median(r.ttft_ms for r in self.rounds)),
            "tpot_ms_median": rounded(median(r.tpot_ms for r in self.rounds)),
            "acceptance": rounded(self.acceptance, 4),
            "mean_acceptance_length": rounded(self.mean_acceptance_length),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "drafts": self.drafts,
        }


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
        return {
            **self.setting.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "launch_s": rounded(self.launch_s),
            "seconds": round(self.seconds, 3),
            "levels": {str(c): lr.to_dict() for c, lr in self.levels.items()},
        }


@dataclass
class TuneResult:
    """Every setting's result; the winner is the best median at the profile's concurrency."""

    results: list[SettingResult]
    levels: tuple[int, ...]  # the profile's concurrency first, then the others
    current: Setting
    min_rounds: int
    budget_s: float
    elapsed_s: float = 0.0
    #: settings measured only for the surface (``none`` when it was not asked for, the draft idle at k 0): never
    #: the winner
    reference_only: frozenset = frozenset()
    #: per method, why the k range ended where it did (filled by the race's widening)
    widening: dict = field(default_factory=dict)

    @property
    def primary(self) -> int:
        return self.levels[0]

    def eligible(self, level: int | None = None, *, reference: bool = False) -> list[SettingResult]:
        """Results with at least ``min_rounds`` rounds at ``level`` (and not failed), best median first
        (``reference``: with the settings measured only as the surface's baseline)."""
        level = self.primary if level is None else level
        ok = [
            r
            for r in self.results
            if r.status in ("measured", "pruned")
            and r.rounds(level) >= self.min_rounds
            and (reference or r.setting not in self.reference_only)
        ]
        return sorted(ok, key=lambda r: -(r.median(level) or 0.0))

    def best_at(self, level: int, *, reference: bool = False) -> SettingResult | None:
        ranked = self.eligible(level, reference=reference)
        return ranked[0] if ranked else None

    # ---- the k range: bracketed or at its edge
    def k_curve(self, method: Method) -> list[tuple[int, float]]:
        """(k, best median at the primary level over the method's settings with that k), by k."""
        best: dict[int, float] = {}
        for r in self.eligible():
            if r.setting.method is method and r.setting.k is not None:
                best[r.setting.k] = max(best.get(r.setting.k, 0.0), r.median(self.primary) or 0.0)
        return sorted(best.items())

    def k_edges(self) -> list[dict]:
        """Per method that takes k: the best k, the ks tried, and whether the best is at an edge of them
        (the optimum is then not bracketed: the curve may keep rising past it), with the widening's why."""
        out = []
        for method in dict.fromkeys(r.setting.method for r in self.results if r.setting.k is not None):
            curve = self.k_curve(method)
            if not curve:
                continue
            ks = [k for k, _ in curve]
            best_k = max(curve, key=lambda kv: kv[1])[0]
            edge = None
            if len(ks) == 1:
                edge = "only"
            elif best_k == ks[-1]:
                edge = "high"
            elif best_k == ks[0] and best_k > 1:
                edge = "low"
            out.append(
                {
                    "method": method.value,
                    "best_k": best_k,
                    "tried": ks,
                    "at_edge": edge,
                    "why": self.widening.get(method.value, ""),
                }
            )
        return out

    # ---- the goodput surface
    def surface_points(self) -> list[dict]:
        """Every measured (method, k) at every level with ``min_rounds`` rounds: the median tokens/s and mean
        acceptance length (``none`` as k 0, a draft idle at k 0 as its method's k 0; settings without a k, such
        as llama.cpp n-gram types, are left out; of several settings with one method and k, e.g. n-gram min/max
        pairs, the best)."""
        best: dict[tuple[str, int, int], dict] = {}
        for r in self.results:
            st = r.setting
            if st.method is not Method.NONE and st.k is None:
                continue
            k = 0 if st.method is Method.NONE else st.k
            for c, lr in r.levels.items():
                if len(lr.rounds) < self.min_rounds or lr.median is None:
                    continue
                key = (st.method.value, k, c)
                if key not in best or lr.median > best[key]["tokens_per_s"]:
                    best[key] = {
                        "method": st.method.value,
                        "k": k,
                        "concurrency": c,
                        "tokens_per_s": round(lr.median, 3),
                        "mean_acceptance_length": None if st.idle else rounded(lr.mean_acceptance_length),
                    }
        return [best[key] for key in sorted(best)]

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

    def per_batch_size(self, backend, engine_version: str | None, parallel: int | None) -> dict | None:
        """A ``num_speculative_tokens_per_batch_size`` proposal from the measured surface (vLLM).

        ``backend`` is a backend name or object; None unless it takes a k per batch size at
        ``engine_version``. Each batch size 1..max(parallel, the top level) gets the k of the speculative
        method with the most tokens/s there on the surface (interpolated in log2 of the concurrency between
        the measured levels, held flat past them), and k 0 where drafting nothing measured faster than every k
        (the draft idle at k 0 where tune measured it, else ``none``:
        :func:`specops.watch.surface.per_batch_schedule`). None when one k fits every batch size or the
        method was measured at fewer than two levels. Returns ``{"value": [[start, end, k], ...], "method",
        "k" (the largest), "why"}``.
        """
        from specops.watch.surface import Surface, option_label, per_batch_schedule

        if len(self.levels) < 2 or not backend_of(backend).takes_per_batch_size(engine_version):
            return None
        method = self._schedule_method()
        points = self.surface_points()
        if method is None or len({p["concurrency"] for p in points if p["method"] == method.value and p["k"]}) < 2:
            return None
        surface = Surface.from_dict({"points": points})
        value = per_batch_schedule(surface, method, max_batch=max(parallel or 0, max(self.levels)))
        ks = [r[2] for r in value]
        if len(value) == 1 or max(ks) == 0:
            return None  # one k (or none) at every batch size: the plain setting says it
        opts = [(m, k) for m, k in surface.options() if m in (method, Method.NONE)]
        best = []
        for c in surface.levels():
            m, k = max(opts, key=lambda o: surface.tokens_per_s(o[0], o[1], c) or 0.0)
            best.append(
                f"concurrency {c}: best {option_label(m, k)} ({surface.tokens_per_s(m, k, c) or 0.0:.1f} tok/s)"
            )
        zero = (
            f"0 where {method.value} drafting nothing (measured at k 0) is faster"
            if surface.has(method, 0)
            else "0 where none is faster (k 0 with the draft loaded was not measured: vLLM still runs the draft there)"
        )
        why = (
            ", ".join(best) + "; each batch size gets the k with the most tokens/s on the measured surface "
            f"(interpolated between levels), {zero}"
        )
        return {"value": value, "method": method.value, "k": max(ks), "why": why}

    def _schedule_method(self) -> Method | None:
        """The speculative method a schedule is rendered for: the winner's, else the best speculative setting's
        at the lowest level; None for n-gram with several min/max pairs (one schedule cannot hold them)."""
        w = self.winner
        method = w.setting.method if w is not None and w.setting.method is not Method.NONE else None
        if method is None:
            low = [r for r in self.eligible(min(self.levels)) if r.setting.method is not Method.NONE]
            method = low[0].setting.method if low else None
        if method is Method.NGRAM:
            pairs = {(r.setting.ngram_min, r.setting.ngram_max) for r in self.results if r.setting.method is method}
            if len(pairs) != 1:
                return None
        return method

    def to_dict(self) -> dict:
        w = self.winner
        ref = self.reference()
        return {
            "levels": list(self.levels),
            "primary_concurrency": self.primary,
            "min_rounds": self.min_rounds,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "current": self.current.to_dict(),
            "winner": w.setting.to_dict() if w else None,
            "reference": {"what": ref[0], "tokens_per_s": round(ref[1], 3)} if ref else None,
            "best_per_concurrency": {
                str(c): (b.setting.label if (b := self.best_at(c)) else None) for c in self.levels
            },
            "reference_only": [s.label for s in self.reference_only],
            "k_range": self.k_edges(),
            "results": [r.to_dict() for r in self.results],
        }
