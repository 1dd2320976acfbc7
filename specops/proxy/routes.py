"""The proxy's upstreams when a profile keeps twins: one per engine, the router choosing per request.

The primary engine stays the proxy's own upstream (its generation and states, :mod:`specops.proxy.states`), driven
by the primary's supervisor exactly as without twins. Each twin has an :class:`EngineUpstream` here, driven by its
own supervisor through an :class:`EngineHandle` (the same four calls the supervisor makes on the proxy: ``hold``,
``drain``, ``release``, ``upstream_failed``, acting on that engine only). :class:`RoutedUpstreams` asks the
:class:`~specops.proxy.router.Router` where a request goes, hands the proxy that engine's generation (None when no
engine is live: the proxy's queue then holds the request, as it always did), and after the answer feeds the
request class's window with the response's own counters (``timings``, vLLM's per-request metrics), the tokens it
generated and its wall time, and adds the model aliases to a ``/v1/models`` answer.

A remote twin (another deployment, :mod:`specops.serve.remote`) is an :class:`EngineUpstream` too, driven by its
health checks instead of a supervisor: its generation is marked remote (the client's ``Authorization`` is replaced
by the remote's own key, and its 502/503/504 is retried elsewhere: :mod:`specops.proxy.forward`), a request that
fails on it before any byte takes it out of the routes until its next health check, and its answers' durations go
into its :class:`~specops.proxy.metrics.LatencyHistogram` (the hop's per-request latency).

Requests in flight finish where they started: a route change only changes where new requests go.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from yarl import URL

from .forward import Flight, Generation
from .metrics import LatencyHistogram
from .router import EngineInfo, Route, Router
from .states import ProxyState

if TYPE_CHECKING:  # pragma: no cover
    from .server import DrainResult, Proxy

log = logging.getLogger("specops.proxy")

#: Twin generations are numbered from here (the primary's count from 1), so status tells them apart.
TWIN_GENERATION_BASE = 1_000_000


class EngineUpstream:
    """One twin engine as the proxy sees it: its current generation and whether it takes requests."""

    def __init__(self, position: int):
        self.position = position
        self.gen: Generation | None = None
        self.live = False
        self.generations = 0
        self.since = time.monotonic()
        self.latency = LatencyHistogram()  # a remote twin's answers, from routing to their last byte

    def release(self, url: str, *, remote: bool = False, authorization: str = "") -> None:
        """Take requests at ``url``: an engine of this deployment, or (``remote``) another deployment, sent
        ``authorization`` (its own key, "" for none) in place of the client's."""
        self.generations += 1
        gid = TWIN_GENERATION_BASE * self.position + self.generations
        self.gen = Generation(gid, url, remote=remote, authorization=authorization)
        self.live, self.since = True, time.monotonic()

    def down(self) -> None:
        if self.live:
            self.live, self.since = False, time.monotonic()


class RoutedUpstreams:
    """Every engine behind the proxy (position 0: the primary, the proxy's own upstream) and the router.

    ``on_route(route, flight, ok, tokens, seconds)`` (optional) is called after each answer of a request class
    (``tokens``: what it generated, None when the answer does not say; ``seconds``: from routing to its last byte;
    both None without a class): the run layer feeds the class windows from it. It runs in the event loop: keep it
    quick.
    """

    def __init__(self, router: Router, *, on_route: Callable[..., Any] | None = None):
        self.router = router
        self.upstreams = [EngineUpstream(i) for i in range(len(router.engines))]
        self.on_route = on_route
        self.closing = False  # specops is stopping: no engine takes new requests (the queue answers 503)
        self.proxy: Proxy | None = None
        self.routed: Counter = Counter()  # (engine position, reason) → requests
        self.refused: Counter = Counter()  # status → requests refused by the router
        self.counting = False  # a canary is measured: every answer's own counters are read (not only a class's)

    def attach(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def live(self) -> list[bool]:
        p = self.proxy
        primary = p is not None and p._state is ProxyState.SERVING and not self.closing
        return [primary] + [u.live and not self.closing for u in self.upstreams[1:]]

    # --------------------------------------------------------------------------------- the request path
    def route(self, path: str, headers, body: bytes) -> Route:
        """The route of one request (raises :class:`~specops.proxy.router.RouteRefused`)."""
        return self.router.route(path, headers, body, self.live(), time.monotonic())

    def default_route(self) -> Route:
        """The engine of the step in effect, else a live one: for ``/health``, whose body is never routed."""
        return self.router.default_route(self.live(), time.monotonic())

    def pick(self, route: Route) -> Generation | None:
        """The generation to send ``route``'s request to now (engines die and come back between attempts):
        None when no engine is live (the proxy's queue waits for the primary)."""
        live = self.live()
        engine = route.engine
        if engine is None or engine >= len(live) or not live[engine]:  # a canary retired since it was routed
            engine = next((i for i in (self.router.current, *range(len(live))) if live[i]), None)
            if engine is None:
                return None
        if engine == 0:
            return self.proxy._gen if self.proxy is not None else None
        return self.upstreams[engine].gen

    def position_of(self, gen: Generation) -> int:
        for u in self.upstreams[1:]:
            if u.gen is gen:
                return u.position
        return 0

    def serving(self, gen: Generation) -> bool:
        """Whether ``gen`` is a twin's current generation and that twin takes requests (a failure on a pooled
        connection to it is then reconnected once, as for the primary, without using the request's retry)."""
        position = self.position_of(gen)
        return position > 0 and self.upstreams[position].gen is gen and self.live()[position]

    def in_effect(self, gen: Generation) -> bool:
        """Whether ``gen`` is the engine of the step in effect: only its answers feed the fallback window (a
        twin at another step, or a canary, runs another draft)."""
        return self.position_of(gen) == self.router.current

    def reads_counters(self, route: Route) -> bool:
        """Whether the answer's own counters are read: for a request class's window, or while a canary is
        measured (then a stream's end is kept for its usage event: :attr:`Flight.tail`)."""
        return route.key is not None or self.counting

    def finished(self, route: Route, flight: Flight | None, ok: bool, resp: Any = None) -> None:
        """After an answer (before it is written, when it was read whole): count it, feed its class window
        (``on_route(route, flight, ok, tokens, seconds)``), and add the aliases to a ``/v1/models`` list."""
        position = self.position_of(flight.gen) if flight is not None else route.engine
        body = getattr(resp, "body", None)
        tokens = seconds = None
        if self.reads_counters(route) and flight is not None:
            answer = body if isinstance(body, bytes) else stream_usage(flight.tail)
            if flight.totals is None:
                flight.totals = vllm_spec_counts(answer)  # vLLM's own counters, when it has them
            if route.key is not None:  # a class's window also takes the answer's tokens and wall time
                tokens = completion_tokens(flight, answer)
                seconds = time.monotonic() - route.start
        if route.lists_models and isinstance(body, bytes) and getattr(resp, "status", 0) == 200:
            listed = self.router.list_aliases(body)
            if listed is not None:
                resp.body = listed
        self.routed[(position, route.reason)] += 1
        if flight is not None and flight.gen.remote and position:  # the hop's per-request latency
            self.upstreams[position].latency.observe(time.monotonic() - route.start)
        if self.on_route is not None:
            try:
                self.on_route(route, flight, ok, tokens, seconds)
            except Exception:  # the class windows must never fail a request
                log.exception("proxy: on_route failed")

    async def unstarted(self, gen: Generation) -> None:
        """A twin's request failed before any byte: when the twin no longer accepts connections, it takes no
        more requests until its supervisor releases it again (the retry goes to a live engine). A remote twin
        takes none until its next health check passes, whatever failed: it may accept connections and still not
        serve (a deployment stopping, its engine gone)."""
        position = self.position_of(gen)
        u = self.upstreams[position] if position else None
        if u is None or u.gen is not gen or not u.live:
            return
        if gen.remote:
            u.down()
            log.info(
                "proxy: the remote twin (engine %d) failed a request; routed elsewhere until it is checked", position
            )
        elif not await _reachable(gen.url):
            u.down()
            log.info("proxy: engine %d at %s does not accept connections; routed elsewhere", position, gen.url)

    # --------------------------------------------------------------------------------- engines
    def handle(self, position: int) -> EngineHandle:
        return EngineHandle(self, position)

    def set_engine(self, position: int, info: EngineInfo) -> None:
        """Engine ``position`` now runs ``info`` (its supervisor fell back or reloaded to another step)."""
        engines = list(self.router.engines)
        engines[position] = info
        self.router.engines = tuple(engines)

    async def drain(self, timeout: float) -> dict:
        """Wait for the requests in flight on every twin (specops is stopping); cut what still runs after it."""
        out = {}
        for u in self.upstreams[1:]:
            if u.gen is not None and u.gen.inflight:
                out[str(u.position)] = (await drain_generation(u.gen, timeout, self.proxy)).to_dict()
        return out

    def snapshot(self) -> list[dict]:
        live = self.live()
        rows = []
        for i, e in enumerate(self.router.engines):
            gen = self.pick(Route(i, "default", "status")) if live[i] else None
            rows.append(
                {
                    "engine": i,
                    "step": e.step,
                    "method": e.method,
                    "speculative": e.speculative,
                    "remote": e.remote is not None,
                    "live": live[i],
                    "current": i == self.router.current,
                    "upstream": gen.url if gen is not None else None,
                    "in_flight": len(gen.inflight) if gen is not None else 0,
                    "routed": sum(n for (pos, _), n in self.routed.items() if pos == i),
                }
            )
        return rows


class EngineHandle:
    """The proxy as one twin's supervisor sees it: hold, drain, release and failure act on that engine only."""

    def __init__(self, upstreams: RoutedUpstreams, position: int):
        self.upstreams = upstreams
        self.position = position

    @property
    def _u(self) -> EngineUpstream:
        return self.upstreams.upstreams[self.position]

    def release(self, upstream_base_url: str | None = None) -> None:
        url = upstream_base_url or (self._u.gen.url if self._u.gen is not None else None)
        if url is None:
            raise ValueError("release() needs an upstream URL: none was set before")
        self._u.release(url)

    def release_remote(self, url: str, authorization: str) -> None:
        """A remote twin passed its health check: requests go to it, with ``authorization`` (its own key)."""
        self._u.release(url, remote=True, authorization=authorization)

    @property
    def live(self) -> bool:
        return self._u.live

    @property
    def latency(self) -> LatencyHistogram:
        return self._u.latency

    def hold(self) -> None:
        self._u.down()

    async def drain(self, timeout: float | None = None) -> DrainResult:
        from .server import DrainResult

        gen = self._u.gen
        if gen is None:
            return DrainResult(0, 0, 0, 0, 0.0, False)
        p = self.upstreams.proxy
        return await drain_generation(gen, p.drain_timeout if timeout is None and p else (timeout or 0.0), p)

    def upstream_failed(self, reason: str = "the engine failed") -> None:
        u = self._u
        u.down()
        if u.gen is not None:
            for f in list(u.gen.inflight):
                f.cut(reason)


async def drain_generation(gen: Generation, timeout: float, proxy: Proxy | None) -> DrainResult:
    """Wait for ``gen``'s requests to finish; cut those still running after ``timeout`` (as the proxy's drain)."""
    from .server import DrainResult

    t0 = time.monotonic()
    n0, done0, timed_out = len(gen.inflight), gen.finished, False
    if gen.inflight:
        gen.idle = asyncio.Event()
        try:
            await asyncio.wait_for(gen.idle.wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
    cut = cut_streams = 0
    if gen.inflight and proxy is not None:
        cut, cut_streams = await proxy._cut_the_rest(gen, timeout)
    return DrainResult(n0, gen.finished - done0, cut, cut_streams, round(time.monotonic() - t0, 6), timed_out)


#: What marks an answer carrying vLLM's per-request counters (``--per-request-spec-decode-metrics``).
_SPEC_METRICS = b'"speculative_decoding"'
_USAGE = b'"usage"'


def stream_usage(tail: bytes | None) -> bytes | None:
    """The last SSE event of a stream's end that carries ``usage`` (with ``stream_options.include_usage`` vLLM
    sends it last, ``choices: []``, with ``metrics.speculative_decoding`` beside it when the per-request metrics
    are on); None when the stream ended without one (the client did not ask for usage)."""
    if not tail or _USAGE not in tail:
        return None
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and _USAGE in line:
            return line[5:].strip()
    return None


def vllm_spec_counts(body: Any) -> dict | None:
    """``{0: (draft tokens, accepted draft tokens)}`` from a vLLM answer's ``metrics.speculative_decoding``
    (the shape the class windows take from llama-server's ``timings``): a whole answer, or a stream's usage
    event (:func:`stream_usage`); None when it has none."""
    if not isinstance(body, bytes) or _SPEC_METRICS not in body:
        return None
    try:
        spec = json.loads(body)["metrics"]["speculative_decoding"]
        drafted, accepted = spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(drafted, int) or not isinstance(accepted, int) or not 0 <= accepted <= drafted:
        return None
    return {0: (drafted, accepted)}


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})')


def completion_tokens(flight: Flight, body: Any) -> int | None:
    """The tokens an answer generated: llama-server's ``timings.predicted_n`` (every choice; streamed answers
    too), else the ``usage.completion_tokens`` of a whole answer or of a stream's usage event (vLLM); None
    when the answer says neither."""
    if flight.predicted:
        return sum(flight.predicted.values())
    if isinstance(body, bytes):
        m = _COMPLETION_TOKENS.search(body)
        if m is not None:
            return int(m.group(1))
    return None


async def _reachable(url: str) -> bool:
    u = URL(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(u.host, u.port), 1.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True
