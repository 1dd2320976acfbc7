"""The supervisor: one engine at a time, as a guarded state machine, moving down the fallback chain.

States use the vocabulary operators know from supervisord::

    stopped → starting → ready → stopping → stopped
                 │          │
                 │          └─(engine died)→ backoff → starting          (restart, same method)
                 └─(never ready / exit before ready / crash loop)→ starting (the step the decider names)
    no step left, or a failure no method can fix (the engine's port is taken) → fatal

Only the transitions in :data:`TRANSITIONS` are allowed; any other raises :class:`IllegalTransition`.

The supervisor reports facts and executes orders; it decides nothing about the chain. When a step cannot
run it reports a :class:`~specops.run.events.StepFailed` (launch failed, crash loop, refused before launch)
to the ``decider`` it was built with and runs the step the returned
:class:`~specops.run.events.FallbackOrder` names (or goes FATAL). A start that fails for a reason no method
can fix (the engine cannot bind its address; another process answers on its port) is no step's failure: the
supervisor goes FATAL at once, without a restart or a fallback (:attr:`Supervisor.fatal_reason` says why). A switch asked for while serving
(:meth:`Supervisor.request_switch`) goes: hold the proxy, drain in-flight requests, stop the engine
gracefully, start the next plan, wait until ready, release the proxy. A profile reload
(:meth:`Supervisor.request_reload`) goes the same way to the new profile's primary step. Everything it does
goes to the event log with its reason, and as typed events to its ``listeners``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from specops.backends.base import LaunchPlan
from specops.config.durations import format_duration
from specops.config.profile import ChainStep, Profile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.run.events import (
    CrashLoop,
    EngineExited,
    EngineLine,
    EngineReady,
    EngineStarting,
    FailureDecider,
    LaunchFailed,
    Listener,
    RefusedBeforeLaunch,
    State,
    StateChanged,
    StepChanged,
    StepFailed,
    SupervisorEvent,
    SwitchOrder,
)
from specops.run.instance import EventLog
from specops.run.process import EngineProcess, ExitInfo
from specops.run.start import EngineStart, StartOutcome

__all__ = ["IllegalTransition", "ReloadOrder", "STABLE_AFTER_S", "ServeOutcome", "State", "Supervisor", "TRANSITIONS"]

STABLE_AFTER_S = 30.0  # ready this long → the restart back-off starts again from its first value

#: Every allowed state change (a "change" to the same state is no change and always allowed).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING, State.FATAL}),
    State.STARTING: frozenset({State.READY, State.STOPPING, State.STOPPED, State.FATAL}),
    State.READY: frozenset({State.STOPPING, State.BACKOFF, State.STARTING, State.STOPPED, State.FATAL}),
    State.STOPPING: frozenset({State.STOPPED, State.STARTING, State.BACKOFF, State.FATAL}),
    State.BACKOFF: frozenset({State.STARTING, State.STOPPED, State.FATAL}),
    State.FATAL: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the state machine does not allow (a bug in the supervisor, never a user error)."""

    def __init__(self, current: State, wanted: State):
        super().__init__(f"illegal supervisor transition {current} → {wanted}")
        self.current, self.wanted = current, wanted


@dataclass(frozen=True)
class ReloadOrder:
    """Run ``profile`` (rendered by ``render(step_index)``) from its primary step: a reloaded profile file."""

    profile: Profile
    render: Callable[[int], LaunchPlan]
    reason: str
    changes: tuple[str, ...] = ()
    #: called with the reason when the new primary step does not start: the supervisor then runs the previous
    #: profile again, at the step it was on (a profile that cannot start never replaces one that runs)
    on_failed: Callable[[str], None] | None = None


@dataclass(frozen=True)
class CannotRun:
    """A start failed for a reason no method of the chain can fix (the engine's address is taken): the
    instance stops. Not a :class:`~specops.run.events.StepFailed`: the decider has nothing to decide."""

    index: int
    method: Method
    reason: str


class ServeOutcome(Enum):
    """How serving a ready engine ended."""

    STOP = "stop"  # specops is stopping
    SWITCHED = "switched"  # a switch was executed: the loop starts the new step
    EXITED = "exited"  # the engine died while serving


class Supervisor:
    """Runs the engine for ``profile``'s chain of methods until asked to stop or no method is left.

    ``render(step_index) -> LaunchPlan`` builds the plan for a step (the caller closes over backend,
    engine version and internal port). ``decider`` says where to go when a step cannot run.
    ``listeners`` receive every :mod:`specops.run.events` event. ``proxy`` (optional) is held and released
    around restarts. ``clock`` is the monotonic clock (crash-loop window, back-off reset, switch timings).
    """

    def __init__(
        self,
        profile: Profile,
        render: Callable[[int], LaunchPlan],
        *,
        events: EventLog,
        say: Callable[[str], None],
        decider: FailureDecider,
        listeners: Iterable[Listener] = (),
        log_path=None,
        proxy: Any = None,
        health_interval: float = 0.25,
        launch_problem: Callable[[str], str | None] | None = None,
        bind_failure: Callable[[str], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.profile = profile
        self.steps = profile.steps
        self.render = render
        self.events = events
        self.say = say
        self.decider = decider
        self.listeners: tuple[Listener, ...] = tuple(listeners)
        self.log_path = log_path
        self.proxy = proxy
        self.health_interval = health_interval
        self.launch_problem = launch_problem or (lambda line: None)
        self.bind_failure = bind_failure or (lambda line: None)
        self.clock = clock
        #: why the supervisor stopped for a failure no method can fix (None: it did not)
        self.fatal_reason: str | None = None

        self.state = State.STOPPED
        self.index = 0
        self.engine: EngineProcess | None = None
        self.plan: LaunchPlan | None = None
        self.restarts = 0
        self.started_at = time.time()
        self.ready_since: float | None = None
        self.exit_times: list[float] = []
        self.backoff = profile.supervisor.restart_backoff
        self.last_switch_timing: dict | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._switch: SwitchOrder | None = None
        self._reload: ReloadOrder | None = None
        self._rollback: tuple[Profile, Callable[[int], LaunchPlan], int, ReloadOrder] | None = None
        self._switch_marks: tuple[float, float, float] | None = None  # switch began, drained, old engine stopped
        self._ready_mono = 0.0

    # ------------------------------------------------------------------ public control
    @property
    def step(self) -> ChainStep:
        return self.steps[self.index]

    def request_stop(self, why: str = "stop requested") -> None:
        if not self._stop.is_set():
            self.events.emit("stop-requested", reason=why)
            self._stop.set()
            self._wake.set()

    def refuse_primary(self, why: str) -> bool:
        """The primary step cannot run (e.g. its draft was refused before launch): report it to the decider
        and go where it says. False when it says there is nowhere to go (the supervisor is then FATAL)."""
        return self._after_failure(RefusedBeforeLaunch(self.index, self.step.method, f"refused before launch: {why}"))

    def request_switch(self, order: SwitchOrder) -> bool:
        """Ask to move to chain step ``order.index`` (the watcher's decision). False if not possible now."""
        if self.state is not State.READY or not (0 <= order.index < len(self.steps)) or order.index == self.index:
            return False
        if self._reload is not None:
            return False
        self._switch = order
        self._wake.set()
        return True

    def request_reload(self, order: ReloadOrder) -> bool:
        """Switch to a reloaded profile's primary step, the zero-loss way of :meth:`request_switch`. False when
        the supervisor cannot take it now (not serving: starting, switching, backing off); ask again later."""
        if self.state is not State.READY or self._stop.is_set() or self._reload is not None:
            return False
        self._reload = order
        self._switch = None  # a decision about the old chain's steps means nothing in the new one
        self._wake.set()
        return True

    def snapshot(self) -> dict:
        """What `specops status` shows about supervision (the decisions are the decider's to show)."""
        plan = self.plan
        return {
            "state": self.state.value,
            "method": self.step.method.value,
            "step": self.index,
            "chain": [s.method.value for s in self.steps],
            "engine_pid": self.engine.pid if self.engine and self.engine.running else None,
            "engine_url": plan.base_url if plan else None,
            "engine_version": plan.engine_version if plan else None,
            "draft_length": plan.draft_length.to_dict() if plan and plan.draft_length else None,
            "restarts": self.restarts,
            "ready_since": self.ready_since,
            "started_at": self.started_at,
            "last_switch_timing": self.last_switch_timing,
        }

    # ------------------------------------------------------------------ the loop
    async def run(self) -> int:
        """Supervise until stopped (exit code 0) or no method of the chain can run (1)."""
        try:
            if self.state is State.FATAL:  # refused before launch, and nothing to fall back to
                return 1
            while not self._stop.is_set():
                started = await self._start_current()
                if started is StartOutcome.STOPPED:
                    break
                if isinstance(started, CannotRun):
                    if self._rollback is not None:  # the reloaded profile's doing: run the previous one again
                        self._roll_back(started.reason)
                        continue
                    self._cannot_run(started)
                    return 1
                if isinstance(started, LaunchFailed):
                    if self._rollback is not None:
                        self._roll_back(started.reason)
                        continue
                    if not self._after_failure(started):
                        return 1
                    continue
                outcome = await self._serve()
                if outcome is ServeOutcome.STOP:
                    break
                if outcome is ServeOutcome.SWITCHED:
                    continue
                crash = self._crash_loop()
                if crash is not None:
                    if not self._after_failure(crash):
                        return 1
                    continue
                if not await self._backoff():
                    break
            return 0
        finally:
            await self._stop_engine("specops is stopping" if self._stop.is_set() else "supervisor exit")
            if self.state is not State.FATAL:
                self._set(State.STOPPED)

    # ------------------------------------------------------------------ state and events
    def _set(self, state: State) -> None:
        """Enter ``state``; raises :class:`IllegalTransition` unless :data:`TRANSITIONS` allows it."""
        previous = self.state
        if state is previous:
            return
        if state not in TRANSITIONS[previous]:
            raise IllegalTransition(previous, state)
        self.events.emit("state", state=state.value, previous=previous.value, method=self.step.method.value)
        self.state = state
        self._emit(StateChanged(previous, state, self.index, self.step.method, self.restarts))

    def _emit(self, event: SupervisorEvent) -> None:
        for listener in self.listeners:
            listener(event)

    def _move_to(self, index: int, reason: str, *, requested: bool, decision=None) -> None:
        old = self.index
        self.index = index
        self._emit(
            StepChanged(
                old, index, self.steps[old].method, self.steps[index].method, reason, requested, dict(decision or {})
            )
        )

    def _on_engine_line(self, line: str) -> None:
        self._emit(EngineLine(line))

    # ------------------------------------------------------------------ starting
    async def _start_current(self) -> StartOutcome | LaunchFailed | CannotRun:
        step = self.step
        try:
            self.plan = self.render(self.index)
        except SpecopsError as exc:
            why = f"cannot render {step.method}: {exc}"
            self.say(why)
            self.events.emit("render-failed", method=step.method.value, reason=str(exc))
            return LaunchFailed(self.index, step.method, why)
        start = EngineStart(
            self.plan,
            on_line=self._on_engine_line,
            launch_problem=self.launch_problem,
            bind_failure=self.bind_failure,
            log_path=self.log_path,
        )
        self.engine = start.process
        self._set(State.STARTING)
        shown = self.plan.to_dict()
        self.events.emit("start", method=step.method.value, argv=shown["argv"], env=shown["env"], url=shown["url"])
        self._emit(EngineStarting(self.index, step.method, self.plan))
        self.say(
            f"starting {self.plan.backend} {self.plan.engine_version} with method {step.method} on {self.plan.base_url}"
        )
        result = await start.run(
            self.profile.engine.ready_timeout,
            interval=self.health_interval,
            stop=self._stop,
            say=self.say,
            timeout_hint=" (engine.ready_timeout)",
        )
        if result.outcome is StartOutcome.STOPPED:
            return StartOutcome.STOPPED
        if result.outcome is StartOutcome.READY:
            self._on_ready(result.seconds)
            return StartOutcome.READY
        why = result.reason
        self.events.emit(
            "launch-failed",
            method=step.method.value,
            reason=why,
            last_lines=list(result.last_lines),
            fatal=result.fatal,
        )
        if result.fatal:  # one line: the engine's own words are in it
            await self._stop_engine(why)
            return CannotRun(self.index, step.method, why)
        self.say(f"{step.method}: {why}; last engine lines:")
        for line in result.last_lines:
            self.say(f"    {line}")
        await self._stop_engine(why)
        return LaunchFailed(self.index, step.method, why)

    def _on_ready(self, seconds: float) -> None:
        step, plan = self.step, self.plan
        assert plan is not None
        self.ready_since = time.time()
        self._ready_mono = self.clock()
        self._rollback = None
        self.events.emit("ready", method=step.method.value, seconds=round(seconds, 3), url=plan.base_url)
        self._set(State.READY)
        self.say(
            f"ready in {seconds:.1f}s: {plan.backend} {plan.engine_version}, "
            f"method {step.method}" + (f", draft length {plan.draft_length.describe()}" if plan.draft_length else "")
        )
        if self.proxy is not None:
            self.proxy.release(plan.base_url)
        if self._switch_marks is not None:
            t0, t1, t2 = self._switch_marks
            now = self.clock()
            self.last_switch_timing = {
                "drain_s": round(t1 - t0, 3),
                "stop_s": round(t2 - t1, 3),
                "start_to_ready_s": round(now - t2, 3),
                "total_s": round(now - t0, 3),
            }
            self.events.emit("switch-complete", method=step.method.value, **self.last_switch_timing)
            self._switch_marks = None
        self._emit(EngineReady(self.index, step.method, plan, seconds))

    # ------------------------------------------------------------------ serving
    async def _serve(self) -> ServeOutcome:
        """Wait while ready, until a stop, a switch (executed here) or the engine's exit."""
        assert self.engine is not None
        exit_task = asyncio.create_task(self.engine.wait_exit())
        try:
            while True:
                self._wake.clear()
                if self._stop.is_set():
                    return ServeOutcome.STOP
                if self._reload is not None:
                    await self._do_reload(self._reload)
                    self._reload = None
                    return ServeOutcome.SWITCHED
                if self._switch is not None:
                    await self._do_switch(self._switch)
                    self._switch = None
                    return ServeOutcome.SWITCHED
                wake_task = asyncio.create_task(self._wake.wait())
                done, _ = await asyncio.wait({exit_task, wake_task}, return_when=asyncio.FIRST_COMPLETED)
                wake_task.cancel()
                if exit_task in done and not self._stop.is_set() and self._switch is None and self._reload is None:
                    info: ExitInfo = exit_task.result()
                    self.exit_times.append(self.clock())
                    if self.proxy is not None:
                        self.proxy.upstream_failed()
                    tail = list(self.engine.last_lines)[-12:]
                    self.events.emit("exit", method=self.step.method.value, how=info.describe(), last_lines=tail)
                    self.say(f"engine {info.describe()} while serving")
                    self._emit(EngineExited(self.index, self.step.method, info.describe()))
                    if self.clock() - self._ready_mono >= STABLE_AFTER_S:
                        self.backoff = self.profile.supervisor.restart_backoff
                    await self._stop_engine("engine exited")  # reap any worker left in its group
                    return ServeOutcome.EXITED
        finally:
            exit_task.cancel()

    async def _do_switch(self, order: SwitchOrder) -> None:
        old = self.step.method
        target = self.steps[order.index].method
        self._set(State.STOPPING)
        self.say(f"switching {old} → {target}: {order.reason}")
        t0, t1, t2, drained = await self._drain_and_stop(f"switch to {target}")
        self.events.emit(
            "switch",
            **{
                "from": old.value,
                "to": target.value,
                "reason": order.reason,
                "decision": dict(order.decision),
                "drain_s": round(t1 - t0, 3),
                "stop_s": round(t2 - t1, 3),
                "drained": getattr(drained, "__dict__", drained),
            },
        )
        self._move_to(order.index, order.reason, requested=True, decision=order.decision)
        self._switch_marks = (t0, t1, t2)

    async def _drain_and_stop(self, why: str) -> tuple[float, float, float, Any]:
        """Hold the proxy (new requests wait), let the requests in flight finish, stop the engine; the times
        each part began and ended, and the proxy's drain result."""
        t0 = self.clock()
        drained = None
        if self.proxy is not None:
            self.proxy.hold()
            drained = await self.proxy.drain(self.profile.proxy.drain_timeout)
        t1 = self.clock()
        await self._stop_engine(why)
        return t0, t1, self.clock(), drained

    async def _do_reload(self, order: ReloadOrder) -> None:
        old = self.step.method
        target = order.profile.steps[0].method
        self._set(State.STOPPING)
        self.say(f"reloading the profile ({old} → {target}): {order.reason}")
        t0, t1, t2, drained = await self._drain_and_stop("profile reload")
        self.events.emit(
            "reload-switch",
            **{
                "from": old.value,
                "to": target.value,
                "reason": order.reason,
                "changes": list(order.changes),
                "drain_s": round(t1 - t0, 3),
                "stop_s": round(t2 - t1, 3),
                "drained": getattr(drained, "__dict__", drained),
            },
        )
        self._rollback = (self.profile, self.render, self.index, order)
        self.profile, self.steps, self.render = order.profile, order.profile.steps, order.render
        self.index = 0
        self.exit_times = []
        self.backoff = order.profile.supervisor.restart_backoff
        self._switch_marks = (t0, t1, t2)

    def _roll_back(self, why: str) -> None:
        """The reloaded profile's primary step did not start: run the previous profile again (the proxy still
        holds the requests), at the step it was on, and tell whoever ordered the reload."""
        assert self._rollback is not None
        profile, render, index, order = self._rollback
        self._rollback = None
        failed = self.step.method
        self.profile, self.steps, self.render, self.index = profile, profile.steps, render, index
        self.exit_times = []
        self.backoff = profile.supervisor.restart_backoff
        self.events.emit("reload-failed", method=failed.value, reason=why, back_to=self.step.method.value)
        self.say(f"the reloaded profile's {failed} did not start ({why}); running the previous profile again")
        if order.on_failed is not None:
            order.on_failed(why)

    # ------------------------------------------------------------------ failures
    def _crash_loop(self) -> CrashLoop | None:
        s = self.profile.supervisor
        now = self.clock()
        recent = [t for t in self.exit_times if now - t <= s.crash_loop_window]
        self.exit_times = recent
        if len(recent) >= s.crash_loop_exits:
            return CrashLoop(
                self.index,
                self.step.method,
                f"crash loop: {len(recent)} exits within {format_duration(s.crash_loop_window)}",
            )
        return None

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

    def _cannot_run(self, failure: CannotRun) -> None:
        """Stop for good: no method of the chain can fix ``failure``, so neither a restart nor a fallback. The
        caller says why (:attr:`fatal_reason`), once."""
        self.fatal_reason = failure.reason
        self._set(State.FATAL)
        self.events.emit("fatal", method=failure.method.value, reason=failure.reason)

    def _after_failure(self, failure: StepFailed) -> bool:
        """Report ``failure`` to the decider and execute its order; False (and FATAL) when nothing is left."""
        order = self.decider.decide_after_failure(failure)
        if order.target is None:
            self._set(State.FATAL)
            self.say(f"no method left to try after {failure.method}: {failure.reason}")
            return False
        if not 0 <= order.target < len(self.steps):
            raise ValueError(f"fallback order names step {order.target}, outside the chain (0..{len(self.steps) - 1})")
        self.exit_times = []
        self.backoff = self.profile.supervisor.restart_backoff
        self._move_to(order.target, failure.reason, requested=False)
        self.say(f"falling back {failure.method} → {self.step.method}: {failure.reason}")
        return True

    async def _stop_engine(self, why: str) -> None:
        engine = self.engine
        if engine is None or engine.proc is None:
            return
        if engine.running:
            self._set(State.STOPPING)
            self.events.emit("stopping", method=self.step.method.value, reason=why)
        await engine.stop(self.profile.supervisor.stop_timeout)
