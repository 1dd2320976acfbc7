"""The supervisor: one engine at a time, as an explicit state machine, moving down the fallback chain.

States use the vocabulary operators know from supervisord::

    stopped → starting → ready → stopping → stopped
                 │          │
                 │          └─(engine died)→ backoff → starting          (restart, same method)
                 └─(never ready / exit before ready / crash loop)→ starting (next method of the chain)
    no method left → fatal

A switch asked for by the watcher goes through the same path: hold the proxy, drain in-flight requests,
stop the engine gracefully, start the next plan, wait until ready, release the proxy. Every transition
and every decision goes to the event log with its reason.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from specops.backends.base import LaunchPlan
from specops.config.durations import format_duration
from specops.errors import SpecopsError
from specops.run.instance import EventLog
from specops.run.process import EngineProcess, ExitInfo
from specops.config.profile import ChainStep, Profile

STABLE_AFTER_S = 30.0  # ready this long → the restart back-off starts again from its first value


class State(str, Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FATAL = "fatal"

    def __str__(self) -> str:
        return self.value


@dataclass
class SwitchRequest:
    index: int
    reason: str
    decision: dict = field(default_factory=dict)


class Supervisor:
    """Runs the engine for ``profile``'s chain of methods until asked to stop or no method is left.

    ``render(step_index) -> LaunchPlan`` builds the plan for a step (the caller closes over backend,
    engine version and internal port). ``proxy`` (optional) is held and released around restarts.
    """

    def __init__(self, profile: Profile, render: Callable[[int], LaunchPlan], *, events: EventLog,
                 say: Callable[[str], None], on_engine_line: Callable[[str], None] | None = None,
                 log_path=None, proxy: Any = None, health_interval: float = 0.25,
                 on_change: Callable[["Supervisor"], None] | None = None,
                 launch_problem: Callable[[str], str | None] | None = None):
        self.profile = profile
        self.steps = profile.steps
        self.render = render
        self.events = events
        self.say = say
        self.on_engine_line = on_engine_line or (lambda line: None)
        self.log_path = log_path
        self.proxy = proxy
        self.health_interval = health_interval
        self.on_change = on_change or (lambda s: None)
        self.launch_problem = launch_problem or (lambda line: None)
        self.ready_listeners: list[Callable[[Supervisor], None]] = []
        #: Where to go when step i cannot run (launch failure, crash loop): an index, or None for FATAL.
        #: Default: the next step. The watcher sets it so a failed retry goes back where it came from.
        self.next_after_failure: Callable[[int], int | None] = \
            lambda i: i + 1 if i + 1 < len(self.steps) else None

        self.state = State.STOPPED
        self.index = 0
        self.engine: EngineProcess | None = None
        self.plan: LaunchPlan | None = None
        self.restarts = 0
        self.switches = 0
        self.started_at = time.time()
        self.ready_since: float | None = None
        self.last_decision: dict | None = None
        self.exit_times: list[float] = []
        self.backoff = profile.supervisor.restart_backoff
        self.last_switch_timing: dict | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._switch: SwitchRequest | None = None
        self._switch_marks: tuple[float, float, float] | None = None  # switch began, drained, old engine stopped
        self._ready_mono = 0.0
        self._launch_failure = ""
        self._crash_reason = ""

    # ------------------------------------------------------------------ public control
    @property
    def step(self) -> ChainStep:
        return self.steps[self.index]

    def request_stop(self, why: str = "stop requested") -> None:
        if not self._stop.is_set():
            self.events.emit("stop-requested", reason=why)
            self._stop.set()
            self._wake.set()

    def skip_primary(self, why: str) -> None:
        """Start at the first fallback step: the primary method cannot run (e.g. its draft was refused)."""
        self._fall_back(1, why, "refused before launch")

    def request_switch(self, index: int, reason: str, decision: dict | None = None) -> bool:
        """Ask to move to chain step ``index`` (called by the watcher). False if not possible now."""
        if self.state is not State.READY or not (0 <= index < len(self.steps)) or index == self.index:
            return False
        self._switch = SwitchRequest(index, reason, decision or {})
        self._wake.set()
        return True

    def snapshot(self) -> dict:
        """What `specops status` shows about supervision."""
        plan = self.plan
        return {
            "state": self.state.value,
            "method": self.step.method.value,
            "step": self.index,
            "chain": [s.method.value for s in self.steps],
            "engine_pid": self.engine.pid if self.engine and self.engine.running else None,
            "engine_url": plan.base_url if plan else None,
            "engine_version": plan.engine_version if plan else None,
            "restarts": self.restarts,
            "switches": self.switches,
            "ready_since": self.ready_since,
            "started_at": self.started_at,
            "last_decision": self.last_decision,
            "last_switch_timing": self.last_switch_timing,
        }

    # ------------------------------------------------------------------ the loop
    async def run(self) -> int:
        """Supervise until stopped (exit code 0) or no method of the chain can run (1)."""
        try:
            while not self._stop.is_set():
                if not await self._start_current():
                    if not await self._advance("launch failed"):
                        return 1
                    continue
                outcome = await self._serve()
                if outcome == "stop":
                    break
                if outcome == "switch":
                    continue
                # the engine died while serving
                if self._crash_loop():
                    if not await self._advance(self._crash_reason):
                        return 1
                    continue
                if not await self._backoff():
                    break
            return 0
        finally:
            await self._stop_engine("specops is stopping" if self._stop.is_set() else "supervisor exit")
            if self.state is not State.FATAL:
                self._set(State.STOPPED)

    def _set(self, state: State) -> None:
        if state is not self.state:
            self.events.emit("state", state=state.value, previous=self.state.value, method=self.step.method.value)
            self.state = state
        self.on_change(self)

    async def _start_current(self) -> bool:
        step = self.step
        try:
            self.plan = self.render(self.index)
        except SpecopsError as exc:
            self._launch_failure = f"cannot render {step.method}: {exc}"
            self.say(self._launch_failure)
            self.events.emit("render-failed", method=step.method.value, reason=str(exc))
            return False
        problems: list[str] = []

        def on_line(line: str) -> None:
            if self.state is State.STARTING and not problems:
                problem = self.launch_problem(line)
                if problem:
                    problems.append(problem)
            self.on_engine_line(line)

        self.engine = EngineProcess(self.plan, on_line=on_line, log_path=self.log_path)
        self._set(State.STARTING)
        shown = self.plan.to_dict()
        self.events.emit("start", method=step.method.value, argv=shown["argv"], env=shown["env"], url=shown["url"])
        self.say(f"starting {self.plan.backend} {self.plan.engine_version} with method {step.method} "
                 f"on {self.plan.base_url}")
        t0 = time.monotonic()
        await self.engine.start()
        last_report = [0.0]

        def progress(elapsed: float) -> None:
            if elapsed - last_report[0] >= 10:
                last_report[0] = elapsed
                last = self.engine.last_lines[-1] if self.engine.last_lines else "(no output yet)"
                self.say(f"waiting for {self.plan.health_url}: {elapsed:.0f}s, last engine line: {last[-160:]}")

        timeout = self.profile.engine.ready_timeout
        ready_task = asyncio.create_task(self.engine.wait_ready(timeout, self.health_interval, progress))
        stop_task = asyncio.create_task(self._stop.wait())
        await asyncio.wait({ready_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        if self._stop.is_set():
            ready_task.cancel()
            return True  # _serve sees the stop at once
        if ready_task.result():
            await asyncio.sleep(0.02)  # let the output reader catch up with lines printed just before ready
            problems += [p for p in map(self.launch_problem, self.engine.last_lines) if p and not problems]
        if ready_task.result() and problems:
            why = problems[0]
        elif ready_task.result():
            elapsed = time.monotonic() - t0
            self.ready_since = time.time()
            self._ready_mono = time.monotonic()
            self.events.emit("ready", method=step.method.value, seconds=round(elapsed, 3), url=self.plan.base_url)
            self._set(State.READY)
            self.say(f"ready in {elapsed:.1f}s: {self.plan.backend} {self.plan.engine_version}, "
                     f"method {step.method}" + (f" (k={self.profile.at_step(self.index).speculative.k})"
                                                 if step.method.value not in ("none",) else ""))
            if self.proxy is not None:
                self.proxy.release(self.plan.base_url)
            if self._switch_marks is not None:
                t0, t1, t2 = self._switch_marks
                self.last_switch_timing = {"drain_s": round(t1 - t0, 3), "stop_s": round(t2 - t1, 3),
                                           "start_to_ready_s": round(time.monotonic() - t2, 3),
                                           "total_s": round(time.monotonic() - t0, 3)}
                self.events.emit("switch-complete", method=step.method.value, **self.last_switch_timing)
                self._switch_marks = None
            for listener in list(self.ready_listeners):
                listener(self)
            return True
        elif self.engine.exit is not None:
            why = f"engine {self.engine.exit.describe()} before it was ready"
        else:
            why = f"engine not ready after {format_duration(timeout)} (engine.ready_timeout)"
        self._launch_failure = why
        tail = list(self.engine.last_lines)[-12:]
        self.events.emit("launch-failed", method=step.method.value, reason=why, last_lines=tail)
        self.say(f"{step.method}: {why}; last engine lines:")
        for line in tail:
            self.say(f"    {line}")
        await self._stop_engine(why)
        return False

    async def _serve(self) -> str:
        """Wait while ready: returns 'stop', 'switch' (done, next step started by the loop) or 'exited'."""
        assert self.engine is not None
        exit_task = asyncio.create_task(self.engine.wait_exit())
        try:
            while True:
                self._wake.clear()
                if self._stop.is_set():
                    return "stop"
                if self._switch is not None:
                    await self._do_switch(self._switch)
                    self._switch = None
                    return "switch"
                wake_task = asyncio.create_task(self._wake.wait())
                done, _ = await asyncio.wait({exit_task, wake_task}, return_when=asyncio.FIRST_COMPLETED)
                wake_task.cancel()
                if exit_task in done and not self._stop.is_set() and self._switch is None:
                    info: ExitInfo = exit_task.result()
                    self.exit_times.append(time.monotonic())
                    if self.proxy is not None:
                        self.proxy.upstream_failed()
                    tail = list(self.engine.last_lines)[-12:]
                    self.events.emit("exit", method=self.step.method.value, how=info.describe(), last_lines=tail)
                    self.say(f"engine {info.describe()} while serving")
                    if time.monotonic() - self._ready_mono >= STABLE_AFTER_S:
                        self.backoff = self.profile.supervisor.restart_backoff
                    await self._stop_engine("engine exited")  # reap any worker left in its group
                    return "exited"
        finally:
            exit_task.cancel()

    async def _do_switch(self, req: SwitchRequest) -> None:
        old = self.step.method
        target = self.steps[req.index].method
        self._set(State.STOPPING)
        self.say(f"switching {old} → {target}: {req.reason}")
        t0 = time.monotonic()
        drained = None
        if self.proxy is not None:
            self.proxy.hold()
            drained = await self.proxy.drain(self.profile.proxy.drain_timeout)
        t1 = time.monotonic()
        await self._stop_engine(f"switch to {target}")
        t2 = time.monotonic()
        self.index = req.index
        self.switches += 1
        self.last_decision = {**req.decision, "reason": req.reason, "from": old.value, "to": target.value,
                              "at": time.time()}
        self.events.emit("switch", **{"from": old.value, "to": target.value, "reason": req.reason,
                                      "decision": req.decision, "drain_s": round(t1 - t0, 3),
                                      "stop_s": round(t2 - t1, 3),
                                      "drained": getattr(drained, "__dict__", drained)})
        self._switch_marks = (t0, t1, t2)

    def _crash_loop(self) -> bool:
        s = self.profile.supervisor
        now = time.monotonic()
        recent = [t for t in self.exit_times if now - t <= s.crash_loop_window]
        self.exit_times = recent
        if len(recent) >= s.crash_loop_exits:
            self._crash_reason = (f"crash loop: {len(recent)} exits within "
                                  f"{format_duration(s.crash_loop_window)}")
            return True
        return False

    async def _backoff(self) -> bool:
        """Wait before restarting the same method; False when a stop arrived meanwhile."""
        self._set(State.BACKOFF)
        wait = self.backoff
        self.backoff = min(self.backoff * 2, self.profile.supervisor.restart_backoff_max)
        self.restarts += 1
        self.events.emit("restart", method=self.step.method.value, after_s=wait, restarts=self.restarts)
        self.say(f"restarting {self.step.method} in {format_duration(wait)} (restart #{self.restarts})")
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=wait)
            return False
        except asyncio.TimeoutError:
            return True

    async def _advance(self, reason: str) -> bool:
        """Move to the next method of the chain; False (and FATAL) when there is none."""
        failed = self.step.method
        why = self._launch_failure if reason == "launch failed" else reason
        target = self.next_after_failure(self.index)
        if target is None:
            self.last_decision = {"action": "fatal", "from": failed.value, "reason": why, "at": time.time()}
            self.events.emit("decision", action="fatal", **{"from": failed.value}, reason=why,
                             rule="chain exhausted")
            self._set(State.FATAL)
            self.say(f"no method left to try after {failed}: {why}")
            return False
        self.exit_times = []
        self.backoff = self.profile.supervisor.restart_backoff
        self._fall_back(target, why, "launch failure" if reason == "launch failed" else "crash loop")
        return True

    def _fall_back(self, target: int, why: str, rule: str) -> None:
        """Move to step ``target`` because the current one cannot run; the decision is logged and shown."""
        failed, self.index = self.step.method, target
        nxt = self.step.method
        self.last_decision = {"action": "switch", "from": failed.value, "to": nxt.value, "reason": why,
                              "rule": rule, "at": time.time()}
        self.events.emit("decision", action="switch", **{"from": failed.value, "to": nxt.value}, reason=why,
                         rule=rule)
        self.switches += 1
        self.say(f"falling back {failed} → {nxt}: {why}")

    async def _stop_engine(self, why: str) -> None:
        engine = self.engine
        if engine is None or engine.proc is None:
            return
        if engine.running:
            self._set(State.STOPPING)
            self.events.emit("stopping", method=self.step.method.value, reason=why)
        await engine.stop(self.profile.supervisor.stop_timeout)
