"""A client request's way through the proxy: admin routes, the client-facing checks, the wait queue,
the engine, and what happens when the engine fails.

Guarantees, in order of strength:

- A request that has not received a response byte when its engine fails (connection refused, engine
  died, drain timeout) is retried once on the next engine; the client only sees a longer wait.
- A completions or chat stream whose engine fails after it started is continued on the next live engine
  from the text already sent (a twin at once, else the restarted engine, waited for in the queue), and the
  client's stream goes on to its ``[DONE]`` (:mod:`specops.proxy.resume`); where that is impossible, and for
  any other stream, it ends with an explicit SSE error event and no ``[DONE]`` (see
  :mod:`specops.proxy.forward`).
- Past ``queue_size`` waiting requests, or after ``queue_timeout`` in the queue, the answer is 503 with
  ``Retry-After``.

When a request fails before any byte and the engine still accepts connections, the failure was a pooled
connection the engine had just closed: the request is resent at once (``reconnects``), without using its
retry. When the engine does not accept connections, the proxy stops forwarding (state ``down``, new
requests queue) until the supervisor releases an engine, or the same URL answers its health check again.

:class:`RequestPath` is the part of :class:`~specops.proxy.server.Proxy` that serves requests; it works
on the proxy's state, counters and engine generations, which :mod:`specops.proxy.server` owns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from dataclasses import replace

import aiohttp
from aiohttp import web
from yarl import URL

from .bodies import HeldBody, read_body
from .errors import Broken, ClientError, Rejected, Unstarted, error_body, shown
from .forward import Flight, Generation, ask_timings_per_token, request_headers
from .limits import UNAUTHENTICATED, cancel_header_deadline, check_key, check_target
from .router import RouteRefused
from .states import ProxyState

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout on 3.10
    from async_timeout import timeout as _timeout

log = logging.getLogger("specops.proxy")

ADMIN_PREFIX = "/specops/"

SERVING, DOWN, STOPPED = ProxyState.SERVING, ProxyState.DOWN, ProxyState.STOPPED


class RequestPath:
    """Serving requests: mixed into :class:`~specops.proxy.server.Proxy` (``self`` is the proxy)."""

    capture = None  # specops.proxy.capture.Capture when the profile's `capture:` keeps traffic for `specops adapt`

    # ------------------------------------------------------------------------------------ entry points

    async def _handle_public(self, request: web.BaseRequest) -> web.StreamResponse:
        """The public port when the admin endpoints have their own port: every request is forwarded."""
        cancel_header_deadline(request)
        return await self._proxy(request)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The public port, admin endpoints included (they need the API key like any request)."""
        cancel_header_deadline(request)
        if request.raw_path.startswith(ADMIN_PREFIX):
            try:
                check_target(request)
                check_key(request, self._key)
            except ClientError as exc:
                return self._refuse(request, exc)
            return await self._handle_admin(request)
        return await self._proxy(request)

    async def _handle_admin_only(self, request: web.BaseRequest) -> web.StreamResponse:
        """The loopback admin port: ``/specops/status`` and ``/specops/metrics``, no key."""
        cancel_header_deadline(request)
        try:
            check_target(request)
        except ClientError as exc:
            return self._refuse(request, exc)
        if request.path.startswith(ADMIN_PREFIX):
            return await self._handle_admin(request)
        return web.json_response(
            {
                "error": {
                    "message": "admin listener: only /specops/status and /specops/metrics",
                    "type": "not_found",
                    "code": 404,
                }
            },
            status=404,
        )

    async def _handle_admin(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path.rstrip("/")
        if path == "/specops/status":
            doc = self.public_status()
            return web.Response(text=json.dumps(doc, indent=1, default=str), content_type="application/json")
        if path == "/specops/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST

            return web.Response(body=self.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})
        return web.json_response(
            {"error": {"message": f"unknown specops endpoint {shown(request.path)}", "type": "not_found", "code": 404}},
            status=404,
        )

    # ------------------------------------------------------------------------------------ refusals

    def _refuse(self, request: web.BaseRequest, exc: ClientError) -> web.Response:
        """Answer a request the proxy refused on its own, and log one (rate-limited) line about it."""
        self._c["rejected_" + exc.counter] += 1
        self._reject_log(
            "proxy: %d %s from %s: %s %s",
            exc.status,
            exc.kind,
            request.remote or "-",
            shown(request.method, 16),
            shown(request.raw_path),
        )
        headers = (
            {"Retry-After": self._retry_after()}
            if exc.status == 503
            else {"WWW-Authenticate": "Bearer"}
            if exc.status == 401
            else None
        )
        resp = web.Response(
            status=exc.status,
            body=error_body(exc.status, exc.kind, str(exc)),
            content_type="application/json",
            headers=headers,
        )
        if exc.close:
            resp.force_close()
        return resp

    def _retry_after(self) -> str:
        if self.retry_after is not None:
            return str(max(1, math.ceil(self.retry_after)))
        return str(max(1, min(30, math.ceil(self.queue_timeout / 4 or 1))))

    def _reject(self, status: int, kind: str, message: str) -> web.Response:
        return web.Response(
            status=status,
            body=error_body(status, kind, message),
            content_type="application/json",
            headers={"Retry-After": self._retry_after()} if status == 503 else None,
        )

    # ------------------------------------------------------------------------------------ forwarding

    async def _proxy(self, request: web.BaseRequest) -> web.StreamResponse:
        """Check the request (target, key, body limits), then forward it."""
        self._c["requests"] += 1
        try:
            check_target(request)
            # GET/HEAD /health, open to load balancers without the key: sent to the engine the routing state
            # names, its body never read nor routed (no client text reaches a rule or a class)
            health = (request.method, request.raw_path) in UNAUTHENTICATED
            if self._key is not None and not health:
                check_key(request, self._key)
            data, reserved = (
                (b"", 0) if health else await read_body(request, self._budget, self.max_body_size, self.body_timeout)
            )
        except ClientError as exc:
            return self._refuse(request, exc)
        body = HeldBody(data, reserved, self._budget)
        del data  # the body lives in `body` only, so releasing it frees it
        try:
            return await self._forward(request, body, routed=not health)
        finally:
            body.release()

    async def _forward(self, request: web.BaseRequest, body: HeldBody, routed: bool = True) -> web.StreamResponse:
        """Send to the engine, waiting in the queue when none serves; reconnect or retry once after a
        failure before any byte, continue a started stream after a failure (see the module docstring).
        ``body`` is released once the answer starts, unless the stream keeps it to be continued.
        With twins the router picks the engine, unless not ``routed``: then the default route does."""
        c = self._c
        loop = asyncio.get_running_loop()
        if self.on_timings is not None:
            body.data = ask_timings_per_token(body.data)
        headers = request_headers(request, body.data)
        retried = reconnected = False
        broken: Broken | None = None  # a started stream that lost its engine: continued on the next one
        continuation: bytes | None = None  # the request that continues it
        deadline = loop.time() + self.queue_timeout
        route = None
        if self.routes is not None and not routed:
            route = self.routes.default_route()
        elif self.routes is not None:  # twins: the router picks the engine (specops.proxy.routes)
            try:
                route = self.routes.route(request.path, request.headers, body.data)
            except RouteRefused as exc:
                self.routes.refused[exc.status] += 1
                return self._reject(exc.status, exc.kind, "specops: " + str(exc))
            if route.body is not None:  # a model alias: sent with the engine's own model name (proxy.router)
                body.data, route = route.body, replace(route, body=None)
        while True:
            try:
                gen = (self.routes.pick(route) if route is not None else None) or (
                    self._gen if self._state is SERVING else await self._acquire(deadline)
                )
            except Rejected as rej:
                c["rejected_" + rej.kind] += 1
                if broken is not None:
                    return await self._forwarder.give_up(request, broken, "no_engine", str(rej))
                if retried:
                    c["upstream_errors"] += 1
                return self._reject(503, "specops_" + rej.kind, "specops: " + str(rej))
            flight = Flight(gen)
            if route is not None:
                flight.window = self.routes.in_effect(gen)
                if self.on_timings is None and self.routes.reads_counters(route):
                    flight.tail = b""  # a stream's usage chunk carries vLLM's per-request counters (routes.py)
            if broken is not None:
                flight.resume = broken.stream
            elif self.capture is not None:  # decided before sending: a streamed answer is copied only if kept
                flight.tap = self.capture.tap(request.method, request.raw_path, body.data, route and route.key)
            resp, failure = await self._attempt(request, body, headers, flight, continuation)
            alive = None
            if isinstance(failure, Unstarted):
                if (
                    failure.stale
                    and not reconnected
                    and flight.cut_reason is None
                    and (
                        (gen is self._gen and self._state is SERVING)
                        or (route is not None and self.routes.serving(gen))
                    )
                ):
                    alive = await self._reachable(gen.url)
                    if alive:  # a pooled connection the engine had closed: just reconnect
                        reconnected = True
                        c["reconnects"] += 1
                        continue
                if broken is None:
                    if retried or not self.retry_unstarted or self._state is STOPPED:
                        c["upstream_errors"] += 1
                        status = 503 if self._state is STOPPED else 502
                        return self._reject(
                            status,
                            "specops_upstream_error",
                            f"specops: the engine failed before answering: {failure.reason}",
                        )
                    retried = True
                    c["retried"] += 1
                    if route is not None and gen is not self._gen:  # a twin failed: route the retry elsewhere
                        await self.routes.unstarted(gen)
                    log.info("proxy: retrying %s %s after: %s", request.method, shown(request.raw_path), failure.reason)
                    await self._after_engine_failure(flight, failure.reason, alive)
                    deadline = loop.time() + self.queue_timeout
                    continue
            if failure is not None:  # a started stream lost its engine (or its continuation failed before a byte)
                broken = failure if isinstance(failure, Broken) else broken
                if route is not None and gen is not self._gen:  # a twin failed: continue elsewhere
                    await self.routes.unstarted(gen)
                await self._after_engine_failure(flight, failure.reason, alive)
                resp, continuation = await self._continuation(request, broken)
                if resp is None:  # sent on the next live engine: a twin at once, else after a wait in the queue
                    deadline = loop.time() + self.queue_timeout
                    continue
            elif broken is not None:
                c["continued_streams"] += 1
            c["completed"] += 1
            if retried:
                c["retried_ok"] += 1
            if route is not None:
                self.routes.finished(route, flight, True, resp)
            if self.sampler is not None and type(resp) is web.Response:  # live spot checks (sample.py)
                self.sampler.offer(request.method, request.raw_path, request.headers, body.data, resp.status, resp.body)
            if flight.tap is not None:  # training data for `specops adapt` (specops.proxy.capture)
                self.capture.offer(flight.tap, resp.status, resp.body if type(resp) is web.Response else None)
            return resp

    async def _attempt(
        self, request: web.BaseRequest, body: HeldBody, headers, flight: Flight, data: bytes | None = None
    ) -> tuple[web.StreamResponse | None, Unstarted | Broken | None]:
        """One exchange, counted in flight on its generation (so drain can wait for it or cut it)."""
        gen = flight.gen
        gen.inflight.add(flight)
        self._inflight += 1
        try:
            return await self._forwarder.exchange(request, body, headers, flight, data), None
        except (Unstarted, Broken) as exc:
            return None, exc
        finally:
            self._inflight -= 1
            gen.inflight.discard(flight)
            if flight.cut_reason is None:
                gen.finished += 1
            if not gen.inflight and gen.idle is not None:
                gen.idle.set()

    async def _acquire(self, deadline: float) -> Generation:
        """The generation to send to: at once when serving, else after a bounded wait in the queue."""
        if self._state is SERVING:
            return self._gen
        if self._state is STOPPED:
            raise Rejected("stopped", "specops is shutting down")
        if self._waiting >= self.queue_size:
            raise Rejected(
                "queue_full", f"the engine is switching and the wait queue is full ({self.queue_size} requests)"
            )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self._waiting += 1
        try:
            while self._state is not SERVING:
                if self._state is STOPPED:
                    raise Rejected("stopped", "specops is shutting down")
                left = deadline - loop.time()
                if left <= 0:
                    raise Rejected(
                        "queue_timeout",
                        f"the engine did not come back within the {self.queue_timeout:g}s queue timeout",
                    )
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
            self._wait_longest = max(self._wait_longest, waited)

    # ------------------------------------------------------------------------------ engine failures

    async def _continuation(self, request: web.BaseRequest, broken: Broken) -> tuple[web.StreamResponse | None, bytes]:
        """What follows a started stream's failure: the request that continues it (and no response yet), or the
        stream ended here: with no engine when nothing was left to generate, else with an error event saying why
        it could not be continued (:mod:`specops.proxy.resume`)."""
        stream = broken.stream
        stream.settle()
        last = stream.ending()
        if last is not None:
            self._c["continued_streams"] += 1
            return await self._forwarder.end_stream(stream, last), b""
        refusal = (
            ("refused", "the engine refused it")
            if broken.cause == "refused"
            else ("no_engine", "specops is shutting down")
            if self._state is STOPPED
            else stream.obstacle()
        )
        if refusal is not None:
            log.info("proxy: a stream on %s not continued: %s", shown(request.raw_path), refusal[1])
            return await self._forwarder.give_up(request, broken, *refusal), b""
        self._c["stream_continuations"] += 1
        log.info("proxy: continuing a stream (%d tokens sent) after: %s", stream.tokens_sent, broken.reason)
        return None, stream.request_body()

    async def _after_engine_failure(self, flight: Flight, reason: str, alive: bool | None) -> None:
        """Decide where the retry (or continuation) goes: the same engine if it is alive, else wait for the next."""
        gen = flight.gen
        if flight.cut_reason is not None or gen is not self._gen or self._state is not SERVING:
            return  # a switch/failure is already being handled: _acquire waits
        if alive is None:
            alive = await self._reachable(gen.url)
        if alive:
            return  # a transient error (e.g. a stale keep-alive connection)
        if gen is self._gen and self._state is SERVING:
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

    def _start_recovery(self, gen: Generation) -> None:
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

    async def _recover(self, gen: Generation) -> None:
        url = gen.url + self.health_path
        while self._state is DOWN and self._gen is gen:
            await asyncio.sleep(self.recover_interval)
            try:
                async with self._forwarder.session.get(
                    url, headers={"Connection": "close"}, timeout=aiohttp.ClientTimeout(total=2.0)
                ) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                ok = False
            if ok and self._state is DOWN and self._gen is gen:
                self._recover_task = None
                self._event("upstream_recovered", url=gen.url)
                self._new_generation(gen.url)
                return
