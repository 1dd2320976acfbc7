"""What the public port accepts: it may face untrusted clients.

- Only origin-form request targets (``/path?query``) are forwarded, and the engine URL is built from its
  parts (the engine's scheme and host:port, then the client's path and query; see
  :func:`specops.proxy.forward.upstream_url`), never by pasting the client's target after the engine's
  address: ``CONNECT`` is answered 405, absolute-form (``GET http://host/...``), ``*`` and any target that
  does not start with ``/`` (or holds a ``#``) 400, so a client can never make the proxy open a connection
  anywhere but its engine (:func:`check_target`).
- With ``api_key`` (the profile's ``server.api_key``) every request except ``GET``/``HEAD /health`` (for
  load balancers; the engines leave it open too) must carry ``Authorization: Bearer <key>``, checked in
  constant time before the body is read, queued or forwarded: 401 otherwise (:func:`check_key`).
  ``/specops/status`` and ``/specops/metrics`` on the public port need the key too; the separate loopback
  admin port does not.
- Limits, each answered with a JSON error like every other rejection: the request headers must arrive
  within ``header_timeout`` of the connection opening or of the previous response (an idle keep-alive
  connection is closed after it as well; :class:`Connection`), the body within ``body_timeout`` (408 and
  the connection closed; :func:`~specops.proxy.bodies.read_body`); a body over ``max_body_size`` is refused from its
  Content-Length without reading it (413); past ``max_connections`` open client connections a new one
  gets a 503 and is closed at once (:class:`Server`, :class:`Refuse`); the bodies held by the proxy (read,
  queued or being forwarded, and the small engine answers it buffers) may add up to
  ``max_buffered_bytes``: past it a request gets 503 with ``Retry-After`` (:class:`~specops.proxy.bodies.BufferBudget`).
  A body's bytes are given back once the engine's answer has started (no retry can need it then), so a
  client that stops reading its answer holds none of them.
- Headers are parsed before the API key can be checked, so their memory is bounded for clients without
  one: a request line or header field over 8190 bytes, or over 128 header fields, is a 400 (aiohttp's
  parser), a header section over ``max_header_bytes`` (64 KiB, the read that ends it included) a 431, and the header bytes of requests still arriving count
  against ``max_buffered_bytes`` like bodies (503 past it); the connection is closed after either answer
  (:class:`Connection`).
- A client that reads nothing of its answer for ``send_timeout`` seconds while the proxy has more to
  send (the socket's buffers are full) is cut: the connection is aborted, the engine request cancelled.
- A rejected or malformed request logs one line (a warning on ``specops.proxy``), never a traceback;
  past ``log_rejects_per_s`` lines a second the rest are counted and the count is added to the next line
  (:class:`RejectLog`, :class:`ServerLog`).
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import logging
import sys
import time

from aiohttp import web
from aiohttp.streams import EMPTY_PAYLOAD

try:  # how aiohttp queues a request it could not parse (answered 400 by handle_error)
    from aiohttp.web_protocol import _ErrInfo as _ParseError
except ImportError:  # pragma: no cover - a release without it: the parser is simply fed on

    class _ParseError:  # type: ignore[no-redef]
        pass


from .bodies import BufferBudget
from .errors import ClientError, brief, describe, error_body, shown

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - aiohttp depends on async-timeout on 3.10
    pass

log = logging.getLogger("specops.proxy")

# Defaults of the client-facing limits; the profile's `proxy` section has the same defaults and documents them.
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024
DEFAULT_MAX_BUFFERED_BYTES = 128 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_SEND_TIMEOUT = 30.0
#: the bytes of one request's header section (request line included); real clients send well under 8 KiB
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
#: the longest request line and header field (name and value), on the public port and from the engine:
#: aiohttp's and nginx's default 8 KiB
MAX_FIELD_SIZE = 8190
#: the most header fields in one request (more: a 400 from the parser; aiohttp 3.14 has the same default)
MAX_HEADERS = 128

#: a request whose body was not read is closed after this much reading-and-discarding (aiohttp: 10 s)
LINGER = 1.0
#: (method, target) pairs served without the API key
UNAUTHENTICATED = frozenset({("GET", "/health"), ("HEAD", "/health")})


# ------------------------------------------------------------------------------------------ rejection log


class RejectLog:
    """One warning line per rejected request, at most ``per_s`` a second; the rest are counted and the
    count is added to the next line that is printed (and to ``Proxy.stats()['log_suppressed']``)."""

    def __init__(self, logger: logging.Logger, per_s: float):
        self.logger = logger
        self.per_s = per_s
        self.window = -1.0
        self.lines = 0
        self.pending = 0  # suppressed since the last printed line
        self.suppressed = 0  # suppressed in all

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


class ServerLog:
    """The logger handed to aiohttp's server: its errors become one rate-limited line, never a traceback
    (the traceback goes to debug level, for whoever is chasing a bug)."""

    def __init__(self, reject: RejectLog):
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
        self._reject("proxy: %s%s", shown(text, 200), f": {shown(brief(exc), 200)}" if exc else "")
        if exc is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("proxy: traceback of the line above", exc_info=exc)

    warning = error = exception = critical = _line

    def isEnabledFor(self, level: int) -> bool:
        return log.isEnabledFor(level)


# ------------------------------------------------------------------------- connections and their deadlines

# answered to a connection past max_connections, before anything is read from it
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


class Refuse(asyncio.Protocol):
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


_ANSWER = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%sConnection: close\r\nContent-Length: %d\r\n\r\n%s"


class Connection(web.RequestHandler):
    """aiohttp's connection handler, counted (for ``max_connections``), with JSON, one-line errors, and
    deadlines: for the first request's headers (aiohttp's keep-alive timer covers the later ones; only
    recent aiohttp releases also start it when the connection opens), and for a client that reads nothing
    of its answer (``send_timeout``, from the transport's flow control: no cost per write).

    The header bytes of a request still arriving are counted (``max_header_bytes`` per request) and held
    in the proxy's :class:`BufferBudget` until the headers are complete or the connection closes: aiohttp's
    parser keeps each header twice (bytes and str) until then, and it parses them before the API key can
    be checked. Body bytes are not counted here (:func:`~specops.proxy.bodies.read_body` holds them).
    """

    def __init__(self, manager: Server, *, header_timeout: float | None = None, **kwargs):
        super().__init__(manager, **kwargs)
        self._specops_counted = True
        self._specops_header_timeout = header_timeout
        self.specops_deadline: asyncio.TimerHandle | None = None
        self._specops_send_deadline: asyncio.TimerHandle | None = None
        self._specops_linger: asyncio.TimerHandle | None = None
        self._specops_header_bytes = 0  # of the request whose headers are arriving, held in the budget
        self._specops_payload = None  # the body of the last request parsed (its end: headers come next)
        self._specops_last = b""  # the last 3 header bytes of the request whose headers are arriving
        self._specops_trim = False  # refused while its headers arrived: trim the heap after it closes

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self._specops_header_timeout:
            self.specops_deadline = asyncio.get_running_loop().call_later(
                self._specops_header_timeout, self._specops_no_request
            )

    def _specops_no_request(self) -> None:
        self.specops_deadline = None  # a request would have cancelled it: none came in time
        self.force_close()

    def data_received(self, data: bytes) -> None:
        payload = self._specops_payload
        if self._force_close or self._close or (payload is not None and not payload.is_eof()):
            super().data_received(data)  # closing, or a body arriving: not header bytes
            return
        server = self._manager
        if server is None or not data:
            super().data_received(data)  # (aiohttp feeds b"" to reparse what it held while paused)
            return
        # this read's header bytes: to the blank line that ends the section when it is here, refused before
        # they are parsed when the section is then over the limit
        end = _end_of_headers(self._specops_last, data)
        if self._specops_header_bytes + (len(data) if end < 0 else end) > server.max_header_bytes:
            self._specops_hold(len(data))  # (given back when the connection closes, like every refusal's)
            return
        parsed = self._request_count
        super().data_received(data)
        budget = server.budget
        if self._request_count == parsed:  # the headers go on in the next read
            self._specops_last = (self._specops_last + data)[-3:]
            self._specops_hold(len(data))
            return
        # the headers are complete (their body, if any, follows)
        if self._specops_header_bytes:
            budget.release_headers(self._specops_header_bytes)
            self._specops_header_bytes = 0
        self._specops_last = b""
        if self._messages and isinstance(self._messages[-1][0], _ParseError):
            # they could not be parsed (a line over the limit...): the 400 is queued. aiohttp would feed the
            # parser on and queue one more error (holding the data read) per read after it
            self._close = True
            return
        self._specops_payload = self._messages[-1][1] if self._messages else None
        # a pipeline that filled aiohttp's queue of parsed requests (it stops reading then) left up to a read of
        # unparsed requests in its parser: trim the heap once the connection is gone, as after a refusal
        self._specops_trim |= getattr(self, "_buffer_paused", False)
        if self._specops_payload is EMPTY_PAYLOAD and end >= 0:
            # no body follows: what follows the last blank line of this read starts the next request's headers
            # (a request pipelined whole inside one read is held to aiohttp's 128 fields of 8190 bytes)
            last = data.rfind(b"\r\n\r\n")
            rest = len(data) - (last + 4 if last >= 0 else end)
            if rest > 0:
                self._specops_last = data[-3:]
                self._specops_hold(rest)

    def _specops_hold(self, n: int) -> None:
        """Count ``n`` more header bytes of the request whose headers are arriving (in the budget too), and
        refuse it past ``max_header_bytes`` (431) or past the budget (503)."""
        server = self._manager
        budget = server.budget
        self._specops_header_bytes += n
        budget.hold_headers(n)
        if self._specops_header_bytes > server.max_header_bytes:
            server.counters["rejected_header_size"] += 1
            self._specops_refuse(
                431,
                b"Request Header Fields Too Large",
                "request_header_fields_too_large",
                f"specops: the request headers are over the proxy's {server.max_header_bytes}-byte limit",
            )
        elif budget.held > budget.limit:
            server.counters["rejected_buffer_full"] += 1
            self._specops_refuse(
                503,
                b"Service Unavailable",
                "specops_buffer_full",
                f"specops: the proxy holds too many request headers and bodies now "
                f"(proxy.max_buffered_bytes {budget.limit}); retry later",
            )

    def _specops_refuse(self, status: int, reason: bytes, kind: str, message: str) -> None:
        """Answer a request whose headers are refused while they arrive, then close: what the client still
        sends is read and dropped for ``LINGER`` seconds, so it gets the answer rather than a reset."""
        server, transport = self._manager, self.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        server.reject_log("proxy: %d %s from %s", status, kind, peer[0] if peer else "-")
        self._specops_trim = True
        self._force_close = True  # aiohttp's data_received drops what comes from now on
        if transport is None:
            return
        if not self._request_in_progress and not self._messages:  # nothing else is being answered on it
            body = error_body(status, kind, message)
            extra = b"Retry-After: 1\r\n" if status == 503 else b""
            transport.write(_ANSWER % (status, reason, extra, len(body), body))
            try:
                transport.write_eof()
            except (NotImplementedError, OSError, RuntimeError):  # pragma: no cover - TCP transports have it
                pass
        self._specops_linger = asyncio.get_running_loop().call_later(LINGER, self.force_close)

    def pause_writing(self) -> None:
        """The transport's buffer is full (the client reads nothing now): start the send deadline."""
        super().pause_writing()
        server = self._manager
        if server is not None and server.send_timeout and self._specops_send_deadline is None:
            self._specops_send_deadline = asyncio.get_running_loop().call_later(
                server.send_timeout, self._specops_send_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._specops_send_deadline is not None:
            self._specops_send_deadline.cancel()
            self._specops_send_deadline = None

    def _specops_send_stalled(self) -> None:
        """The client read nothing for ``send_timeout``: cut it (its engine request is cancelled with it)."""
        self._specops_send_deadline = None
        server, transport = self._manager, self.transport
        if server is None or transport is None:
            return
        server.counters["cut_slow_clients"] += 1
        peer = transport.get_extra_info("peername")
        server.reject_log(
            "proxy: cut a client that read nothing of its answer for %gs (proxy.send_timeout): %s",
            server.send_timeout,
            peer[0] if peer else "-",
        )
        transport.abort()

    def connection_lost(self, exc) -> None:
        for timer in (self.specops_deadline, self._specops_send_deadline, self._specops_linger):
            if timer is not None:
                timer.cancel()
        self.specops_deadline = self._specops_send_deadline = self._specops_linger = None
        server = self._manager
        if server is not None and self._specops_header_bytes:
            server.budget.release_headers(self._specops_header_bytes)
            self._specops_trim |= self._specops_header_bytes >= MAX_FIELD_SIZE
        if server is not None and self._specops_trim:  # what its headers took is freed with it: give it back
            server.heap.trim_soon()
        self._specops_header_bytes = 0
        self._specops_payload = None
        self._specops_last = b""
        for message, _ in self._messages:  # parse errors never answered: free what their tracebacks hold
            if isinstance(message, _ParseError) and message.exc is not None:
                message.exc.__traceback__ = None
        if self._specops_counted:
            self._specops_counted = False
            if server is not None:
                server.open_connections -= 1
        super().connection_lost(exc)

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (400, 413, 431...) or a bug in the handler (500)."""
        server = self._manager
        if isinstance(exc, ConnectionError):  # the client went away: nothing to answer, nothing to report
            log.debug("proxy: client %s went away: %s", request.remote, describe(exc))
        elif server is not None:
            server.report_error(request, status, exc, message)
        if status < 500 and exc is not None:
            # aiohttp caught the parse error in data_received: its traceback holds that frame, which holds
            # the data read and this connection (its parser, the headers so far), and the error is held by
            # the frame's locals: a cycle only the cyclic GC would free, minutes later under load
            exc.__traceback__ = None
        self._specops_trim |= status < 500  # a header line over the limit, say: trim once it is freed
        if status >= 500:
            kind, text = "specops_internal_error", "specops: internal error"
        else:
            kind, text = "invalid_request_error", f"malformed HTTP request ({type(exc).__name__ if exc else status})"
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started: no error response can follow")
        resp = web.Response(status=status, body=error_body(status, kind, text), content_type="application/json")
        resp.force_close()
        return resp


def _end_of_headers(before: bytes, data: bytes) -> int:
    """Where in ``data`` a header section ends (just past its blank line), ``before`` being the section's last
    bytes before ``data`` (3 are enough); -1 when it does not end in ``data``."""
    if before:
        joined = before + data[:3]
        at = joined.find(b"\r\n\r\n")
        if 0 <= at < len(before):
            return at + 4 - len(before)
    at = data.find(b"\r\n\r\n")
    return -1 if at < 0 else at + 4


def cancel_header_deadline(request: web.BaseRequest) -> None:
    """The request's headers came in time: the connection's first-request deadline is over."""
    deadline = request.protocol.specops_deadline
    if deadline is not None:
        deadline.cancel()
        request.protocol.specops_deadline = None


class Server(web.Server):
    """aiohttp's low-level server with a cap on open client connections.

    ``counters`` is the proxy's counter dict (``rejected_connections``, ``rejected_malformed``,
    ``rejected_header_size``, ``cut_slow_clients``, ``internal_errors`` are counted here); ``reject_log``
    gets one line per refusal; ``budget`` holds the header bytes of requests still arriving
    (:class:`Connection`).
    """

    def __init__(
        self,
        handler,
        *,
        counters: dict,
        reject_log: RejectLog,
        max_connections: int | None,
        header_timeout: float | None,
        budget: BufferBudget,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
        **kwargs,
    ):
        kwargs.setdefault("max_line_size", MAX_FIELD_SIZE)
        kwargs.setdefault("max_field_size", MAX_FIELD_SIZE)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        super().__init__(handler, **kwargs)
        self.counters = counters
        self.reject_log = reject_log
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.budget = budget
        self.max_header_bytes = max_header_bytes
        self.send_timeout = send_timeout
        self.heap = HeapTrim()
        self.open_connections = 0
        self._refusal = error_body(
            503, "specops_too_many_connections", f"specops: too many open connections ({max_connections}); retry later"
        )

    def __call__(self) -> asyncio.Protocol:  # the protocol factory: one call per accepted connection
        if self.max_connections is not None and self.open_connections >= self.max_connections:
            self.counters["rejected_connections"] += 1
            self.reject_log(
                "proxy: refused a connection: %d connections are open (max_connections)", self.open_connections
            )
            return Refuse(self._refusal)
        self.open_connections += 1
        return Connection(self, loop=self._loop, header_timeout=self.header_timeout, **self._kwargs)

    def report_error(self, request, status: int, exc: BaseException | None, message: str | None) -> None:
        """Count and log (one line) a request aiohttp could not parse, or a bug in the handler."""
        self.counters["rejected_malformed" if status < 500 else "internal_errors"] += 1
        self.reject_log(
            "proxy: %d %s from %s: %s",
            status,
            "malformed request" if status < 500 else "internal error",
            request.remote or "-",
            shown(brief(exc) if exc else message, 160),
        )
        if exc is not None and status >= 500 and log.isEnabledFor(logging.DEBUG):
            log.debug("proxy: traceback of the internal error", exc_info=exc)


class HeapTrim:
    """Hands the heap memory freed after refused requests back to the system, at most once a ``interval``.

    What a refused request cost is freed at once, but glibc's malloc keeps most of it: the reads and
    header values are tens of KiB each, freed among long-lived small objects, and glibc returns only the
    top of its heap. 200 connections refused for header lines over the limit left the process 160 MiB
    larger for good on uvloop (``benchmarks/bench_header_memory.py``); ``malloc_trim(0)`` gives the free
    pages back (a few ms on such a heap). A no-op without glibc.
    """

    interval = 1.0
    _trim = None  # glibc's malloc_trim, looked up once per process (False: not available)

    def __init__(self):
        self.pending: asyncio.TimerHandle | None = None
        self.trims = 0

    def trim_soon(self) -> None:
        if self.pending is None and self._malloc_trim() is not None:
            self.pending = asyncio.get_running_loop().call_later(self.interval, self._run)

    def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None

    def _run(self) -> None:
        self.pending = None
        fn = self._malloc_trim()
        if fn is not None:
            fn(0)
            self.trims += 1

    @classmethod
    def _malloc_trim(cls):
        if cls._trim is None:
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                HeapTrim._trim = fn
            except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
                HeapTrim._trim = False
        return cls._trim or None


def raise_fd_limit(wanted: int) -> None:
    """Raise the soft open-files limit towards ``wanted`` (never above the hard limit, never lower it), so
    ``max_connections`` client connections, each with an engine connection, fit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            if new > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not on Linux, or not allowed
        pass


# ------------------------------------------------------------------------------------- request checks


def check_target(request: web.BaseRequest) -> None:
    """Only origin-form targets (``/path?query``) are served: nothing else can name another host."""
    target = request.raw_path  # the request-target exactly as the client sent it
    if request.method == "CONNECT":
        raise ClientError(
            405,
            "method_not_allowed",
            "specops: CONNECT is not supported: this is a reverse proxy for one engine",
            close=True,
            counter="method",
        )
    if target[:1] != "/" or "#" in target:
        raise ClientError(
            400,
            "invalid_request_error",
            "specops: the request target must be a path "
            "starting with '/' (no absolute URL, authority, '*' or fragment)",
            close=True,
            counter="bad_target",
        )


def check_key(request: web.BaseRequest, key: bytes | None) -> None:
    """``key`` is ``b"Bearer <api_key>"`` (None: no key needed); compared in constant time."""
    if key is None:
        return
    got = request.headers.get("Authorization")
    if got is not None:
        raw = got.strip().encode("utf-8", "surrogateescape")
        if raw[:7].lower() == b"bearer ":  # the scheme is case-insensitive (RFC 9110 §11.1)
            raw = b"Bearer " + raw[7:].lstrip()
        if hmac.compare_digest(raw, key):
            return
    raise ClientError(
        401,
        "authentication_error",
        "specops: a valid API key is required (Authorization: Bearer <key>)",
        close=request.body_exists,
        counter="unauthorized",
    )
