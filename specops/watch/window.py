"""Acceptance over a sliding window, from timestamped counter samples. Pure: no clock, no I/O.

A window ending at ``now`` reaches back ``window_s``: its baseline is the newest sample taken at or before
``now - window_s`` (so the window covers all of it — ``full``), or the oldest sample when the history is
shorter. Between the baseline and the newest sample the counters are differenced pair by pair:

- a counter that falls means the engine restarted: like Prometheus' ``increase()``, the new value counts
  as the increase since the restart (the tokens between the last scrape and the crash are lost);
- a sample without speculative series (``counters=None``) counts as all-zero counters;
- acceptance = Δaccepted / Δdraft_tokens; mean acceptance length = 1 + Δaccepted / Δdrafts;
  per-position acceptance = Δaccepted_at_position / Δdrafts.

Statuses: ``ok``; ``no-data`` (fewer than two samples, or nothing drafted in the window — an idle engine
is never "acceptance 0"); ``spec-off`` (the newest sample has no speculative series: speculation is off
or stats are disabled, not a failure); ``unavailable`` (the source could not be read; built by the
watcher with :meth:`WindowStats.unavailable`). Coarse counters (vLLM V0) give ``coarse=True`` stats whose
acceptance is the engine's lifetime ratio and whose token counts are unknown (None).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from specops.backends.counters import SpecCounters


class WindowStatus(str, Enum):
    """What a window can say; ``.value`` is the word in events, JSON and ``specops status``."""

    OK = "ok"  # a verdict is possible: drafted tokens in the window
    NO_DATA = "no-data"  # idle, or too few samples
    SPEC_OFF = "spec-off"  # the engine exposes no speculative series
    UNAVAILABLE = "unavailable"  # the source could not be read

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


OK, NO_DATA, SPEC_OFF, UNAVAILABLE = (
    WindowStatus.OK,
    WindowStatus.NO_DATA,
    WindowStatus.SPEC_OFF,
    WindowStatus.UNAVAILABLE,
)

_ZERO = SpecCounters(draft_tokens=0.0, accepted=0.0)


@dataclass(frozen=True)
class Sample:
    """The counters read at time ``t`` (seconds on any monotonic clock); None = no speculative series."""

    t: float
    counters: SpecCounters | None


@dataclass(frozen=True)
class WindowStats:
    """What one window says about acceptance, with every number the policy needs to explain itself."""

    status: WindowStatus
    window_s: float
    start: float | None = None  # time of the baseline sample
    end: float | None = None  # time of the newest sample
    acceptance: float | None = None  # Δaccepted / Δdraft_tokens (coarse: lifetime ratio)
    mean_acceptance_length: float | None = None  # 1 + Δaccepted / Δdrafts (None without drafts)
    draft_tokens: float | None = None  # None when unknown (coarse)
    accepted: float | None = None
    drafts: float | None = None
    per_position: tuple[float, ...] = ()  # acceptance at each draft position (needs drafts)
    resets: int = 0  # counter resets (engine restarts) inside the window
    full: bool = False  # the samples span the whole window
    coarse: bool = False
    source: str = ""
    samples: int = 0
    reason: str = ""

    @classmethod
    def unavailable(cls, now: float, reason: str, window_s: float = 0.0) -> WindowStats:
        """Stats for a tick whose source could not be read (endpoint down, Prometheus unreachable)."""
        return cls(status=UNAVAILABLE, window_s=window_s, end=now, reason=reason)

    @property
    def span(self) -> float:
        return (self.end - self.start) if self.start is not None and self.end is not None else 0.0

    @property
    def mean_draft_length(self) -> float | None:
        """Draft tokens per draft (the k in effect, measured); None without drafts."""
        if self.drafts and self.draft_tokens is not None:
            return self.draft_tokens / self.drafts
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": getattr(self.status, "value", self.status),
            "window_s": self.window_s,
            "start": self.start,
            "end": self.end,
            "acceptance": self.acceptance,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "drafts": self.drafts,
            "per_position": list(self.per_position),
            "resets": self.resets,
            "full": self.full,
            "coarse": self.coarse,
            "source": self.source,
            "samples": self.samples,
            "reason": self.reason,
        }


def _fields(c: SpecCounters) -> list[float]:
    return [c.draft_tokens, c.accepted, c.drafts or 0.0, *c.per_position]


class WindowError(ValueError):
    """A window length that cannot be used (not a finite number of seconds above zero)."""


def check_window(window_s: object) -> float:
    """``window_s`` as float seconds when it is finite and > 0; raises :class:`WindowError` (one line)."""
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)):
        raise WindowError(f"the window must be a number of seconds, not {type(window_s).__name__}")
    try:
        value = float(window_s)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or not value > 0:
        raise WindowError(f"the window must be a finite number of seconds > 0, got {window_s!r}")
    return value


def window_stats(samples: Iterable[Sample], now: float, window_s: float) -> WindowStats:
    """Acceptance over ``(now - window_s, now]`` from ``samples`` (any order; samples after ``now`` ignored)."""
    window_s = check_window(window_s)
    ordered = sorted((s for s in samples if s.t <= now), key=lambda s: s.t)
    if not ordered:
        return WindowStats(NO_DATA, window_s, reason="no samples yet")
    newest = ordered[-1]
    kind = newest.counters
    if kind is None:
        return WindowStats(
            SPEC_OFF,
            window_s,
            start=newest.t,
            end=newest.t,
            samples=1,
            reason="no speculative series: speculation is off or stats are disabled",
        )
    cut = now - window_s
    base = _baseline(ordered, cut)
    full = ordered[base].t <= cut
    used = ordered[base:]
    common = WindowStats(
        NO_DATA,
        window_s,
        start=used[0].t,
        end=newest.t,
        full=full,
        coarse=kind.coarse,
        source=kind.source,
        samples=len(used),
    )
    if len(used) < 2:
        return replace(common, reason="one sample: a window needs two")
    delta, resets = _increase(used)
    common = replace(common, resets=resets)
    restarted = f" ({resets} counter reset{'s' if resets != 1 else ''}: engine restarted)" if resets else ""
    if kind.coarse:
        return _coarse_stats(common, kind, delta[0], restarted)
    has_drafts = all(s.counters is None or s.counters.drafts is not None for s in used)
    return _windowed_stats(common, delta, has_drafts, restarted)


def _baseline(ordered: Sequence[Sample], cut: float) -> int:
    """Index of the newest sample at or before ``cut`` (the oldest one when none is)."""
    base = 0
    for i, s in enumerate(ordered):
        if s.t <= cut:
            base = i
    return base


def _increase(used: Sequence[Sample]) -> tuple[list[float], int]:
    """Summed pairwise differences of every counter field, and how many times a counter fell (a restart:
    the new value counts as the increase since it)."""
    width = max(len(_fields(s.counters or _ZERO)) for s in used)
    delta = [0.0] * width
    resets = 0
    prev = _fields(used[0].counters or _ZERO)
    for s in used[1:]:
        cur = _fields(s.counters or _ZERO)
        cur += [0.0] * (width - len(cur))
        prev += [0.0] * (width - len(prev))
        if any(c < p for c, p in zip(cur, prev)):
            resets += 1
            step = cur
        else:
            step = [c - p for c, p in zip(cur, prev)]
        delta = [d + x for d, x in zip(delta, step)]
        prev = cur
    return delta, resets


def _coarse_stats(common: WindowStats, kind: SpecCounters, d_tokens: float, restarted: str) -> WindowStats:
    """vLLM V0: the counters over-count, only "did anything get drafted" can be read from them."""
    if d_tokens <= 0:
        return replace(common, reason="nothing drafted in the window (idle)" + restarted)
    if kind.lifetime_acceptance is None:
        return replace(common, reason="no lifetime acceptance ratio yet" + restarted)
    return replace(
        common,
        status=OK,
        acceptance=kind.lifetime_acceptance,
        reason="coarse: the engine's lifetime acceptance ratio (vLLM V0 counters over-count and "
        "cannot be windowed)" + restarted,
    )


def _windowed_stats(common: WindowStats, delta: list[float], has_drafts: bool, restarted: str) -> WindowStats:
    """Acceptance, mean acceptance length and per-position acceptance from the counters' increase."""
    d_tokens, d_accepted, d_drafts = delta[0], delta[1], delta[2]
    drafts = d_drafts if has_drafts else None
    counted = replace(common, draft_tokens=d_tokens, accepted=d_accepted, drafts=drafts)
    if d_tokens <= 0:
        return replace(counted, reason="nothing drafted in the window (idle)" + restarted)
    acceptance = d_accepted / d_tokens
    note = ""
    if acceptance > 1.0:
        acceptance, note = 1.0, f"; accepted ({d_accepted:g}) exceeds drafted ({d_tokens:g}), clamped to 1"
    mal = 1.0 + d_accepted / drafts if drafts else None
    per_position = tuple(x / drafts for x in delta[3:]) if drafts else ()
    return replace(
        counted,
        status=OK,
        acceptance=acceptance,
        mean_acceptance_length=mal,
        per_position=per_position,
        reason=f"{d_accepted:g} accepted of {d_tokens:g} drafted" + restarted + note,
    )


@dataclass
class SampleBuffer:
    """Samples for one window: keeps what the window needs (one sample at or before its start, and after).

    Clear it when the engine changes method: a window must never mix two methods.
    """

    window_s: float
    _samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.window_s = check_window(self.window_s)

    def add(self, sample: Sample) -> None:
        if self._samples and sample.t < self._samples[-1].t:
            raise ValueError(f"samples must arrive in time order ({sample.t} < {self._samples[-1].t})")
        self._samples.append(sample)
        self.trim(sample.t)

    def trim(self, now: float) -> None:
        """Drop samples older than the newest one at or before ``now - window_s``."""
        times = [s.t for s in self._samples]
        keep_from = bisect.bisect_right(times, now - self.window_s) - 1
        if keep_from > 0:
            del self._samples[:keep_from]

    def stats(self, now: float) -> WindowStats:
        return window_stats(self._samples, now, self.window_s)

    def clear(self) -> None:
        self._samples.clear()

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(list(self._samples))

    @property
    def samples(self) -> Sequence[Sample]:
        return tuple(self._samples)
