"""Remote twins: another deployment standing for a chain step, routed to as a local twin is, started by no one here.

A ``routing.twins`` entry with a ``url`` (:class:`~specops.config.routing.RemoteTwin`) is one more engine behind the
proxy (an :class:`~specops.proxy.routes.EngineUpstream`) that this ``specops up`` does not run: a
:class:`RemoteEngine` health-checks it in place of a supervisor, and puts it in or takes it out of the routes. The
class routing, aliases, the client's header, the canary and the fallback's route changes treat it as the twin of its
method; while it is down its requests go to a live engine here, as a dead local twin's do.

The check, every :data:`CHECK_INTERVAL`: its ``/specops/status`` (with its key) when it is a specops proxy, which
must report the declared method and a proxy that serves; else (a plain engine, a Service in front of one) its
``/health``. Its round trip is the hop's latency as a health check sees it; the requests' own durations are kept by
the proxy (:attr:`~specops.proxy.routes.EngineUpstream.latency`). Both are in ``specops status`` and the metrics.

The key comes from the environment variable ``api_key_env`` names (:func:`remote_keys`: ``specops up`` refuses to
start without it) and is sent in place of the client's ``Authorization``: a client's key never reaches another
deployment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp

from specops.config.loaded import LoadedProfile
from specops.config.routing import RemoteTwin
from specops.errors import ProfileError
from specops.proxy.routes import EngineHandle
from specops.urls import redact_text, redact_url

__all__ = ["CHECK_INTERVAL", "RemoteEngine", "remote_authorization", "remote_keys", "remote_metrics"]

log = logging.getLogger("specops.serve.remote")

#: Seconds between two health checks of a remote twin (and the longest one may take).
CHECK_INTERVAL = 1.0
CHECK_TIMEOUT = 3.0
#: The proxy states of a remote specops in which it serves (else its requests would wait or be refused there).
_SERVING = "serving"


def remote_keys(loaded: LoadedProfile, environ: Mapping[str, str]) -> dict[str, str]:
    """Each remote twin's ``Authorization`` value, by URL ("" without ``api_key_env``); raises
    :class:`~specops.errors.ProfileError`, located at the field, when a named variable is unset or empty."""
    out, problems = {}, []
    for i, twin in enumerate(loaded.profile.routing.twins):
        if not isinstance(twin, RemoteTwin):
            continue
        auth = remote_authorization(twin, environ)
        if auth is None:
            problems.append(
                loaded.problem(
                    ("routing", "twins", i, "api_key_env"),
                    f"${twin.api_key_env} is unset or empty: export the remote twin's API key in it before "
                    "`specops up` (or remove api_key_env when it needs none)",
                )
            )
        out[twin.url] = auth or ""
    if problems:
        raise ProfileError(problems)
    return out


def remote_authorization(twin: RemoteTwin, environ: Mapping[str, str]) -> str | None:
    """``Bearer <key>`` from the twin's ``api_key_env``; "" when it names none; None when it is unset or empty."""
    if twin.api_key_env is None:
        return ""
    key = environ.get(twin.api_key_env, "").strip()
    return f"Bearer {key}" if key else None


class RemoteEngine:
    """One remote twin: health checks drive its upstream in the proxy. It offers what :class:`TwinEngines` asks of
    a twin's supervisor (``run``, ``request_stop``, ``snapshot``, ``plan``), so both sit in one list."""

    plan = None  # no launch plan: nothing starts here

    def __init__(
        self,
        twin: RemoteTwin,
        authorization: str,
        handle: EngineHandle,
        *,
        events,
        say: Callable[[str], None],
        on_change: Callable[[], None] = lambda: None,
        interval: float = CHECK_INTERVAL,
    ):
        self.twin, self.authorization, self.handle = twin, authorization, handle
        self.events, self.say, self.on_change = events, say, on_change
        self.interval = interval
        self.shown = redact_url(twin.url)
        self.reported_method: str | None = None  # what its /specops/status says it runs (None: not a specops proxy)
        self.reason = "not checked yet"
        self.rtt: float | None = None  # the last health check's round trip, seconds
        self.rtt_max = 0.0
        self.checks = self.failed_checks = self.outages = 0
        self.checked_at: float | None = None
        self.ok = False  # the last health check passed
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ a twin's supervisor's surface
    async def run(self) -> int:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT), trust_env=False, cookie_jar=aiohttp.DummyCookieJar()
        ) as session:
            while not self._stop.is_set():
                await self.check(session)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
        return 0  # its upstream is closed by whoever stopped it (specops stopping, a reload retiring it)

    def request_stop(self, why: str) -> None:
        self._stop.set()

    def retarget(self, twin: RemoteTwin, authorization: str) -> bool:
        """A reloaded profile kept this twin (same URL and method): its key may have changed. True when it did
        (the next check sends the new one, and so do the requests once it passes)."""
        changed = authorization != self.authorization
        self.twin, self.authorization = twin, authorization
        if changed and self.handle.live:
            self.handle.release_remote(self.twin.url, authorization)
        return changed

    def snapshot(self) -> dict:
        live = self.handle.live
        lat = self.handle.latency
        p50, p99 = lat.quantile(0.5), lat.quantile(0.99)
        return {
            "state": "stopped" if self._stop.is_set() else "ready" if live else "down",
            "engine_pid": None,
            "restarts": 0,
            "engine_url": self.twin.url,
            "remote": {
                "url": self.shown,
                "method": self.twin.method.value,
                "reported_method": self.reported_method,
                "live": live,
                "reason": self.reason,
                "checked_at": self.checked_at,
                "checks": self.checks,
                "failed_checks": self.failed_checks,
                "outages": self.outages,
                "health_rtt_ms": _ms(self.rtt),
                "health_rtt_max_ms": _ms(self.rtt_max),
                "requests": lat.count,
                "request_p50_ms": _ms(p50),
                "request_p99_ms": _ms(p99),
            },
        }

    # ------------------------------------------------------------------ the health check
    async def check(self, session: aiohttp.ClientSession) -> bool:
        """One health check; the remote goes in or out of the routes on what it finds. True when it passed."""
        t0 = time.monotonic()
        ok, reason, reported = await self._probe(session)
        self.rtt = time.monotonic() - t0
        self.rtt_max = max(self.rtt_max, self.rtt)
        self.checks += 1
        self.checked_at = round(time.time(), 3)
        self.reported_method = reported
        if not ok:
            self.failed_checks += 1
        passed_before, self.ok, self.reason = self.ok, ok, reason
        if ok and not self.handle.live:  # passed, or passes again after a request failed on it (routes.unstarted)
            self.handle.release_remote(self.twin.url, self.authorization)
        elif not ok and self.handle.live:
            self.handle.hold()  # new requests go to a live engine here; those in flight finish there (or are retried)
        if ok != passed_before or self.checks == 1:
            self.outages += passed_before and not ok
            self._changed(ok, reason)
        return ok

    async def _probe(self, session: aiohttp.ClientSession) -> tuple[bool, str, str | None]:
        """(passed, why, the method it reports): its ``/specops/status`` first, its ``/health`` when it has none."""
        headers = {"Authorization": self.authorization} if self.authorization else {}
        url = self.twin.url
        try:
            async with session.get(url + "/specops/status", headers=headers, allow_redirects=False) as r:
                status = r.status
                body = await r.content.read(1 << 20) if status == 200 else b""
            if status in (401, 403):
                return False, f"its /specops/status refused the key ({status}): check api_key_env", None
            doc = _json_object(body)
            if doc is not None and isinstance(doc.get("method"), str):
                return self._judge(doc)
            async with session.get(url + "/health", headers=headers, allow_redirects=False) as r:
                status = r.status
            if status == 200:
                return True, "its /health answers 200 (not a specops proxy: its method is taken as declared)", None
            return False, f"its /health answers {status}", None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return False, redact_text(f"unreachable: {type(exc).__name__} {exc}".strip()), None

    def _judge(self, doc: dict) -> tuple[bool, str, str | None]:
        reported = doc["method"]
        proxy = doc.get("proxy") if isinstance(doc.get("proxy"), dict) else {}
        state = proxy.get("state")
        declared = self.twin.method.value
        if reported != declared:
            return False, f"it reports method {reported[:40]!r}, not the declared {declared!r}", reported[:40]
        if state is not None and state != _SERVING:
            return False, f"its proxy is {str(state)[:20]!r}, not serving", reported
        return True, f"its /specops/status reports {declared}, serving", reported

    def _changed(self, live: bool, reason: str) -> None:
        self.events.emit("remote", url=self.shown, live=live, reason=reason)
        where = "routed to again" if live else "out of the routes: its requests go to a live engine here"
        self.say(f"remote twin {self.shown} ({self.twin.method}) {where}: {reason}")
        self.on_change()


def _json_object(body: bytes) -> dict | None:
    try:
        doc = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def remote_metrics(engines: list[tuple[str, RemoteEngine]]):
    """The remote twins' Prometheus families, for the twins' collector: ``(engine label, remote)`` pairs."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    if not engines:
        return
    up = GaugeMetricFamily(
        "specops_remote_twin_up", "A remote twin passes its health checks (1) or not (0)", labels=["engine"]
    )
    rtt = GaugeMetricFamily(
        "specops_remote_twin_health_rtt_seconds", "Round trip of a remote twin's last health check", labels=["engine"]
    )
    checks = CounterMetricFamily(
        "specops_remote_twin_health_checks", "Health checks of a remote twin, by result", labels=["engine", "result"]
    )
    outages = CounterMetricFamily(
        "specops_remote_twin_outages",
        "Times a remote twin left the routes (its traffic went to a local engine)",
        labels=["engine"],
    )
    hist = HistogramMetricFamily(
        "specops_remote_twin_request_seconds",
        "Requests a remote twin answered, from routing to their last byte (the hop included)",
        labels=["engine"],
    )
    for name, r in engines:
        up.add_metric([name], 1.0 if r.handle.live else 0.0)
        if r.rtt is not None:
            rtt.add_metric([name], r.rtt)
        checks.add_metric([name, "ok"], r.checks - r.failed_checks)
        checks.add_metric([name, "failed"], r.failed_checks)
        outages.add_metric([name], r.outages)
        hist.add_metric([name], r.handle.latency.buckets(), r.handle.latency.sum)
    yield from (up, rtt, checks, outages, hist)
