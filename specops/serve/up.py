"""``specops up``: resolve, render, launch, supervise, watch, and serve through the proxy until stopped.

This module wires the parts together, explicitly and once: it builds the fallback decider (the policy),
the watcher, the proxy and the supervisor, and connects them with what each takes at construction —
the supervisor reports typed events (:mod:`specops.run.events`) to its listeners (the console, the
decider, the watcher, the state writer) and asks the decider where to go when a step cannot run; the
watcher acts through a switch order to the supervisor; the proxy gets the live timings sink, the metrics
registry and the status provider. No part replaces another's methods or attributes, and the state file
is written from the parts' snapshots.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass

from specops.backends.render import render_plan
from specops.config.engines import CANARY, PRIMARY, splits_gpu_by_share, with_gpu_share
from specops.config.profile import LoadedProfile
from specops.errors import SpecopsError
from specops.perf.verifycost import decision_curve, decision_draft_cost
from specops.resolve.prelaunch import Address, check_before_launch, resolve_for_launch
from specops.run.events import EngineLine, SwitchOrder
from specops.run.instance import EventLog, InstancePaths, write_state
from specops.run.lock import acquire, release
from specops.run.reload import ProfileReloader, ReloadMetrics
from specops.run.start import free_port
from specops.run.supervise import ReloadOrder, Supervisor
from specops.serve.remote import remote_keys
from specops.urls import http_url
from specops.watch.decide import FallbackDecider
from specops.watch.policy import Policy
from specops.watch.watcher import AcceptanceReader, LiveCounters, SpecopsMetrics, Watcher

__all__ = ["Console", "UpOptions", "run_up", "up_blocking"]


@dataclass
class UpOptions:
    backend_version: str | None = None
    show_engine_output: bool = True
    offline: bool = False
    health_interval: float = 0.25
    require_certificate: bool = False  # refuse to start without a current certificate (``specops certify``)


class Console:
    """specops' own lines and the engine's prefixed lines, on stdout, flushed at once."""

    def __init__(self, prefix: str, show_engine: bool, stream=None):
        self.prefix = prefix
        self.show_engine = show_engine
        self.stream = stream or sys.stdout

    def say(self, msg: str) -> None:
        self._write(f"specops: {msg}")

    def engine(self, line: str) -> None:
        if self.show_engine:
            self._write(f"[{self.prefix}] {line}")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass


async def run_up(loaded: LoadedProfile, registry, opts: UpOptions, console: Console | None = None) -> int:
    """Run one deployment until SIGINT/SIGTERM (exit 0) or until no method of the chain can run (1)."""
    console = console or Console(loaded.profile.backend, opts.show_engine_output)
    engine_host, engine_port = _engine_address(loaded.profile)
    # what no method can fix (the target model, a taken port) stops here, before anything is launched
    check_before_launch(loaded, _addresses(loaded.profile, engine_host, engine_port), twins=True)
    remote_keys(loaded, os.environ)  # a remote twin's key named but not exported: refused before anything starts
    as_written = loaded
    loaded, refused = resolve_for_launch(loaded, opts.offline, console.say)
    profile = loaded.profile
    if refused and not profile.chain:
        raise SpecopsError(f"the draft was refused and the fallback chain is empty: {refused}")
    backend = registry.backend(profile.backend)
    engine = backend.engine_info(profile, opts.backend_version, probe=True)
    _check_certificate(as_written, registry, engine.version, opts.require_certificate, console.say)

    paths = InstancePaths.for_profile(profile.name, profile.supervisor.state_dir)
    acquire(paths)
    events = EventLog(paths.events)
    up = _Instance(
        loaded,
        backend,
        engine,
        paths,
        events,
        console,
        f"{engine_host}:{engine_port}",
        decider=FallbackDecider.from_profile(  # surface: the profile's folder; mode model: this machine's curve
            loaded,
            curve=decision_curve(profile, engine.version),
            draft_cost=decision_draft_cost(profile, engine.version),
            events=events,
            say=console.say,
        ),
    )
    metrics = SpecopsMetrics()
    live = LiveCounters() if (profile.proxy.enabled and backend.live_timings) else None
    up.watcher = _watcher(up, AcceptanceReader.for_profile(profile, backend, live=live), metrics)
    up.proxy = _proxy(up, live, metrics) if profile.proxy.enabled else None
    if profile.certify.spot_check.enabled:  # live spot checks (specops.perf.certify_spot)
        from specops.perf.certify_spot import LiveSpotChecks

        up.spot = LiveSpotChecks(
            profile,
            backend,
            up.proxy,
            up.public_url,
            events=events,
            registry=metrics.registry,
            say=console.say,
            on_check=up.write_state,
        )
    if profile.routing.enabled:  # twins: engines beside the primary, routed per request (specops.serve.twins)
        up.twins = _twins(up, registry, metrics, opts)
    up.sup = _supervisor(up, _step_renderer(loaded, registry, engine, engine_host, engine_port), opts)
    up.fleet = _fleet(up, metrics)
    if refused:
        up.sup.refuse_primary(refused)
    return await _serve(up, registry, opts)


def _check_certificate(loaded: LoadedProfile, registry, engine_version: str, required: bool, say) -> None:
    """Warn when the certificate (``specops certify``) no longer matches what is about to run: the engine
    version, the target or draft revision, the chat template or the profile; refuse instead when
    ``required`` (also when there is none or it does not certify)."""
    from specops.perf.certify_file import certificate_report

    rep = certificate_report(loaded, registry, engine_version)
    name = rep["path"].name
    problems = [d.message() for d in rep["stale"]]
    if rep["exists"] and not rep["certified"]:
        problems.insert(0, f"{name} does not certify this deployment (its verdict: not certified)")
    if not rep["exists"]:
        if required:
            raise SpecopsError(f"--require-certificate: {rep['path']} is missing; run `specops certify {loaded.path}`")
        return
    if not problems:
        say(f"certificate {name}: current ({rep['cert'].get('created')})")
        return
    text = f"certificate {name}: " + "; ".join(problems)
    if required:
        raise SpecopsError(f"--require-certificate: {text}; run `specops certify {loaded.path}` again")
    say(f"warning: {text}")


def _engine_address(profile) -> tuple[str, int]:
    """Where the engine listens: a loopback port behind the proxy, else the profile's server address."""
    if profile.proxy.enabled:
        return "127.0.0.1", profile.proxy.engine_port or free_port()
    return profile.server.host, profile.server.port


def _addresses(profile, engine_host: str, engine_port: int) -> list[Address]:
    """What ``up`` binds, each with the profile field that sets it: the engine's address, and the proxy's."""
    if not profile.proxy.enabled:
        return [Address(engine_host, engine_port, ("server", "port"))]
    engine_field = ("proxy", "engine_port") if profile.proxy.engine_port else None
    return [
        Address(profile.server.host, profile.server.port, ("server", "port")),
        Address(engine_host, engine_port, engine_field),
    ]


def _step_renderer(loaded: LoadedProfile, registry, engine, host: str, port: int):
    """``render(index)``: the launch plan of the fallback chain's step ``index``, on the engine's address."""
    profile = loaded.profile
    if splits_gpu_by_share(profile.backend):  # with twins the engines split the GPUs (routing.memory_utilization)
        profile = with_gpu_share(profile, PRIMARY)

    def render_step(index: int):
        return render_plan(
            LoadedProfile(profile.at_step(index), loaded.document, loaded.path),
            registry,
            engine=engine,
            host=host,
            port=port,
        )

    return render_step


@dataclass
class _Instance:
    """One ``specops up``: the parts :func:`run_up` builds and what they reach each other through.

    The parts refer to each other (the watcher orders the supervisor, the supervisor reports to the
    watcher), so each is built with callbacks into this record, which holds them all once built."""

    loaded: LoadedProfile
    backend: object
    engine: object
    paths: InstancePaths
    events: EventLog
    console: Console
    engine_at: str
    decider: FallbackDecider
    watcher: Watcher | None = None
    proxy: object | None = None
    sup: Supervisor | None = None
    spot: object | None = None  # LiveSpotChecks when certify.spot_check is enabled
    reloader: ProfileReloader | None = None  # the profile file's reloads (SIGHUP, a changed file)
    draining: asyncio.Task | None = None  # the shutdown drain, once a stop signal came
    fleet: object | None = None  # FleetCoordinator: the fleet's switch slots (deploy.coordination), when on
    twins: object | None = None  # TwinEngines: engines kept warm beside the primary (routing.twins), when set

    @property
    def public_url(self) -> str:
        server = self.loaded.profile.server
        return http_url(server.host, server.port)

    def status(self) -> dict:
        """Supervision, decisions and the watcher's window: the state file's core and ``/specops/status``."""
        spot = self.spot.snapshot() if self.spot is not None else {}
        fleet = self.fleet.snapshot() if self.fleet is not None else {}  # fleet: waiting, slot, holders
        reload = {"profile_reload": self.reloader.snapshot()} if self.reloader is not None else {}
        twins = self.twins.snapshot() if self.twins is not None else {}  # engines, routing, classes
        return {
            **self.sup.snapshot(),
            **twins,
            **self.decider.snapshot(),
            **self.watcher.snapshot(),
            **spot,
            **fleet,
            **reload,
        }

    def write_state(self) -> None:
        profile, paths = self.loaded.profile, self.paths
        write_state(
            paths,
            {
                "name": profile.name,
                "profile": os.path.abspath(self.loaded.path),
                "pid": os.getpid(),
                "backend": profile.backend,
                "url": self.public_url,
                "proxy": profile.proxy.enabled,
                "admin_url": self.proxy.admin_url if self.proxy is not None else None,
                "engine_log": str(paths.engine_log),
                "events": str(paths.events),
                "updated_at": time.time(),
                **self.status(),
            },
        )

    def on_supervisor_event(self, event) -> None:
        if isinstance(event, EngineLine):
            self.console.engine(event.line)
        else:
            if self.fleet is not None:  # a switch ends (ready, stopped, fatal): its slot goes back
                self.fleet.on_event(event)
            self.write_state()

    def switch(self, decision) -> bool:
        """The watcher's decision, as an order to the supervisor; False when it cannot switch now. With fleet
        coordination always False here: the order runs once a switch slot is ours (``FleetCoordinator``)."""
        if self.twins is not None and self.twins.route_to(decision.to_index, decision.reason, decision.to_dict()):
            return True  # a warm twin runs that step: a route change, no restart
        order = SwitchOrder(decision.to_index, decision.reason, decision.to_dict())
        if self.fleet is not None:
            return self.fleet.want(order)
        return self.sup.request_switch(order)


def _fleet(up: _Instance, metrics: SpecopsMetrics):
    """At most ``deploy.max_switching`` replicas switch at once: the gate ``deploy.coordination`` names (Leases,
    a shared directory), or None (off: the watcher's switches go straight to the supervisor)."""
    from specops.k8s.lease import gate_for
    from specops.run.switchgate import FleetCoordinator

    profile = up.loaded.profile
    gate = gate_for(profile, os.environ, up.console.say)
    if gate is None:
        return None
    lease = profile.deploy.lease_duration

    def executed(order: SwitchOrder) -> None:
        d = order.decision
        metrics.fallbacks.labels(d.get("from"), d.get("to"), d.get("rule")).inc()

    return FleetCoordinator(
        gate,
        execute=up.sup.request_switch,
        events=up.events,
        say=up.console.say,
        on_executed=executed,
        registry=metrics.registry,
        retry_interval=min(5.0, max(1.0, lease / 10)),
        renew_interval=lease / 3,
        # the watcher repeats a decision not executed at each fresh window; one not repeated is dropped
        stale_after=max(30.0, 3 * profile.fallback.window + 2 * profile.monitor.interval),
    )


def _watcher(up: _Instance, reader: AcceptanceReader, metrics: SpecopsMetrics) -> Watcher:
    return Watcher(
        up.loaded.profile,
        reader,
        up.decider,
        say=up.console.say,
        metrics=metrics,
        on_tick=up.write_state,
        act=up.switch,
        concurrency=lambda: _proxy_load(up),
    )


def _proxy_load(up: _Instance) -> float | None:
    """Requests on specops' proxy right now: in flight plus waiting (held during a switch, which the
    engine's own running/waiting gauges miss). None without a proxy: the watcher then reads the engine's."""
    if up.proxy is None:
        return None
    stats = up.proxy.stats()
    return float(stats["in_flight"] + stats["queue_depth"])


def _proxy(up: _Instance, live: LiveCounters | None, metrics: SpecopsMetrics):
    from specops.proxy import Proxy

    return Proxy.from_profile(
        up.loaded.profile,
        status_provider=up.status,
        on_timings=live.add if live is not None else None,
        metrics_registry=metrics.registry,
    )


def _twins(up: _Instance, registry, metrics: SpecopsMetrics, opts: UpOptions):
    """The twins of ``routing.twins``: one supervisor each, on a loopback port of its own, behind the proxy."""
    from specops.serve.twins import TwinEngines

    loaded = up.loaded

    def render_twin(profile, step: int, port: int):
        twin, doc, path = profile.at_step(step), up.loaded.document, up.loaded.path  # up.loaded: the reloaded one
        if splits_gpu_by_share(twin.backend):  # the twin's own share of the GPUs (routing.memory_utilization)
            twin = with_gpu_share(profile, twin.speculative.method.value).at_step(step)
        return lambda index: render_plan(
            LoadedProfile(twin.at_step(index), doc, path), registry, engine=up.engine, host="127.0.0.1", port=port
        )

    twins = TwinEngines(
        loaded.profile,
        decider=up.decider,
        events=up.events,
        say=up.console.say,
        render_twin=render_twin,
        log_path=lambda name: up.paths.root / f"engine.{name}.log",
        health_interval=opts.health_interval,
        launch_problem=up.backend.launch_problem,
        on_change=up.write_state,
        metrics=metrics,
    )
    twins.attach(up.proxy)
    return twins


def _supervisor(up: _Instance, render_step, opts: UpOptions) -> Supervisor:
    # the order of listeners matters: the decider tells the policy which step runs before the watcher
    # starts its window, and the state is written last, with what both know
    return Supervisor(
        up.loaded.profile,
        render_step,
        events=up.events,
        say=up.console.say,
        decider=up.decider,
        listeners=(up.decider.on_event, up.watcher.on_event, up.on_supervisor_event)
        + ((up.twins.on_primary_event,) if up.twins is not None else ()),
        log_path=up.paths.engine_log,
        proxy=up.proxy,
        health_interval=opts.health_interval,
        launch_problem=up.backend.launch_problem,
        bind_failure=up.backend.bind_failure,
    )


async def _serve(up: _Instance, registry, opts: UpOptions) -> int:
    """Start the proxy, the watcher and the profile reloader, supervise until stopped, then stop everything and
    release the lock. SIGINT/SIGTERM drain and stop; SIGHUP reloads the profile."""
    profile, sup, engine = up.loaded.profile, up.sup, up.engine
    loop = asyncio.get_running_loop()
    reloader = up.reloader = _reloader(up, registry, opts)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_stop_signal, up, signal.Signals(sig).name)
    loop.add_signal_handler(signal.SIGHUP, reloader.trigger)
    up.events.emit(
        "up",
        profile=os.path.abspath(up.loaded.path),
        backend=profile.backend,
        engine_version=engine.version,
        engine=engine.source,
        url=up.public_url,
    )
    up.console.say(
        f"{profile.name}: {up.backend.name} {engine.version} ({engine.source}); "
        f"chain {' → '.join(s.method.value for s in sup.steps)}; state in {up.paths.root}"
    )
    rc = 1
    watching = False
    try:
        if up.proxy is not None:
            await _start_proxy(up)
        if up.twins is not None:
            up.twins.start()
        up.watcher.start()
        reloader.start()
        watching = True
        if up.spot is not None:
            up.spot.start()
        rc = await sup.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await reloader.stop()
        if up.spot is not None:
            await up.spot.stop()
        if watching:
            await up.watcher.stop()
        if up.twins is not None:
            await up.twins.stop()
        if up.proxy is not None:
            await up.proxy.stop()
        up.write_state()
        up.events.emit("down", state=sup.state.value, exit_code=rc)
        release(up.paths)
    if rc == 0:
        up.console.say("stopped")
    else:
        up.console.say(f"gave up: {sup.fatal_reason or 'no method of the chain could run'}")
    return rc


def _reloader(up: _Instance, registry, opts: UpOptions) -> ProfileReloader:
    """Reloads the profile on SIGHUP and when its file changes (a ConfigMap's symlink swap included)."""
    metrics = up.watcher.metrics if up.watcher is not None else None

    reloader = ProfileReloader(
        up.loaded,
        up.loaded,
        apply=lambda loaded, changes: _apply_reload(up, registry, loaded, changes, reloader.rolled_back),
        events=up.events,
        say=up.console.say,
        offline=opts.offline,
        registry=registry,
        metrics=ReloadMetrics(metrics.registry) if metrics is not None else None,
        on_status=lambda snapshot: up.write_state(),  # status() reads the reloader's snapshot
    )
    return reloader


def _apply_reload(up: _Instance, registry, loaded: LoadedProfile, changes: list[str], rolled_back) -> bool | str:
    """Hand a valid reloaded profile to the supervisor (a zero-loss restart on its primary step) and point the
    watcher at its policy and monitor settings. Raises SpecopsError, changing nothing, when it does not render
    or its policy cannot be built; False when the supervisor cannot take it now. When its engine does not
    start, the supervisor runs the previous profile again and the watcher goes back to it too."""
    if up.twins is None and loaded.profile.routing.enabled:
        raise SpecopsError(
            "routing.twins: this specops up started without twins; a reload cannot add them: restart specops up"
        )
    remote_keys(loaded, os.environ)
    host, port = up.engine_at.rsplit(":", 1)
    render = _step_renderer(loaded, registry, up.engine, host, int(port))
    render(0)
    # a relative surface: from the reloaded profile's folder; mode model: the curve stored for its engine and model
    policy = Policy.from_profile(
        loaded,
        curve=decision_curve(loaded.profile, up.engine.version),
        draft_cost=decision_draft_cost(loaded.profile, up.engine.version),
    )
    if up.twins is not None:  # a new draft is measured on live traffic first (routing.canary, specops.serve.twins)
        if up.twins.abort_canary("a newer profile file was reloaded before the canary concluded"):
            if loaded.profile == up.loaded.profile:  # back to what the primary runs: nothing to restart
                return True
        if up.twins.wants_canary(up.loaded.profile, loaded.profile):
            up.twins.start_canary(
                loaded.profile,
                _canary_renderer(loaded, registry, up.engine),
                roll_out=lambda: _reload_now(up, loaded, render, policy, changes, rolled_back),
                refuse=rolled_back,
            )
            return "a canary measures the new draft on live traffic before the primary restarts on it"
    return _reload_now(up, loaded, render, policy, changes, rolled_back)


def _canary_renderer(loaded: LoadedProfile, registry, engine):
    """``render(port)``: the launch plans of ``loaded``'s primary step as a canary, on a loopback port."""
    canary = loaded.profile
    if splits_gpu_by_share(canary.backend):  # its own share of the GPUs (routing.memory_utilization: canary)
        canary = with_gpu_share(canary, CANARY)
    return lambda port: (
        lambda index: render_plan(
            LoadedProfile(canary.at_step(index), loaded.document, loaded.path),
            registry,
            engine=engine,
            host="127.0.0.1",
            port=port,
        )
    )


def _reload_now(up: _Instance, loaded: LoadedProfile, render, policy, changes: list[str], rolled_back) -> bool:
    """The reload itself: the supervisor restarts the primary on ``loaded`` (through a fleet switch slot), the
    watcher and the twins follow it. False when it cannot be taken now."""
    reader = AcceptanceReader.for_profile(loaded.profile, up.backend, live=up.watcher.reader.live)
    before, before_policy = up.loaded, up.decider.policy

    def failed(why: str) -> None:
        live = up.watcher.reader.live
        up.watcher.repoint(
            before.profile, before_policy, AcceptanceReader.for_profile(before.profile, up.backend, live=live)
        )
        up.loaded = before
        if up.twins is not None:  # the twins and routes go back to the previous profile too
            up.twins.reload(before.profile)
        rolled_back(why)

    order = ReloadOrder(loaded.profile, render, "the profile file changed", tuple(changes), on_failed=failed)
    # a changed ConfigMap reaches every replica at about the same time: a reload restarts the engine, so it
    # takes a fleet switch slot like a switch does (False: asked for or waiting; the reloader asks again)
    if up.fleet is not None and not up.fleet.admit("reload"):
        reader.close()
        return False
    if not up.sup.request_reload(order):
        reader.close()
        if up.fleet is not None:
            up.fleet.abandon("the supervisor could not reload now")
        return False
    up.watcher.repoint(loaded.profile, policy, reader)
    up.loaded = loaded
    if up.twins is not None:  # route rules, class settings, twins added, removed or restarted (specops.serve.twins)
        up.twins.reload(loaded.profile)
    return True


def _on_stop_signal(up: _Instance, name: str) -> None:
    """First SIGINT/SIGTERM: drain the requests in flight, then stop; a second one: stop now."""
    why = f"received {name}"
    if up.proxy is None or up.draining is not None:
        up.sup.request_stop(why + (" again: stopping without waiting for the drain" if up.draining else ""))
        return
    up.draining = asyncio.get_running_loop().create_task(_drain_then_stop(up, why))


async def _drain_then_stop(up: _Instance, why: str) -> None:
    """Stop forwarding (new requests wait, and get 503 when specops stops), let the requests on the engine
    finish for at most ``proxy.drain_timeout``, then stop: shutting down loses no request in flight."""
    timeout = up.loaded.profile.proxy.drain_timeout
    up.console.say(f"{why}: finishing the requests in flight (at most {timeout:g}s), then stopping")
    up.proxy.hold()
    try:
        result = await up.proxy.drain(timeout)
        twins = await up.twins.drain(timeout) if up.twins is not None else {}
        up.events.emit("shutdown-drain", **result.to_dict(), **({"twins": twins} if twins else {}))
    finally:
        up.sup.request_stop(why)


async def _start_proxy(up: _Instance) -> None:
    try:
        await up.proxy.start()
    except OSError as exc:
        raise SpecopsError(f"cannot serve {up.public_url}: {exc.strerror or exc} (server.host/server.port)") from None
    up.console.say(f"serving {up.public_url} (engine on {up.engine_at})")


def up_blocking(loaded: LoadedProfile, registry, opts: UpOptions) -> int:
    if loaded.profile.proxy.enabled:  # the proxy's loop: uvloop when installed (SPECOPS_UVLOOP=0: asyncio's)
        from specops.proxy import run_event_loop

        return run_event_loop(run_up(loaded, registry, opts))
    return asyncio.run(run_up(loaded, registry, opts))
