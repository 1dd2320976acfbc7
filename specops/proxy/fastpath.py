"""The lean front end of the public port (``proxy.http: lean``): an asyncio protocol with httptools' C parser
(llhttp, Node.js' parser) in place of aiohttp's server, for the pass-through path where aiohttp's per-request
Python work was most of the proxy's own cost.

It only parses and writes HTTP/1.1; everything a request goes through (the target and key checks, body
limits, the wait queue, hold/drain, retries, twins routing, capture, spot checks) is the same code as on the
aiohttp front end (:class:`~specops.proxy.dispatch.RequestPath`, :mod:`specops.proxy.forward`,
:mod:`specops.proxy.limits`): :class:`LeanRequest` carries the few request attributes that code reads, and the
answers it returns (aiohttp ``web.Response`` objects, or a :class:`LeanStream` it streamed into) are written here.

The same client-facing limits hold (:mod:`specops.proxy.limits` says what they are): the connection cap, the
first-request and keep-alive header deadline, a request line or header field over 8190 bytes (400), a header
section over ``max_header_bytes`` (431) or past the buffer budget while it arrives (503), the send deadline.
llhttp refuses the framings used for request smuggling (Content-Length with Transfer-Encoding, two
Content-Lengths, obs-fold, bare LF, an unknown transfer coding): 400 and the connection closed. After a
``CONNECT`` or an ``Upgrade`` request nothing more is read from the connection: it closes after the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import httptools
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from multidict import CIMultiDict
from yarl import URL

from .errors import brief, error_body, shown
from .limits import LINGER, MAX_FIELD_SIZE, BufferBudget, HeapTrim, Refuse, RejectLog

log = logging.getLogger("specops.proxy")

__all__ = ["LeanRequest", "LeanServer", "LeanStream"]

#: a request body buffered past this while the handler has not read it pauses reading from the client
_BODY_HIGH_WATER = 1 << 16
_NO_BODY_STATUS = frozenset({204, 304})


class LeanBody:
    """A request body as it arrives: the part of aiohttp's ``StreamReader`` that
    :func:`~specops.proxy.limits.read_body` uses (``is_eof``, ``read_nowait``, ``readany``)."""

    __slots__ = ("_chunks", "_conn", "_eof", "_exc", "_size", "_waiter")

    def __init__(self, conn: LeanConnection):
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def is_eof(self) -> bool:
        return self._eof

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _BODY_HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def read_nowait(self) -> bytes:
        if self._exc is not None:
            raise self._exc
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        self._conn.resume_reading()
        return data

    async def readany(self) -> bytes:
        while not self._chunks and not self._eof and self._exc is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.read_nowait()


class LeanRequest:
    """One parsed request: the attributes of aiohttp's ``BaseRequest`` the request path reads."""

    __slots__ = (
        "_path",
        "body_exists",
        "content",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "protocol",
        "raw_path",
        "remote",
        "too_long",
        "transport",
        "version",
    )
    scheme = "http"

    @property
    def path(self) -> str:
        """The decoded path (no query), as aiohttp's ``request.path``."""
        if self._path is None:
            raw, _, query = self.raw_path.partition("?")
            self._path = URL.build(path=raw, query_string=query, encoded=True).path if raw[:1] == "/" else raw
        return self._path

    def open_stream(
        self, status: int, reason: str | None, headers: CIMultiDict, content_length: int | None
    ) -> LeanStream:
        """The response an engine's answer is streamed into (see :func:`specops.proxy.forward.stream_response`)."""
        return LeanStream(self.protocol, self, status, reason, headers, content_length)


def _head(status: int, reason: str | None, headers, extra: str) -> bytes:
    """A response's status line and header section."""
    if reason is None:
        reason = web.Response(status=status).reason  # aiohttp's table of reason phrases
    parts = [f"HTTP/1.1 {status} {reason}\r\n"]
    for k, v in headers.items():
        if "\n" in v or "\r" in v or "\n" in k or "\r" in k:
            raise ValueError(f"a line break in the response header {k!r}")
        parts.append(f"{k}: {v}\r\n")
    parts.append(extra)
    return "".join(parts).encode("utf-8", "surrogateescape")


class LeanStream:
    """A streamed answer on the lean front end: ``prepare``, ``write`` and ``write_eof`` as aiohttp's
    ``StreamResponse`` (chunked unless the engine gave a Content-Length)."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_no_body",
        "_request",
        "complete",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, conn, request: LeanRequest, status, reason, headers, content_length):
        self._conn = conn
        self._request = request
        self.status, self.reason, self.headers = status, reason, headers
        self.content_length = content_length
        self._no_body = request.method == "HEAD" or status in _NO_BODY_STATUS or status < 200
        self._chunked = content_length is None and not self._no_body and request.version != "1.0"
        self.complete = False

    async def prepare(self, request) -> None:
        conn = self._conn
        extra = []
        if self.content_length is not None:
            extra.append(f"Content-Length: {self.content_length}\r\n")
        elif self._chunked:
            extra.append("Transfer-Encoding: chunked\r\n")
        if not conn.keep(self._request) or (self.content_length is None and not self._chunked and not self._no_body):
            conn.closing = True
            extra.append("Connection: close\r\n")
        extra.append("\r\n")
        conn.send(_head(self.status, self.reason, self.headers, "".join(extra)))
        conn.head_sent = True
        if conn.paused:
            await conn.drain()

    async def write(self, data: bytes) -> None:
        if self._no_body or not data:
            return
        conn = self._conn
        conn.send(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if conn.paused:
            await conn.drain()

    async def write_eof(self) -> None:
        if self._chunked:
            self._conn.send(b"0\r\n\r\n")
        self.complete = True
        if self._conn.paused:
            await self._conn.drain()


class LeanConnection(asyncio.Protocol):
    """One client connection: parses requests with httptools and serves them one after another."""

    def __init__(self, server: LeanServer):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.remote: str | None = None
        self.specops_deadline: asyncio.TimerHandle | None = None  # the next request's headers are due
        self._send_deadline: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._url: list[bytes] = []
        self._fields: list[tuple[bytes, bytes]] = []
        self._in_head = False  # a request's header section has begun and is not complete
        self._heads_done = 0  # requests whose headers were complete on this connection
        self._line = 0  # bytes of the header line arriving now (across reads)
        self._header_bytes = 0  # of the request whose headers are arriving, held in the budget
        self._parsing: LeanRequest | None = None  # the request whose body is arriving
        self._queue: deque = deque()  # requests (or a parse error) waiting for the one being answered
        self._task: asyncio.Task | None = None
        self._reading_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self.paused = False  # the transport's buffer is full
        self.closing = False  # close once the current answer is written
        self._discard = False  # read nothing more (a refusal, an upgrade, a parse error)
        self._trim = False
        self.head_sent = False  # the answer to the request being served has started

    # ----------------------------------------------------------------------------------- transport events

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if peer else None
        self._await_headers()

    def connection_lost(self, exc) -> None:
        server = self.server
        for timer in (self.specops_deadline, self._send_deadline, self._linger):
            if timer is not None:
                timer.cancel()
        self.specops_deadline = self._send_deadline = self._linger = None
        if self._header_bytes:
            server.budget.release_headers(self._header_bytes)
            self._trim |= self._header_bytes >= MAX_FIELD_SIZE
            self._header_bytes = 0
        if self._trim:
            server.heap.trim_soon()
        gone = ConnectionResetError("the client closed the connection")
        if self._parsing is not None and not self._parsing.content.is_eof():
            self._parsing.content.set_exception(gone)
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_exception(gone)
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # as aiohttp's handler_cancellation: the engine request is cancelled with it
        self.transport = None
        server.connections.discard(self)
        server.open_connections -= 1

    def pause_writing(self) -> None:
        """The client reads nothing now: start the send deadline (:mod:`specops.proxy.limits`)."""
        self.paused = True
        timeout = self.server.send_timeout
        if timeout and self._send_deadline is None:
            self._send_deadline = self.loop.call_later(timeout, self._send_stalled)

    def resume_writing(self) -> None:
        self.paused = False
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _send_stalled(self) -> None:
        self._send_deadline = None
        if self.transport is None:
            return
        server = self.server
        server.counters["cut_slow_clients"] += 1
        server.reject_log(
            "proxy: cut a client that read nothing of its answer for %gs (proxy.send_timeout): %s",
            server.send_timeout,
            self.remote or "-",
        )
        self.transport.abort()

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if not self.paused:
            return
        self._drain_waiter = self.loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def send(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        t.write(data)

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self._queue:
            self._reading_paused = False
            self.transport.resume_reading()

    # ------------------------------------------------------------------------------------------ parsing

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        # as aiohttp's Connection: a read that ends a body, or the headers of a request, is not counted (its
        # part of the next request's headers, at most one read, neither); the reads after it are
        req = self._parsing
        counted = self._heads_done if req is None or req.content.is_eof() else -1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._discard = True  # CONNECT / Upgrade: its request is answered, then the connection closes
            self.closing = True
            return
        except httptools.HttpParserError as exc:
            self._malformed(exc)
            return
        if not self._in_head or self._discard:
            return
        # headers still arriving: their bytes are held in the budget until they are complete
        server, budget = self.server, self.server.budget
        n = len(data)
        nl = data.rfind(b"\n")
        self._line = self._line + n if nl < 0 else n - nl - 1
        if counted == self._heads_done:
            self._header_bytes += n
            budget.hold_headers(n)
        if self._header_bytes > server.max_header_bytes:
            server.counters["rejected_header_size"] += 1
            self._refuse_head(
                431,
                "Request Header Fields Too Large",
                "request_header_fields_too_large",
                f"specops: the request headers are over the proxy's {server.max_header_bytes}-byte limit",
            )
        elif budget.held > budget.limit:
            server.counters["rejected_buffer_full"] += 1
            self._refuse_head(
                503,
                "Service Unavailable",
                "specops_buffer_full",
                f"specops: the proxy holds too many request headers and bodies now "
                f"(proxy.max_buffered_bytes {budget.limit}); retry later",
            )
        elif self._line > MAX_FIELD_SIZE:
            self._malformed(BadHttpMessage(f"a header line over {MAX_FIELD_SIZE} bytes"))

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url = []
        self._fields = []

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads_done += 1
        self._line = 0
        if self.specops_deadline is not None:
            self.specops_deadline.cancel()
            self.specops_deadline = None
        if self._header_bytes:
            self.server.budget.release_headers(self._header_bytes)
            self._header_bytes = 0
        parser = self.parser
        req = LeanRequest()
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        fields = self._fields
        req.too_long = len(url) > MAX_FIELD_SIZE or any(
            len(n) > MAX_FIELD_SIZE or len(v) > MAX_FIELD_SIZE for n, v in fields
        )
        req.method = parser.get_method().decode("ascii", "replace")
        req.raw_path = url.decode("utf-8", "surrogateescape")
        req._path = None
        req.version = parser.get_http_version()
        req.keep_alive = parser.should_keep_alive()
        req.headers = headers = CIMultiDict(
            [(n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for n, v in fields]
        )
        req.remote = self.remote
        req.transport = self.transport
        req.protocol = self
        clen = headers.get("Content-Length")
        req.content_length = int(clen) if clen is not None and clen.isdigit() else None
        req.body_exists = bool(req.content_length) or "Transfer-Encoding" in headers
        req.content = LeanBody(self)
        if not req.body_exists:
            req.content.feed_eof()
        self._parsing = req
        if self._task is None:
            self._task = self.loop.create_task(self._serve(req))
        else:  # pipelined behind the request being answered
            self._queue.append(req)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        self._parsing.content.feed(body)

    def on_message_complete(self) -> None:
        req = self._parsing
        if req is not None and not req.content.is_eof():
            req.content.feed_eof()

    def _malformed(self, exc: BaseException) -> None:
        """A request that cannot be parsed: 400, then the connection closes (what follows is not read)."""
        self._discard = True
        req = self._parsing
        if req is not None and not req.content.is_eof():  # its body: the handler answers 400 (read_body)
            req.content.set_exception(BadHttpMessage(brief(exc)))
            return
        server = self.server
        server.counters["rejected_malformed"] += 1
        server.reject_log(
            "proxy: %d %s from %s: %s", 400, "malformed request", self.remote or "-", shown(brief(exc), 160)
        )
        self._trim = True
        resp = web.Response(
            status=400,
            body=error_body(400, "invalid_request_error", f"malformed HTTP request ({type(exc).__name__})"),
            content_type="application/json",
        )
        resp.force_close()
        if self._task is None:
            self._write_whole(None, resp)
            self._close_soon()
        else:
            self._queue.append(resp)

    def _refuse_head(self, status: int, reason: str, kind: str, message: str) -> None:
        """Refuse headers while they arrive (too large, no room): answer if nothing else is, then close."""
        self.server.reject_log("proxy: %d %s from %s", status, kind, self.remote or "-")
        self._discard = True
        self._trim = True
        if self._task is None and self.transport is not None:
            body = error_body(status, kind, message)
            extra = "Retry-After: 1\r\n" if status == 503 else ""
            self.send(
                _head(status, reason, {"Content-Type": "application/json"}, f"{extra}Connection: close\r\n")
                + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.closing = True
        if self._task is None:
            self._close_soon()

    # ------------------------------------------------------------------------------------------ answers

    def keep(self, req: LeanRequest) -> bool:
        """Whether the connection may serve another request after ``req``."""
        return req.keep_alive and req.version == "1.1" and not self.closing and not self._discard

    async def _serve(self, req: LeanRequest) -> None:
        server = self.server
        while True:
            self.head_sent = False
            try:
                if req.too_long:
                    self._parsing_error_for(req)
                    resp = self._too_long()
                else:
                    resp = await server.handler(req)
            except asyncio.CancelledError:
                return  # the client went away
            except Exception as exc:
                server.counters["internal_errors"] += 1
                server.reject_log(
                    "proxy: %d %s from %s: %s", 500, "internal error", self.remote or "-", shown(brief(exc), 160)
                )
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("proxy: traceback of the internal error", exc_info=exc)
                resp = web.Response(
                    status=500,
                    body=error_body(500, "specops_internal_error", "specops: internal error"),
                    content_type="application/json",
                )
                resp.force_close()
                if self.head_sent and self.transport is not None:
                    self.transport.abort()  # the answer had started: no error answer can follow
                    return
            if self.transport is None:
                return
            try:
                if isinstance(resp, LeanStream):
                    if not resp.complete:
                        self.closing = True
                else:
                    self._write_whole(req, resp)
                    if self.paused:
                        await self.drain()
            except (ConnectionError, asyncio.CancelledError):
                return
            if not req.content.is_eof():  # the body was not read (a refusal): the connection cannot go on
                self.closing = True
            if self.closing or not self.keep(req):
                self._close_soon()
                return
            if not self._queue:
                self._task = None
                self._await_headers()
                self.resume_reading()
                return
            nxt = self._queue.popleft()
            self.resume_reading()
            if isinstance(nxt, web.Response):  # a parse error after the pipelined requests
                self._write_whole(None, nxt)
                self._close_soon()
                return
            req = nxt

    def _parsing_error_for(self, req: LeanRequest) -> None:
        server = self.server
        server.counters["rejected_malformed"] += 1
        server.reject_log(
            "proxy: %d %s from %s: %s",
            400,
            "malformed request",
            self.remote or "-",
            f"a request line or header field over {MAX_FIELD_SIZE} bytes",
        )
        self._trim = True

    @staticmethod
    def _too_long() -> web.Response:
        resp = web.Response(
            status=400,
            body=error_body(400, "invalid_request_error", "malformed HTTP request (LineTooLong)"),
            content_type="application/json",
        )
        resp.force_close()
        return resp

    def _write_whole(self, req: LeanRequest | None, resp: web.StreamResponse) -> None:
        """An answer made whole (aiohttp's ``web.Response``): the proxy's own, or a small engine answer."""
        body = resp.body if isinstance(resp, web.Response) else None
        if body is None:
            body = b""
        elif not isinstance(body, (bytes, bytearray)):
            raise TypeError(f"cannot write a {type(body).__name__} body")
        if resp.keep_alive is False or req is None or not self.keep(req):
            self.closing = True
        headers = resp.headers
        extra = f"Content-Length: {len(body)}\r\n"
        if self.closing:
            extra += "Connection: close\r\n"
        head = _head(resp.status, resp.reason, headers, extra + "\r\n")
        if req is not None and (req.method == "HEAD" or resp.status in _NO_BODY_STATUS):
            self.send(head)
        else:
            self.send(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                self.send(body)

    # ----------------------------------------------------------------------------------- connection ends

    def _await_headers(self) -> None:
        """The next request's headers are due within ``header_timeout`` (also the idle keep-alive timeout)."""
        timeout = self.server.header_timeout
        if timeout and self.transport is not None:
            if self.specops_deadline is not None:
                self.specops_deadline.cancel()
            self.specops_deadline = self.loop.call_later(timeout, self._no_request)

    def _no_request(self) -> None:
        self.specops_deadline = None
        if self._task is None and self.transport is not None:
            self.transport.close()

    def _close_soon(self) -> None:
        """Close after the answer: at once when the request was read whole, else after reading and dropping
        what the client still sends for ``LINGER`` seconds (so it reads the answer rather than a reset)."""
        self._discard = True
        self._task = None
        t = self.transport
        if t is None:
            return
        req = self._parsing
        if req is not None and req.content.is_eof() and not self._in_head_with_bytes():
            t.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        try:
            t.write_eof()
        except (NotImplementedError, OSError, RuntimeError):  # pragma: no cover - TCP transports have it
            pass
        if self._linger is None:
            self._linger = self.loop.call_later(LINGER, t.close)

    def _in_head_with_bytes(self) -> bool:
        return self._header_bytes > 0 or self._line > 0


class LeanServer:
    """The protocol factory of the lean public listener: a cap on open connections (past it, a 503 and
    closed, as :class:`~specops.proxy.limits.Server`), and what every connection shares."""

    def __init__(
        self,
        handler,
        *,
        counters: dict,
        reject_log: RejectLog,
        max_connections: int | None,
        header_timeout: float | None,
        budget: BufferBudget,
        max_header_bytes: int,
        send_timeout: float | None,
    ):
        self.handler = handler
        self.counters = counters
        self.reject_log = reject_log
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.budget = budget
        self.max_header_bytes = max_header_bytes
        self.send_timeout = send_timeout
        self.heap = HeapTrim()
        self.open_connections = 0
        self.connections: set[LeanConnection] = set()
        self.loop = asyncio.get_running_loop()
        self.listener: asyncio.AbstractServer | None = None
        self._refusal = error_body(
            503, "specops_too_many_connections", f"specops: too many open connections ({max_connections}); retry later"
        )

    def __call__(self) -> asyncio.Protocol:
        if self.max_connections is not None and self.open_connections >= self.max_connections:
            self.counters["rejected_connections"] += 1
            self.reject_log(
                "proxy: refused a connection: %d connections are open (max_connections)", self.open_connections
            )
            return Refuse(self._refusal)
        self.open_connections += 1
        conn = LeanConnection(self)
        self.connections.add(conn)
        return conn

    async def listen(self, host: str, port: int) -> int:
        """Bind and serve; returns the port (``port`` 0: a free one)."""
        self.listener = await self.loop.create_server(self, host, port, reuse_address=True)
        return self.listener.sockets[0].getsockname()[1]

    async def close(self, grace: float = 1.0) -> None:
        """Stop listening; answers in progress get ``grace`` seconds, then their connections are cut."""
        if self.listener is not None:
            self.listener.close()
        tasks = [c._task for c in self.connections if c._task is not None and not c._task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for conn in list(self.connections):
            if conn._task is not None and not conn._task.done():
                conn._task.cancel()
            if conn.transport is not None:
                conn.transport.abort()
        self.heap.cancel()
