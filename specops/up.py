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

from specops.urls import http_url
from specops.backends.render import render_plan
from specops.config.profile import LoadedProfile
from specops.errors import SpecopsError
from specops.resolve.prelaunch import resolve_for_launch
from specops.run.events import EngineLine, SwitchOrder
from specops.run.instance import EventLog, InstancePaths, write_state
from specops.run.lock import acquire, release
from specops.run.start import free_port
from specops.run.supervise import Supervisor
from specops.watch.decide import FallbackDecider
from specops.watch.watcher import AcceptanceReader, LiveCounters, SpecopsMetrics, Watcher

__all__ = ["Console", "UpOptions", "free_port", "resolve_for_launch", "run_up", "up_blocking"]


@dataclass
class UpOptions:
    backend_version: str | None = None
    show_engine_output: bool = True
    offline: bool = False
    health_interval: float = 0.25


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
    profile = loaded.profile
    console = console or Console(profile.backend, opts.show_engine_output)
    loaded, refused = resolve_for_launch(loaded, opts.offline, console.say)
    profile = loaded.profile
    if refused and not profile.chain:
        raise SpecopsError(f"the draft was refused and the fallback chain is empty: {refused}")
    backend = registry.backend(profile.backend)
    engine = backend.engine_info(profile, opts.backend_version, probe=True)
    use_proxy = profile.proxy.enabled
    if use_proxy:
        engine_host, engine_port = "127.0.0.1", profile.proxy.engine_port or free_port()
    else:
        engine_host, engine_port = profile.server.host, profile.server.port

    paths = InstancePaths.for_profile(profile.name, profile.supervisor.state_dir)
    acquire(paths)
    events = EventLog(paths.events)
    public_url = http_url(profile.server.host, profile.server.port)

    def render_step(index: int):
        return render_plan(LoadedProfile(profile.at_step(index), loaded.document, loaded.path), registry, engine=engine,
                           host=engine_host, port=engine_port)

    decider = FallbackDecider.from_profile(profile, events=events, say=console.say)
    metrics = SpecopsMetrics()
    live = LiveCounters() if (use_proxy and backend.live_timings) else None
    reader = AcceptanceReader.for_profile(profile, backend, live=live)

    def status() -> dict:
        """Supervision, decisions and the watcher's window: the state file's core and ``/specops/status``."""
        return {**sup.snapshot(), **decider.snapshot(), **watcher.snapshot()}

    def write() -> None:
        write_state(paths, {
            "name": profile.name, "profile": os.path.abspath(loaded.path), "pid": os.getpid(),
            "backend": profile.backend, "url": public_url, "proxy": use_proxy,
            "admin_url": proxy.admin_url if proxy is not None else None,
            "engine_log": str(paths.engine_log), "events": str(paths.events), "updated_at": time.time(),
            **status(),
        })

    def on_supervisor_event(event) -> None:
        if isinstance(event, EngineLine):
            console.engine(event.line)
        else:
            write()

    watcher = Watcher(profile, reader, decider, say=console.say, metrics=metrics, on_tick=write,
                      act=lambda d: sup.request_switch(SwitchOrder(d.to_index, d.reason, d.to_dict())))
    proxy = None
    if use_proxy:
        from specops.proxy import Proxy
        proxy = Proxy.from_profile(profile, status_provider=lambda: {**sup.snapshot(), **decider.snapshot()},
                                   on_timings=live.add if live is not None else None,
                                   metrics_registry=metrics.registry)
    # the order of listeners matters: the decider tells the policy which step runs before the watcher
    # starts its window, and the state is written last, with what both know
    sup = Supervisor(profile, render_step, events=events, say=console.say, decider=decider,
                     listeners=(decider.on_event, watcher.on_event, on_supervisor_event),
                     log_path=paths.engine_log, proxy=proxy, health_interval=opts.health_interval,
                     launch_problem=backend.launch_problem)
    if refused:
        sup.refuse_primary(refused)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop, f"received {signal.Signals(sig).name}")
    events.emit("up", profile=os.path.abspath(loaded.path), backend=profile.backend,
                engine_version=engine.version, engine=engine.source, url=public_url)
    console.say(f"{profile.name}: {backend.name} {engine.version} ({engine.source}); "
                f"chain {' → '.join(s.method.value for s in sup.steps)}; state in {paths.root}")
    rc = 1
    watching = False
    try:
        if proxy is not None:
            try:
                await proxy.start()
            except OSError as exc:
                raise SpecopsError(f"cannot serve {public_url}: {exc.strerror or exc} (server.host/server.port)") from None
            console.say(f"serving {public_url} (engine on {engine_host}:{engine_port})")
        watcher.start()
        watching = True
        rc = await sup.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if watching:
            await watcher.stop()
        if proxy is not None:
            await proxy.stop()
        write()
        events.emit("down", state=sup.state.value, exit_code=rc)
        release(paths)
    console.say("stopped" if rc == 0 else "gave up: no method of the chain could run")
    return rc


def up_blocking(loaded: LoadedProfile, registry, opts: UpOptions) -> int:
    if loaded.profile.proxy.enabled:        # the proxy's loop: uvloop when installed (SPECOPS_UVLOOP=0: asyncio's)
        from specops.proxy import run_event_loop
        return run_event_loop(run_up(loaded, registry, opts))
    return asyncio.run(run_up(loaded, registry, opts))
