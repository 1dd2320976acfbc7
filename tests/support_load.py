"""Client load against a real server (`specops up`, an engine, a stand-in): the one load generator of the
suite. Many concurrent clients (half streaming by default), every request counted.

The central promise of specops is that a client never loses a request it sent while the supervisor restarts
or switches the engine. :class:`Load` checks it from the outside, the way a client sees it: each request
ends in exactly one of

- ``ok``: HTTP 200 and a complete answer (a JSON body with choices; a stream that ends with ``[DONE]``);
- ``stream_error``: a stream that had started and ended with an explicit SSE error event (no ``[DONE]``):
  the proxy's answer when an engine dies under a started stream — visible to the client, never silent;
- ``http_error``: any status but 200;
- ``connection_error``: refused, reset or closed before the answer was read;
- ``timeout``: no complete answer within the request timeout;
- ``malformed``: a 200 whose body is not a complete answer (not JSON, no choices or text, a truncated body,
  a stream that just stops).

The last four are lost requests (:data:`LOST`); the promise is ``lost == 0``. The clients run on their own
asyncio loop in a background thread, and nothing a request does can end a client early: every exception is
counted. Every request has a timeout and the load stops by itself after ``max_seconds`` even if the test
never calls :meth:`Load.stop`. Loopback only.

A test that needs other requests (chat, fixed lengths...) passes ``request``; one that checks more of each
answer than a complete body (its text, which engine answered) passes ``check``, whose labels it counts.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import threading
import time
from collections.abc import Callable

import aiohttp

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "def hello world return print self",
    "it is the and of to in that for on with",
    "lazy dog and quick fox over the hill",
]
#: The outcomes that are a lost request.
LOST = ("http_error", "connection_error", "timeout", "malformed")
OUTCOMES = ("ok", "stream_error", *LOST)
#: A client's next request: (client index, how many it sent before) → (path, JSON body); the body's
#: ``stream`` says how its answer is read.
Request = Callable[[int, int], tuple[str, dict]]
#: A closer look at a complete answer: (the body sent, the answer's text) → a label, counted in
#: :attr:`Load.labels` (which engine answered, say); raising makes the request ``malformed``.
Check = Callable[[dict, str], str]


def classify(status: int, text: str, stream: bool) -> tuple[str, str]:
    """(outcome, detail) of one exchange that got a status and a body; see the module docstring."""
    if status != 200:
        return "http_error", f"HTTP {status}: {text[:200]}"
    if not stream:
        try:
            doc = json.loads(text)
            choice = doc["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return "malformed", f"not a JSON body with choices: {text[-200:]!r}"
        if not isinstance(choice, dict):
            return "malformed", f"a choice that is not an object: {choice!r}"[:300]
        if choice.get("text") is None and not (choice.get("message") or {}).get("content"):
            return "malformed", f"no text in {choice!r}"[:300]
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
    return "malformed", f"stream ended without [DONE] or an error event: {text[-200:]!r}"


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """(outcome, detail) of an exchange that raised before a complete body was read."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout", detail
    if isinstance(exc, aiohttp.ClientPayloadError | UnicodeDecodeError):
        return "malformed", detail  # a truncated or undecodable body
    return "connection_error", detail


class Load:
    """``clients`` concurrent clients sending greedy completions to ``url`` (a list of URLs: each request to
    the next, round-robin, as a Service spreads them).

    ``stream``: ``"half"`` (even-numbered clients stream), ``True`` or ``False`` (all or none). ``pause_s``:
    each client waits that long between its requests (a steady trickle instead of back-to-back load).
    ``request`` replaces the greedy completions (``max_tokens``, ``model`` and ``stream`` are then its own),
    ``check`` looks at each complete answer (see :data:`Request`, :data:`Check`).
    """

    def __init__(
        self,
        url: str | list[str],
        clients: int = 16,
        max_tokens: int = 24,
        model: str | None = None,
        request_timeout: float = 300.0,
        max_seconds: float = 900.0,
        stream: bool | str = "half",
        pause_s: float = 0.0,
        request: Request | None = None,
        check: Check | None = None,
    ):
        urls = [url] if isinstance(url, str) else list(url)
        assert urls and stream in (True, False, "half"), (urls, stream)
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self._next_url = itertools.cycle(self.urls)
        self.clients = clients
        self.max_tokens = max_tokens
        self.model = model
        self.request_timeout = request_timeout
        self.max_seconds = max_seconds
        self.stream = stream
        self.pause_s = pause_s
        self.request = request or self._completion
        self._own = request is None  # the greedy completions ``stream`` describes
        self.check = check
        self.counts: collections.Counter = collections.Counter()
        self.labels: collections.Counter = collections.Counter()  # of the complete answers, by ``check``
        self.by_client: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self.stream_errors: list[str] = []
        self.started = 0
        self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self._lock = threading.Lock()
        self.crashed: BaseException | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> Load:
        """Let every client finish the request it is in, then return (bounded by the request timeout)."""
        self._stop.set()
        self._thread.join(timeout=self.request_timeout + 30)
        assert not self._thread.is_alive(), "the load did not stop"
        assert self.crashed is None, f"the load generator itself failed: {self.crashed!r}"
        return self

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for_answers(self, n: int, timeout: float) -> None:
        """Block until ``n`` more requests were answered (any outcome), or fail after ``timeout``."""
        target = self.total + n
        deadline = time.monotonic() + timeout
        while self.total < target:
            assert time.monotonic() < deadline, (
                f"only {self.total} of {target} answers after {timeout}s: {self.report()}"
            )
            assert self.crashed is None, f"the load generator itself failed: {self.crashed!r}"
            time.sleep(0.1)

    # ------------------------------------------------------------------ results
    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def lost(self) -> int:
        return sum(self.counts[k] for k in LOST)

    @property
    def ok(self) -> int:
        return self.counts["ok"]

    def snapshot(self) -> dict[str, int]:
        """Every outcome's count now, and ``lost`` (their sum over :data:`LOST`)."""
        with self._lock:
            return {**{k: self.counts[k] for k in OUTCOMES}, "lost": self.lost}

    def report(self) -> str:
        streaming = (
            {"half": "half streaming", True: "streaming", False: "JSON"}[self.stream] if self._own else "own requests"
        )
        outcomes = " ".join(f"{k}={self.counts[k]}" for k in OUTCOMES)
        labels = f" ({' '.join(f'{k}={n}' for k, n in sorted(self.labels.items()))})" if self.labels else ""
        return (
            f"{self.total} requests from {self.clients} clients ({streaming}): {outcomes}{labels} "
            f"(lost={self.lost}); longest answer {self.longest_s:.2f}s"
        )

    # ------------------------------------------------------------------ clients
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # a bug of the generator: reported by stop(), never a silent thread death
            self.crashed = exc

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        deadline = time.monotonic() + self.max_seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
            await asyncio.gather(*(self._client(s, i, deadline) for i in range(self.clients)))

    def _completion(self, i: int, n: int) -> tuple[str, dict]:
        """The default request: a greedy completion, streamed by the clients ``stream`` names."""
        payload = {
            "prompt": PROMPTS[(i + n) % len(PROMPTS)],
            "max_tokens": self.max_tokens - i % 5,
            "temperature": 0,
            "stream": i % 2 == 0 if self.stream == "half" else bool(self.stream),
        }
        if self.model:
            payload["model"] = self.model
        return "/v1/completions", payload

    async def _client(self, s: aiohttp.ClientSession, i: int, deadline: float) -> None:
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            path, payload = self.request(i, n)
            stream = bool(payload.get("stream"))
            url = next(self._next_url)
            t0 = time.monotonic()
            with self._lock:
                self.started += 1
            label = None
            try:
                async with s.post(url + path, json=payload) as r:
                    status, text = r.status, await r.text()
            except Exception as exc:  # noqa: BLE001 - every way a request can end is an outcome to count
                kind, detail = classify_exception(exc)
            else:
                kind, detail = classify(status, text, stream)
                if kind == "ok" and self.check is not None:
                    try:
                        label = self.check(payload, text)
                    except Exception as exc:  # noqa: BLE001 - an answer the check refuses is not a right one
                        kind, detail = "malformed", f"the check refused it: {type(exc).__name__}: {exc}"[:300]
            took = time.monotonic() - t0
            with self._lock:
                self.counts[kind] += 1
                self.by_client[i] += 1
                self.longest_s = max(self.longest_s, took)
                if label is not None:
                    self.labels[label] += 1
                if kind in LOST:
                    self.failures.append(f"client {i} ({'stream' if stream else 'json'}) → {url}: {kind}: {detail}")
                elif kind == "stream_error":
                    self.stream_errors.append(detail)
            n += 1
            if self.pause_s and not self._stop.is_set():
                await asyncio.sleep(self.pause_s)


def one_client(url: str, max_tokens: int = 64, request_timeout: float = 300.0) -> Load:
    """One client sending greedy JSON completions back to back (a steady stream of evidence for a watcher).
    A request may wait in the proxy's queue for a whole engine switch (a vLLM start is ~1 min): hence the
    long request timeout."""
    return Load(url, clients=1, max_tokens=max_tokens, stream=False, request_timeout=request_timeout)
