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

What the public port accepts (it may face untrusted clients):

- Only origin-form request targets (``/path?query``) are forwarded, and the engine URL is built from its
  parts (the engine's scheme and host:port, then the client's path and query), never by pasting the
  client's target after the engine's address: ``CONNECT`` is answered 405, absolute-form
  (``GET http://host/...``), ``*`` and any target that does not start with ``/`` (or holds a ``#``)
  400, so a client can never make the proxy open a connection anywhere but its engine.
- With ``api_key`` (the profile's ``server.api_key``) every request except ``GET``/``HEAD /health`` (for
  load balancers; the engines leave it open too) must carry ``Authorization: Bearer <key>``, checked in
  constant time before the body is read, queued or forwarded: 401 otherwise. ``/specops/status`` and
  ``/specops/metrics`` on the public port need the key too; the separate loopback admin port does not.
- Limits, each answered with a JSON error like every other rejection: the request headers must arrive
  within ``header_timeout`` of the connection opening or of the previous response (an idle keep-alive
  connection is closed after it as well), the body within ``body_timeout`` (408 and the connection
  closed); a body over ``max_body_size`` is refused from its Content-Length without reading it (413);
  past ``max_connections`` open client connections a new one gets a 503 and is closed at once; the
  bodies held by the proxy (read, queued or being forwarded, and the small engine answers it buffers)
  may add up to ``max_buffered_bytes``: past it a request gets 503 with ``Retry-After``.
- ``X-Forwarded-For`` gets the peer's address appended (what came before is the client's claim, the
  last entry is the proxy's); ``X-Forwarded-Host`` and ``X-Forwarded-Proto`` are replaced by what the
  proxy saw (the ``Host`` header, ``http``); the client's ``Forwarded``, ``X-Forwarded-Port`` and
  ``X-Real-IP`` are dropped, so none of them can be spoofed past the proxy.
- A rejected or malformed request logs one line (a warning on ``specops.proxy``), never a traceback;
  past ``log_rejects_per_s`` lines a second the rest are counted and the count is added to the next line.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import re
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
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
# forwarding headers a client could spoof: the proxy writes its own (see the module docstring)
_FORWARDING = frozenset({"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
                         "x-forwarded-port", "x-real-ip"})
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect"} | _FORWARDING
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}
_RESPONSE_DROP_NAMES = tuple(sorted(_RESPONSE_DROP))

_UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, asyncio.TimeoutError)

_ENGINE_KEEPALIVE = 4.0

# llama-server closes the connection after a streamed (chunked) response without saying so, and aiohttp
# has pooled it by then: the next request on it fails before any byte. Streamed requests therefore ask
# the engine for `Connection: close` (a new connection per stream costs ~0.1 ms; a stream lasts seconds).
_STREAM_KEY = b'"stream"'
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

_TIMINGS = b'"timings"'
_SSE_TAIL_LIMIT = 1 << 20

# Defaults of the client-facing limits; the profile's `proxy` section has the same defaults and documents them.
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024
DEFAULT_MAX_BUFFERED_BYTES = 128 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0

# a request whose body was not read is closed after this much reading-and-discarding (aiohttp: 10 s)
_LINGER = 1.0
_UNAUTHENTICATED = frozenset({("GET", "/health"), ("HEAD", "/health")})

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

    __slots__ = ("id", "url", "scheme", "authority", "path", "inflight", "finished", "idle")

    def __init__(self, gid: int, url: str):
        self.id = gid
        self.url = url.rstrip("/")
        base = URL(self.url)
        # the parts every upstream URL is built from (never the client's target pasted after a string)
        self.scheme = base.scheme
        self.authority = base.raw_authority
        self.path = base.raw_path.rstrip("/")
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


class _ClientError(Exception):
    """A request the proxy refuses on its own (bad target, no key, too large, too slow, no room)."""

    def __init__(self, status: int, kind: str, message: str, close: bool = False, counter: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.close = close                  # the body was not read: do not keep the connection
        self.counter = counter or kind


def _error_body(status: int, kind: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}},
                      separators=(",", ":")).encode()


def _shown(text: str | None, limit: int = 120) -> str:
    """Client-sent text for a log line: one line, printable, bounded."""
    if text is None:
        return "-"
    out = ascii(text[:limit])[1:-1]
    return out + "..." if len(text) > limit else out


class _RejectLog:
    """One warning line per rejected request, at most ``per_s`` a second; the rest are counted and the
    count is added to the next line that is printed (and to ``Proxy.stats()['log_suppressed']``)."""

    def __init__(self, logger: logging.Logger, per_s: float):
        self.logger = logger
        self.per_s = per_s
        self.window = -1.0
        self.lines = 0
        self.pending = 0                    # suppressed since the last printed line
        self.suppressed = 0                 # suppressed in all

    def __call__(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.window >= 1.0:
            self.window = now
            self.lines = 0
        if self.lines >= self.per_s:
            self.pending += 1
            self.suppressed += 1
            return
        self.lines += 1
        if self.pending:
            msg += " (%d similar lines suppressed before this one)"
            args += (self.pending,)
            self.pending = 0
        self.logger.warning(msg, *args)


class _ServerLog:
    """The logger handed to aiohttp's server: its errors become one rate-limited line, never a traceback
    (the traceback goes to debug level, for whoever is chasing a bug)."""

    def __init__(self, reject: _RejectLog):
        self._reject = reject

    def debug(self, msg, *args, **kw) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(msg, *args, **kw)

    info = debug

    def _line(self, msg, *args, exc_info=None, **kw) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1] if exc_info else None
        try:
            text = msg % args if args else str(msg)
        except (TypeError, ValueError):
            text = str(msg)
        self._reject("proxy: %s%s", _shown(text, 200), f": {_shown(_brief(exc), 200)}" if exc else "")
        if exc is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("proxy: traceback of the line above", exc_info=exc)

    warning = error = exception = critical = _line

    def isEnabledFor(self, level: int) -> bool:     # noqa: N802 (logging.Logger's name)
        return log.isEnabledFor(level)


# answered to a connection past max_connections, before anything is read from it
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


class _Refuse(asyncio.Protocol):
    """A connection past ``max_connections``: a 503 at once, then closed (after the request arrives,
    or 0.5 s, so the client reads the answer rather than a reset)."""

    def __init__(self, body: bytes):
        self.body = body
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(_REFUSED % (len(self.body), self.body))
        self.timer = asyncio.get_running_loop().call_later(0.5, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None


class _Connection(web.RequestHandler):
    """aiohttp's connection handler, counted (for ``max_connections``), with JSON, one-line errors, and a
    deadline for the first request's headers (aiohttp's keep-alive timer covers the later ones; only
    recent aiohttp releases also start it when the connection opens)."""

    def __init__(self, manager: "_Server", *, header_timeout: float | None = None, **kwargs):
        super().__init__(manager, **kwargs)
        self._specops_counted = True
        self._specops_header_timeout = header_timeout
        self.specops_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self._specops_header_timeout:
            self.specops_deadline = asyncio.get_running_loop().call_later(
                self._specops_header_timeout, self._specops_no_request)

    def _specops_no_request(self) -> None:
        self.specops_deadline = None        # a request would have cancelled it: none came in time
        self.force_close()

    def connection_lost(self, exc) -> None:
        if self.specops_deadline is not None:
            self.specops_deadline.cancel()
            self.specops_deadline = None
        if self._specops_counted:
            self._specops_counted = False
            server = self._manager
            if server is not None:
                server.open_connections -= 1
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse (400, 413, 431...) or a bug in the handler (500)."""
        server = self._manager
        proxy = server.proxy if server is not None else None
        if isinstance(exc, ConnectionError):     # the client went away: nothing to answer, nothing to report
            log.debug("proxy: client %s went away: %s", request.remote, _describe(exc))
            proxy = None
        if status >= 500:
            kind, text = "specops_internal_error", "specops: internal error"
        else:
            kind, text = "invalid_request_error", f"malformed HTTP request ({type(exc).__name__ if exc else status})"
        if proxy is not None:
            proxy._c["rejected_malformed" if status < 500 else "internal_errors"] += 1
            proxy._reject_log("proxy: %d %s from %s: %s", status, "malformed request" if status < 500 else
                              "internal error", request.remote or "-",
                              _shown(_brief(exc) if exc else message, 160))
            if exc is not None and status >= 500 and log.isEnabledFor(logging.DEBUG):
                log.debug("proxy: traceback of the internal error", exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started: no error response can follow")
        resp = web.Response(status=status, body=_error_body(status, kind, text), content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    """aiohttp's low-level server with a cap on open client connections."""

    def __init__(self, handler, *, proxy: "Proxy", max_connections: int | None, header_timeout: float | None,
                 **kwargs):
        super().__init__(handler, **kwargs)
        self.proxy = proxy
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open_connections = 0
        self._refusal = _error_body(503, "specops_too_many_connections",
                                    f"specops: too many open connections ({max_connections}); retry later")

    def __call__(self) -> asyncio.Protocol:     # the protocol factory: one call per accepted connection
        if self.max_connections is not None and self.open_connections >= self.max_connections:
            self.proxy._c["rejected_connections"] += 1
            self.proxy._reject_log("proxy: refused a connection: %d connections are open (max_connections)",
                                   self.open_connections)
            return _Refuse(self._refusal)
        self.open_connections += 1
        return _Connection(self, loop=self._loop, header_timeout=self.header_timeout, **self._kwargs)


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
                 max_body_size: int = DEFAULT_MAX_BODY_SIZE, buffer_limit: int = 1024 * 1024,
                 health_path: str = "/health", recover_interval: float = 1.0,
                 events_kept: int = 100, api_key: str | None = None,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
                 max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES, log_rejects_per_s: float = 5.0):
        if queue_size < 0:
            raise ValueError("queue_size must be >= 0")
        if header_timeout <= 0 or body_timeout <= 0:
            raise ValueError("header_timeout and body_timeout must be > 0")
        if max_connections is not None and max_connections < 1:
            raise ValueError("max_connections must be >= 1 (or None: no cap)")
        if max_body_size < 0 or max_buffered_bytes < 0:
            raise ValueError("max_body_size and max_buffered_bytes must be >= 0")
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
        self.api_key = api_key or None
        self._key = b"Bearer " + api_key.encode("utf-8") if api_key else None
        self.header_timeout = float(header_timeout)
        self.body_timeout = float(body_timeout)
        self.max_connections = max_connections
        self.max_buffered_bytes = int(max_buffered_bytes)
        self._buffered = 0                  # request bodies (and buffered answers) held now, in bytes
        self._server: _Server | None = None
        self._reject_log = _RejectLog(log, log_rejects_per_s)

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
            "cut_streams", "client_disconnects", "timings_draft_n", "timings_draft_n_accepted",
            "rejected_bad_target", "rejected_method", "rejected_unauthorized", "rejected_too_large",
            "rejected_body_timeout", "rejected_buffer_full", "rejected_connections", "rejected_malformed",
            "internal_errors")}
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

    @classmethod
    def from_profile(cls, profile, **kwargs) -> "Proxy":
        """The proxy ``specops up`` runs for a profile: its ``server`` address and key, its ``proxy`` settings.

        ``kwargs`` (e.g. ``status_provider``) are passed on and win over the profile.
        """
        p, server = profile.proxy, profile.server
        opts = dict(queue_size=p.queue_size, queue_timeout=p.queue_timeout, drain_timeout=p.drain_timeout,
                    retry_unstarted=p.retry_unstarted, admin_port=p.admin_port, api_key=server.api_key,
                    max_body_size=p.max_body_size, max_buffered_bytes=p.max_buffered_bytes,
                    max_connections=p.max_connections, header_timeout=p.header_timeout,
                    body_timeout=p.body_timeout)
        opts.update(kwargs)
        return cls(server.host, server.port, **opts)

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
        loop = asyncio.get_running_loop()

        def request_factory(message, payload, protocol, writer, task, _server=None):
            return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body)

        _raise_fd_limit(2 * (self.max_connections or 0) + 256)
        handler = self._handle if self.admin_port is None else self._handle_public
        # keepalive_timeout: aiohttp closes a connection that has not delivered a complete request this long
        # after it opened or after the previous response: the header timeout and the idle timeout at once
        server_log = _ServerLog(self._reject_log)
        self._server = server = _Server(
            handler, proxy=self, max_connections=self.max_connections, header_timeout=self.header_timeout,
            request_factory=request_factory,
            handler_cancellation=True, access_log=None, max_line_size=65536, max_field_size=65536,
            keepalive_timeout=self.header_timeout, lingering_time=_LINGER, logger=server_log)
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        if self.admin_port is not None:
            admin = _Server(self._handle_admin_only, proxy=self, max_connections=64,
                            header_timeout=self.header_timeout, handler_cancellation=True,
                            access_log=None, keepalive_timeout=self.header_timeout, lingering_time=_LINGER,
                            logger=server_log)
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
        if self._reject_log.pending:
            log.warning("proxy: %d lines about rejected requests were suppressed", self._reject_log.pending)
            self._reject_log.pending = 0
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
                 held_for_s=round(time.monotonic() - self._held_since, 3) if self._held_since else None,
                 buffered_bytes=self._buffered,
                 connections=self._server.open_connections if self._server is not None else 0,
                 log_suppressed=self._reject_log.suppressed)
        return d

    def status(self) -> dict:
        """The ``/specops/status`` document: the proxy's own section, merged with ``status_provider()``."""
        doc: dict = {"proxy": dict(self.stats(), url=self.url, started_at=round(self._started_at, 3),
                                   queue_timeout_s=self.queue_timeout,
                                   drain_timeout_s=self.drain_timeout, retry_unstarted=self.retry_unstarted,
                                   limits={"api_key": self._key is not None,
                                           "max_connections": self.max_connections,
                                           "max_body_size": self.max_body_size,
                                           "max_buffered_bytes": self.max_buffered_bytes,
                                           "header_timeout_s": self.header_timeout,
                                           "body_timeout_s": self.body_timeout},
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
        deadline = request.protocol.specops_deadline
        if deadline is not None:            # the first request's headers came in time
            deadline.cancel()
            request.protocol.specops_deadline = None
        return await self._proxy(request)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        deadline = request.protocol.specops_deadline
        if deadline is not None:
            deadline.cancel()
            request.protocol.specops_deadline = None
        if request.raw_path.startswith(ADMIN_PREFIX):
            try:
                self._check_target(request)
                self._check_key(request)
            except _ClientError as exc:
                return self._refuse(request, exc)
            return await self._handle_admin(request)
        return await self._proxy(request)

    async def _handle_admin_only(self, request: web.BaseRequest) -> web.StreamResponse:
        deadline = request.protocol.specops_deadline
        if deadline is not None:
            deadline.cancel()
            request.protocol.specops_deadline = None
        try:
            self._check_target(request)
        except _ClientError as exc:
            return self._refuse(request, exc)
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
        return web.json_response({"error": {"message": f"unknown specops endpoint {_shown(request.path)}",
                                            "type": "not_found", "code": 404}}, status=404)

    # ------------------------------------------------------------------------------- client-facing checks

    @staticmethod
    def _check_target(request: web.BaseRequest) -> None:
        """Only origin-form targets (``/path?query``) are served: nothing else can name another host."""
        target = request.raw_path           # the request-target exactly as the client sent it
        method = request.method
        if method == "CONNECT":
            raise _ClientError(405, "method_not_allowed", "specops: CONNECT is not supported: this is a "
                               "reverse proxy for one engine", close=True, counter="method")
        if target[:1] != "/" or "#" in target:
            raise _ClientError(400, "invalid_request_error", "specops: the request target must be a path "
                               "starting with '/' (no absolute URL, authority, '*' or fragment)", close=True,
                               counter="bad_target")

    def _check_key(self, request: web.BaseRequest) -> None:
        key = self._key
        if key is None:
            return
        got = request.headers.get("Authorization")
        if got is not None:
            raw = got.strip().encode("utf-8", "surrogateescape")
            if raw[:7].lower() == b"bearer ":          # the scheme is case-insensitive (RFC 9110 §11.1)
                raw = b"Bearer " + raw[7:].lstrip()
            if hmac.compare_digest(raw, key):
                return
        raise _ClientError(401, "authentication_error", "specops: a valid API key is required "
                           "(Authorization: Bearer <key>)", close=request.body_exists, counter="unauthorized")

    def _refuse(self, request: web.BaseRequest, exc: _ClientError) -> web.Response:
        """Answer a request the proxy refused on its own, and log one (rate-limited) line about it."""
        self._c["rejected_" + exc.counter] += 1
        self._reject_log("proxy: %d %s from %s: %s %s", exc.status, exc.kind, request.remote or "-",
                         _shown(request.method, 16), _shown(request.raw_path))
        headers = {"Retry-After": self._retry_after()} if exc.status == 503 else \
            {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        resp = web.Response(status=exc.status, body=_error_body(exc.status, exc.kind, str(exc)),
                            content_type="application/json", headers=headers)
        if exc.close:
            resp.force_close()
        return resp

    async def _read_body(self, request: web.BaseRequest) -> tuple[bytes, int]:
        """The whole request body and the bytes it reserved of ``max_buffered_bytes`` (give them back).

        Refused without reading when the Content-Length is over ``max_body_size`` or the reservation does
        not fit; a body that does not arrive within ``body_timeout`` is a 408.
        """
        if not request.body_exists:
            return b"", 0
        limit = self.max_body_size
        clen = request.content_length
        if clen is not None and clen > limit:
            raise _ClientError(413, "request_too_large", f"specops: the request body ({clen} bytes) is over "
                               f"the {limit}-byte limit (proxy.max_body_size)", close=True, counter="too_large")
        content = request.content
        if content.is_eof():                # the usual case: the body came with the headers
            try:
                body = content.read_nowait()
            except HttpProcessingError as exc:
                raise _ClientError(400, "invalid_request_error", f"specops: malformed request body "
                                   f"({type(exc).__name__})", close=True, counter="malformed") from None
            if len(body) > limit:
                raise _ClientError(413, "request_too_large", f"specops: the request body is over the "
                                   f"{limit}-byte limit (proxy.max_body_size)", close=True, counter="too_large")
            self._reserve(len(body))
            return body, len(body)
        reserved = clen or 0
        self._reserve(reserved)
        try:
            chunks = []
            size = 0
            try:
                async with _timeout(self.body_timeout):
                    while True:
                        chunk = await content.readany()
                        if not chunk:
                            break
                        size += len(chunk)
                        if size > limit:
                            raise _ClientError(413, "request_too_large", f"specops: the request body is over "
                                               f"the {limit}-byte limit (proxy.max_body_size)", close=True,
                                               counter="too_large")
                        if size > reserved:     # no Content-Length (chunked): reserve as it comes
                            self._reserve(size - reserved)
                            reserved = size
                        chunks.append(chunk)
            except asyncio.TimeoutError:
                raise _ClientError(408, "request_timeout", f"specops: the request body did not arrive within "
                                   f"{self.body_timeout:g}s (proxy.body_timeout)", close=True,
                                   counter="body_timeout") from None
            except HttpProcessingError as exc:
                raise _ClientError(400, "invalid_request_error", f"specops: malformed request body "
                                   f"({type(exc).__name__})", close=True, counter="malformed") from None
        except BaseException:
            self._buffered -= reserved
            raise
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), reserved

    def _reserve(self, n: int) -> None:
        if n and self._buffered + n > self.max_buffered_bytes:
            raise _ClientError(503, "specops_buffer_full", f"specops: the proxy holds too many request bodies "
                               f"now ({self._buffered} bytes; proxy.max_buffered_bytes "
                               f"{self.max_buffered_bytes}); retry later", close=True, counter="buffer_full")
        self._buffered += n

    # ------------------------------------------------------------------------------------------ forwarding

    async def _proxy(self, request: web.BaseRequest) -> web.StreamResponse:
        c = self._c
        c["requests"] += 1
        reserved = 0
        try:
            try:
                self._check_target(request)
                if self._key is not None and (request.method, request.raw_path) not in _UNAUTHENTICATED:
                    self._check_key(request)
                body, reserved = await self._read_body(request)
            except _ClientError as exc:
                return self._refuse(request, exc)
            return await self._forward(request, body)
        finally:
            if reserved:
                self._buffered -= reserved

    async def _forward(self, request: web.BaseRequest, body: bytes) -> web.StreamResponse:
        c = self._c
        loop = asyncio.get_running_loop()
        headers = self._request_headers(request, body)
        retried = reconnected = False
        deadline = loop.time() + self.queue_timeout
        while True:
            try:
                gen = self._gen if self._state == SERVING else await self._acquire(deadline)
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
            log.info("proxy: retrying %s %s after: %s", request.method, _shown(request.raw_path), failure.reason)
            await self._after_unstarted_failure(flight, failure.reason, alive)
            deadline = loop.time() + self.queue_timeout

    def _request_headers(self, request: web.BaseRequest, body: bytes) -> CIMultiDict:
        """The headers sent to the engine: the client's, less hop-by-hop and forwarding ones, plus the
        proxy's own forwarding headers (see the module docstring)."""
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
            prior = src.getall("X-Forwarded-For", ())
            out["X-Forwarded-For"] = ", ".join((*prior, remote)) if prior else remote
        if body and _STREAM_KEY in body and _STREAM_TRUE.search(body):
            out["Connection"] = "close"
        host = src.get("Host")
        if host:
            out["X-Forwarded-Host"] = host
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
                        request.method, _upstream_url(flight.gen, request.raw_path),
                        headers=headers, data=body or None, allow_redirects=False)
                except _UPSTREAM_ERRORS as exc:
                    stale = (isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
                             and not isinstance(exc, aiohttp.ClientConnectorError))
                    raise _Unstarted(_describe(exc), stale) from None
                ctype = up.headers.get("Content-Type", "")
                sse = ctype.startswith("text/event-stream")
                clen = up.content_length
                out_headers = CIMultiDict(up.headers)   # one C-level copy, then drop the few hop-by-hop ones
                conn = out_headers.get("Connection")
                if conn:
                    for name in conn.split(","):
                        out_headers.popall(name.strip(), None)
                for name in _RESPONSE_DROP_NAMES:
                    if name in out_headers:
                        del out_headers[name]

                if not sse and clen is not None and clen <= self.buffer_limit and request.method != "HEAD" \
                        and self._buffered + clen <= self.max_buffered_bytes:
                    self._buffered += clen      # counted while it is read (then aiohttp writes it out)
                    try:
                        data = await up.read()
                    except _UPSTREAM_ERRORS as exc:
                        raise _Unstarted(_describe(exc)) from None
                    finally:
                        self._buffered -= clen
                    complete = True
                    if self.on_timings is not None and _TIMINGS in data:
                        self._timings_from_json(data, flight)
                    return web.Response(status=up.status, reason=up.reason, body=data, headers=out_headers)

                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out_headers)
                if clen is not None:
                    resp.content_length = clen
                try:
                    await resp.prepare(request)
                except (ConnectionError, RuntimeError):
                    self._c["client_disconnects"] += 1
                    return resp              # closing the engine response (finally) cancels its request
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


def _upstream_url(gen: _Generation, target: str) -> URL:
    """The engine URL for an origin-form target (checked to start with '/'): built from its parts."""
    if target[:1] != "/":                # _check_target refused it already; never build from anything else
        raise ValueError("not an origin-form request target")
    path, _, query = target.partition("?")
    return URL.build(scheme=gen.scheme, authority=gen.authority, path=gen.path + path, query_string=query,
                     encoded=True)


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft open-files limit towards ``wanted`` (never above the hard limit, never lower it), so
    ``max_connections`` client connections, each with an engine connection, fit."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            if new > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError):      # pragma: no cover - not on Linux, or not allowed
        pass


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (a faster loop for the proxy), else None (asyncio's own).

    ``SPECOPS_UVLOOP=0`` in the environment keeps asyncio's loop.
    """
    if os.environ.get("SPECOPS_UVLOOP", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_event_loop(main):
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    factory = loop_factory()
    if factory is None:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    import uvloop                                   # pragma: no cover - Python 3.10
    return uvloop.run(main)


def _brief(exc: BaseException) -> str:
    """An exception in one short line: its type and the first line of its message (aiohttp's parse errors
    add the offending request line and a caret below it)."""
    text = getattr(exc, "message", None)
    if not isinstance(text, str):
        text = str(exc)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first.rstrip(':')}" if first else type(exc).__name__


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
                       (["stopped"], c["rejected_stopped"]), (["buffer_full"], c["rejected_buffer_full"]),
                       (["connections"], c["rejected_connections"])], labels=["reason"])
        yield counter("specops_proxy_refused", "Client requests the proxy refused itself (4xx).",
                      [([k], c["rejected_" + k]) for k in ("bad_target", "method", "unauthorized", "too_large",
                                                            "body_timeout", "malformed")], labels=["reason"])
        yield gauge("specops_proxy_buffered_bytes", "Request bodies (and buffered answers) held now.",
                    st["buffered_bytes"])
        yield gauge("specops_proxy_connections", "Open client connections on the public port.", st["connections"])
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
