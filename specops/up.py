"""``specops up``: resolve, render, launch, supervise, watch, and serve through the proxy until stopped.

This module wires the parts together; each part lives in its own module (render, process, supervise,
watch, proxy) and knows nothing of the others beyond the small interfaces used here.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

from specops.errors import ProfileError, SpecopsError
from specops.run.instance import EventLog, InstancePaths, acquire, release, write_state
from specops.config.profile import LoadedProfile
from specops.backends.base import http_url
from specops.backends.render import plan as render_plan
from specops.run.supervise import Supervisor
from specops.watch.watcher import Watcher


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def resolve_for_launch(loaded: LoadedProfile, offline: bool, say: Callable[[str], None]) -> tuple[LoadedProfile, str | None]:
    """Apply the resolver (draft/method `auto`, the lock file, the compatibility checks).

    Returns the profile to launch and, when the checks refuse the primary draft (``checks: enforce``),
    why: the caller then starts at the next method of the chain instead of launching a draft that cannot
    work. With ``checks: warn`` the findings are printed and the engine decides.
    """
    from specops.resolve import resolve_profile

    enforce = loaded.profile.speculative.checks == "enforce"
    try:
        resolution = resolve_profile(loaded, offline=offline, raise_errors=enforce)
    except ProfileError as exc:
        return loaded, "; ".join(p.message for p in exc.problems)
    for note in resolution.notes:
        say(note)
    for finding in resolution.findings:
        if finding.severity in ("warning", "error"):
            say(f"{finding.severity}: {finding.message}")
    if resolution.profile is loaded.profile:
        return loaded, None
    return LoadedProfile(resolution.profile, loaded.document, loaded.path), None


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

    state_extra: dict = {}

    def write(s: Supervisor) -> None:
        write_state(paths, {
            "name": profile.name, "profile": os.path.abspath(loaded.path), "pid": os.getpid(),
            "backend": profile.backend, "url": public_url, "proxy": use_proxy,
            "admin_url": proxy.admin_url if proxy is not None else None,
            "engine_log": str(paths.engine_log), "events": str(paths.events), "updated_at": time.time(),
            **s.snapshot(), **state_extra,
        })

    proxy = None
    if use_proxy:
        from specops.proxy import Proxy
        proxy = Proxy.from_profile(profile, status_provider=lambda: sup.snapshot())
    sup = Supervisor(profile, render_step, events=events, say=console.say, on_engine_line=console.engine,
                     log_path=paths.engine_log, proxy=proxy, health_interval=opts.health_interval,
                     on_change=write, launch_problem=backend.launch_problem)
    if refused:
        sup.skip_primary(f"refused before launch: {refused}")

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop, f"received {signal.Signals(sig).name}")
    events.emit("up", profile=os.path.abspath(loaded.path), backend=profile.backend,
                engine_version=engine.version, engine=engine.source, url=public_url)
    console.say(f"{profile.name}: {backend.name} {engine.version} ({engine.source}); "
                f"chain {' → '.join(s.method.value for s in sup.steps)}; state in {paths.root}")
    watcher = None
    rc = 1
    try:
        if proxy is not None:
            try:
                await proxy.start()
            except OSError as exc:
                raise SpecopsError(f"cannot serve {public_url}: {exc.strerror or exc} (server.host/server.port)") from None
            console.say(f"serving {public_url} (engine on {engine_host}:{engine_port})")
        watcher = Watcher.attach(profile, sup, events=events, say=console.say, proxy=proxy, status=state_extra,
                                 publish=lambda: write(sup))
        rc = await sup.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if watcher is not None:
            await watcher.stop()
        if proxy is not None:
            await proxy.stop()
        write(sup)
        events.emit("down", state=sup.state.value, exit_code=rc)
        release(paths)
    console.say("stopped" if rc == 0 else "gave up: no method of the chain could run")
    return rc


def up_blocking(loaded: LoadedProfile, registry, opts: UpOptions) -> int:
    if loaded.profile.proxy.enabled:        # the proxy's loop: uvloop when installed (SPECOPS_UVLOOP=0: asyncio's)
        from specops.proxy import run_event_loop
        return run_event_loop(run_up(loaded, registry, opts))
    return asyncio.run(run_up(loaded, registry, opts))
