"""The front proxy: a stable public address in front of an engine that specops restarts and switches.

``specops up`` serves the public host/port itself and runs the engine on an internal loopback port. Every
request passes through :class:`Proxy`, an aiohttp server + aiohttp client running in specops' own asyncio
loop. Paths, methods, query strings, bodies, status codes and headers pass through unchanged (minus
hop-by-hop headers); SSE streams are forwarded chunk by chunk as they arrive; a client that disconnects
cancels its request on the engine (the upstream connection is closed, which vLLM and llama-server treat
as an abort).

Why a proxy at all: a fallback (EAGLE → n-gram → none) means restarting the engine with other flags, and
clients must not notice. The supervisor drives the switch through four calls::

    proxy.hold()                        # new requests wait in a bounded queue
    result = await proxy.drain(t)       # in-flight requests on the old engine finish (or are cut at t)
    ... stop the old engine, start the new one, wait until it is healthy ...
    proxy.release(new_base_url)         # queued requests go to the new engine

Guarantees, in order of strength:

- A request that has not received a response byte when its engine fails (connection refused, engine
  died, drain timeout) is retried once on the next engine; the client only sees a longer wait.
- A stream that breaks after it started ends with an explicit SSE error event
  (``data: {"error": {...}}``) and no ``[DONE]``; a non-SSE body that breaks is cut at the transport
  so the client sees an incomplete body, never a silently short one.
- Past ``queue_size`` waiting requests, or after ``queue_timeout`` in the queue, the answer is 503 with
  ``Retry-After``.

When a request fails before any byte and the engine still accepts connections, the failure was a pooled
connection the engine had just closed: the request is resent at once (``reconnects``), without using its
retry. When the engine does not accept connections, the proxy stops forwarding (state ``down``, new requests
queue) until the supervisor releases an engine, or the same URL answers its health check again.

The hot path is lean: no JSON parsing unless ``on_timings`` is set (llama.cpp live acceptance), and then
only bodies/lines that contain ``"timings"``. Small non-streamed bodies (≤ ``buffer_limit``, with a
Content-Length and not SSE) are read whole before they are answered, which costs nothing (the engine sends
them at once) and lets a failure while reading them be retried too.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout on 3.10
    from async_timeout import timeout as _timeout

log = logging.getLogger("specops.proxy")

__all__ = ["Proxy", "DrainResult", "ADMIN_PREFIX"]

ADMIN_PREFIX = "/specops/"

#: Hop-by-hop headers (RFC 9110 §7.6.1) plus the non-standard ones proxies commonly strip.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect"}
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}

_UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, asyncio.TimeoutError)

_ENGINE_KEEPALIVE = 4.0

# llama-server closes the connection after a streamed (chunked) response without saying so, and aiohttp
# has pooled it by then: the next request on it fails before any byte. Streamed requests therefore ask
# the engine for `Connection: close` (a new connection per stream costs ~0.1 ms; a stream lasts seconds).
_STREAM_KEY = b'"stream"'
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

_TIMINGS = b'"timings"'
_SSE_TAIL_LIMIT = 1 << 20

# proxy states
IDLE = "idle"            # no upstream yet: requests queue
SERVING = "serving"
HELD = "held"            # a switch is in progress: requests queue
DOWN = "down"            # the engine failed: requests queue until an engine is released
STOPPED = "stopped"
STATES = (IDLE, SERVING, HELD, DOWN, STOPPED)


@dataclass(frozen=True)
class DrainResult:
    """What :meth:`Proxy.drain` did: requests that finished on the old engine, and those it cut."""

    in_flight: int          # in flight on the drained engine when the drain began
    finished: int           # of those (and any that started during the drain), how many completed
    cut: int                # still running at the timeout: cut (streams got an error event, others retry)
    cut_streams: int        # of the cut, how many had already started answering (ended with an error event)
    waited_s: float
    timed_out: bool

    def to_dict(self) -> dict:
        return asdict(self)


class _Generation:
    """One upstream engine as seen by the proxy; a new one on every release/set_upstream."""

    __slots__ = ("id", "url", "inflight", "finished", "idle")

    def __init__(self, gid: int, url: str):
        self.id = gid
        self.url = url.rstrip("/")
        self.inflight: set[_Flight] = set()
        self.finished = 0
        self.idle: asyncio.Event | None = None      # made by drain(); set when inflight empties


class _Flight:
    """One request on one generation, so drain/upstream_failed can cut it."""

    __slots__ = ("gen", "cm", "cut_reason", "started", "totals")

    def __init__(self, gen: _Generation):
        self.gen = gen
        self.cm = None
        self.cut_reason: str | None = None
        self.started = False
        self.totals: dict | None = None     # timings running totals per choice index

    def cut(self, reason: str) -> None:
        if self.cut_reason is None:
            self.cut_reason = reason
        cm = self.cm
        if cm is not None:
            move = getattr(cm, "reschedule", None) or cm.update    # asyncio.timeout / async_timeout (3.10)
            try:
                move(asyncio.get_running_loop().time())
            except RuntimeError:            # the block is already exiting
                pass


class _Unstarted(Exception):
    """The upstream failed before the client received anything: the request may be retried.

    ``stale``: the failure looks like a pooled connection the engine had just closed (disconnected or
    unwritable before a response, as opposed to a refused connection, a timeout or a cut).
    """

    def __init__(self, reason: str, stale: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.stale = stale


class _Rejected(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _error_body(status: int, kind: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}},
                      separators=(",", ":")).encode()


class Proxy:
    """Reverse proxy in front of the engine; see the module docstring for the switch protocol.

    ``on_timings(draft_n, draft_n_accepted)`` is called with the *delta* since the previous call for the
    same request, from llama-server ``timings`` in JSON bodies and in SSE chunks (every chunk when the
    client set ``timings_per_token``, else the final one). It runs inside the event loop: keep it quick.
    ``status_provider()`` returns a dict merged into ``/specops/status``. ``metrics_registry`` (a
    prometheus_client ``CollectorRegistry``) is exposed on ``/specops/metrics`` together with the proxy's
    own metrics.
    """

    def __init__(self, host: str, port: int, *, queue_size: int, queue_timeout: float, drain_timeout: float,
                 retry_unstarted: bool = True,
                 on_timings: Callable[[int, int], Any] | None = None,
                 status_provider: Callable[[], dict] | None = None,
                 metrics_registry=None,
                 admin_host: str = "127.0.0.1", admin_port: int | None = None,
                 retry_after: float | None = None,
                 connect_timeout: float = 5.0, read_timeout: float | None = None,
                 max_body_size: int = 64 * 1024 * 1024, buffer_limit: int = 1024 * 1024,
                 health_path: str = "/health", recover_interval: float = 1.0,
                 events_kept: int = 100):
        if queue_size < 0:
            raise ValueError("queue_size must be >= 0")
        self.host = host
        self.port = port
        self.queue_size = queue_size
        self.queue_timeout = float(queue_timeout)
        self.drain_timeout = float(drain_timeout)
        self.retry_unstarted = retry_unstarted
        self.on_timings = on_timings
        self.status_provider = status_provider
        self.metrics_registry = metrics_registry
        self.admin_host = admin_host
        self.admin_port = admin_port
        self.retry_after = retry_after
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_body_size = max_body_size
        self.buffer_limit = buffer_limit
        self.health_path = health_path
        self.recover_interval = recover_interval

        self._state = IDLE
        self._gen: _Generation | None = None
        self._next_gen = 0
        self._open = asyncio.Event()        # set exactly when state == SERVING (or STOPPED, to wake waiters)
        self._waiting = 0
        self._inflight = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._admin_runner: web.ServerRunner | None = None
        self._recover_task: asyncio.Task | None = None
        self._held_since: float | None = None
        self._events: deque = deque(maxlen=events_kept)
        self._started_at = time.time()
        self._c = {k: 0 for k in (
            "requests", "completed", "waited", "rejected_queue_full", "rejected_queue_timeout",
            "rejected_stopped", "retried", "retried_ok", "reconnects", "upstream_errors", "broken_streams",
            "cut_streams", "client_disconnects", "timings_draft_n", "timings_draft_n_accepted")}
        self._wait_total = 0.0
        self._wait_longest = 0.0

    # ----------------------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def admin_url(self) -> str:
        if self.admin_port is None:
            return self.url
        return f"http://{self.admin_host}:{self.admin_port}"

    async def start(self) -> None:
        """Bind the public (and admin) listeners. Requests queue until :meth:`set_upstream`."""
        # Idle engine connections are dropped before the engines drop them (uvicorn in vLLM and
        # llama-server both close idle keep-alive connections after 5 s): a connection the engine is
        # closing just as it is reused fails the request before any byte, which would cost its retry.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=_ENGINE_KEEPALIVE,
                                         ttl_dns_cache=None, use_dns_cache=True)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.connect_timeout,
                                          sock_read=self.read_timeout),
            trust_env=False, raise_for_status=False, max_line_size=65536, max_field_size=65536)
        max_body = self.max_body_size

        def request_factory(message, payload, protocol, writer, task, _server=None):
            return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop(),
                                   client_max_size=max_body)

        handler = self._handle if self.admin_port is None else self._handle_public
        server = web.Server(handler, request_factory=request_factory, handler_cancellation=True,
                            access_log=None, max_line_size=65536, max_field_size=65536)
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        if self.admin_port is not None:
            admin = web.Server(self._handle_admin_only, handler_cancellation=True, access_log=None)
            self._admin_runner = web.ServerRunner(admin, shutdown_timeout=1.0, handle_signals=False)
            await self._admin_runner.setup()
            await web.TCPSite(self._admin_runner, self.admin_host, self.admin_port, reuse_address=True).start()
            self.admin_port = self._admin_runner.addresses[0][1]
        self._event("start", url=self.url)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop serving: waiting requests get 503; in-flight ones get ``grace`` seconds, then are cut."""
        if self._state == STOPPED:
            return
        if grace > 0:
            self.hold()
            await self.drain(grace)
        self._set_state(STOPPED)
        self._open.set()                    # wake waiters: they see STOPPED and answer 503
        if self._recover_task is not None:
            self._recover_task.cancel()
        if self._gen is not None:
            for f in list(self._gen.inflight):
                f.cut("specops is shutting down")
        for runner in (self._runner, self._admin_runner):
            if runner is not None:
                await runner.cleanup()
        if self._session is not None:
            await self._session.close()
        self._event("stop")

    # ------------------------------------------------------------------------------------- switch control

    def set_upstream(self, url: str) -> None:
        """Point at the first engine (or any engine, at once) and let queued requests go."""
        self._new_generation(url)

    def release(self, upstream_base_url: str | None = None) -> None:
        """End a hold: point at ``upstream_base_url`` (default: the same URL, a restarted engine) and go."""
        url = upstream_base_url or (self._gen.url if self._gen is not None else None)
        if url is None:
            raise ValueError("release() needs an upstream URL: none was set before")
        self._new_generation(url)

    def hold(self) -> None:
        """Stop forwarding new requests: they wait (bounded) until :meth:`release`."""
        if self._state in (STOPPED, HELD):
            return
        self._stop_recovery()
        self._set_state(HELD)
        self._event("hold", in_flight=self._inflight_current())

    def upstream_failed(self, reason: str = "the engine failed") -> None:
        """The supervisor learned the engine died: queue new requests, cut in-flight ones.

        Cut requests that had not started answering are retried on the next engine; started streams end
        with an error event. Forwarding resumes at the next :meth:`release` / :meth:`set_upstream`.
        """
        if self._state == STOPPED:
            return
        self._set_state(DOWN)
        self._stop_recovery()
        gen = self._gen
        n = 0
        if gen is not None:
            for f in list(gen.inflight):
                f.cut(reason)
                n += 1
        self._event("upstream_failed", reason=reason, cut=n)

    async def drain(self, timeout: float | None = None) -> DrainResult:
        """Wait for in-flight requests on the current engine; cut those still running after ``timeout``.

        Call after :meth:`hold` (otherwise new requests keep arriving on the same engine). Returns once
        every request has left the engine (the cut ones unwind at once).
        """
        timeout = self.drain_timeout if timeout is None else float(timeout)
        gen = self._gen
        t0 = time.monotonic()
        if gen is None:
            return DrainResult(0, 0, 0, 0, 0.0, False)
        n0 = len(gen.inflight)
        done0 = gen.finished
        timed_out = False
        if gen.inflight:
            gen.idle = asyncio.Event()
            try:
                await asyncio.wait_for(gen.idle.wait(), timeout)
            except asyncio.TimeoutError:
                timed_out = True
        cut = cut_streams = 0
        if gen.inflight:
            for f in list(gen.inflight):
                cut += 1
                cut_streams += f.started
                f.cut(f"the engine was stopped for a switch after a {timeout:g}s drain")
            self._event("drain_cut", cut=cut, streams=cut_streams)
            gen.idle = asyncio.Event()
            try:                            # cut requests unwind on the next loop turns
                await asyncio.wait_for(gen.idle.wait(), 5.0)
            except asyncio.TimeoutError:
                log.warning("proxy: %d cut requests did not unwind within 5s", len(gen.inflight))
        result = DrainResult(in_flight=n0, finished=gen.finished - done0, cut=cut, cut_streams=cut_streams,
                             waited_s=round(time.monotonic() - t0, 6), timed_out=timed_out)
        self._event("drain", **result.to_dict())
        return result

    # ------------------------------------------------------------------------------------------- status

    @property
    def state(self) -> str:
        return self._state

    @property
    def upstream(self) -> str | None:
        return self._gen.url if self._gen is not None else None

    def stats(self) -> dict:
        """Counters and gauges (the same numbers as ``/specops/metrics``)."""
        d = dict(self._c)
        d.update(state=self._state, upstream=self.upstream, generation=self._gen.id if self._gen else None,
                 queue_depth=self._waiting, queue_size=self.queue_size, in_flight=self._inflight,
                 longest_wait_s=round(self._wait_longest, 6), total_wait_s=round(self._wait_total, 6),
                 held_for_s=round(time.monotonic() - self._held_since, 3) if self._held_since else None)
        return d

    def status(self) -> dict:
        """The ``/specops/status`` document: the proxy's own section, merged with ``status_provider()``."""
        doc: dict = {"proxy": dict(self.stats(), url=self.url, started_at=round(self._started_at, 3),
                                   queue_timeout_s=self.queue_timeout,
                                   drain_timeout_s=self.drain_timeout, retry_unstarted=self.retry_unstarted,
                                   events=list(self._events))}
        if self.status_provider is not None:
            try:
                extra = self.status_provider()
                if extra:
                    doc.update(extra)
            except Exception as exc:        # status must never take the proxy down
                log.exception("proxy: status_provider failed")
                doc["status_error"] = f"{type(exc).__name__}: {exc}"
        return doc

    def metrics_text(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        own = CollectorRegistry(auto_describe=False)
        own.register(_ProxyCollector(self))
        out = generate_latest(own)
        if self.metrics_registry is not None:
            out = generate_latest(self.metrics_registry) + out
        return out

    # ------------------------------------------------------------------------------------------- internals

    def _event(self, kind: str, **detail) -> None:
        self._events.append({"t": round(time.time(), 3), "event": kind, **detail})
        log.info("proxy %s %s", kind, detail or "")

    def _set_state(self, state: str) -> None:
        self._state = state
        if state == SERVING:
            self._held_since = None
            self._open.set()
        else:
            if self._held_since is None and state in (HELD, DOWN, IDLE):
                self._held_since = time.monotonic()
            if state != STOPPED:
                self._open.clear()

    def _new_generation(self, url: str) -> None:
        if self._state == STOPPED:
            raise RuntimeError("the proxy is stopped")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL must be http(s)://host:port, got {url!r}")
        self._stop_recovery()
        self._next_gen += 1
        self._gen = _Generation(self._next_gen, url)
        waited = self._waiting
        self._set_state(SERVING)
        self._event("upstream", url=self._gen.url, generation=self._gen.id, queued=waited)

    def _inflight_current(self) -> int:
        return len(self._gen.inflight) if self._gen is not None else 0

    def _retry_after(self) -> str:
        if self.retry_after is not None:
            return str(max(1, math.ceil(self.retry_after)))
        return str(max(1, min(30, math.ceil(self.queue_timeout / 4 or 1))))

    def _reject(self, status: int, kind: str, message: str) -> web.Response:
        return web.Response(status=status, body=_error_body(status, kind, message),
                            content_type="application/json",
                            headers={"Retry-After": self._retry_after()} if status == 503 else None)

    async def _acquire(self, deadline: float) -> _Generation:
        """The generation to send to: at once when serving, else after a bounded wait in the queue."""
        if self._state == SERVING:
            return self._gen
        if self._state == STOPPED:
            raise _Rejected("stopped", "specops is shutting down")
        if self._waiting >= self.queue_size:
            raise _Rejected("queue_full", f"the engine is switching and the wait queue is full "
                                          f"({self.queue_size} requests)")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self._waiting += 1
        try:
            while self._state != SERVING:
                if self._state == STOPPED:
                    raise _Rejected("stopped", "specops is shutting down")
                left = deadline - loop.time()
                if left <= 0:
                    raise _Rejected("queue_timeout", f"the engine did not come back within the "
                                                     f"{self.queue_timeout:g}s queue timeout")
                try:
                    async with _timeout(left):
                        await self._open.wait()
                except asyncio.TimeoutError:
                    pass
            return self._gen
        finally:
            self._waiting -= 1
            waited = loop.time() - t0
            self._c["waited"] += 1
            self._wait_total += waited
            if waited > self._wait_longest:
                self._wait_longest = waited

    async def _handle_public(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self._proxy(request)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path.startswith(ADMIN_PREFIX):
            return await self._handle_admin(request)
        return await self._proxy(request)

    async def _handle_admin_only(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path.startswith(ADMIN_PREFIX):
            return await self._handle_admin(request)
        return web.json_response({"error": {"message": "admin listener: only /specops/status and "
                                            "/specops/metrics", "type": "not_found", "code": 404}}, status=404)

    async def _handle_admin(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path.rstrip("/")
        if path == "/specops/status":
            return web.Response(text=json.dumps(self.status(), indent=1, default=str),
                                content_type="application/json")
        if path == "/specops/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST
            return web.Response(body=self.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})
        return web.json_response({"error": {"message": f"unknown specops endpoint {request.path}",
                                            "type": "not_found", "code": 404}}, status=404)

    async def _proxy(self, request: web.BaseRequest) -> web.StreamResponse:
        c = self._c
        c["requests"] += 1
        loop = asyncio.get_running_loop()
        try:
            body = await request.read() if request.body_exists else b""
        except web.HTTPRequestEntityTooLarge as exc:
            return self._reject(413, "request_too_large", str(exc))
        headers = self._request_headers(request, body)
        retried = reconnected = False
        deadline = loop.time() + self.queue_timeout
        while True:
            try:
                gen = await self._acquire(deadline)
            except _Rejected as rej:
                c["rejected_" + rej.kind] += 1
                if retried:
                    c["upstream_errors"] += 1
                return self._reject(503, "specops_" + rej.kind, "specops: " + str(rej))
            flight = _Flight(gen)
            gen.inflight.add(flight)
            self._inflight += 1
            try:
                resp = await self._exchange(request, body, headers, flight)
            except _Unstarted as exc:
                failure = exc
            else:
                failure = None
            finally:
                self._inflight -= 1
                gen.inflight.discard(flight)
                if flight.cut_reason is None:
                    gen.finished += 1
                if not gen.inflight and gen.idle is not None:
                    gen.idle.set()
            if failure is None:
                c["completed"] += 1
                if retried:
                    c["retried_ok"] += 1
                return resp
            alive = None
            if failure.stale and not reconnected and flight.cut_reason is None and gen is self._gen \
                    and self._state == SERVING:
                alive = await self._reachable(gen.url)
                if alive:                   # a pooled connection the engine had closed: just reconnect
                    reconnected = True
                    c["reconnects"] += 1
                    continue
            if retried or not self.retry_unstarted or self._state == STOPPED:
                c["upstream_errors"] += 1
                status = 503 if self._state == STOPPED else 502
                return self._reject(status, "specops_upstream_error",
                                    f"specops: the engine failed before answering: {failure.reason}")
            retried = True
            c["retried"] += 1
            log.info("proxy: retrying %s %s after: %s", request.method, request.path, failure.reason)
            await self._after_unstarted_failure(flight, failure.reason, alive)
            deadline = loop.time() + self.queue_timeout

    def _request_headers(self, request: web.BaseRequest, body: bytes) -> CIMultiDict:
        src = request.headers
        conn = src.get("Connection")
        named = {t.strip().lower() for t in conn.split(",")} if conn else ()
        out = CIMultiDict()
        for k, v in src.items():
            kl = k.lower()
            if kl in _REQUEST_DROP or kl in named:
                continue
            out.add(k, v)
        remote = request.remote
        if remote:
            prior = src.get("X-Forwarded-For")
            out["X-Forwarded-For"] = f"{prior}, {remote}" if prior else remote
        if body and _STREAM_KEY in body and _STREAM_TRUE.search(body):
            out["Connection"] = "close"
        host = src.get("Host")
        if host and "X-Forwarded-Host" not in out:
            out["X-Forwarded-Host"] = host
        if "X-Forwarded-Proto" not in out:
            out["X-Forwarded-Proto"] = request.scheme
        return out

    async def _after_unstarted_failure(self, flight: _Flight, reason: str, alive: bool | None) -> None:
        """Decide where the retry goes: the same engine if it is alive, else wait for the next one."""
        gen = flight.gen
        if flight.cut_reason is not None or gen is not self._gen or self._state != SERVING:
            return                          # a switch/failure is already being handled: _acquire waits
        if alive is None:
            alive = await self._reachable(gen.url)
        if alive:
            return                          # a transient error (e.g. a stale keep-alive connection)
        if gen is self._gen and self._state == SERVING:
            self._set_state(DOWN)
            self._event("upstream_unreachable", url=gen.url, reason=reason)
            self._start_recovery(gen)

    async def _reachable(self, url: str) -> bool:
        u = URL(url)
        try:
            async with _timeout(min(1.0, self.connect_timeout)):
                _, writer = await asyncio.open_connection(u.host, u.port)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    def _start_recovery(self, gen: _Generation) -> None:
        """Self-detected failure: reopen on the same URL once its health endpoint answers 200 again.

        The supervisor normally calls release()/set_upstream() first; this only keeps a proxy whose engine
        came back by itself from waiting forever.
        """
        self._stop_recovery()
        self._recover_task = asyncio.get_running_loop().create_task(self._recover(gen))

    def _stop_recovery(self) -> None:
        task, self._recover_task = self._recover_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _recover(self, gen: _Generation) -> None:
        url = gen.url + self.health_path
        while self._state == DOWN and self._gen is gen:
            await asyncio.sleep(self.recover_interval)
            try:
                async with self._session.get(url, headers={"Connection": "close"},
                                             timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                ok = False
            if ok and self._state == DOWN and self._gen is gen:
                self._recover_task = None
                self._event("upstream_recovered", url=gen.url)
                self._new_generation(gen.url)
                return

    async def _exchange(self, request: web.BaseRequest, body: bytes, headers: CIMultiDict,
                        flight: _Flight) -> web.StreamResponse:
        """One attempt against one engine. Raises :class:`_Unstarted` when nothing reached the client."""
        if flight.cut_reason is not None:
            raise _Unstarted(flight.cut_reason)
        up: aiohttp.ClientResponse | None = None
        resp: web.StreamResponse | None = None
        sse = False
        complete = False
        broken: str | None = None
        try:
            async with _timeout(None) as cm:
                flight.cm = cm
                try:
                    up = await self._session.request(
                        request.method, URL(flight.gen.url + request.raw_path, encoded=True),
                        headers=headers, data=body or None, allow_redirects=False)
                except _UPSTREAM_ERRORS as exc:
                    stale = (isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
                             and not isinstance(exc, aiohttp.ClientConnectorError))
                    raise _Unstarted(_describe(exc), stale) from None
                ctype = up.headers.get("Content-Type", "")
                sse = ctype.startswith("text/event-stream")
                clen = up.content_length
                out_headers = CIMultiDict()
                for k, v in up.headers.items():
                    if k.lower() not in _RESPONSE_DROP:
                        out_headers.add(k, v)

                if not sse and clen is not None and clen <= self.buffer_limit and request.method != "HEAD":
                    try:
                        data = await up.read()
                    except _UPSTREAM_ERRORS as exc:
                        raise _Unstarted(_describe(exc)) from None
                    complete = True
                    if self.on_timings is not None and _TIMINGS in data:
                        self._timings_from_json(data, flight)
                    return web.Response(status=up.status, reason=up.reason, body=data, headers=out_headers)

                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out_headers)
                if clen is not None:
                    resp.content_length = clen
                await resp.prepare(request)
                flight.started = True
                scan = self.on_timings is not None and sse
                tail = b""
                read = up.content.readany
                write = resp.write
                while True:
                    try:
                        chunk = await read()
                    except _UPSTREAM_ERRORS as exc:
                        broken = "the engine connection broke mid-response: " + _describe(exc)
                        break
                    if not chunk:
                        complete = True
                        break
                    try:
                        await write(chunk)
                    except (ConnectionError, RuntimeError):
                        self._c["client_disconnects"] += 1
                        return resp          # closing the engine response (finally) cancels its request
                    if scan:
                        tail = self._timings_from_sse(tail + chunk if tail else chunk, flight)
        except asyncio.TimeoutError:
            if flight.cut_reason is None:
                raise
            if not flight.started:
                raise _Unstarted(flight.cut_reason) from None
            self._c["cut_streams"] += 1
            await self._end_broken(request, resp, sse, "specops: " + flight.cut_reason)
            return resp
        except asyncio.CancelledError:
            self._c["client_disconnects"] += 1
            raise
        finally:
            flight.cm = None
            if up is not None:
                if complete:
                    up.release()
                else:
                    up.close()               # abort the engine request (vLLM/llama-server cancel on close)
        if broken is not None:
            self._c["broken_streams"] += 1
            await self._end_broken(request, resp, sse, broken)
            return resp
        try:
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            self._c["client_disconnects"] += 1
        return resp

    async def _end_broken(self, request: web.BaseRequest, resp: web.StreamResponse, sse: bool,
                          message: str) -> None:
        """End a started response that cannot complete: an SSE error event, or a cut connection."""
        if sse:
            event = b"data: " + _error_body(502, "specops_stream_broken", message) + b"\n\n"
            try:
                await resp.write(event)
                await resp.write_eof()
                return
            except (ConnectionError, RuntimeError):
                pass
        transport = request.transport
        if transport is not None:
            transport.abort()               # the client sees an incomplete body, never a short one

    def _timings_from_json(self, data: bytes, flight: _Flight) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if isinstance(obj, dict):
            self._feed_timings(obj, flight)

    def _timings_from_sse(self, buf: bytes, flight: _Flight) -> bytes:
        """Feed ``timings`` from the complete lines of ``buf``; returns the incomplete last line."""
        nl = buf.rfind(b"\n")
        if nl < 0:
            return buf if len(buf) < _SSE_TAIL_LIMIT else b""
        if _TIMINGS in buf:
            for line in buf[:nl].split(b"\n"):
                if _TIMINGS in line and line.startswith(b"data:"):
                    try:
                        obj = json.loads(line[5:])
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        self._feed_timings(obj, flight)
        return buf[nl + 1:]

    def _feed_timings(self, obj: dict, flight: _Flight) -> None:
        t = obj.get("timings")
        if not isinstance(t, dict):
            return
        dn, da = t.get("draft_n"), t.get("draft_n_accepted")
        if not isinstance(dn, int) or not isinstance(da, int):
            return
        index = 0
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            index = choices[0].get("index", 0)
        elif "index" in obj:
            index = obj.get("index", 0)
        totals = flight.totals
        if totals is None:
            totals = flight.totals = {}
        pn, pa = totals.get(index, (0, 0))
        if dn < pn or da < pa:              # a new sequence: counts started again
            pn = pa = 0
        totals[index] = (dn, da)
        d_n, d_a = dn - pn, da - pa
        if d_n or d_a:
            self._c["timings_draft_n"] += d_n
            self._c["timings_draft_n_accepted"] += d_a
            try:
                self.on_timings(d_n, d_a)
            except Exception:
                log.exception("proxy: on_timings failed")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _ProxyCollector:
    """prometheus_client collector reading the proxy's plain counters at scrape time (no hot-path cost)."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.proxy
        c = p._c
        st = p.stats()

        def counter(name, doc, value, labels=None):
            m = CounterMetricFamily(name, doc, labels=list(labels) if labels else None)
            if labels:
                for lv, v in value:
                    m.add_metric(lv, v)
            else:
                m.add_metric([], value)
            return m

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        yield counter("specops_proxy_requests", "Requests received on the public port (admin excluded).",
                      c["requests"])
        yield counter("specops_proxy_completed", "Requests answered by an engine (any status).", c["completed"])
        yield gauge("specops_proxy_in_flight", "Requests being forwarded to an engine now.", st["in_flight"])
        yield gauge("specops_proxy_queue_depth", "Requests waiting for an engine now.", st["queue_depth"])
        yield gauge("specops_proxy_queue_capacity", "Most requests that may wait (queue_size).", p.queue_size)
        yield counter("specops_proxy_waited_requests", "Requests that waited in the queue.", c["waited"])
        yield gauge("specops_proxy_longest_wait_seconds", "Longest time a request waited in the queue.",
                    p._wait_longest)
        yield counter("specops_proxy_wait_seconds", "Time spent waiting in the queue, summed.", p._wait_total)
        yield counter("specops_proxy_rejected", "Requests answered 503 by the proxy.",
                      [(["queue_full"], c["rejected_queue_full"]), (["queue_timeout"], c["rejected_queue_timeout"]),
                       (["stopped"], c["rejected_stopped"])], labels=["reason"])
        yield counter("specops_proxy_retried_requests", "Requests retried after the engine failed before "
                      "answering.", c["retried"])
        yield counter("specops_proxy_retried_ok", "Retried requests that then got an answer.", c["retried_ok"])
        yield counter("specops_proxy_reconnects", "Requests resent at once because a pooled engine connection "
                      "had been closed by the engine (not counted as retries).", c["reconnects"])
        yield counter("specops_proxy_upstream_errors", "Requests answered 502/503 because the engine failed "
                      "(after the retry).", c["upstream_errors"])
        yield counter("specops_proxy_broken_streams", "Started responses that could not complete.",
                      [(["engine"], c["broken_streams"]), (["drain"], c["cut_streams"])], labels=["cause"])
        yield counter("specops_proxy_client_disconnects", "Clients that went away before their response "
                      "completed (the engine request was cancelled).", c["client_disconnects"])
        yield counter("specops_proxy_timings_draft_tokens", "llama.cpp draft tokens seen in response timings.",
                      c["timings_draft_n"])
        yield counter("specops_proxy_timings_accepted_tokens", "llama.cpp accepted draft tokens seen in "
                      "response timings.", c["timings_draft_n_accepted"])
        g = GaugeMetricFamily("specops_proxy_state", "1 for the proxy's current state.", labels=["state"])
        for s in STATES:
            g.add_metric([s], 1.0 if p.state == s else 0.0)
        yield g
        yield gauge("specops_proxy_upstream_generation", "How many engines the proxy has pointed at.",
                    st["generation"] or 0)
