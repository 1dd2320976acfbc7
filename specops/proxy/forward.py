"""One exchange with the engine: a client request sent on, its answer passed back.

Paths, methods, query strings, bodies, status codes and headers pass through unchanged (minus hop-by-hop
headers; with ``on_timings`` set, a streamed request also asks llama-server for per-token timings:
:func:`ask_timings_per_token`); SSE streams are forwarded chunk by chunk as they arrive; a client that
disconnects cancels its request on the engine (the upstream connection is closed, which vLLM and
llama-server treat as an abort).

- The engine URL is built from its parts (:func:`upstream_url`): the engine's scheme and host:port, then
  the client's path and query, never the client's target pasted after the engine's address.
- ``X-Forwarded-For`` gets the peer's address appended (what came before is the client's claim, the last
  entry is the proxy's); ``X-Forwarded-Host`` and ``X-Forwarded-Proto`` are replaced by what the proxy
  saw (the ``Host`` header, ``http``); the client's ``Forwarded``, ``X-Forwarded-Port`` and ``X-Real-IP``
  are dropped, so none of them can be spoofed past the proxy (:func:`request_headers`).
- A failure before the client received a byte raises :class:`~specops.proxy.errors.Unstarted`: the caller
  may retry (:mod:`specops.proxy.dispatch`). A completions or chat stream that breaks after it started (the
  connection breaks, or ends before ``[DONE]``, or is cut) raises :class:`~specops.proxy.errors.Broken`: the
  caller continues it on a live engine (:mod:`specops.proxy.resume`), whose answer is written on into the same
  client response. Any other stream that breaks ends with an explicit SSE error event
  (``data: {"error": {...}}``) and no ``[DONE]``; a non-SSE body that breaks is cut at the transport so the client
  sees an incomplete body, never a silently short one (:meth:`Forwarder.end_broken`).

The hot path is lean: no JSON parsing unless ``on_timings`` is set (llama.cpp live acceptance), and then
only bodies/lines that contain ``"timings"`` (:class:`Timings`). Small non-streamed bodies
(≤ ``buffer_limit``, with a Content-Length and not SSE) are read whole before they are answered, which
costs nothing (the engine sends them at once) and lets a failure while reading them be retried too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from .bodies import BufferBudget, HeldBody
from .errors import Broken, Unstarted, describe, error_body
from .limits import MAX_FIELD_SIZE
from .resume import CONTINUABLE_PATHS, Resumable

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout on 3.10
    from async_timeout import timeout as _timeout

log = logging.getLogger("specops.proxy")

#: Hop-by-hop headers (RFC 9110 §7.6.1) plus the non-standard ones proxies commonly strip.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# forwarding headers a client could spoof: the proxy writes its own (see the module docstring)
_FORWARDING = frozenset(
    {"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-forwarded-port", "x-real-ip"}
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect"} | _FORWARDING
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}
_RESPONSE_DROP_NAMES = tuple(sorted(_RESPONSE_DROP))

UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, asyncio.TimeoutError)
_CLIENT_GONE = (ConnectionError, RuntimeError)

# Idle engine connections are dropped before the engines drop them (uvicorn in vLLM and llama-server both
# close idle keep-alive connections after 5 s): a connection the engine is closing just as it is reused
# fails the request before any byte, which would cost its retry.
ENGINE_KEEPALIVE = 4.0

# llama-server closes the connection after a streamed (chunked) response without saying so, and aiohttp
# has pooled it by then: the next request on it fails before any byte. Streamed requests therefore ask
# the engine for `Connection: close` (a new connection per stream costs ~0.1 ms; a stream lasts seconds).
_STREAM_KEY = b'"stream"'
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')

_TIMINGS = b'"timings"'
_TIMINGS_PER_TOKEN = b'"timings_per_token"'
_SSE_TAIL_LIMIT = 1 << 20
#: A remote twin's answers that mean it could not serve the request (its queue, its engine, a gateway before it)
_REMOTE_UNAVAILABLE = frozenset({502, 503, 504})
#: How much of a stream's end a flight keeps when asked (``Flight.tail``): vLLM's final usage chunk, with its
#: per-request speculative decoding metrics, is well under 2 KiB.
STREAM_TAIL = 8192


def engine_session(connect_timeout: float, read_timeout: float | None) -> aiohttp.ClientSession:
    """The client session every engine request goes through (made inside the running loop)."""
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, keepalive_timeout=ENGINE_KEEPALIVE, ttl_dns_cache=None, use_dns_cache=True
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout, sock_read=read_timeout),
        trust_env=False,
        raise_for_status=False,
        max_line_size=MAX_FIELD_SIZE,
        max_field_size=MAX_FIELD_SIZE,
    )


class Generation:
    """One upstream engine as seen by the proxy; a new one on every release/set_upstream."""

    __slots__ = ("authority", "authorization", "finished", "id", "idle", "inflight", "path", "remote", "scheme", "url")

    def __init__(self, gid: int, url: str, *, remote: bool = False, authorization: str = ""):
        self.id = gid
        self.url = url.rstrip("/")
        # another deployment (a remote twin, specops.serve.remote): it gets ``authorization`` (its own key, "" for
        # none) in place of the client's, and its 502/503/504 before any byte is a failure to retry elsewhere
        self.remote = remote
        self.authorization = authorization
        base = URL(self.url)
        # the parts every upstream URL is built from (never the client's target pasted after a string)
        self.scheme = base.scheme
        self.authority = base.raw_authority
        self.path = base.raw_path.rstrip("/")
        self.inflight: set[Flight] = set()
        self.finished = 0
        self.idle: asyncio.Event | None = None  # made by drain(); set when inflight empties


class Flight:
    """One request on one generation, so drain/upstream_failed can cut it."""

    __slots__ = ("cm", "cut_reason", "gen", "predicted", "resume", "started", "tail", "tap", "totals", "window")

    def __init__(self, gen: Generation):
        self.gen = gen
        self.cm = None
        self.cut_reason: str | None = None
        self.started = False
        self.totals: dict | None = None  # timings running totals per choice index
        self.predicted: dict | None = None  # timings predicted_n (tokens generated) per choice index
        self.tap = None  # a specops.proxy.capture.Tap: the streamed answer is copied into it (capture: on)
        self.tail: bytes | None = None  # b"" asks for a stream's last STREAM_TAIL bytes (its usage chunk)
        self.resume: Resumable | None = None  # a continuation: the client's stream its answer goes on in
        # whether its timings feed the fallback window (on_timings): only answers of the engine of the step in
        # effect do; a twin's or a canary's measure another draft
        self.window = True

    def cut(self, reason: str) -> None:
        if self.cut_reason is None:
            self.cut_reason = reason
        cm = self.cm
        if cm is not None:
            move = getattr(cm, "reschedule", None) or cm.update  # asyncio.timeout / async_timeout (3.10)
            try:
                move(asyncio.get_running_loop().time())
            except RuntimeError:  # the block is already exiting
                pass


def upstream_url(gen: Generation, target: str) -> URL:
    """The engine URL for an origin-form target (checked to start with '/'): built from its parts."""
    if target[:1] != "/":  # check_target refused it already; never build from anything else
        raise ValueError("not an origin-form request target")
    path, _, query = target.partition("?")
    return URL.build(scheme=gen.scheme, authority=gen.authority, path=gen.path + path, query_string=query, encoded=True)


def request_headers(request: web.BaseRequest, body: bytes) -> CIMultiDict:
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


def ask_timings_per_token(body: bytes) -> bytes:
    """A streamed request (a JSON object with ``"stream": true``) that does not name ``timings_per_token``
    gets ``"timings_per_token": true`` (a llama-server request field), so every chunk carries ``timings`` and
    a collapse of draft acceptance is seen while the request runs, not one request late when it ends. The
    chunks then hold a ``timings`` object, as llama-server's last chunk always does. Any other body is sent
    as it came."""
    if _TIMINGS_PER_TOKEN in body or _STREAM_KEY not in body or not _STREAM_TRUE.search(body):
        return body
    start = len(body) - len(body.lstrip())
    if body[start : start + 1] != b"{":
        return body
    return body[: start + 1] + _TIMINGS_PER_TOKEN + b":true," + body[start + 1 :]


def stream_response(
    request: web.BaseRequest, status: int, reason: str | None, headers: CIMultiDict, content_length: int | None
) -> web.StreamResponse:
    """The response a streamed answer is written into."""
    resp = web.StreamResponse(status=status, reason=reason, headers=headers)
    if content_length is not None:
        resp.content_length = content_length
    return resp


def _response_headers(up: aiohttp.ClientResponse) -> CIMultiDict:
    out = CIMultiDict(up.headers)  # one C-level copy, then drop the few hop-by-hop ones
    conn = out.get("Connection")
    if conn:
        for name in conn.split(","):
            out.popall(name.strip(), None)
    for name in _RESPONSE_DROP_NAMES:
        if name in out:
            del out[name]
    return out


class Forwarder:
    """Sends one request to one engine and passes the answer back (:meth:`exchange`).

    ``counters`` is the proxy's counter dict (``client_disconnects``, ``broken_streams``, ``cut_streams``,
    ``uncontinued_*`` and the timings totals are counted here); ``budget`` also holds the small answers read
    whole, and the bodies continuable streams keep.
    """

    def __init__(
        self, counters: dict, budget: BufferBudget, buffer_limit: int, on_timings: Callable[[int, int], Any] | None
    ):
        self.session: aiohttp.ClientSession | None = None  # set by Proxy.start()
        self.counters = counters
        self.budget = budget
        self.buffer_limit = buffer_limit
        self.timings = Timings(counters, on_timings)

    async def exchange(
        self, request: web.BaseRequest, body: HeldBody, headers: CIMultiDict, flight: Flight, data: bytes | None = None
    ) -> web.StreamResponse:
        """One attempt against one engine. Raises :class:`Unstarted` when nothing reached the client, and
        :class:`Broken` when a continuable stream broke after it started.

        ``data``: what to send instead of ``body`` (a continuation of ``flight.resume``). ``body`` is released
        (its budget given back, the bytes dropped) once the answer to the client has started, unless the
        stream keeps it to be continued (:mod:`specops.proxy.resume`)."""
        if flight.cut_reason is not None:
            raise Unstarted(flight.cut_reason)
        ex = _Exchange(request, flight, body)
        try:
            async with _timeout(None) as cm:
                flight.cm = cm
                ex.up = await self._send(request, body.data if data is None else data, headers, flight)
                answer = await self._answer(ex)
                if answer is not None:
                    return answer
        except asyncio.TimeoutError:
            if flight.cut_reason is None:
                raise
            if not flight.started:
                raise Unstarted(flight.cut_reason) from None
            ex.broken, ex.cause = "specops: " + flight.cut_reason, "drain"
        except asyncio.CancelledError:
            self.counters["client_disconnects"] += 1
            raise
        finally:
            flight.cm = None
            if ex.up is not None:
                if ex.complete:
                    ex.up.release()
                else:
                    ex.up.close()  # abort the engine request (vLLM/llama-server cancel on close)
        return await self._finish(ex)

    async def _send(
        self, request: web.BaseRequest, body: bytes, headers: CIMultiDict, flight: Flight
    ) -> aiohttp.ClientResponse:
        gen = flight.gen
        if gen.remote:  # never the client's key to another deployment: its own, or none
            headers = headers.copy()
            headers.popall("Authorization", None)
            if gen.authorization:
                headers["Authorization"] = gen.authorization
        try:
            return await self.session.request(
                request.method,
                upstream_url(gen, request.raw_path),
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except UPSTREAM_ERRORS as exc:
            stale = isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and not isinstance(
                exc, aiohttp.ClientConnectorError
            )
            raise Unstarted(describe(exc), stale) from None

    async def _answer(self, ex: _Exchange) -> web.StreamResponse | None:
        """Pass the engine's answer on: whole when it is small, else streamed. Returns the response when
        the exchange is over; None when the stream ended (or broke) and :meth:`_finish` ends it."""
        up, request = ex.up, ex.request
        if up.status in _REMOTE_UNAVAILABLE and ex.flight.gen.remote:  # it could not serve it: the local engine will
            raise Unstarted(f"the remote twin answered {up.status} {up.reason or ''}".rstrip())
        ex.sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
        if ex.flight.resume is not None:
            return await self._answer_continuation(ex)
        clen = up.content_length
        out_headers = _response_headers(up)
        if (
            not ex.sse
            and clen is not None
            and clen <= self.buffer_limit
            and request.method != "HEAD"
            and self.budget.fits(clen)
        ):
            return await self._answer_whole(ex, clen, out_headers)
        ex.resp = resp = stream_response(request, up.status, up.reason, out_headers, clen)
        try:
            await resp.prepare(request)
        except _CLIENT_GONE:
            self.counters["client_disconnects"] += 1
            return resp  # closing the engine response (finally) cancels its request
        ex.flight.started = True
        continuable = ex.sse and up.status == 200 and request.method == "POST" and request.path in CONTINUABLE_PATHS
        if continuable and self.budget.held <= self.budget.limit // 2:  # else new requests come first
            ex.resume = Resumable(request.path, ex.body, resp)  # kept: a continuation resends it (resume.py)
        else:
            ex.unkept = continuable
            ex.body.release()  # no retry from here on: the client's body is not needed any more
        return await self._stream(ex)

    async def _answer_continuation(self, ex: _Exchange) -> web.StreamResponse | None:
        """A continuation's answer, written on into the client's stream (rewritten: :meth:`Resumable.rewrite`)."""
        ex.resume = resume = ex.flight.resume
        up = ex.up
        if up.status != 200 or not ex.sse:
            raise Broken(f"the engine answered the continuation with HTTP {up.status}", resume, "refused")
        ex.flight.started = True
        ex.resp = resume.resp
        return await self._stream(ex)

    async def _answer_whole(self, ex: _Exchange, clen: int, out_headers: CIMultiDict) -> web.Response:
        """A small answer, read whole first: a failure while reading it can still be retried."""
        budget = self.budget
        budget.held += clen  # counted while it is read (then aiohttp writes it out)
        try:
            data = await ex.up.read()
        except UPSTREAM_ERRORS as exc:
            raise Unstarted(describe(exc)) from None
        finally:
            budget.held -= clen
        ex.complete = True
        if self.timings.on_timings is not None and _TIMINGS in data:
            self.timings.from_json(data, ex.flight)
        return web.Response(status=ex.up.status, reason=ex.up.reason, body=data, headers=out_headers)

    async def _stream(self, ex: _Exchange) -> web.StreamResponse | None:
        """Copy the engine's answer to the client chunk by chunk (scanning SSE lines for timings)."""
        scan = self.timings.on_timings is not None and ex.sse
        from_sse = self.timings.from_sse
        flight = ex.flight
        tail = b""
        tap = flight.tap.feed if flight.tap is not None else None
        keep_tail = flight.tail is not None
        resume = ex.resume
        rewrite = None
        if resume is not None:  # a continuable stream: whole events recorded as sent, a continuation's rewritten
            rewrite = resume.rewrite if flight.resume is not None else resume.hold
        read = ex.up.content.readany
        write = ex.resp.write
        while True:
            try:
                chunk = await read()
            except UPSTREAM_ERRORS as exc:
                ex.broken = "the engine connection broke mid-response: " + describe(exc)
                return None
            if not chunk:
                ex.complete = True
                if resume is not None and not resume.ended():
                    ex.broken = "the engine ended the stream before [DONE]"
                return None
            if rewrite is not None:
                chunk = rewrite(chunk)  # recorded as sent there
                if not chunk:
                    continue
            try:
                await write(chunk)
            except _CLIENT_GONE:
                self.counters["client_disconnects"] += 1
                return ex.resp  # closing the engine response (finally) cancels its request
            if scan:
                tail = from_sse(tail + chunk if tail else chunk, flight)
            if tap is not None:
                tap(chunk)
            if keep_tail:
                flight.tail = (flight.tail + chunk)[-STREAM_TAIL:]

    async def _finish(self, ex: _Exchange) -> web.StreamResponse:
        """End a streamed answer: its last chunk, or an error event when the engine broke off (a continuable
        stream raises :class:`Broken` instead: the caller continues it)."""
        if ex.broken is not None:
            if ex.resume is not None:
                raise Broken(ex.broken, ex.resume, ex.cause)
            self.counters["cut_streams" if ex.cause == "drain" else "broken_streams"] += 1
            if ex.unkept:
                self.counters["uncontinued_not_kept"] += 1
            await self.end_broken(ex.request, ex.resp, ex.sse, ex.broken)
            return ex.resp
        try:
            await ex.resp.write_eof()
        except _CLIENT_GONE:
            self.counters["client_disconnects"] += 1
        return ex.resp

    async def give_up(self, request: web.BaseRequest, broken: Broken, reason: str, why: str) -> web.StreamResponse:
        """End a stream that cannot be continued with an error event, counted by what broke it and ``reason``
        (``uncontinued_<reason>``: see :mod:`specops.proxy.resume`)."""
        self.counters["cut_streams" if broken.cause == "drain" else "broken_streams"] += 1
        self.counters["uncontinued_" + reason] += 1
        await self.end_broken(request, broken.stream.resp, True, f"{broken.reason}; not continued: {why}")
        return broken.stream.resp

    async def end_stream(self, resume: Resumable, last: bytes) -> web.StreamResponse:
        """End a broken stream that had nothing left to generate with ``last`` (:meth:`Resumable.ending`)."""
        try:
            if last:
                await resume.resp.write(last)
            await resume.resp.write_eof()
        except _CLIENT_GONE:
            self.counters["client_disconnects"] += 1
        return resume.resp

    @staticmethod
    async def end_broken(request: web.BaseRequest, resp: web.StreamResponse, sse: bool, message: str) -> None:
        """End a started response that cannot complete: an SSE error event, or a cut connection."""
        if sse:
            event = b"data: " + error_body(502, "specops_stream_broken", message) + b"\n\n"
            try:
                await resp.write(event)
                await resp.write_eof()
                return
            except _CLIENT_GONE:
                pass
        transport = request.transport
        if transport is not None:
            transport.abort()  # the client sees an incomplete body, never a short one


class _Exchange:
    """Where one exchange stands (what the ``finally`` of :meth:`Forwarder.exchange` must clean up)."""

    __slots__ = ("body", "broken", "cause", "complete", "flight", "request", "resp", "resume", "sse", "unkept", "up")

    def __init__(self, request: web.BaseRequest, flight: Flight, body: HeldBody):
        self.request = request
        self.flight = flight
        self.body = body
        self.up: aiohttp.ClientResponse | None = None
        self.resp: web.StreamResponse | None = None
        self.sse = False
        self.complete = False  # the engine's answer was read to its end
        self.broken: str | None = None  # why a started stream could not complete
        self.cause = "engine"  # what broke it: the engine, or a cut ("drain": drain or upstream_failed)
        self.resume: Resumable | None = None  # the stream is continuable (resume.py)
        self.unkept = False  # it would be, but its body was not kept (the budget was over half full)


class Timings:
    """llama-server ``timings`` (draft tokens, accepted draft tokens) read from answers as they pass.

    ``on_timings(draft_n, draft_n_accepted)`` gets the *delta* since the previous call for the same request
    (per choice index), from JSON bodies and SSE chunks (every chunk when the client set
    ``timings_per_token``, else the final one). It runs inside the event loop: it must be quick.
    """

    def __init__(self, counters: dict, on_timings: Callable[[int, int], Any] | None):
        self.counters = counters
        self.on_timings = on_timings

    def from_json(self, data: bytes, flight: Flight) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if isinstance(obj, dict):
            self.feed(obj, flight)

    def from_sse(self, buf: bytes, flight: Flight) -> bytes:
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
                        self.feed(obj, flight)
        return buf[nl + 1 :]

    def feed(self, obj: dict, flight: Flight) -> None:
        t = obj.get("timings")
        if not isinstance(t, dict):
            return
        index = 0
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            index = choices[0].get("index", 0)
        elif "index" in obj:
            index = obj.get("index", 0)
        pn = t.get("predicted_n")  # tokens generated so far (an engine without speculation says it too)
        if isinstance(pn, int) and pn >= 0:
            if flight.predicted is None:
                flight.predicted = {}
            flight.predicted[index] = pn
        dn, da = t.get("draft_n"), t.get("draft_n_accepted")
        if not isinstance(dn, int) or not isinstance(da, int):
            return
        totals = flight.totals
        if totals is None:
            totals = flight.totals = {}
        pn, pa = totals.get(index, (0, 0))
        if dn < pn or da < pa:  # a new sequence: counts started again
            pn = pa = 0
        totals[index] = (dn, da)
        d_n, d_a = dn - pn, da - pa
        if d_n or d_a:
            self.counters["timings_draft_n"] += d_n
            self.counters["timings_draft_n_accepted"] += d_a
            if not flight.window:
                return
            try:
                self.on_timings(d_n, d_a)
            except Exception:
                log.exception("proxy: on_timings failed")
