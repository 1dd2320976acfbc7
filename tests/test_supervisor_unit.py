"""The supervisor alone, on the stand-in engine (tests/support_upstream.py: a real HTTP server process that
speaks the engine protocol) and a fake clock: its guarded state machine, failed starts, crash loops,
refusals and switches — each reported as a typed fact and executed as the decider orders."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from support_ports import free_port
from support_supervisor import (
    FakeClock,
    Recorder,
    ScriptedDecider,
    exits_at_once,
    health,
    make_profile,
    run,
    standin,
    supervisor,
    wait_until,
)

from specops.methods import Method
from specops.run.events import (
    CrashLoop,
    EngineExited,
    EngineReady,
    EngineStarting,
    LaunchFailed,
    RefusedBeforeLaunch,
    State,
    StateChanged,
    StepChanged,
    SwitchOrder,
)
from specops.run.instance import EventLog
from specops.run.process import group_members
from specops.run.supervise import TRANSITIONS, IllegalTransition, Supervisor
from specops.watch.decide import FallbackDecider


def test_every_transition_outside_the_table_raises():
    sup, rec = supervisor(lambda i: standin(i, 1), ScriptedDecider())
    for a in State:
        for b in State:
            sup.state = a
            if b is a:
                sup._set(b)  # no change: always allowed, nothing reported
                continue
            if b in TRANSITIONS[a]:
                sup._set(b)
                assert sup.state is b
            else:
                with pytest.raises(IllegalTransition, match=f"{a.value} → {b.value}"):
                    sup._set(b)
                assert sup.state is a  # a refused transition changes nothing
    assert not TRANSITIONS[State.FATAL]  # fatal is final
    changes = rec.of(StateChanged)
    assert changes and all(c.state in TRANSITIONS[c.previous] for c in changes)


def test_illegal_transition_from_stopped_to_ready():
    sup, rec = supervisor(lambda i: standin(i, 1), ScriptedDecider())
    with pytest.raises(IllegalTransition):
        sup._set(State.READY)
    assert sup.state is State.STOPPED and not rec.events


# ------------------------------------------------------------------------------------------- start, serve, stop


def test_start_ready_serve_and_stop():
    port = free_port()
    log = EventLog(None)

    async def main():
        sup, rec = supervisor(lambda i: standin(i, port), ScriptedDecider(), events=log)
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        [starting], [ready] = rec.of(EngineStarting), rec.of(EngineReady)
        assert (starting.index, ready.index, ready.method) == (0, 0, Method.DRAFT_MODEL)
        assert ready.plan.base_url == f"http://127.0.0.1:{port}" and ready.seconds > 0
        assert await asyncio.to_thread(health, ready.plan.base_url) == 200
        snap = sup.snapshot()
        assert snap["state"] == "ready" and snap["method"] == "draft_model" and snap["engine_pid"]
        assert "switches" not in snap and "last_decision" not in snap  # the decider's to show
        assert any(line.startswith("LISTENING") for line in rec.lines)
        pgid = sup.engine.pid
        sup.request_stop("test over")
        assert await task == 0
        return rec, pgid

    rec, pgid = run(main())
    assert rec.states() == ["starting", "ready", "stopping", "stopped"]
    assert not group_members(pgid)
    kinds = [e["event"] for e in log.recent]
    assert kinds[:4] == ["state", "start", "ready", "state"] and "stop-requested" in kinds


def test_stop_while_starting_stops_the_engine():
    port = free_port()
    slow = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]

    async def main():
        sup, rec = supervisor(lambda i: standin(i, port, argv=slow), ScriptedDecider())
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.lines, what="the engine's first line")
        pgid = sup.engine.pid
        sup.request_stop()
        assert await task == 0
        return rec, pgid

    rec, pgid = run(main())
    assert rec.states() == ["starting", "stopping", "stopped"] and not rec.of(EngineReady)
    assert not group_members(pgid)


# ------------------------------------------------------------------------------------------- failed starts


def test_failed_start_is_reported_and_the_order_executed():
    port = free_port()
    log = EventLog(None)

    def render(i):
        return standin(i, port, argv=exits_at_once(3) if i == 0 else None)

    async def main():
        decider = ScriptedDecider(1)
        sup, rec = supervisor(render, decider, events=log)
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready on the fallback")
        sup.request_stop()
        assert await task == 0
        return sup, rec, decider

    sup, rec, decider = run(main())
    [failure] = decider.failures
    assert isinstance(failure, LaunchFailed) and failure.rule == "launch failure"
    assert (failure.index, failure.method) == (0, Method.DRAFT_MODEL)
    assert failure.reason == "engine exited with code 3 before it was ready"
    [moved] = rec.of(StepChanged)
    assert (moved.from_index, moved.to_index, moved.requested) == (0, 1, False)
    assert rec.of(EngineReady)[0].index == 1 and sup.index == 1
    [failed] = [e for e in log.recent if e["event"] == "launch-failed"]
    assert failed["method"] == "draft_model" and "cannot load the model" in failed["last_lines"]


def test_launch_problem_line_fails_the_start_and_no_step_left_is_fatal():
    """A line that says the speculation did not take effect fails the start even though /health answers."""
    port = free_port()

    async def main():
        decider = ScriptedDecider(None)
        sup, rec = supervisor(
            lambda i: standin(i, port),
            decider,
            launch_problem=lambda line: "runs without speculation" if "LISTENING" in line else None,
        )
        rc = await sup.run()
        return sup, rec, decider, rc

    sup, rec, decider, rc = run(main())
    assert rc == 1 and sup.state is State.FATAL
    assert decider.failures[0].reason == "runs without speculation"
    assert rec.states() == ["starting", "stopping", "fatal"]
    assert not rec.of(EngineReady) and not sup.engine.running


def test_render_failure_is_a_failed_launch():
    from specops.errors import SpecopsError

    port = free_port()

    def render(i):
        if i == 0:
            raise SpecopsError("no such flag")
        return standin(i, port)

    async def main():
        decider = ScriptedDecider(2)
        sup, rec = supervisor(render, decider)
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        sup.request_stop()
        await task
        return sup, decider

    sup, decider = run(main())
    assert decider.failures[0].reason == "cannot render draft_model: no such flag" and sup.index == 2


def test_refused_before_launch():
    port = free_port()

    async def main():
        decider = ScriptedDecider(1)
        sup, rec = supervisor(lambda i: standin(i, port), decider)
        assert sup.refuse_primary("the draft's vocabulary differs") is True
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        sup.request_stop()
        await task
        return rec, decider

    rec, decider = run(main())
    [failure] = decider.failures
    assert isinstance(failure, RefusedBeforeLaunch) and failure.reason.startswith("refused before launch: ")
    assert [e.index for e in rec.of(EngineStarting)] == [1]  # the refused step never started

    async def nowhere():
        sup, rec = supervisor(lambda i: standin(i, port), ScriptedDecider(None))
        assert sup.refuse_primary("refused") is False
        return sup, rec, await sup.run()

    sup, rec, rc = run(nowhere())
    assert rc == 1 and sup.state is State.FATAL and not rec.of(EngineStarting)


# ------------------------------------------------------------------------------------------- crashes


def test_restart_then_crash_loop_on_a_fake_clock():
    """Exits within crash_loop_window count; an exit outside it is forgotten; the loop goes to the decider."""
    port = free_port()
    clock = FakeClock()
    profile = make_profile(crash_loop_exits=2, crash_loop_window=60)

    async def kill_and_wait_ready(sup, rec, n_ready):
        os.killpg(sup.engine.pid, signal.SIGKILL)
        await wait_until(lambda: len(rec.of(EngineReady)) >= n_ready, what=f"ready #{n_ready}")

    async def main():
        decider = ScriptedDecider(1)
        sup, rec = supervisor(lambda i: standin(i, port), decider, profile=profile, clock=clock)
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        await kill_and_wait_ready(sup, rec, 2)  # exit 1: a restart
        assert sup.restarts == 1 and not decider.failures
        clock.advance(120)  # exit 1 is now outside the window
        await kill_and_wait_ready(sup, rec, 3)  # exit 2: a restart again
        assert sup.restarts == 2 and not decider.failures
        clock.advance(10)
        await kill_and_wait_ready(sup, rec, 4)  # exit 3, 10 s after exit 2: a crash loop
        sup.request_stop()
        assert await task == 0
        return sup, rec, decider

    sup, rec, decider = run(main())
    [loop] = decider.failures
    assert isinstance(loop, CrashLoop) and loop.index == 0 and loop.reason == "crash loop: 2 exits within 1m"
    assert sup.index == 1 and sup.restarts == 2 and rec.of(EngineReady)[-1].index == 1
    assert len(rec.of(EngineExited)) == 3 and "SIGKILL" in rec.of(EngineExited)[0].how
    assert "backoff" in rec.states()


# ------------------------------------------------------------------------------------------- switches


def test_switch_order_is_executed():
    port = free_port()
    log = EventLog(None)

    async def main():
        sup, rec = supervisor(lambda i: standin(i, port), ScriptedDecider(), events=log)
        assert not sup.request_switch(SwitchOrder(1, "not ready yet"))
        task = asyncio.create_task(sup.run())
        await wait_until(lambda: rec.of(EngineReady), what="ready")
        assert not sup.request_switch(SwitchOrder(0, "already there"))
        assert not sup.request_switch(SwitchOrder(5, "no such step"))
        assert sup.request_switch(SwitchOrder(1, "acceptance too low", {"rule": "threshold", "action": "switch"}))
        await wait_until(lambda: len(rec.of(EngineReady)) == 2, what="ready after the switch")
        sup.request_stop()
        await task
        return sup, rec

    sup, rec = run(main())
    [moved] = rec.of(StepChanged)
    assert (moved.from_index, moved.to_index, moved.requested) == (0, 1, True)
    assert moved.decision == {"rule": "threshold", "action": "switch"} and moved.reason == "acceptance too low"
    assert rec.states()[:5] == ["starting", "ready", "stopping", "starting", "ready"]
    [switch] = [e for e in log.recent if e["event"] == "switch"]
    assert (switch["from"], switch["to"], switch["decision"]["rule"]) == ("draft_model", "ngram", "threshold")
    [complete] = [e for e in log.recent if e["event"] == "switch-complete"]
    assert complete["method"] == "ngram" and set(sup.last_switch_timing) == {
        "drain_s",
        "stop_s",
        "start_to_ready_s",
        "total_s",
    }


# ------------------------------------------------------------------------------------------- with the policy


def test_policy_decider_orders_and_logs_every_failure():
    """The real decider: the next step on a failure, FATAL at the end; decisions logged, switches counted."""
    port = free_port()
    log = EventLog(None)
    profile = make_profile()
    clock = FakeClock()

    async def main():
        decider = FallbackDecider.from_profile(profile, events=log, say=lambda m: None, clock=clock)
        rec = Recorder()
        sup = Supervisor(
            profile,
            lambda i: standin(i, port, argv=exits_at_once()),
            events=log,
            say=lambda m: None,
            decider=decider,
            listeners=[decider.on_event, rec],
            health_interval=0.05,
            clock=clock,
        )
        return sup, decider, await sup.run()

    sup, decider, rc = run(main())
    assert rc == 1 and sup.state is State.FATAL
    decisions = [e for e in log.recent if e["event"] == "decision"]
    assert [(d["action"], d.get("to"), d["rule"]) for d in decisions] == [
        ("switch", "ngram", "launch failure"),
        ("switch", "none", "launch failure"),
        ("fatal", None, "chain exhausted"),
    ]
    assert [d["policy_rule"] for d in decisions] == ["failed-start", "failed-start", "chain-end"]
    snap = decider.snapshot()
    assert snap["switches"] == 2 and snap["last_decision"]["action"] == "fatal"
    assert snap["last_decision"]["from"] == "none" and "exited with code 3" in snap["last_decision"]["reason"]
