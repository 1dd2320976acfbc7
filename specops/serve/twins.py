"""Twins: chain steps kept warm as engines of their own beside the primary, behind the same proxy.

Each twin runs under its own :class:`~specops.run.supervise.Supervisor` (today's state machine: own loopback port,
own log, restart with back-off, crash-loop guard); its supervisor drives the twin's upstream in the proxy through an
:class:`~specops.proxy.routes.EngineHandle`, so a twin that dies takes no requests until it is ready again while
the others serve. Twins start in chain order, each once the engine before it is ready (or has given up). A twin
that cannot run is not replaced by another step: it is left out (FATAL for that twin) and the others serve.

Where requests go is the router's (:mod:`specops.proxy.router`); whether a request class speculates is the one
decider's (:meth:`specops.watch.decide.FallbackDecider.route_class`), asked here every ``monitor.interval``; a switch
the decider orders to a step a live twin runs is a route change (:meth:`TwinEngines.route_to`): no hold, no drain,
no restart, and every change of route is a ``route`` event with its reason.

A reloaded profile whose draft changed, with ``routing.canary`` on, is measured first by a canary engine beside
the others (:mod:`specops.serve.canary`, whose methods :class:`TwinEngines` has).

A remote twin (another deployment standing for a step, :mod:`specops.serve.remote`) takes a twin's place in every
list here, its health checks in place of a supervisor: nothing starts for it, nothing waits for it to start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from specops.proxy.router import EngineInfo, Route, Router
from specops.proxy.routes import EngineHandle, EngineUpstream, RoutedUpstreams, drain_generation
from specops.run.events import EngineReady, FallbackOrder, State, StateChanged, StepChanged, StepFailed
from specops.run.start import free_port
from specops.run.supervise import ReloadOrder, Supervisor
from specops.serve.canary import Canary, CanaryMixin, TaggedEvents, canary_metrics
from specops.serve.remote import RemoteEngine, remote_authorization, remote_metrics
from specops.watch.canary import CANARY, CURRENT
from specops.watch.classes import ClassTable

__all__ = ["TwinEngines", "engine_infos"]

log = logging.getLogger("specops.serve.twins")


def engine_infos(profile) -> list[EngineInfo]:
    """The engines of ``profile``: the primary (step 0), then one per twin, local or remote, in chain order."""
    steps = profile.steps
    local = set(profile.routing.local_twins)
    remote = {t.method: t.url for t in profile.routing.remote_twins}
    out = [EngineInfo(0, steps[0].method.value, steps[0].method.value != "none")]
    for i, step in enumerate(steps[1:], start=1):
        m = step.method
        if m in local or m in remote:
            out.append(EngineInfo(i, m.value, m.value != "none", remote=remote.get(m) if m not in local else None))
    return out


def _remote_twin(profile, info: EngineInfo):
    """The ``routing.twins`` entry of a remote engine."""
    return next(t for t in profile.routing.remote_twins if t.url == info.remote and t.method.value == info.method)


def _identity(info: EngineInfo) -> tuple[str, str | None]:
    """What a reload keeps a twin by: its method, and for a remote twin its URL."""
    return info.method, info.remote


def _served_name(profile) -> str:
    """The model name the engines serve, before a launch plan says it: ``model.served_name``, else the id (vLLM's
    default; llama-server answers whatever name a request gives)."""
    return profile.model.served_name or profile.model.id


def _class_table(c) -> ClassTable | None:
    """The class windows ``routing.classes`` asks for (None: no learned routing)."""
    return ClassTable(c.max_classes, c.window, c.explore) if c.key != "none" else None


class _TwinDecider:
    """A twin that cannot run stays out (its supervisor goes FATAL); the others serve. Logged as a decision."""

    def __init__(self, events, say: Callable[[str], None]):
        self.events, self.say = events, say

    def decide_after_failure(self, failure: StepFailed) -> FallbackOrder:
        self.events.emit("decision", action="twin-out", **{"from": failure.method.value}, reason=failure.reason)
        self.say(f"twin {failure.method} is left out: {failure.reason}; the other engines serve")
        return FallbackOrder(None, failure.reason)


class TwinEngines(CanaryMixin):
    """The twins of one ``specops up``: their supervisors, the routed upstreams, the class decisions."""

    def __init__(
        self,
        profile,
        *,
        decider,
        events,
        say: Callable[[str], None],
        render_twin: Callable[[Any, int, int], Callable[[int], Any]],
        log_path: Callable[[str], Any],
        health_interval: float,
        launch_problem: Callable[[str], str | None] | None,
        on_change: Callable[[], None] = lambda: None,
        metrics=None,
        environ: Mapping[str, str] = os.environ,
    ):
        self.profile = profile
        self.environ = environ  # where remote twins' keys are read (``api_key_env``)
        self.decider = decider
        self.events = events
        self.say = say
        self.on_change = on_change
        self.render_twin = render_twin  # (profile, step, port) -> render(index): the twin's launch plans
        self.canary: Canary | None = None
        # how the last canary ended (rolled back: why the file's draft is not the one that runs), and the counts
        self.last_canary: dict | None = None
        self.canary_outcomes: dict[str, int] = {"rolled_out": 0, "rolled_back": 0, "aborted": 0}
        self.log_path = log_path
        self.health_interval = health_interval
        self.launch_problem = launch_problem
        self.classes = _class_table(profile.routing.classes)
        self.router = Router(profile.routing, engine_infos(profile), self.classes)
        self.router.served = _served_name(profile)  # until an engine's launch plan says it (EngineReady)
        self.upstreams = RoutedUpstreams(self.router, on_route=self._on_route)
        self.supervisors: list[Supervisor | RemoteEngine] = []
        self._handles: list[EngineHandle] = []  # aligned with supervisors (position = index + 1)
        self._ports: list[int | None] = []  # None: a remote twin
        self._ready = [asyncio.Event() for _ in self.router.engines]  # engine i is ready or gave up
        self._tasks: list[asyncio.Task] = []
        self._deciding: asyncio.Task | None = None
        self._started = False
        self._stopping = False
        self.route_changes = 0
        for position, info in enumerate(self.router.engines[1:], start=1):
            self._add_engine(position, info)
        decider.set_warm(self.warm_steps)
        if metrics is not None:
            metrics.registry.register(_RoutingCollector(self))

    def _add_engine(self, position: int, info: EngineInfo) -> Supervisor | RemoteEngine:
        if info.remote is None:
            return self._add_twin(position, info, free_port())
        twin = _remote_twin(self.profile, info)
        remote = RemoteEngine(
            twin,
            remote_authorization(twin, self.environ) or "",  # `up` refused to start without it (remote_keys)
            self.upstreams.handle(position),
            events=TaggedEvents(self.events, f"remote-{info.method}"),
            say=self.say,
            on_change=self.on_change,
        )
        self.supervisors.insert(position - 1, remote)
        self._handles.insert(position - 1, remote.handle)
        self._ports.insert(position - 1, None)
        self._ready[position].set()  # nothing starts here: no local twin waits for it
        return remote

    def _add_twin(self, position: int, info: EngineInfo, port: int) -> Supervisor:
        name = f"twin-{info.method}"
        tagged = TaggedEvents(self.events, name)
        say = self.say
        handle = self.upstreams.handle(position)
        sup = Supervisor(
            self.profile.at_step(info.step),
            self.render_twin(self.profile, info.step, port),
            events=tagged,
            say=lambda msg, name=name: say(f"[{name}] {msg}"),
            decider=_TwinDecider(tagged, lambda msg, name=name: say(f"[{name}] {msg}")),
            listeners=(lambda ev, handle=handle: self._on_twin_event(handle.position, ev),),
            log_path=self.log_path(name),
            proxy=handle,
            health_interval=self.health_interval,
            launch_problem=self.launch_problem,
        )
        self.supervisors.insert(position - 1, sup)
        self._handles.insert(position - 1, handle)
        self._ports.insert(position - 1, port)
        return sup

    # ------------------------------------------------------------------ wiring
    def attach(self, proxy) -> None:
        proxy.routes = self.upstreams
        self.upstreams.attach(proxy)

    def on_primary_event(self, event) -> None:
        """A listener of the primary's supervisor: twins start once it is ready (or gave up); a step change of
        the primary (a fallback, a reload) changes what engine 0 runs."""
        if isinstance(event, EngineReady) or (
            isinstance(event, StateChanged) and event.state in (State.FATAL, State.STOPPED)
        ):
            self._ready[0].set()
        self._plan_served(event)
        if isinstance(event, StepChanged) and self.canary is not None:
            self._roll_back(self.canary, f"the primary moved to {event.to_method} during the canary")
        if isinstance(event, (EngineReady, StepChanged)):
            index = event.index if isinstance(event, EngineReady) else event.to_index
            method = event.method if isinstance(event, EngineReady) else event.to_method
            self.upstreams.set_engine(0, EngineInfo(index, method.value, method.value != "none"))
            self.follow_decider("the primary engine " + ("is ready" if isinstance(event, EngineReady) else "moved"))

    def follow_decider(self, why: str) -> bool:
        """Point the default route at the engine that runs the decider's step in effect: a twin when a route change
        put it there (and the decider still runs that step), else the primary. One truth: the policy's step; the
        router follows it (a listener of the primary's supervisor, after the decider's). True when it moved."""
        step = self.decider.routed_step
        want = 0
        if step is not None:
            want = next(
                (i for i, e in enumerate(self.router.engines) if i > 0 and e.step == step and i != self.router.canary),
                0,
            )
        old = self.router.current
        if want == old:
            return False
        self.router.current = want
        self.route_changes += 1
        engines = self.router.engines
        reason = f"{why}: the default route follows the step in effect ({engines[want].method})"
        self.events.emit(
            "route", **{"from": engines[old].method, "to": engines[want].method}, reason=reason, scope="default"
        )
        self.say(f"route change {engines[old].method} → {engines[want].method}: {reason}")
        self.on_change()
        return True

    def _plan_served(self, event) -> None:
        """The model name an engine serves, from its launch plan: what a model alias is replaced with."""
        name = getattr(getattr(event, "plan", None), "model_name", None) if isinstance(event, EngineReady) else None
        if name:
            self.router.served = name

    def _on_twin_event(self, position: int, event) -> None:
        self._plan_served(event)
        if isinstance(event, EngineReady) or (
            isinstance(event, StateChanged) and event.state in (State.FATAL, State.STOPPED)
        ):
            self._ready[position].set()
        if isinstance(event, (EngineReady, StateChanged)):
            self.on_change()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the twins in chain order (each after the engine before it), and the class decisions."""
        loop = asyncio.get_running_loop()
        self._started = True
        for handle, sup in zip(self._handles, self.supervisors):
            self._tasks.append(loop.create_task(self._run_twin(handle, sup)))
        self._deciding = loop.create_task(self._decide_classes())

    def _starts_after(self, position: int) -> int:
        """The engine a twin starts after: the one before it that runs here (a remote twin starts nothing)."""
        before = position - 1
        while before > 0 and self.router.engines[before].remote is not None:
            before -= 1
        return before

    async def _run_twin(self, handle: EngineHandle, sup: Supervisor | RemoteEngine) -> None:
        if isinstance(sup, RemoteEngine):  # checked from the start: it serves while the engines here load
            await sup.run()
            return
        while sup in self.supervisors and not self._ready[self._starts_after(handle.position)].is_set():
            await asyncio.sleep(0.05)
            if self._stopping:
                return
        if self._stopping or sup not in self.supervisors:  # a reload removed it before it started
            return
        await sup.run()

    async def stop(self) -> None:
        """Stop every twin (their engines stopped as the primary's is) and the class decisions."""
        self._stopping = True
        self.upstreams.closing = True
        for sup in self.supervisors:
            sup.request_stop("specops is stopping")
        if self.canary is not None:
            self.canary.sup.request_stop("specops is stopping")
        for ev in self._ready:
            ev.set()
        if self._deciding is not None:
            self._deciding.cancel()
        canary = [self.canary.run] if self.canary is not None and self.canary.run is not None else []
        await asyncio.gather(*self._tasks, *canary, *(t for t in (self._deciding,) if t), return_exceptions=True)

    async def drain(self, timeout: float) -> dict:
        """specops is stopping: no new requests to any engine; the twins' requests in flight finish."""
        self.upstreams.closing = True
        return await self.upstreams.drain(timeout)

    # ------------------------------------------------------------------ a reloaded profile
    def reload(self, profile) -> list[str]:
        """Follow a reloaded profile: its route rules and class settings from the next request on; twins it no
        longer lists take no new requests, finish those in flight and stop; new ones start beside the engines
        that serve; a kept twin whose launch plan changed restarts on it while the others serve. Raises what
        rendering raises before changing anything. Returns what changed, in words. A canary still routed leaves
        first: rolled out when it passed (this reload is its rollout), else aborted (a newer profile came first)."""
        if self.canary is not None:
            c = self.canary
            if c.state == "passed":
                self._retire_canary(c, "rolled_out", "the primary restarts on the new draft")
                self.on_change()
            else:
                self.abort_canary("a newer profile was reloaded before the canary concluded")
        old, new_infos = self.profile, engine_infos(profile)
        kept = {_identity(info): i for i, info in enumerate(self.router.engines[1:])}
        plans = {}  # method -> (render, plan changed) of the kept local twins
        for info in new_infos[1:]:
            i = kept.get(_identity(info))
            if i is not None and info.remote is None:
                render = self.render_twin(profile, info.step, self._ports[i])
                before = self.supervisors[i].plan
                plans[info.method] = (render, before is None or render(0).argv != before.argv)
        changes = []
        if profile.routing.classes != old.routing.classes:
            self.classes = _class_table(profile.routing.classes)
            changes.append("class settings (the class windows start over)")
        if profile.routing.rules != old.routing.rules:
            changes.append("route rules")
        if profile.routing.aliases != old.routing.aliases:
            changes.append("model aliases")
        if profile.routing.client_choice != old.routing.client_choice:
            changes.append(f"client_choice: {profile.routing.client_choice}")
        primary = self.router.engines[0]  # the primary engine runs on until its own supervisor reloads it
        router = Router(profile.routing, (primary, *new_infos[1:]), self.classes)
        router.load_off = self.router.load_off
        router.served = self.router.served if old.model == profile.model else _served_name(profile)
        old_rows = list(
            zip(self.supervisors, self._handles, self._ports, self.upstreams.upstreams[1:], self._ready[1:])
        )
        old_methods = [e.method for e in self.router.engines[1:]]
        self.profile, self.router, self.upstreams.router = profile, router, router
        self.supervisors, self._handles, self._ports = [], [], []
        self.upstreams.upstreams = self.upstreams.upstreams[:1]
        self._ready = self._ready[:1]
        loop = asyncio.get_running_loop() if self._started else None
        for position, info in enumerate(router.engines[1:], start=1):
            if _identity(info) in kept:
                sup, handle, port, upstream, ready = old_rows[kept.pop(_identity(info))]
                handle.position = upstream.position = position
                self.supervisors.append(sup)
                self._handles.append(handle)
                self._ports.append(port)
                self.upstreams.upstreams.append(upstream)
                self._ready.append(ready)
                if isinstance(sup, RemoteEngine):
                    twin = _remote_twin(profile, info)
                    if sup.retarget(twin, remote_authorization(twin, self.environ) or ""):
                        changes.append(f"remote twin {info.method}: a new key")
                    continue
                render, changed = plans[info.method]
                if changed:
                    order = ReloadOrder(profile.at_step(info.step), render, "the profile file changed")
                    if sup.request_reload(order):
                        changes.append(f"twin {info.method} restarts on the new launch plan")
                    else:
                        changes.append(f"twin {info.method} keeps its engine (not serving now: reload it again)")
                continue
            self.upstreams.upstreams.append(EngineUpstream(position))
            self._ready.append(asyncio.Event())
            sup = self._add_engine(position, info)
            changes.append(f"{'remote twin' if info.remote else 'twin'} {info.method} added")
            if loop is not None:
                self._tasks.append(loop.create_task(self._run_twin(self._handles[-1], sup)))
        for i in kept.values():  # no longer listed: no new requests; those in flight finish, then stop
            sup, _, _, upstream, ready = old_rows[i]
            ready.set()
            changes.append(f"twin {old_methods[i]} removed")
            if loop is not None:
                self._tasks.append(loop.create_task(self._retire(sup, upstream)))
        self.follow_decider("the profile was reloaded")
        self.events.emit("route", scope="reload", changes=changes, reason="the profile file changed")
        self.say("routing follows the reloaded profile: " + ("; ".join(changes) or "nothing to change"))
        self.on_change()
        return changes

    async def _retire(self, sup: Supervisor, upstream: EngineUpstream) -> None:
        """A twin the reloaded profile no longer lists: its requests in flight finish, then its engine stops."""
        upstream.down()
        if upstream.gen is not None and upstream.gen.inflight:
            p = self.upstreams.proxy
            await drain_generation(upstream.gen, p.drain_timeout if p is not None else 30.0, p)
        sup.request_stop("the reloaded profile no longer lists this twin")

    # ------------------------------------------------------------------ route changes
    def warm_steps(self) -> set[int]:
        """The chain steps a live engine runs now (not the canary's): a switch to one is a route change."""
        live = self.upstreams.live()
        return {
            e.step for i, e in enumerate(self.router.engines) if i < len(live) and live[i] and i != self.router.canary
        }

    def route_to(self, step: int, reason: str, decision: dict | None = None) -> bool:
        """A switch to chain step ``step`` as a route change, when a live engine runs it: new requests go there
        at once; requests in flight finish where they started. False when no live engine runs it (the caller
        then switches by restart, as without twins)."""
        position = self.router.engine_for_step(step)
        if position is None or not self.upstreams.live()[position]:
            return False
        old = self.router.current
        if position == old:
            return False
        self.router.current = position
        self.route_changes += 1
        engines = self.router.engines
        self.events.emit(
            "route",
            **{"from": engines[old].method, "to": engines[position].method},
            reason=reason,
            scope="default",
            decision=dict(decision or {}),
        )
        self.say(f"route change {engines[old].method} → {engines[position].method}: {reason}")
        self.decider.on_route_change(step, reason, decision, on_twin=position != 0)
        self.on_change()
        return True

    def _on_route(
        self, route: Route, flight, ok: bool, tokens: int | None = None, seconds: float | None = None
    ) -> None:
        """After each answer: the class window gets the response's own counters, its tokens and wall time; a
        canary's tally gets them when the canary or the speculating primary answered."""
        if flight is None or not ok:
            return
        c = self.canary
        if (self.classes is None or route.key is None) and c is None:
            return
        position = self.upstreams.position_of(flight.gen)
        speculative = self.router.engines[position].speculative
        totals = flight.totals or {}
        draft_n = sum(n for n, _ in totals.values())
        accepted = sum(a for _, a in totals.values())
        if c is not None and c.ready_at is not None and speculative:
            if position == self.router.canary:
                c.tally.note(CANARY, draft_n, accepted)
            elif position == 0:
                c.tally.note(CURRENT, draft_n, accepted)
        if self.classes is None or route.key is None:
            return
        self.classes.note(
            route.key,
            time.monotonic(),
            speculative=speculative,
            draft_tokens=draft_n,
            accepted=accepted,
            tokens=tokens,
            seconds=seconds,
        )

    async def _decide_classes(self) -> None:
        interval = max(0.2, float(self.profile.monitor.interval))
        min_tokens = self.profile.routing.classes.min_draft_tokens
        while True:
            await asyncio.sleep(interval)
            self.decide_classes(time.monotonic(), min_tokens)

    def decide_classes(self, now: float, min_draft_tokens: int) -> int:
        """Ask the decider about the live load (past the measured crossover every class goes to the engine
        without speculation) and about every class (its verdict, with the fallback's hysteresis); a changed
        verdict is a ``route`` event. Returns the changes."""
        changed = 0
        on_step = self.router.engines[self.router.on_engine].step
        verdict, why = self.decider.load_route(now, on_step)
        if verdict is not None and (verdict is False) != self.router.load_off:
            self.router.load_off = verdict is False
            changed += 1
            self.events.emit("route", scope="load", speculate=not self.router.load_off, reason=why)
            where = "every class to the engine without speculation" if self.router.load_off else "classes by verdict"
            self.say(f"route change: {where}: {why}")
        for key in self.classes.keys() if self.classes is not None else ():
            c = self.classes.get(key)
            verdict, why = self.decider.judge_class(c, self.classes.stats(key, now), min_draft_tokens, on_step)
            if self.classes.decide(key, verdict, why):
                changed += 1
                self.events.emit("route", scope="class", **{"class": key}, speculate=verdict, reason=why)
        if changed:
            self.on_change()
        return changed

    # ------------------------------------------------------------------ status
    def snapshot(self) -> dict:
        engines = self.upstreams.snapshot()
        sups = list(self.supervisors)
        if self.canary is not None:
            sups.append(self.canary.sup)
        for row, sup in zip(engines[1:], sups):
            snap = sup.snapshot()
            row.update(
                state=snap["state"], engine_pid=snap["engine_pid"], restarts=snap["restarts"], url=snap["engine_url"]
            )
            if "remote" in snap:  # its health, the method it reports, the hop's latency (specops.serve.remote)
                row["remote"] = snap["remote"]
        if self.canary is not None:
            engines[-1]["canary"] = True
        now = time.monotonic()
        return {
            "engines": engines,
            "routing": {
                "current": self.router.current,
                "load_off": self.router.load_off,
                "route_changes": self.route_changes,
                "client_choice": self.profile.routing.client_choice,
                "class_key": self.profile.routing.classes.key,
                "aliases": dict(self.profile.routing.aliases),
                "refused": {str(k): v for k, v in self.upstreams.refused.items()},
                "classes": self.classes.snapshot(now) if self.classes is not None else [],
                "classes_forgotten": self.classes.forgotten if self.classes is not None else 0,
                "learning": self.classes.learner(now) if self.classes is not None else None,
            },
            "canary": self._canary_snapshot(),
        }


class _RoutingCollector:
    """``/specops/metrics`` per engine and per class, from the live tables (labels bounded by the class count)."""

    def __init__(self, twins: TwinEngines):
        self.twins = twins

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = self.twins
        up = GaugeMetricFamily("specops_engine_live", "Engine takes requests now (1) or not (0)", labels=["engine"])
        routed = CounterMetricFamily(
            "specops_routed_requests", "Requests answered, by engine and routing reason", labels=["engine", "reason"]
        )
        live = t.upstreams.live()
        names = [f"{i}:{e.method}" for i, e in enumerate(t.router.engines)]
        for i, name in enumerate(names):
            up.add_metric([name], 1.0 if live[i] else 0.0)
        for (pos, reason), n in sorted(t.upstreams.routed.items(), key=str):
            routed.add_metric([names[pos] if pos is not None and pos < len(names) else "none", reason], n)
        yield up
        yield routed
        yield from canary_metrics(t)
        yield from remote_metrics(
            [(names[h.position], s) for h, s in zip(t._handles, t.supervisors) if isinstance(s, RemoteEngine)]
        )
        if t.classes is None:
            return
        acc = GaugeMetricFamily("specops_class_acceptance", "Acceptance of a request class's window", labels=["cls"])
        spec = GaugeMetricFamily(
            "specops_class_speculate", "A request class is routed to speculation (1) or not (0)", labels=["cls"]
        )
        share = GaugeMetricFamily(
            "specops_class_on_share", "Share of a class's window served speculating", labels=["cls"]
        )
        speed = GaugeMetricFamily(
            "specops_class_tokens_per_second",
            "Tokens per second a request class's clients saw over its window, by whether a speculating engine served "
            "them (speculation on/off): the tokens its answers generated (llama-server timings.predicted_n, else "
            "usage.completion_tokens, a vLLM stream's only when it carries its usage event) over their wall time "
            "from routing to the last byte",
            labels=["cls", "speculation"],
        )
        length = GaugeMetricFamily(
            "specops_class_mean_acceptance_length",
            "Mean acceptance length of a request class's answers served speculating that drafted, over its window: "
            "tokens per target forward pass, tokens / (tokens - accepted draft tokens) (1: nothing accepted)",
            labels=["cls"],
        )
        for row in t.classes.snapshot(time.monotonic()):
            if row["acceptance"] is not None:
                acc.add_metric([row["class"]], row["acceptance"])
            if row["speculate"] is not None:
                spec.add_metric([row["class"]], 1.0 if row["speculate"] else 0.0)
            if row["on_share"] is not None:
                share.add_metric([row["class"]], row["on_share"])
            for side in ("on", "off"):
                if row[f"tokens_per_s_{side}"] is not None:
                    speed.add_metric([row["class"], side], row[f"tokens_per_s_{side}"])
            if row["mean_acceptance_length"] is not None:
                length.add_metric([row["class"]], row["mean_acceptance_length"])
        yield acc
        yield spec
        yield share
        yield speed
        yield length
