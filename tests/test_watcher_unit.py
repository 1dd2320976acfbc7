"""The watcher alone, on the stand-in engine (tests/support_upstream.py) and a fake clock: which window the
reader trusts (the proxy's live timings or the engine's counters), ticks through a source outage and back,
acting on a decision (and a refused one), and following the supervisor through its events."""

from __future__ import annotations

import asyncio

import pytest
from support_upstream import Upstream
from support_watch import PROFILE, FakeClock, backend, complete, make_watcher, plan_for

from specops.methods import Method
from specops.plugins import get_registry
from specops.run.events import EngineLine, EngineReady, State, StateChanged, StepChanged
from specops.run.instance import EventLog
from specops.watch.decision import Action
from specops.watch.watcher import AcceptanceReader, LiveCounters

# ------------------------------------------------------------------------------------------- the reader


def test_backend_capabilities_choose_the_sources():
    reader = AcceptanceReader.for_profile(PROFILE, backend(), live=LiveCounters())
    assert reader.log is not None and reader.live is not None  # llama.cpp logs acceptance lines
    vllm = get_registry().backend("vllm")
    assert AcceptanceReader.for_profile(PROFILE, vllm).log is None
    assert backend().live_timings and not vllm.live_timings


def test_reader_takes_the_window_that_saw_more_drafts():
    """While a long request runs only the proxy's timings move; once requests finish the engine's counters
    (which also count drafts and positions) saw more, and they are the window. Totals stay the engine's."""
    with Upstream.start("engine", acceptance=0.5) as up:
        live = LiveCounters()
        reader = AcceptanceReader("scrape", backend(), window_s=10, timeout=3, live=live)
        reader.attach(up.url + "/metrics", None)
        first = reader.read_blocking(0.0)
        assert first.stats.status == "no-data"
        live.add(100, 80)  # timings of a request still running
        during = reader.read_blocking(1.0)
        assert during.stats.status == "ok" and during.stats.source == "proxy-timings"
        assert (during.stats.draft_tokens, during.stats.acceptance) == (100, 0.8)
        assert during.counters.source == "llamacpp" and during.counters.draft_tokens == 0
        complete(up.url, 200)  # the engine counts 400 drafted, 200 accepted
        after = reader.read_blocking(2.0)
        assert after.stats.source == "llamacpp" and (after.stats.draft_tokens, after.stats.acceptance) == (400, 0.5)
        reader.attach(up.url + "/metrics", None)  # a new engine: a fresh window, live counters reset
        assert live.read().draft_tokens == 0 and reader.read_blocking(3.0).stats.status == "no-data"


def test_reader_of_an_unreachable_source_never_raises():
    reader = AcceptanceReader("scrape", backend(), window_s=10, timeout=0.5)
    with Upstream.start("gone") as up:
        url = up.url
    reader.attach(url + "/metrics", None)
    r = reader.read_blocking(0.0)
    assert r.stats.status == "unavailable" and "127.0.0.1" in r.stats.reason


# ------------------------------------------------------------------------------------------- ticks


def test_ticks_through_a_source_outage_then_a_switch():
    clock = FakeClock()
    log, said, acted = EventLog(None), [], []

    async def main():
        up = Upstream.start("engine", acceptance=0.2)
        port = up.port
        reader = AcceptanceReader("scrape", backend(), window_s=2, timeout=1)
        reader.attach(up.url + "/metrics", None)
        watcher, decider, ticks = make_watcher(reader, clock, lambda d: acted.append(d) or True, log, said)
        try:
            assert (await watcher.tick()).rule == "no-data"
            up.stop()  # the engine's /metrics goes away
            outage = []
            for t in (1.0, 2.0, 3.0):
                clock.t = t
                outage.append(await watcher.tick())
            assert all((d.action, d.rule) == (Action.KEEP, "source-unavailable") for d in outage)
            assert sum(1 for d in outage if d.warning) == 1 and sum("unavailable" in s for s in said) == 1
            assert watcher.snapshot()["acceptance"]["status"] == "unavailable"
            assert decider.snapshot()["policy"]["source_down_since"] == 1.0
            up = Upstream.start("engine", acceptance=0.2, port=port)  # back (its counters from zero)
            clock.t = 4.0
            back = await watcher.tick()
            assert "recovered" in back.reason and decider.snapshot()["policy"]["source_down_since"] is None
            for t in (5.0, 6.5):
                await asyncio.to_thread(complete, up.url, 50)
                clock.t = t
                d = await watcher.tick()
                if d.acts:
                    break
            assert (d.action, d.rule, d.to_index) == (Action.SWITCH, "threshold", 1)
            assert acted == [d] and ticks[:5] == [0.0, 1.0, 2.0, 3.0, 4.0] and ticks[-1] == clock.t
            assert (await watcher.tick()).rule == "switch-pending"  # until the supervisor confirms
            metrics = watcher.metrics.registry
            assert (
                metrics.get_sample_value(
                    "specops_fallbacks_total",
                    {"from_method": "draft_model", "to_method": "ngram", "reason": "threshold"},
                )
                == 1.0
            )
            assert metrics.get_sample_value("specops_source_up") == 1.0
        finally:
            up.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    decisions = [e for e in log.recent if e["event"] == "decision"]
    assert decisions[0]["rule"] == "source-unavailable" and decisions[0]["warning"]
    assert decisions[-1]["action"] == "switch" and decisions[-1]["window"]["status"] == "ok"
    assert decisions[-1]["numbers"]["acceptance"] == pytest.approx(0.2)


def test_a_refused_switch_leaves_no_pending_decision():
    clock = FakeClock()
    log, said = EventLog(None), []

    async def main():
        with Upstream.start("engine", acceptance=0.1) as up:
            reader = AcceptanceReader("scrape", backend(), window_s=2, timeout=1)
            reader.attach(up.url + "/metrics", None)
            watcher, decider, _ = make_watcher(reader, clock, lambda d: False, log, said)
            await watcher.tick()
            for t in (1.0, 2.5):
                await asyncio.to_thread(complete, up.url, 50)
                clock.t = t
                d = await watcher.tick()
            assert d.action is Action.SWITCH and decider.policy.pending is None
            assert decider.switches == 0 and decider.last_decision is None  # nothing was executed
            return watcher

    watcher = asyncio.run(asyncio.wait_for(main(), 60))
    assert (
        watcher.metrics.registry.get_sample_value(
            "specops_fallbacks_total", {"from_method": "draft_model", "to_method": "ngram", "reason": "threshold"}
        )
        is None
    )


# ------------------------------------------------------------------------------------------- supervisor events


def test_watcher_and_decider_follow_the_supervisor_events():
    clock = FakeClock(10.0)
    log, said = EventLog(None), []
    reader = AcceptanceReader.for_profile(PROFILE, backend())
    watcher, decider, _ = make_watcher(reader, clock, lambda d: True, log, said)
    with Upstream.start("engine") as up:
        ready = EngineReady(0, Method.DRAFT_MODEL, plan_for(up), 1.0)
        for listener in (decider.on_event, watcher.on_event):
            listener(StateChanged(State.STARTING, State.READY, 0, Method.DRAFT_MODEL, 0))
            listener(ready)
        assert watcher.serving and watcher.attached and reader._scrape is not None
        watcher.on_event(EngineLine("draft acceptance rate = 0.50000 (   10 accepted /    20 generated)"))
        assert reader.log.lines == 1
        m = watcher.metrics.registry
        assert m.get_sample_value("specops_active_method", {"method": "draft_model"}) == 1.0
        assert m.get_sample_value("specops_supervisor_state", {"state": "ready"}) == 1.0
        watcher.on_event(StateChanged(State.READY, State.STOPPING, 0, Method.DRAFT_MODEL, 0))
        assert not watcher.serving
        decider.on_event(
            StepChanged(0, 1, Method.DRAFT_MODEL, Method.NGRAM, "low", True, {"action": "switch", "rule": "threshold"})
        )
        decider.on_event(EngineReady(1, Method.NGRAM, plan_for(up), 1.0))
    snap = decider.snapshot()
    assert snap["switches"] == 1 and snap["policy"]["index"] == 1 and snap["policy"]["method"] == "ngram"
    assert snap["last_decision"]["rule"] == "threshold" and snap["last_decision"]["to"] == "ngram"
