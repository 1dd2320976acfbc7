"""The lean HTTP layer's engine client (``proxy.http: lean``): pooled keep-alive connections to the engine,
read with httptools' response parser, in place of aiohttp's client session for the pass-through path.

It offers what :class:`~specops.proxy.forward.Forwarder` uses of aiohttp's client (``request()`` and, on its
answer, ``status``, ``reason``, ``headers``, ``content_length``, ``read()``, ``content.readany()``,
``release()``, ``close()``), and fails the same way: it raises aiohttp's exception classes, so what counts as
a stale pooled connection (reconnect at once) or a refused one (retry on the next engine) is decided by the
same code (:mod:`specops.proxy.dispatch`). The engine's header lines are held to the same 8190 bytes.

Idle connections are dropped after ``keepalive`` seconds, before the engines drop them (see
:data:`specops.proxy.forward.ENGINE_KEEPALIVE`); an answer that is not read to its end closes its
connection (vLLM and llama-server cancel the request on close); an answer to HEAD, or one that says
``Connection: close``, is never pooled.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import httptools
from multidict import CIMultiDict

from .limits import MAX_FIELD_SIZE

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout on 3.10
    from async_timeout import timeout as _timeout

__all__ = ["EngineClient", "EngineUnreachable"]

#: an answer's body buffered past this while nobody reads it pauses reading from the engine
_BODY_HIGH_WATER = 1 << 16
#: the longest header section taken from an engine
_MAX_HEAD = 1 << 20
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class EngineUnreachable(aiohttp.ClientConnectionError):
    """The engine did not accept a connection (refused, or not within the connect timeout): not stale."""


class _Body:
    """An answer's body as it arrives (``readany`` as aiohttp's ``StreamReader``)."""

    __slots__ = ("_chunks", "_conn", "_eof", "_exc", "_size", "_waiter", "_whole")

    def __init__(self, conn: EngineConnection):
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._whole = False  # read whole (read()): never paused, the caller reserved its size
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _BODY_HIGH_WATER and not self._whole:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        if not self._eof:
            self._exc = exc
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        self._conn.resume()
        return data

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            timeout = self._conn.read_timeout
            if timeout is None:
                await self._waiter
            else:
                try:
                    async with _timeout(timeout):
                        await self._waiter
                except asyncio.TimeoutError:
                    raise aiohttp.ServerTimeoutError("Timeout on reading data from the engine") from None
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            await self._wait()
        return self._take()

    async def read(self) -> bytes:
        self._whole = True
        self._conn.resume()
        while not self._eof:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        return self._take() if self._chunks else b""


class EngineResponse:
    """One answer from the engine: the attributes of aiohttp's ``ClientResponse`` the forwarder reads."""

    __slots__ = ("_conn", "content", "content_length", "headers", "reason", "status")

    def __init__(self, conn: EngineConnection, status: int, reason: str, headers: CIMultiDict):
        self._conn = conn
        self.status = status
        self.reason = reason
        self.headers = headers
        clen = headers.get("Content-Length")
        self.content_length = int(clen) if clen is not None and clen.isdigit() else None
        self.content = conn.body

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """The answer was read to its end: the connection goes back to the pool (when it may)."""
        self._conn.done()

    def close(self) -> None:
        """Stop reading: the connection is closed (the engine cancels the request)."""
        self._conn.abort()


class EngineConnection(asyncio.Protocol):
    """One keep-alive connection to the engine, one request at a time."""

    def __init__(self, client: EngineClient, key: tuple[str, int]):
        self.client = client
        self.key = key
        self.loop = client.loop
        self.read_timeout = client.read_timeout
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future | None = None
        self.body = _Body(self)
        self.reusable = False
        self.closed = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self._reason = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._paused = False
        self._head_only = False

    # ---------------------------------------------------------------------------------------- exchange

    def begin(self, request: bytes, head_only: bool, keep: bool) -> asyncio.Future:
        """Send one request; the returned future gets the :class:`EngineResponse` when its headers arrive."""
        self.head = self.loop.create_future()
        self.body = _Body(self)
        self._reason = b""
        self._fields = []
        self._head_bytes = 0
        self._head_only = head_only
        self.reusable = keep
        self.transport.write(request)
        return self.head

    def done(self) -> None:
        if self.reusable and not self.closed and self.body._eof:
            self.client.put_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # ------------------------------------------------------------------------------------ transport events

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.reusable = False
        self.client.forget(self)
        head = self.head
        if head is not None and not head.done():
            # closed before any byte of an answer: a pooled connection the engine had just closed (stale)
            head.set_exception(aiohttp.ServerDisconnectedError("the engine closed the connection"))
        elif not self.body._eof:
            self.body.set_exception(aiohttp.ClientPayloadError("the engine's answer is not complete"))

    def data_received(self, data: bytes) -> None:
        head = self.head
        if head is None:  # nothing asked: an idle connection the engine writes to cannot be reused
            self.abort()
            return
        if not head.done():
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.abort()
        except httptools.HttpParserError as exc:
            self._fail(f"a malformed answer from the engine ({exc})")
            return
        if not head.done() and self._head_bytes > _MAX_HEAD:
            self._fail(f"the engine's header section is over {_MAX_HEAD} bytes")

    def _fail(self, why: str) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(aiohttp.ClientPayloadError(why))
        else:
            self.body.set_exception(aiohttp.ClientPayloadError(why))
        self.abort()

    def eof_received(self) -> bool:
        return False

    # ----------------------------------------------------------------------------------- parser callbacks

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        head = self.head
        if head is None or head.done():
            return
        fields = self._fields
        if any(len(n) > MAX_FIELD_SIZE or len(v) > MAX_FIELD_SIZE for n, v in fields):
            self._fail(f"the engine sent a header line over {MAX_FIELD_SIZE} bytes")
            return
        headers = CIMultiDict(
            [(n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for n, v in fields]
        )
        status = self.parser.get_status_code()
        if not self.parser.should_keep_alive():
            self.reusable = False
        head.set_result(EngineResponse(self, status, self._reason.decode("latin-1"), headers))
        if self._head_only:  # HEAD: no body follows, and llhttp cannot be told so: never reuse the connection
            self.reusable = False
            self.body.feed_eof()

    def on_body(self, body: bytes) -> None:
        self.body.feed(body)

    def on_message_complete(self) -> None:
        self.body.feed_eof()


class EngineClient:
    """Pooled keep-alive connections to the engines, one request per connection at a time."""

    def __init__(self, connect_timeout: float, read_timeout: float | None, keepalive: float):
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive = keepalive
        self.idle: dict[tuple[str, int], list[EngineConnection]] = {}
        self.busy: set[EngineConnection] = set()

    async def request(self, method: str, url, headers: CIMultiDict, data: bytes | None = None, **_) -> EngineResponse:
        """Send ``method url`` with ``headers`` (Host and Content-Length are added) and ``data``; returns the
        answer once its headers have arrived. Raises aiohttp's client errors."""
        host, port = url.host, url.port
        key = (host, port)
        body = data or b""
        parts = [f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_authority}\r\n"]
        for k, v in headers.items():
            parts.append(f"{k}: {v}\r\n")
        if body or method in _BODY_METHODS:
            parts.append(f"Content-Length: {len(body)}\r\n")
        parts.append("\r\n")
        request = "".join(parts).encode("utf-8", "surrogateescape")
        if body:
            request += body
        keep = headers.get("Connection", "").lower() != "close"
        conn = await self._connection(key)
        self.busy.add(conn)
        try:
            fut = conn.begin(request, method == "HEAD", keep)
            if self.read_timeout is None:
                return await fut
            try:
                async with _timeout(self.read_timeout):
                    return await fut
            except asyncio.TimeoutError:
                raise aiohttp.ServerTimeoutError("Timeout on reading data from the engine") from None
        except BaseException:
            conn.abort()
            raise

    async def _connection(self, key: tuple[str, int]) -> EngineConnection:
        pool = self.idle.get(key)
        while pool:
            conn = pool.pop()
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        try:
            async with _timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(lambda: EngineConnection(self, key), key[0], key[1])
        except asyncio.TimeoutError:
            raise EngineUnreachable(
                f"Cannot connect to the engine at {key[0]}:{key[1]}: no answer within {self.connect_timeout:g}s"
            ) from None
        except OSError as exc:
            raise EngineUnreachable(
                f"Cannot connect to the engine at {key[0]}:{key[1]}: {exc.strerror or exc}"
            ) from None
        return conn

    def put_back(self, conn: EngineConnection) -> None:
        self.busy.discard(conn)
        conn.head = None
        conn.idle_timer = self.loop.call_later(self.keepalive, conn.abort)
        self.idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: EngineConnection) -> None:
        self.busy.discard(conn)
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        pool = self.idle.get(conn.key)
        if pool and conn in pool:
            pool.remove(conn)

    async def close(self) -> None:
        for pool in list(self.idle.values()):
            for conn in list(pool):
                conn.abort()
        for conn in list(self.busy):
            conn.abort()
        self.idle.clear()
