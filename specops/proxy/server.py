"""The front proxy: a stable public address in front of an engine that specops restarts and switches.

``specops up`` serves the public host/port itself and runs the engine on an internal loopback port. Every
request passes through :class:`Proxy`, an aiohttp server + aiohttp client running in specops' own asyncio
loop. Why a proxy at all: a fallback (EAGLE → n-gram → none) means restarting the engine with other flags,
and clients must not notice. The supervisor drives the switch through :meth:`Proxy.hold`,
:meth:`Proxy.drain` and :meth:`Proxy.release` (the states and their changes: :mod:`specops.proxy.states`).

Where the rest lives:

- :mod:`specops.proxy.dispatch`: a request's way through: checks, the wait queue, retries, recovery;
- :mod:`specops.proxy.forward`: one exchange with the engine (headers, URL, streaming, timings);
- :mod:`specops.proxy.options`: the settings a proxy is made with (``Proxy(host, port, **options)``);
- :mod:`specops.proxy.limits`: what the public port accepts (connections, deadlines, sizes, the API key);
- :mod:`specops.proxy.metrics`: ``/specops/metrics``; :mod:`specops.proxy.loop`: uvloop or asyncio.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web
from yarl import URL

from specops.urls import http_url

from .bodies import BufferBudget
from .dispatch import RequestPath
from .forward import Forwarder, Generation, engine_session
from .limits import LINGER, RejectLog, Server, ServerLog, raise_fd_limit
from .metrics import metrics_text
from .options import ProxyOptions
from .sample import LiveSampler
from .states import WAITING_STATES, ProxyState, check_transition

log = logging.getLogger("specops.proxy")

__all__ = ["DrainResult", "Proxy"]

IDLE, SERVING, HELD, DOWN, STOPPED = (
    ProxyState.IDLE,
    ProxyState.SERVING,
    ProxyState.HELD,
    ProxyState.DOWN,
    ProxyState.STOPPED,
)

#: the proxy's counters (``stats()`` reports them all; ``/specops/metrics`` exposes them)
COUNTERS = (
    "requests",
    "completed",
    "waited",
    "rejected_queue_full",
    "rejected_queue_timeout",
    "rejected_stopped",
    "retried",
    "retried_ok",
    "reconnects",
    "upstream_errors",
    "broken_streams",
    "cut_streams",
    "stream_continuations",
    "continued_streams",
    "uncontinued_options",
    "uncontinued_not_kept",
    "uncontinued_no_engine",
    "uncontinued_refused",
    "uncontinued_limit",
    "client_disconnects",
    "timings_draft_n",
    "timings_draft_n_accepted",
    "rejected_bad_target",
    "rejected_method",
    "rejected_unauthorized",
    "rejected_too_large",
    "rejected_body_timeout",
    "rejected_buffer_full",
    "rejected_connections",
    "rejected_malformed",
    "rejected_header_size",
    "cut_slow_clients",
    "internal_errors",
)


@dataclass(frozen=True)
class DrainResult:
    """What :meth:`Proxy.drain` did: requests that finished on the old engine, and those it cut."""

    in_flight: int  # in flight on the drained engine when the drain began
    finished: int  # of those (and any that started during the drain), how many completed
    cut: int  # still running at the timeout: cut (streams got an error event, others retry)
    cut_streams: int  # of the cut, how many had already started answering (ended with an error event)
    waited_s: float
    timed_out: bool

    def to_dict(self) -> dict:
        return asdict(self)


#: the keys of ``/specops/status`` whose values are an engine's internal address
_ADDRESS_KEYS = frozenset({"engine_url", "upstream"})
_ADDRESS_EVENTS = frozenset({"upstream", "upstream_unreachable", "upstream_recovered"})


def _engine_addresses(node, found: set[str]) -> None:
    """Collect the engine URLs a status document holds (under :data:`_ADDRESS_KEYS`, and the ``url`` of
    the proxy's events about engines)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and (
                key in _ADDRESS_KEYS or (key == "url" and node.get("event") in _ADDRESS_EVENTS)
            ):
                found.add(value)
            else:
                _engine_addresses(value, found)
    elif isinstance(node, list):
        for value in node:
            _engine_addresses(value, found)


def _without_addresses(doc, engines: set[str]):
    """``doc`` without the keys holding an engine URL (any key whose value is one, too), and with the
    engines' URLs and host:port replaced by "the engine" inside other text."""
    hidden = sorted(engines | {URL(u).raw_authority for u in engines if URL(u).raw_authority}, key=len, reverse=True)

    def clean(node):
        if isinstance(node, dict):
            return {
                k: clean(v)
                for k, v in node.items()
                if k not in _ADDRESS_KEYS and not (isinstance(v, str) and v in engines)
            }
        if isinstance(node, list):
            return [clean(v) for v in node]
        if isinstance(node, str):
            for h in hidden:
                if h in node:
                    node = node.replace(h, "the engine")
        return node

    return clean(doc)


class Proxy(RequestPath):
    """Reverse proxy in front of the engine; see :mod:`specops.proxy.states` for the switch protocol.

    ``on_timings(draft_n, draft_n_accepted)`` is called with the *delta* since the previous call for the
    same request, from llama-server ``timings`` in JSON bodies and in SSE chunks (every chunk: with it set, a
    streamed request that does not name ``timings_per_token`` is sent with it). It runs inside the event
    loop: keep it quick.
    ``status_provider()`` returns a dict merged into ``/specops/status``. ``metrics_registry`` (a
    prometheus_client ``CollectorRegistry``) is exposed on ``/specops/metrics`` together with the proxy's
    own metrics. ``sampler`` (a :class:`~specops.proxy.sample.LiveSampler`) is offered every completed
    non-streamed answer, for live spot checks. The client-facing limits are described in :mod:`specops.proxy.limits`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        on_timings: Callable[[int, int], Any] | None = None,
        status_provider: Callable[[], dict] | None = None,
        metrics_registry=None,
        sampler: LiveSampler | None = None,
        **options,
    ):
        """``options`` are the keywords of :class:`~specops.proxy.options.ProxyOptions` (checked there)."""
        opts = ProxyOptions(**options)
        self.host, self.port = host, port
        self.sampler = sampler  # keeps a few greedy requests for live spot checks (None: off)
        self.admin_host, self.admin_port = opts.admin_host, opts.admin_port
        self.queue_size = opts.queue_size
        self.queue_timeout = float(opts.queue_timeout)
        self.drain_timeout = float(opts.drain_timeout)
        self.retry_unstarted = opts.retry_unstarted
        self.retry_after = opts.retry_after
        self.status_provider = status_provider
        self.metrics_registry = metrics_registry
        self.connect_timeout, self.read_timeout = opts.connect_timeout, opts.read_timeout
        self.health_path, self.recover_interval = opts.health_path, opts.recover_interval
        self.api_key = opts.api_key or None
        self._key = b"Bearer " + opts.api_key.encode("utf-8") if opts.api_key else None
        self.max_body_size = opts.max_body_size
        self.header_timeout, self.body_timeout = float(opts.header_timeout), float(opts.body_timeout)
        self.send_timeout = float(opts.send_timeout) if opts.send_timeout is not None else None
        self.max_header_bytes = opts.max_header_bytes
        self.max_connections = opts.max_connections
        self.max_buffered_bytes = int(opts.max_buffered_bytes)
        self._budget = BufferBudget(self.max_buffered_bytes)  # request bodies (and buffered answers) held
        self._reject_log = RejectLog(log, opts.log_rejects_per_s)
        self._c = dict.fromkeys(COUNTERS, 0)
        self._forwarder = Forwarder(self._c, self._budget, opts.buffer_limit, on_timings)
        self._server: Server | None = None
        self._runner: web.ServerRunner | None = None
        self._admin_runner: web.ServerRunner | None = None

        self._state = IDLE
        self._gen: Generation | None = None
        self._next_gen = 0
        self._open = asyncio.Event()  # set exactly when state is SERVING (or STOPPED, to wake waiters)
        self._waiting = 0
        self._inflight = 0
        self._recover_task: asyncio.Task | None = None
        self._held_since: float | None = None
        self._events: deque = deque(maxlen=opts.events_kept)
        self._started_at = time.time()
        self._wait_total = 0.0
        self._wait_longest = 0.0
        self.routes = None  # RoutedUpstreams (specops.proxy.routes) when the profile keeps twins

    # ----------------------------------------------------------------------------------------- settings

    @property
    def on_timings(self) -> Callable[[int, int], Any] | None:
        return self._forwarder.timings.on_timings

    @on_timings.setter
    def on_timings(self, fn: Callable[[int, int], Any] | None) -> None:
        self._forwarder.timings.on_timings = fn

    @property
    def buffer_limit(self) -> int:
        """Engine answers up to this size (with a Content-Length, not SSE) are read whole, then answered."""
        return self._forwarder.buffer_limit

    @buffer_limit.setter
    def buffer_limit(self, n: int) -> None:
        self._forwarder.buffer_limit = n

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def admin_url(self) -> str:
        if self.admin_port is None:
            return self.url
        return f"http://{self.admin_host}:{self.admin_port}"

    @classmethod
    def from_profile(cls, profile, **kwargs) -> Proxy:
        """The proxy ``specops up`` runs for a profile: its ``server`` address and key, its ``proxy`` settings.

        ``kwargs`` (e.g. ``status_provider``) are passed on and win over the profile.
        """
        p, server = profile.proxy, profile.server
        opts = dict(
            queue_size=p.queue_size,
            queue_timeout=p.queue_timeout,
            drain_timeout=p.drain_timeout,
            retry_unstarted=p.retry_unstarted,
            admin_port=p.admin_port,
            api_key=server.api_key,
            max_body_size=p.max_body_size,
            max_buffered_bytes=p.max_buffered_bytes,
            max_connections=p.max_connections,
            header_timeout=p.header_timeout,
            body_timeout=p.body_timeout,
            send_timeout=p.send_timeout,
        )
        spot = profile.certify.spot_check
        if spot.enabled and spot.source != "probes":
            opts["sampler"] = LiveSampler(max_entries=2 * spot.sample)
        opts.update(kwargs)
        proxy = cls(server.host, server.port, **opts)
        if profile.capture.enabled:  # traffic kept for `specops adapt` (specops.proxy.capture)
            from specops.proxy.capture import Capture

            proxy.capture = Capture.for_profile(profile)
        return proxy

    # ----------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind the public (and admin) listeners. Requests queue until :meth:`set_upstream`."""
        self._forwarder.session = engine_session(self.connect_timeout, self.read_timeout)
        raise_fd_limit(2 * (self.max_connections or 0) + 256)
        server_log = ServerLog(self._reject_log)
        await self._listen_public(server_log)
        if self.admin_port is not None:
            await self._listen_admin(server_log)
        self._event("start", url=self.url)

    async def _listen_public(self, server_log: ServerLog) -> None:
        max_body = self.max_body_size
        loop = asyncio.get_running_loop()

        def request_factory(message, payload, protocol, writer, task, _server=None):
            return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body)

        handler = self._handle if self.admin_port is None else self._handle_public
        # keepalive_timeout: aiohttp closes a connection that has not delivered a complete request this long
        # after it opened or after the previous response: the header timeout and the idle timeout at once
        self._server = server = Server(
            handler,
            counters=self._c,
            reject_log=self._reject_log,
            max_connections=self.max_connections,
            header_timeout=self.header_timeout,
            budget=self._budget,
            max_header_bytes=self.max_header_bytes,
            send_timeout=self.send_timeout,
            request_factory=request_factory,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.header_timeout,
            lingering_time=LINGER,
            logger=server_log,
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]

    async def _listen_admin(self, server_log: ServerLog) -> None:
        admin = Server(
            self._handle_admin_only,
            counters=self._c,
            reject_log=self._reject_log,
            max_connections=64,
            header_timeout=self.header_timeout,
            budget=self._budget,
            max_header_bytes=self.max_header_bytes,
            send_timeout=self.send_timeout,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.header_timeout,
            lingering_time=LINGER,
            logger=server_log,
        )
        self._admin_runner = web.ServerRunner(admin, shutdown_timeout=1.0, handle_signals=False)
        await self._admin_runner.setup()
        await web.TCPSite(self._admin_runner, self.admin_host, self.admin_port, reuse_address=True).start()
        self.admin_port = self._admin_runner.addresses[0][1]

    async def stop(self, grace: float = 0.0) -> None:
        """Stop serving: waiting requests get 503; in-flight ones get ``grace`` seconds, then are cut."""
        if self._state is STOPPED:
            return
        if grace > 0:
            self.hold()
            await self.drain(grace)
        self._set_state(STOPPED)
        self._open.set()  # wake waiters: they see STOPPED and answer 503
        if self._recover_task is not None:
            self._recover_task.cancel()
        if self._gen is not None:
            for f in list(self._gen.inflight):
                f.cut("specops is shutting down")
        for runner in (self._runner, self._admin_runner):
            if runner is not None:
                server = runner.server
                await runner.cleanup()
                server.heap.cancel()  # the closed connections may have asked for a trim: none is due now
        if self._forwarder.session is not None:
            await self._forwarder.session.close()
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
        self._event("hold", in_flight=len(self._gen.inflight) if self._gen is not None else 0)

    def upstream_failed(self, reason: str = "the engine failed") -> None:
        """The supervisor learned the engine died: queue new requests, cut in-flight ones.

        Cut requests that had not started answering are retried on the next engine; started streams end
        with an error event. Forwarding resumes at the next :meth:`release` / :meth:`set_upstream`.
        """
        if self._state is STOPPED:
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
        cut, cut_streams = await self._cut_the_rest(gen, timeout)
        result = DrainResult(
            in_flight=n0,
            finished=gen.finished - done0,
            cut=cut,
            cut_streams=cut_streams,
            waited_s=round(time.monotonic() - t0, 6),
            timed_out=timed_out,
        )
        self._event("drain", **result.to_dict())
        return result

    async def _cut_the_rest(self, gen: Generation, timeout: float) -> tuple[int, int]:
        """Cut the requests still on ``gen`` after the drain timeout, and let them unwind (at most 5 s)."""
        cut = cut_streams = 0
        if not gen.inflight:
            return cut, cut_streams
        for f in list(gen.inflight):
            cut += 1
            cut_streams += f.started
            f.cut(f"the engine was stopped for a switch after a {timeout:g}s drain")
        self._event("drain_cut", cut=cut, streams=cut_streams)
        gen.idle = asyncio.Event()
        try:  # cut requests unwind on the next loop turns
            await asyncio.wait_for(gen.idle.wait(), 5.0)
        except asyncio.TimeoutError:
            log.warning("proxy: %d cut requests did not unwind within 5s", len(gen.inflight))
        return cut, cut_streams

    # ------------------------------------------------------------------------------------------- status

    @property
    def state(self) -> ProxyState:
        """The current state (a ``str`` enum: ``proxy.state == "serving"`` holds when serving)."""
        return self._state

    @property
    def upstream(self) -> str | None:
        return self._gen.url if self._gen is not None else None

    def stats(self) -> dict:
        """Counters and gauges (the same numbers as ``/specops/metrics``)."""
        d = dict(self._c)
        d.update(
            state=self._state.value,
            upstream=self.upstream,
            generation=self._gen.id if self._gen else None,
            queue_depth=self._waiting,
            queue_size=self.queue_size,
            in_flight=self._inflight,
            longest_wait_s=round(self._wait_longest, 6),
            total_wait_s=round(self._wait_total, 6),
            held_for_s=round(time.monotonic() - self._held_since, 3) if self._held_since else None,
            buffered_bytes=self._budget.held,
            header_bytes=self._budget.headers,
            connections=self._server.open_connections if self._server is not None else 0,
            log_suppressed=self._reject_log.suppressed,
        )
        return d

    def status(self) -> dict:
        """The ``/specops/status`` document: the proxy's own section, merged with ``status_provider()``."""
        doc: dict = {
            "proxy": dict(
                self.stats(),
                url=self.url,
                started_at=round(self._started_at, 3),
                queue_timeout_s=self.queue_timeout,
                drain_timeout_s=self.drain_timeout,
                retry_unstarted=self.retry_unstarted,
                limits={
                    "api_key": self._key is not None,
                    "max_connections": self.max_connections,
                    "max_body_size": self.max_body_size,
                    "max_buffered_bytes": self.max_buffered_bytes,
                    "header_timeout_s": self.header_timeout,
                    "body_timeout_s": self.body_timeout,
                    "send_timeout_s": self.send_timeout,
                    "max_header_bytes": self.max_header_bytes,
                },
                events=list(self._events),
            )
        }
        if self.status_provider is not None:
            try:
                extra = self.status_provider()
                if extra:
                    doc.update(extra)
            except Exception as exc:  # status must never take the proxy down
                log.exception("proxy: status_provider failed")
                doc["status_error"] = f"{type(exc).__name__}: {exc}"
        return doc

    def public_status(self) -> dict:
        """The document ``/specops/status`` serves: :meth:`status` less where things are on this machine.

        Any key holder may read it, so every engine's internal address (``proxy.upstream``, ``engine_url``,
        a twin's row, the events' URLs, its host:port inside a reason) and the profile's absolute path
        (``profile_reload.path``) are left out; the local ``specops status`` reads them from the state file.
        """
        doc = self.status()
        reload = doc.get("profile_reload")
        if isinstance(reload, dict):
            doc["profile_reload"] = {k: v for k, v in reload.items() if k != "path"}
        engines = {self._gen.url} if self._gen is not None else set()
        _engine_addresses(doc, engines)
        return _without_addresses(doc, engines)

    def metrics_text(self) -> bytes:
        return metrics_text(self)

    # ------------------------------------------------------------------------------------------- internals

    def _event(self, kind: str, **detail) -> None:
        self._events.append({"t": round(time.time(), 3), "event": kind, **detail})
        log.info("proxy %s %s", kind, detail or "")

    def _set_state(self, state: ProxyState) -> None:
        """Enter ``state``: raises :class:`~specops.proxy.states.IllegalTransition` unless it is allowed."""
        check_transition(self._state, state)
        self._state = state
        if state is SERVING:
            self._held_since = None
            self._open.set()
        else:
            if self._held_since is None and state in WAITING_STATES:
                self._held_since = time.monotonic()
            if state is not STOPPED:
                self._open.clear()

    def _new_generation(self, url: str) -> None:
        if self._state is STOPPED:
            raise RuntimeError("the proxy is stopped")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL must be http(s)://host:port, got {url!r}")
        self._stop_recovery()
        self._next_gen += 1
        self._gen = Generation(self._next_gen, url)
        waited = self._waiting
        self._set_state(SERVING)
        self._event("upstream", url=self._gen.url, generation=self._gen.id, queued=waited)
