"""The watcher: read acceptance every ``monitor.interval``, window it, ask the policy, act on its decision.

The watcher is the effectful shell around the pure parts: :mod:`specops.watch.sources` reads, :mod:`specops.watch.window`
windows, :mod:`specops.watch.policy` decides (through :mod:`specops.watch.decide`, which also logs every
decision). Under ``specops up`` it acts with the ``act`` callable it is given (a switch order to the
supervisor: hold the proxy, drain, stop, start the next method, release) and follows the supervisor
through its events (:meth:`Watcher.on_event`). Under ``specops watch`` it only reports and recommends,
and can run a command or call a webhook on each decision.

Every notable decision goes to the event log, to specops' own ``/metrics`` and, through
:meth:`Watcher.snapshot` and the decider's snapshot, to the state file that ``specops status`` reads.

Bounds: a read every :data:`MIN_INTERVAL` seconds at most (a smaller interval is raised to it, so a bad
setting can never busy-loop the engine's ``/metrics``), a window of at most :data:`MAX_WINDOW`, and a
webhook is an ``http``/``https`` URL with a host whose userinfo, query values and token-like path
segments are never printed (:mod:`specops.urls`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specops.backends.counters import SpecCounters
from specops.errors import SpecopsError
from specops.run.events import EngineLine, EngineReady, State, StateChanged
from specops.urls import check_http_url, redact_text, redact_url, split_userinfo
from specops.watch.decide import FallbackDecider
from specops.watch.decision import Decision
from specops.watch.goodput import Load
from specops.watch.policy import Policy
from specops.watch.sources import LogLineSource, PromQLSource, ScrapeSource, SourceError, promql_labels
from specops.watch.window import Sample, SampleBuffer, WindowStats

#: The shortest time between two reads: a smaller ``monitor.interval`` / ``--interval`` is not allowed.
MIN_INTERVAL = 0.1
#: The longest time between two reads.
MAX_INTERVAL = 3600.0
#: The longest acceptance window.
MAX_WINDOW = 86400.0
#: Samples one window may hold (window / interval): more would only cost memory.
MAX_WINDOW_SAMPLES = 100_000


def watch_interval(seconds: float) -> float:
    """The interval the watcher uses: at least :data:`MIN_INTERVAL`; raises SpecopsError unless finite."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        raise SpecopsError(f"monitor.interval must be a finite number of seconds, got {seconds!r}")
    return min(max(float(seconds), MIN_INTERVAL), MAX_INTERVAL)


class LiveCounters:
    """Spec-decode totals added up from per-response ``timings`` the proxy sees (llama.cpp).

    llama-server's own counters move only when a request finishes; with ``timings_per_token`` the proxy
    sees acceptance chunk by chunk, so the window is current even during long generations.
    """

    def __init__(self) -> None:
        self.draft_tokens = 0
        self.accepted = 0

    def add(self, draft_n: int, accepted: int) -> None:
        self.draft_tokens += draft_n
        self.accepted += accepted

    def read(self) -> SpecCounters:
        return SpecCounters(
            draft_tokens=float(self.draft_tokens), accepted=float(self.accepted), source="proxy-timings"
        )

    def reset(self) -> None:
        self.draft_tokens = self.accepted = 0


#: Gauges of requests an engine is running or holding (summed over their series) when its backend object has no
#: ``running_requests(metrics_text)``: the names the built-in engines use, under the backend's ``metric_prefix``.
LOAD_GAUGES = ("num_requests_running", "num_requests_waiting", "requests_processing", "requests_deferred")


def engine_load(backend: Any, metrics_text: str | None) -> float | None:
    """Requests the engine runs or holds now, from its /metrics text: ``backend.running_requests(text)`` when the
    backend has it, else the sum of :data:`LOAD_GAUGES` under its prefix; None when none is exposed."""
    if not metrics_text:
        return None
    ask = getattr(backend, "running_requests", None)
    if callable(ask):
        return ask(metrics_text)
    prefix = re.escape(getattr(backend, "metric_prefix", "") or "")
    names = "|".join(LOAD_GAUGES)
    found = re.findall(rf"^{prefix}(?:{names})(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", metrics_text, re.M)
    if not found:
        return None
    try:
        return sum(float(v) for v in found)
    except ValueError:
        return None


@dataclass
class Reading:
    stats: WindowStats
    tokens_per_s: float | None = None
    counters: SpecCounters | None = None
    engine_load: float | None = None  # requests the engine runs or holds (its gauges), when exposed


@dataclass
class AcceptanceReader:
    """Reads the current engine's acceptance over the window, from the source the profile names."""

    source: str  # "scrape" | "promql"
    backend: Any  # reads its own acceptance from /metrics text
    window_s: float
    timeout: float
    prometheus_url: str | None = None
    labels: dict = field(default_factory=dict)
    live: LiveCounters | None = None
    log: LogLineSource | None = None
    _scrape: ScrapeSource | None = None
    _promql: PromQLSource | None = None
    _buffer: SampleBuffer | None = None
    _live_buffer: SampleBuffer | None = None
    _generated: list = field(default_factory=list)
    _model_name: str | None = None

    @classmethod
    def for_profile(cls, profile, backend, *, live: LiveCounters | None = None) -> AcceptanceReader:
        """The reader ``specops up`` uses: the profile's ``monitor`` source and window; ``live`` when the proxy
        feeds per-request timings (``backend.live_timings``), and the engine's own acceptance log lines when
        the backend writes them (``backend.log_acceptance``)."""
        m = profile.monitor
        return cls(
            m.source,
            backend,
            profile.fallback.window,
            m.timeout,
            m.prometheus_url,
            dict(m.labels),
            live=live,
            log=LogLineSource() if backend.log_acceptance else None,
        )

    def attach(self, metrics_url: str, model_name: str | None, headers: dict | None = None) -> None:
        """A new engine (or method): start a fresh window, so one window never mixes two methods."""
        self._scrape = ScrapeSource(metrics_url, self.prefix, model_name, self.timeout, headers)
        self._model_name = model_name
        if self.source == "promql":
            if self._promql is not None:
                self._promql.close()
            self._promql = PromQLSource(
                self.prometheus_url,
                self.prefix,
                promql_labels(self.backend.model_name_label, self.labels, model_name),
                self.window_s,
                timeout=self.timeout,
            )
        self._buffer = SampleBuffer(self.window_s)
        self._live_buffer = SampleBuffer(self.window_s)
        self._generated = []
        if self.live is not None:
            self.live.reset()
        if self.log is not None:
            self.log.reset()

    def read_blocking(self, now: float) -> Reading:
        """One tick (blocking I/O: run it in a thread). Never raises for an unreadable source."""
        assert self._scrape is not None and self._buffer is not None
        try:
            text, openmetrics = self._scrape.fetch()
        except SourceError as exc:
            text, openmetrics, scrape_error = None, False, str(exc)
        else:
            scrape_error = None
        tps = self._tokens_per_s(text, now) if text is not None else None
        load = engine_load(self.backend, text)
        if self._promql is not None:
            try:
                return Reading(self._promql.read(now=now), tps, engine_load=load)
            except SourceError as exc:
                return Reading(WindowStats.unavailable(now, str(exc), self.window_s), tps, engine_load=load)
        if scrape_error is not None:
            return Reading(WindowStats.unavailable(now, scrape_error, self.window_s))
        try:
            counters = self.backend.acceptance_counters(text, self._model_name, openmetrics)
        except ValueError as exc:
            return Reading(
                WindowStats.unavailable(now, f"{self._scrape.shown_url}: {redact_text(str(exc))}", self.window_s), tps
            )
        if counters is None and self.log is not None and self.log.lines:
            counters = self.log.read()  # llama-server builds without spec counters: the per-request log line
        self._buffer.add(Sample(now, counters))
        stats = self._buffer.stats(now)
        if self.live is not None:
            # llama.cpp's counters move only when a request finishes; the proxy sees timings chunk by chunk.
            # Each source is windowed on its own (mixing them would look like counter resets); the window
            # that saw more drafted tokens is the current one: the proxy's while long requests run, else
            # the engine's, which also counts drafts and positions.
            live = self.live.read()
            self._live_buffer.add(Sample(now, live))
            live_stats = self._live_buffer.stats(now)
            if live_stats.status == "ok" and (stats.status != "ok" or live_stats.draft_tokens > stats.draft_tokens):
                return Reading(live_stats, tps, counters, load)  # totals seen stay the engine's (one source)
        return Reading(stats, tps, counters, load)

    @property
    def prefix(self) -> str:
        return self.backend.metric_prefix

    def _tokens_per_s(self, text: str, now: float) -> float | None:
        total = self.backend.generated_tokens(text)
        if total is None:
            return None
        self._generated.append((now, total))
        self._generated = [(t, v) for t, v in self._generated if now - t <= self.window_s] or [(now, total)]
        (t0, v0), (t1, v1) = self._generated[0], self._generated[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 and v1 >= v0 else None

    def close(self) -> None:
        if self._promql is not None:
            self._promql.close()


class SpecopsMetrics:
    """specops' own /metrics: what it measured and what it decided (prometheus_client)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.method = Gauge(
            "specops_active_method", "1 for the speculative method the engine runs now", ["method"], registry=r
        )
        self.state = Gauge("specops_supervisor_state", "1 for the supervisor's current state", ["state"], registry=r)
        self.acceptance = Gauge(
            "specops_acceptance_rate", "Draft acceptance over the window (NaN: no data)", registry=r
        )
        self.length = Gauge(
            "specops_mean_acceptance_length",
            "Mean tokens per target step over the window (1 + accepted/drafts; NaN: no data)",
            registry=r,
        )
        self.window_tokens = Gauge("specops_window_draft_tokens", "Drafted tokens in the current window", registry=r)
        self.drafted = Counter("specops_draft_tokens_seen", "Drafted tokens seen by the watcher", registry=r)
        self.accepted = Counter("specops_accepted_tokens_seen", "Accepted draft tokens seen by the watcher", registry=r)
        self.decisions = Counter(
            "specops_decisions", "Policy decisions other than a plain keep", ["action", "rule"], registry=r
        )
        self.fallbacks = Counter(
            "specops_fallbacks", "Method switches", ["from_method", "to_method", "reason"], registry=r
        )
        self.switch_seconds = Histogram(
            "specops_switch_duration_seconds",
            "From the decision to the new engine being ready",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.restarts = Gauge("specops_engine_restarts", "Engine restarts after a crash (same method)", registry=r)
        self.source_up = Gauge(
            "specops_source_up", "1 when the acceptance source could be read at the last tick", registry=r
        )
        self.tokens_per_s = Gauge(  # per replica in `specops status --fleet` (the engine's own names differ)
            "specops_tokens_per_second",
            "Generated tokens per second over the window, from the engine's counter (NaN: not exposed)",
            registry=r,
        )
        self._last: SpecCounters | None = None

    def observe(self, reading: Reading) -> None:
        s = reading.stats
        self.source_up.set(0 if s.status == "unavailable" else 1)
        self.acceptance.set(s.acceptance if s.acceptance is not None else math.nan)
        self.length.set(s.mean_acceptance_length if s.mean_acceptance_length is not None else math.nan)
        self.window_tokens.set(s.draft_tokens or 0)
        self.tokens_per_s.set(reading.tokens_per_s if reading.tokens_per_s is not None else math.nan)
        c = reading.counters
        if c is not None and not c.coarse:
            last = self._last
            if last is not None and c.draft_tokens >= last.draft_tokens and c.accepted >= last.accepted:
                self.drafted.inc(c.draft_tokens - last.draft_tokens)
                self.accepted.inc(c.accepted - last.accepted)
            elif last is None or c.draft_tokens < last.draft_tokens:  # first reading, or a restart
                self.drafted.inc(c.draft_tokens)
                self.accepted.inc(c.accepted)
            self._last = c

    def new_engine(self) -> None:
        self._last = None

    def set_method(self, method: str, all_methods: list[str]) -> None:
        for m in all_methods:
            self.method.labels(m).set(1 if m == method else 0)

    def set_state(self, state: str) -> None:
        for s in State:
            self.state.labels(s.value).set(1 if s.value == state else 0)


class Watcher:
    """The loop: every interval read → window → decide → act.

    Decisions come from ``decider`` (a :class:`~specops.watch.decide.FallbackDecider`: the policy, the
    decision log). ``act(decision) -> bool`` performs a switch (under ``specops up``: a
    :class:`~specops.run.events.SwitchOrder` to the supervisor; False when it cannot take it now); without
    ``act`` the watcher only recommends, through ``on_recommend(decision, stats)``. ``concurrency()`` (optional)
    is the number of requests in flight (the proxy's); without it, mode goodput uses the engine's gauges of running
    and waiting requests. ``on_tick()`` runs after
    each handled reading (``specops up`` writes its state file then). Under ``specops up`` the watcher is
    a supervisor listener (:meth:`on_event`): it reads only while an engine is ready, and starts a fresh
    window for each new engine. :meth:`snapshot` is what it shows in ``specops status``.
    """

    def __init__(
        self,
        profile,
        reader: AcceptanceReader,
        decider: FallbackDecider,
        *,
        say: Callable[[str], None],
        act: Callable[[Decision], bool] | None = None,
        on_recommend: Callable[[Decision, WindowStats], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        metrics: SpecopsMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        concurrency: Callable[[], float | None] | None = None,
    ):
        self.profile = profile
        self.reader = reader
        self.decider = decider
        self.say = say
        self.act = act
        self.on_recommend = on_recommend
        self.on_tick = on_tick or (lambda: None)
        self.metrics = metrics
        self.clock = clock
        self.concurrency = concurrency
        self.interval = watch_interval(profile.monitor.interval)
        self.attached = False  # the reader follows an engine (under `up`: since the first EngineReady)
        self.serving = False  # under `up`: the supervisor is READY
        self.last_decision: Decision | None = None
        self.decided_at: dict = {}
        self._status: dict = {}
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    @property
    def policy(self) -> Policy:
        return self.decider.policy

    def snapshot(self) -> dict:
        """The last window read and tokens/s (empty before the first reading), for the state file."""
        return dict(self._status)

    # ------------------------------------------------------------------ the supervisor's events
    def on_event(self, event) -> None:
        """A supervisor listener: follow the engine (lines, ready, state changes)."""
        if isinstance(event, EngineLine):
            if self.reader.log is not None:
                self.reader.log.feed(event.line)
        elif isinstance(event, EngineReady):
            self._on_engine_ready(event)
        elif isinstance(event, StateChanged):
            self.serving = event.state is State.READY
            if self.metrics is not None:
                self.metrics.set_state(event.state.value)
                self.metrics.restarts.set(event.restarts)

    def _on_engine_ready(self, event: EngineReady) -> None:
        now = self.clock()
        decision = self.last_decision
        if (
            decision is not None
            and decision.acts
            and decision.to_index == event.index
            and id(decision) in self.decided_at
        ):
            took = max(0.0, now - self.decided_at.pop(id(decision)))
            self.policy.note_switch_cost(took)  # mode goodput weighs the next switch against it
            if self.metrics is not None:
                self.metrics.switch_seconds.observe(took)
        plan = event.plan
        self.reader.attach(plan.metrics_url, plan.model_name, plan.auth_headers)
        self.attached = True
        self.serving = True
        if self.metrics is not None:
            self.metrics.new_engine()
            self.metrics.set_method(event.method.value, [s.method.value for s in self.profile.steps])

    def repoint(self, profile, policy: Policy, reader: AcceptanceReader) -> None:
        """A reloaded profile (``specops up`` on SIGHUP): decide with its ``policy`` (the decider's from now on),
        read with its monitor settings; the engine it restarts gets a fresh window when ready."""
        old = self.reader
        self.profile, self.reader = profile, reader
        self.interval = watch_interval(profile.monitor.interval)
        if policy.rule.line() != self.decider.policy.rule.line():
            self.say(policy.rule.line())
        self.decider.policy = policy
        self.attached = False
        self.last_decision = None
        self.decided_at.clear()
        if old is not reader:
            old.close()

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Run :meth:`_loop` in the background (under ``specops up``) until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=self.interval)
                break
            except asyncio.TimeoutError:
                pass
            if not (self.serving and self.attached):
                continue
            await self.tick()

    async def tick(self) -> Decision:
        now = self.clock()
        reading = await asyncio.to_thread(self.reader.read_blocking, now)
        return self.handle(reading, now)

    def load(self, reading: Reading) -> Load:
        """This tick's concurrency (the proxy's requests in flight and waiting, else the engine's gauges) and tokens/s
        (the watched engine's; none while a twin serves the step in effect: the idle primary's would say the step
        makes nothing)."""
        conc, source = None, ""
        if self.concurrency is not None:
            conc, source = self.concurrency(), "proxy in flight + waiting"
        if conc is None and reading.engine_load is not None:
            conc, source = reading.engine_load, "engine running + waiting"
        tps = reading.tokens_per_s if self.decider.routed_step is None else None
        return Load(conc, tps, source)

    def handle(self, reading: Reading, now: float) -> Decision:
        stats = reading.stats
        decision = self.decider.observe(stats, now, self.load(reading))
        if self.metrics is not None:
            self.metrics.observe(reading)
            if decision.notable:
                self.metrics.decisions.labels(decision.action.value, decision.rule).inc()
        self._status = {"acceptance": stats.to_dict(), "tokens_per_s": reading.tokens_per_s}
        if decision.acts:
            self.last_decision = decision
            self.decided_at[id(decision)] = now
            if self.act is None:  # watch-only: recommend, and let the next fresh low window recommend again
                if self.on_recommend is not None:
                    self.on_recommend(decision, stats)
                self.decider.not_executed(decision)
                self.on_tick()
                return decision
            self.say(
                f"decision: {decision.action} {decision.from_method} → {decision.to_method} "
                f"[{decision.rule}] {decision.reason}"
            )
            if self.act(decision):
                if self.metrics is not None:
                    self.metrics.fallbacks.labels(
                        decision.from_method.value, decision.to_method.value, decision.rule
                    ).inc()
            else:
                self.decider.not_executed(decision)
        self.on_tick()
        return decision

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self.reader.close()


# ---------------------------------------------------------------------- `specops watch`: read-only


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 - a webhook is not followed
        return None


def check_webhook(url: str) -> str:
    """``url`` when it can be a webhook (``http``/``https`` with a host); raises SpecopsError, URL redacted."""
    try:
        return check_http_url(url, "webhook")
    except ValueError as exc:
        raise SpecopsError(str(exc)) from None


def notify(
    decision: Decision,
    stats: WindowStats,
    *,
    command: list[str] | None,
    webhook: str | None,
    say: Callable[[str], None],
    timeout: float = 10.0,
) -> None:
    """Run ``command`` (decision JSON on stdin and in $SPECOPS_DECISION) and/or POST it to ``webhook``.

    The command is an argv list run without a shell; its stderr is kept to the last 200 bytes. The webhook
    must be ``http``/``https``; credentials in it are sent as Basic auth, redirects are not followed, and
    its URL is printed redacted."""
    payload = json.dumps({"decision": decision.to_dict(), "window": stats.to_dict()}, default=str)
    if command:
        try:
            with tempfile.TemporaryFile() as err:
                res = subprocess.run(
                    command,
                    input=payload,
                    text=True,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    timeout=timeout,
                    env={**os.environ, "SPECOPS_DECISION": payload},
                )
                tail = ""
                if res.returncode:
                    err.seek(0, os.SEEK_END)
                    err.seek(max(0, err.tell() - 200))
                    tail = err.read().decode("utf-8", "replace").strip()
            say(f"on-decision command exited {res.returncode}" + (f": {redact_text(tail)}" if tail else ""))
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            say(f"warning: on-decision command failed: {redact_text(str(exc))[:300]}")
    if webhook:
        shown = redact_url(webhook)
        try:
            check_http_url(webhook, "webhook")
            url, creds = split_userinfo(webhook)
            headers = {"Content-Type": "application/json", "User-Agent": "specops"}
            if creds is not None:
                token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
                headers["Authorization"] = f"Basic {token}"
            req = urllib.request.Request(url, data=payload.encode(), headers=headers, method="POST")
            opener = urllib.request.build_opener(_NoRedirect())
            with opener.open(req, timeout=timeout) as resp:
                say(f"webhook answered {resp.status}")
        except urllib.error.HTTPError as exc:
            say(f"warning: webhook {shown} answered HTTP {exc.code}")
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            say(f"warning: webhook {shown} failed: {redact_text(str(reason))[:300]}")
