"""Client load against a real `specops up`: many concurrent clients (half streaming), every request counted.

The central promise of specops is that a client never loses a request it sent while the supervisor restarts
or switches the engine. :class:`Load` checks it from the outside, the way a client sees it: each request
ends in exactly one of

- ``ok``: HTTP 200 and a complete answer (a JSON body with choices; a stream that ends with ``[DONE]``);
- ``stream_error``: a stream that had started and ended with an explicit SSE error event (no ``[DONE]``):
  the proxy's answer when an engine dies under a started stream — visible to the client, never silent;
- ``lost``: anything else (a refused or reset connection, a 5xx, a truncated body, a stream that just
  stops). The promise is ``lost == 0``.

The clients run on their own asyncio loop in a background thread; every request has a timeout and the load
stops by itself after ``max_seconds`` even if the test never calls :meth:`Load.stop`. Loopback only.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

import aiohttp

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "def hello world return print self",
    "it is the and of to in that for on with",
    "lazy dog and quick fox over the hill",
]


def classify(status: int, text: str, stream: bool) -> tuple[str, str]:
    """(category, detail) of one finished exchange; see the module docstring."""
    if status != 200:
        return "lost", f"HTTP {status}: {text[:200]}"
    if not stream:
        try:
            doc = json.loads(text)
            choice = doc["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return "lost", f"incomplete JSON body: {text[-200:]!r}"
        if choice.get("text") is None and not (choice.get("message") or {}).get("content"):
            return "lost", f"no text in {choice!r}"[:300]
        return "ok", ""
    events = [block[6:] for block in text.split("\n\n") if block.startswith("data: ")]
    if events and events[-1] == "[DONE]" and text.endswith("\n\n"):
        return "ok", ""
    if events:
        try:
            last = json.loads(events[-1])
        except ValueError:
            last = None
        if isinstance(last, dict) and "error" in last and text.endswith("\n\n"):
            return "stream_error", last["error"].get("message", "") if isinstance(last["error"], dict) else ""
    return "lost", f"stream ended without [DONE] or an error event: {text[-200:]!r}"


class Load:
    """``clients`` concurrent clients (even-numbered ones stream) sending greedy completions to ``url``."""

    def __init__(
        self,
        url: str,
        clients: int = 16,
        max_tokens: int = 24,
        model: str | None = None,
        request_timeout: float = 300.0,
        max_seconds: float = 900.0,
    ):
        self.url = url.rstrip("/")
        self.clients = clients
        self.max_tokens = max_tokens
        self.model = model
        self.request_timeout = request_timeout
        self.max_seconds = max_seconds
        self.counts: collections.Counter = collections.Counter()
        self.by_client: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self.stream_errors: list[str] = []
        self.started = 0
        self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ control
    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> Load:
        """Let every client finish the request it is in, then return (bounded by the request timeout)."""
        self._stop.set()
        self._thread.join(timeout=self.request_timeout + 30)
        assert not self._thread.is_alive(), "the load did not stop"
        return self

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for_answers(self, n: int, timeout: float) -> None:
        """Block until ``n`` more requests were answered (any category), or fail after ``timeout``."""
        target = self.total + n
        deadline = time.monotonic() + timeout
        while self.total < target:
            assert time.monotonic() < deadline, (
                f"only {self.total} of {target} answers after {timeout}s: {self.report()}"
            )
            time.sleep(0.1)

    # ------------------------------------------------------------------ results
    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def lost(self) -> int:
        return self.counts["lost"]

    def report(self) -> str:
        return (
            f"{self.total} requests from {self.clients} clients (half streaming): ok={self.counts['ok']} "
            f"stream_error={self.counts['stream_error']} lost={self.lost}; longest answer "
            f"{self.longest_s:.2f}s"
        )

    # ------------------------------------------------------------------ clients
    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        deadline = time.monotonic() + self.max_seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
            await asyncio.gather(*(self._client(s, i, deadline) for i in range(self.clients)))

    async def _client(self, s: aiohttp.ClientSession, i: int, deadline: float) -> None:
        stream = i % 2 == 0
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            payload = {
                "prompt": PROMPTS[(i + n) % len(PROMPTS)],
                "max_tokens": self.max_tokens - i % 5,
                "temperature": 0,
                "stream": stream,
            }
            if self.model:
                payload["model"] = self.model
            t0 = time.monotonic()
            with self._lock:
                self.started += 1
            try:
                async with s.post(self.url + "/v1/completions", json=payload) as r:
                    status, text = r.status, await r.text()
                kind, detail = classify(status, text, stream)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                kind, detail = "lost", f"{type(exc).__name__}: {exc}"
            took = time.monotonic() - t0
            with self._lock:
                self.counts[kind] += 1
                self.by_client[i] += 1
                self.longest_s = max(self.longest_s, took)
                if kind == "lost":
                    self.failures.append(f"client {i} ({'stream' if stream else 'json'}): {detail}")
                elif kind == "stream_error":
                    self.stream_errors.append(detail)
            n += 1
