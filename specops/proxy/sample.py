"""A small, bounded copy of recent greedy client requests and their answers, for live spot checks.

When ``certify.spot_check`` is enabled with a ``live`` source, the proxy offers every completed request to a
:class:`LiveSampler`; the spot checker (:mod:`specops.perf.certify_spot`) takes the kept ones now and then
and replays them against a reference without speculation. The client path pays almost nothing:

- :meth:`LiveSampler.offer` is synchronous and does byte checks only (full? a completions path? status
  200? the body within the size caps and saying ``"temperature": 0`` or ``"top_k": 1``?); the JSON parse
  that confirms a request is greedy runs later, on the next loop turn (``call_soon``), after the handler
  has handed its answer to the transport. Nothing is awaited.
- Bounded: at most ``max_entries`` requests and ``max_bytes`` in all (request body + answer), each at most
  ``max_entry_bytes``; when full, new requests are dropped (counted), never queued. Each check takes the
  newest and empties the sampler, so it holds requests that completed since the last check.
- Only non-streamed answers (read whole by the proxy) are kept: a streamed answer is not copied.
- Only the request body and the answer are kept — no header, so never the client's ``Authorization`` —
  in memory only, and the spot checker drops them once compared. What a check records (status, events,
  metrics, printed lines) says where an answer diverged, never its text: that goes only to an opt-in
  0600 file (``certify.spot_check.keep_text``, :mod:`specops.perf.certify_spot`).
- The checker's own probes carry :data:`PROBE_HEADER` and are never kept.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from dataclasses import dataclass

#: Paths whose greedy answers can be replayed and compared.
PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Header the spot checker's own probe requests carry (they are compared already, never sampled).
PROBE_HEADER = "X-Specops-Spot-Probe"
# cheap pre-filter on the raw body: an explicit temperature 0 or top_k 1 (the JSON parse confirms it)
_GREEDY = re.compile(rb'"temperature"\s*:\s*0(?:\.0*)?(?:[eE][+-]?\d+)?\s*[,}]|"top_k"\s*:\s*1\s*[,}]')
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')


@dataclass(frozen=True)
class Sample:
    """One greedy request as the client sent it (body only) and the answer the client got."""

    path: str
    body: bytes
    answer: bytes
    at: float  # time.time() when it completed

    @property
    def size(self) -> int:
        return len(self.body) + len(self.answer)


def is_greedy(req: object) -> bool:
    """A request whose answer is deterministic under greedy decoding: one choice, temperature 0 or top_k 1."""
    if not isinstance(req, dict) or req.get("stream") is True:
        return False
    n = req.get("n", 1)
    if n not in (None, 1) or req.get("best_of", 1) not in (None, 1):
        return False
    temp, top_k = req.get("temperature"), req.get("top_k")
    zero = isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp == 0
    one = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 1
    return zero or one


class LiveSampler:
    """Latest greedy requests, bounded in count and bytes; dropped when full (see the module docstring)."""

    def __init__(self, max_entries: int = 8, max_entry_bytes: int = 256 * 1024, max_bytes: int = 1024 * 1024):
        if max_entries < 1 or max_entry_bytes < 1 or max_bytes < max_entry_bytes:
            raise ValueError("LiveSampler needs max_entries >= 1 and max_bytes >= max_entry_bytes >= 1")
        self.max_entries, self.max_entry_bytes, self.max_bytes = max_entries, max_entry_bytes, max_bytes
        self._kept: deque[Sample] = deque()
        self._bytes = 0  # kept and pending (offered, not yet parsed)
        self._pending = 0
        self.counts = dict.fromkeys(("kept", "dropped_full", "dropped_size", "not_greedy", "taken", "discarded"), 0)

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def bytes(self) -> int:
        return self._bytes

    def offer(self, method: str, raw_path: str, headers, body: bytes, status: int, answer) -> None:
        """A completed request (from the proxy's request path): byte checks now, the JSON parse later."""
        if method != "POST" or status != 200 or not isinstance(answer, (bytes, bytearray)):
            return
        if raw_path.partition("?")[0] not in PATHS or PROBE_HEADER in headers:
            return
        if len(self._kept) + self._pending >= self.max_entries:
            self.counts["dropped_full"] += 1
            return
        if not _GREEDY.search(body) or _STREAM_TRUE.search(body):
            self.counts["not_greedy"] += 1
            return
        size = len(body) + len(answer)
        if size > self.max_entry_bytes or self._bytes + size > self.max_bytes:
            self.counts["dropped_size"] += 1
            return
        self._bytes += size
        self._pending += 1
        sample = Sample(raw_path.partition("?")[0], bytes(body), bytes(answer), time.time())
        try:
            asyncio.get_running_loop().call_soon(self._admit, sample)
        except RuntimeError:  # no loop (a direct call in a test): admit now
            self._admit(sample)

    def _admit(self, sample: Sample) -> None:
        self._pending -= 1
        try:
            req, ans = json.loads(sample.body), json.loads(sample.answer)
        except ValueError:
            req = ans = None
        if not is_greedy(req) or not isinstance(ans, dict) or not isinstance(ans.get("choices"), list):
            self._bytes -= sample.size
            self.counts["not_greedy"] += 1
            return
        self._kept.append(sample)
        self.counts["kept"] += 1

    def take(self, n: int) -> list[Sample]:
        """Up to ``n`` kept requests, newest first; the sampler is emptied (older ones are stale by the
        next check), so it fills again with requests that come after this check."""
        out = [self._kept.pop() for _ in range(min(n, len(self._kept)))]
        self.counts["taken"] += len(out)
        self.counts["discarded"] += len(self._kept)
        for s in (*out, *self._kept):
            self._bytes -= s.size
        self._kept.clear()
        return out

    def snapshot(self) -> dict:
        return {**self.counts, "held": len(self._kept), "held_bytes": self._bytes}
