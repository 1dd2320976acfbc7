"""Acceptance per request class: a sliding window per class, fed from each response's own counters. Pure: no I/O.

With learned routing (``routing.classes``) every request belongs to a class (a header's value, the ``model``, a
hash of the system prompt, or the path). Each class keeps, over ``window`` seconds, what the responses a
speculating engine gave it drafted and accepted (llama-server's per-response ``timings.draft_n`` and
``draft_n_accepted``), and how many of its requests each engine served. The window is a ring of buckets, so it
ages as the method windows do (what is older than the window no longer counts) in bounded memory; the number of
classes is bounded too: past ``max_classes`` the least recently seen class is forgotten.

Whether a class speculates is not decided here: :meth:`specops.watch.decide.FallbackDecider.judge_class` judges
a class's :class:`~specops.watch.window.WindowStats` with the deployment's policy and its hysteresis (the streak
is kept on the class), and the verdict is kept here.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from specops.watch.window import NO_DATA, OK, WindowStats

#: Buckets per window: the window ages in steps of window/BUCKETS seconds.
BUCKETS = 16


@dataclass
class _Bucket:
    slot: int = -1  # which window/BUCKETS-long interval of time this bucket holds (-1: empty)
    draft_tokens: int = 0
    accepted: int = 0
    on: int = 0  # requests served by a speculating engine
    off: int = 0  # requests served by an engine without speculation


@dataclass
class RequestClass:
    """One class: its window of counters, its routing verdict, and the exploration it owes."""

    key: str
    buckets: list[_Bucket] = field(default_factory=lambda: [_Bucket() for _ in range(BUCKETS)])
    speculate: bool | None = None  # the decider's verdict (None: not decided yet: measured on the speculating engine)
    reason: str = ""
    first_seen: float = 0.0
    requests: int = 0
    explore_credit: float = 0.0
    streak: int = 0  # consecutive disjoint windows that disagreed with the verdict (the fallback's hysteresis)
    counted_end: float | None = None  # end of the last window that counted (hysteresis counts disjoint windows)


class ClassTable:
    """Every class seen lately, least recently seen first; at most ``max_classes``."""

    def __init__(self, max_classes: int, window_s: float, explore: float = 0.0):
        if max_classes < 1:
            raise ValueError("max_classes must be at least 1")
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError("window_s must be a positive number of seconds")
        self.max_classes = max_classes
        self.window_s = float(window_s)
        self.explore = float(explore)
        self.bucket_s = self.window_s / BUCKETS
        self._classes: OrderedDict[str, RequestClass] = OrderedDict()
        self.forgotten = 0  # classes dropped past max_classes

    def __len__(self) -> int:
        return len(self._classes)

    def __contains__(self, key: str) -> bool:
        return key in self._classes

    def keys(self) -> list[str]:
        return list(self._classes)

    def get(self, key: str) -> RequestClass | None:
        return self._classes.get(key)

    def touch(self, key: str, now: float) -> RequestClass:
        """The class ``key``, made most recently seen (created, forgetting the least recent past the bound)."""
        c = self._classes.get(key)
        if c is None:
            c = self._classes[key] = RequestClass(key, first_seen=now)
            while len(self._classes) > self.max_classes:
                self._classes.popitem(last=False)
                self.forgotten += 1
        else:
            self._classes.move_to_end(key)
        return c

    def _bucket(self, c: RequestClass, now: float) -> _Bucket:
        slot = int(now // self.bucket_s)
        b = c.buckets[slot % BUCKETS]
        if b.slot != slot:
            b.slot, b.draft_tokens, b.accepted, b.on, b.off = slot, 0, 0, 0, 0
        return b

    def explores(self, key: str, now: float) -> bool:
        """Whether this request of class ``key`` goes to the other engine than its verdict says (a share of
        ``explore`` of its requests, evenly spread), so a class that changes is seen. Counts the request."""
        c = self.touch(key, now)
        c.requests += 1
        if c.speculate is None or self.explore <= 0:
            return False
        c.explore_credit += self.explore
        if c.explore_credit >= 1.0:
            c.explore_credit -= 1.0
            return True
        return False

    def note(self, key: str, now: float, *, speculative: bool, draft_tokens: int = 0, accepted: int = 0) -> None:
        """A response of class ``key`` finished on a speculating engine (``speculative``) or not, with the draft
        tokens and accepted draft tokens its own counters reported."""
        c = self._classes.get(key)
        if c is None:  # forgotten while the request ran
            return
        b = self._bucket(c, now)
        if speculative:
            b.on += 1
            b.draft_tokens += max(0, int(draft_tokens))
            b.accepted += max(0, int(accepted))
        else:
            b.off += 1

    def _live(self, c: RequestClass, now: float) -> list[_Bucket]:
        oldest = int(now // self.bucket_s) - BUCKETS + 1
        return [b for b in c.buckets if b.slot >= oldest]

    def stats(self, key: str, now: float) -> WindowStats:
        """The class's window as :class:`WindowStats` (``ok`` once a speculating engine drafted for it)."""
        c = self._classes.get(key)
        if c is None:
            return WindowStats(status=NO_DATA, window_s=self.window_s, end=now, reason=f"class {key!r} not seen")
        live = self._live(c, now)
        drafted = sum(b.draft_tokens for b in live)
        accepted = sum(b.accepted for b in live)
        start = max(c.first_seen, now - self.window_s)
        common = dict(
            window_s=self.window_s,
            start=start,
            end=now,
            full=now - c.first_seen >= self.window_s,
            source="per-response timings",
            samples=sum(b.on for b in live),
        )
        if drafted <= 0:
            return WindowStats(status=NO_DATA, reason=f"nothing drafted for class {key!r} in the window", **common)
        return WindowStats(
            status=OK,
            acceptance=accepted / drafted,
            draft_tokens=float(drafted),
            accepted=float(accepted),
            reason=f"{accepted} accepted of {drafted} drafted for class {key!r}",
            **common,
        )

    def decide(self, key: str, speculate: bool | None, reason: str) -> bool:
        """Keep the decider's verdict for ``key``; True when it changed (a route change worth an event)."""
        c = self._classes.get(key)
        if c is None or speculate is None or speculate == c.speculate:
            return False
        c.speculate, c.reason = speculate, reason
        return True

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """One row per class (most recently seen last): its window, routed shares and verdict, for status."""
        rows = []
        for key, c in self._classes.items():
            live = self._live(c, now)
            on, off = sum(b.on for b in live), sum(b.off for b in live)
            s = self.stats(key, now)
            rows.append(
                {
                    "class": key,
                    "speculate": c.speculate,
                    "reason": c.reason,
                    "streak": c.streak,
                    "requests": c.requests,
                    "acceptance": s.acceptance,
                    "draft_tokens": int(s.draft_tokens or 0),
                    "served_on": on,
                    "served_off": off,
                    "on_share": round(on / (on + off), 3) if on + off else None,
                }
            )
        return rows
