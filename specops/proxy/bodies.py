"""Request bodies on the public port: read within ``body_timeout`` and ``max_body_size``, held against the
proxy's :class:`BufferBudget` (``max_buffered_bytes``) until the engine's answer has started, so a retry can
resend them and a client that stops reading its answer holds none of them (see :mod:`specops.proxy.limits`
for every limit the port applies)."""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .errors import ClientError

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout on 3.10
    from async_timeout import timeout as _timeout


class BufferBudget:
    """The bytes of request bodies, buffered engine answers and unfinished request headers the proxy holds
    now, against ``max_buffered_bytes``."""

    __slots__ = ("headers", "held", "limit")

    def __init__(self, limit: int):
        self.held = 0  # bodies, buffered answers and unfinished headers
        self.headers = 0  # of which: the headers of requests still arriving
        self.limit = limit

    def hold_headers(self, n: int) -> None:
        """Count ``n`` more header bytes, whether or not they fit (the caller refuses past the limit)."""
        self.held += n
        self.headers += n

    def release_headers(self, n: int) -> None:
        self.held -= n
        self.headers -= n

    def reserve(self, n: int) -> None:
        """Hold ``n`` more bytes, or refuse the request (503, retry later) when they do not fit."""
        if n and self.held + n > self.limit:
            raise ClientError(
                503,
                "specops_buffer_full",
                f"specops: the proxy holds too many request bodies "
                f"now ({self.held} bytes; proxy.max_buffered_bytes {self.limit}); retry later",
                close=True,
                counter="buffer_full",
            )
        self.held += n

    def fits(self, n: int) -> bool:
        return self.held + n <= self.limit


def _too_large(limit: int, size: int | None = None) -> ClientError:
    what = f"the request body ({size} bytes) is over the" if size is not None else "the request body is over the"
    return ClientError(
        413,
        "request_too_large",
        f"specops: {what} {limit}-byte limit (proxy.max_body_size)",
        close=True,
        counter="too_large",
    )


def _malformed(exc: Exception) -> ClientError:
    return ClientError(
        400,
        "invalid_request_error",
        f"specops: malformed request body ({type(exc).__name__})",
        close=True,
        counter="malformed",
    )


async def read_body(
    request: web.BaseRequest, budget: BufferBudget, limit: int, body_timeout: float
) -> tuple[bytes, int]:
    """The whole request body and the bytes it reserved of ``budget`` (give them back).

    Refused without reading when the Content-Length is over ``limit`` (``max_body_size``) or the
    reservation does not fit; a body that does not arrive within ``body_timeout`` is a 408.
    """
    if not request.body_exists:
        return b"", 0
    clen = request.content_length
    if clen is not None and clen > limit:
        raise _too_large(limit, clen)
    content = request.content
    if content.is_eof():  # the usual case: the body came with the headers
        try:
            body = content.read_nowait()
        except HttpProcessingError as exc:
            raise _malformed(exc) from None
        if len(body) > limit:
            raise _too_large(limit)
        budget.reserve(len(body))
        return body, len(body)
    incoming = _Incoming(clen or 0)
    budget.reserve(incoming.reserved)
    try:
        try:
            async with _timeout(body_timeout):
                await incoming.read(content, budget, limit)
        except asyncio.TimeoutError:
            raise ClientError(
                408,
                "request_timeout",
                f"specops: the request body did not arrive within {body_timeout:g}s (proxy.body_timeout)",
                close=True,
                counter="body_timeout",
            ) from None
        except HttpProcessingError as exc:
            raise _malformed(exc) from None
    except BaseException:
        budget.held -= incoming.reserved
        raise
    chunks = incoming.chunks
    return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), incoming.reserved


class HeldBody:
    """A request body read whole, and the bytes of the budget it holds.

    The body is kept while a retry may still send it again; :meth:`release` gives its bytes back to the
    budget and drops it once the engine's answer has started (no retry can follow), so a client that then
    reads its answer slowly, or not at all, holds no budget.
    """

    __slots__ = ("budget", "data", "reserved")

    def __init__(self, data: bytes, reserved: int, budget: BufferBudget):
        self.data = data
        self.reserved = reserved
        self.budget = budget

    def release(self) -> None:
        if self.reserved:
            self.budget.held -= self.reserved
            self.reserved = 0
        self.data = b""


class _Incoming:
    """A body that did not come with the headers, read as it arrives."""

    __slots__ = ("chunks", "reserved")

    def __init__(self, reserved: int):
        self.chunks: list[bytes] = []
        self.reserved = reserved  # of the budget: the Content-Length, or what came (chunked)

    async def read(self, content, budget: BufferBudget, limit: int) -> None:
        size = 0
        while True:
            chunk = await content.readany()
            if not chunk:
                return
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if size > self.reserved:  # no Content-Length (chunked): reserve as it comes
                budget.reserve(size - self.reserved)
                self.reserved = size
            self.chunks.append(chunk)
