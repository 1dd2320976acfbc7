"""The canary of a new draft: a reloaded profile's primary step measured on live traffic before it replaces the primary.

A reloaded profile whose draft changed, with ``routing.canary`` on, is measured first
(:meth:`CanaryMixin.start_canary`): the new primary step runs as one more engine behind the proxy (its own
supervisor, ``engine.canary.log``), takes an even share of the requests placed on the speculating primary, and both
sides' answers' own counters are tallied over the same period (:mod:`specops.watch.canary`). The decider judges the
tally (:meth:`~specops.watch.decide.FallbackDecider.judge_canary`): passed, the reload goes on as without a canary
(the primary restarts on the new draft through the fleet's switch slot while the other engines serve; the canary is
retired); worse, or not proven in ``max_duration``, the canary is retired, the primary keeps its draft, and the
reload is reported rejected (``canary_rolled_back``).

Kept apart from :mod:`specops.serve.twins` (the engines kept warm beside the primary), whose
:class:`~specops.serve.twins.TwinEngines` runs the canary with the methods of :class:`CanaryMixin`: they share its
router, upstreams, events and task list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specops.errors import SpecopsError
from specops.proxy.router import EngineInfo
from specops.proxy.routes import EngineHandle, EngineUpstream, RoutedUpstreams, drain_generation
from specops.run.events import EngineReady, FallbackOrder, StateChanged, StepFailed
from specops.run.start import free_port
from specops.run.supervise import Supervisor
from specops.watch.canary import CANARY, CanaryTally

__all__ = ["Canary", "CanaryMixin", "TaggedEvents", "canary_metrics", "draft_changed", "draft_of"]

log = logging.getLogger("specops.serve.twins")  # the canary is part of the twins' runtime


class TaggedEvents:
    """The instance's event log, each record marked with the engine (a twin, the canary) it is about."""

    def __init__(self, events, engine: str):
        self.events, self.engine = events, engine

    def emit(self, event: str, **fields) -> dict:
        return self.events.emit(event, engine=self.engine, **fields)


class _PinnedHandle(EngineHandle):
    """The proxy as the canary's supervisor sees it: its own upstream, wherever the router's list has moved."""

    def __init__(self, upstreams: RoutedUpstreams, upstream: EngineUpstream):
        super().__init__(upstreams, upstream.position)
        self._pinned = upstream

    @property
    def _u(self) -> EngineUpstream:
        return self._pinned


class CanaryDecider:
    """The canary's engine does not fall back: a new draft that cannot run is rolled back."""

    def __init__(self, on_failed: Callable[[str], None]):
        self.on_failed = on_failed

    def decide_after_failure(self, failure: StepFailed) -> FallbackOrder:
        self.on_failed(f"the canary's engine failed: {failure.reason}")
        return FallbackOrder(None, failure.reason)


def draft_of(profile) -> str | None:
    """The draft a profile's primary runs, as written (for events and status)."""
    spec = profile.speculative
    return spec.draft or (None if spec.method.value == "none" else spec.method.value)


def draft_changed(old, new) -> bool:
    """Whether a reloaded profile changes what the primary drafts with (its ``speculative`` section), both
    speculating: what a canary measures."""
    return (
        old.speculative != new.speculative
        and old.speculative.method.value != "none"
        and new.speculative.method.value != "none"
    )


@dataclass
class Canary:
    """One new draft under measure: its engine, its place in the router, its tally and what ends it."""

    profile: Any
    sup: Supervisor
    upstream: EngineUpstream
    roll_out: Callable[[], bool]  # the reload as without a canary; False: not now (asked again each interval)
    refuse: Callable[[str, str], None]  # (why, cause): the reload is reported rejected, the running profile kept
    started: float = field(default_factory=time.time)
    ready_at: float | None = None  # monotonic: when it took requests (the tally counts from here)
    state: str = "starting"  # starting | measuring | passed (the rollout waits for the supervisor or a slot)
    reason: str = ""
    tally: CanaryTally = field(default_factory=CanaryTally)
    run: asyncio.Task | None = None


class CanaryMixin:
    """The canary's part of :class:`~specops.serve.twins.TwinEngines` (``self.canary``: the one measured now, else None;
    ``last_canary`` and ``canary_outcomes``: how they ended)."""

    def wants_canary(self, old, new) -> str | None:
        """Why a reload from ``old`` to ``new`` is measured by a canary first, or None: ``new`` turns
        ``routing.canary`` on, changes the draft the primary speculates with, and the primary serves it now."""
        if not new.routing.canary.enabled or not draft_changed(old, new):
            return None
        if self.router.engines[0].step != 0 or not self.router.engines[0].speculative or self.router.current != 0:
            return None  # the primary does not serve its own draft now: nothing to compare against
        return f"the draft changes ({draft_of(old)} → {draft_of(new)})"

    def start_canary(
        self,
        profile,
        render: Callable[[int], Callable[[int], Any]],
        *,
        roll_out: Callable[[], bool],
        refuse: Callable[[str, str], None],
    ) -> None:
        """Run ``profile``'s primary step (``render(port)``: its launch plans on a loopback port) as a canary
        engine beside the others and measure it on live traffic; ``roll_out()`` once it passes (False: not now,
        asked again every ``monitor.interval``), ``refuse(why, cause)`` when it is rolled back or aborted. Raises
        what rendering raises before changing anything."""
        if self.canary is not None:
            raise RuntimeError("a canary is already running")
        cfg = profile.routing.canary
        render = render(free_port())
        render(0)
        position = self.router.start_canary(EngineInfo(0, CANARY, True), cfg.share)
        upstream = EngineUpstream(position)
        self.upstreams.upstreams.append(upstream)
        self.upstreams.counting = True
        tagged = TaggedEvents(self.events, CANARY)

        def say(msg: str) -> None:
            self.say(f"[canary] {msg}")

        holder: list[Canary] = []
        sup = Supervisor(
            profile.at_step(0),
            render,
            events=tagged,
            say=say,
            decider=CanaryDecider(lambda why: self._roll_back(holder[0], why)),
            listeners=(lambda ev: self._on_canary_event(holder[0], ev),),
            log_path=self.log_path(CANARY),
            proxy=_PinnedHandle(self.upstreams, upstream),
            health_interval=self.health_interval,
            launch_problem=self.launch_problem,
        )
        c = Canary(profile, sup, upstream, roll_out, refuse)
        holder.append(c)
        self.canary = c
        self.events.emit(
            "canary_started",
            draft=draft_of(profile),
            current_draft=draft_of(self.profile),
            share=cfg.share,
            min_draft_tokens=cfg.min_draft_tokens,
            tolerance=cfg.tolerance,
            max_duration=cfg.max_duration,
        )
        self.say(
            f"canary: the new draft {draft_of(profile)} starts beside the primary; it gets {cfg.share:.0%} of the "
            f"primary's requests until its live acceptance is judged (the primary keeps {draft_of(self.profile)})"
        )
        c.run = asyncio.get_running_loop().create_task(self._run_canary(c))
        self.on_change()

    async def _run_canary(self, c: Canary) -> None:
        run = asyncio.get_running_loop().create_task(c.sup.run())
        interval = max(0.2, float(self.profile.monitor.interval))
        try:
            while self.canary is c and not run.done():
                await asyncio.wait({run}, timeout=interval)
                if self.canary is c:
                    try:
                        self.judge_canary(time.monotonic())
                    except Exception as exc:  # a bug here must not leave a canary routed with nobody judging it
                        log.exception("canary: judging failed")
                        self._roll_back(c, f"the canary could not be judged: {type(exc).__name__}: {exc}")
        finally:
            await asyncio.gather(run, return_exceptions=True)
        if self.canary is c and not self._stopping:  # its supervisor ended on its own (FATAL: rolled back already)
            self._roll_back(c, f"the canary's engine stopped ({c.sup.state.value})")

    def _on_canary_event(self, c: Canary, event) -> None:
        if isinstance(event, EngineReady) and c.ready_at is None and self.canary is c:
            c.ready_at, c.state, c.tally = time.monotonic(), "measuring", CanaryTally()
            self.say(f"canary: {draft_of(c.profile)} is ready ({event.seconds:.1f}s); measuring live acceptance")
        if isinstance(event, (EngineReady, StateChanged)):
            self.on_change()

    def judge_canary(self, now: float) -> bool | None:
        """Ask the decider about the running canary's tally (True: rolled out or rolling out; False: rolled
        back; None: measuring, or nothing to judge)."""
        c = self.canary
        if c is None or c.ready_at is None:
            return None
        if c.state == "passed":
            return self._roll_out(c)
        cfg = c.profile.routing.canary
        verdict, why = self.decider.judge_canary(
            c.tally,
            min_draft_tokens=cfg.min_draft_tokens,
            tolerance=cfg.tolerance,
            elapsed=now - c.ready_at,
            max_duration=cfg.max_duration,
        )
        c.reason = why
        if verdict is None:
            return None
        if verdict is False:
            self._roll_back(c, why)
            return False
        c.state = "passed"
        self.events.emit("canary_passed", draft=draft_of(c.profile), reason=why, **self._acceptances(c))
        self.say(f"canary passed: {why}; the primary restarts on {draft_of(c.profile)}")
        return self._roll_out(c)

    def _roll_out(self, c: Canary) -> bool:
        try:
            taken = c.roll_out()  # the reload as without a canary; its twins.reload retires the canary
        except SpecopsError as exc:
            self._roll_back(c, f"the rollout could not start: {exc}")
            return False
        if not taken and not c.reason.endswith("(the rollout waits)"):
            c.reason += " (the rollout waits)"
            self.say("canary: the rollout waits for the supervisor or a fleet switch slot; the canary keeps serving")
        return True

    def _acceptances(self, c: Canary) -> dict:
        return {
            "canary_acceptance": c.tally.canary.to_dict()["acceptance"],
            "current_acceptance": c.tally.current.to_dict()["acceptance"],
            "tally": c.tally.to_dict(),
        }

    def _roll_back(self, c: Canary, why: str) -> None:
        """The new draft is refused live: the canary retires, the primary keeps its draft, the reload is
        reported rejected (the file on disk is not what runs, and status says why)."""
        if self.canary is not c:
            return
        self._retire_canary(c, "rolled_back", why)
        self.events.emit(
            "canary_rolled_back",
            draft=draft_of(c.profile),
            current_draft=draft_of(self.profile),
            reason=why,
            **self._acceptances(c),
        )
        self.say(f"canary rolled back: {why}; the primary keeps {draft_of(self.profile)}")
        c.refuse(why, "the new draft was refused live by its canary")
        self.on_change()  # after the refusal: status never shows the rollback without its rejected reload

    def abort_canary(self, why: str) -> bool:
        """A newer profile replaces the one under measure: the canary retires without a verdict, and its reload
        is reported rejected (the previous profile runs until the newer one is applied). False: none runs."""
        c = self.canary
        if c is None:
            return False
        self._retire_canary(c, "aborted", why)
        self.events.emit("canary_aborted", draft=draft_of(c.profile), reason=why, **self._acceptances(c))
        self.say(f"canary aborted: {why}")
        c.refuse(why, "the new draft's canary was aborted")
        self.on_change()
        return True

    def _retire_canary(self, c: Canary, outcome: str, why: str) -> None:
        """No new requests to the canary (at once); those in flight finish, then its engine stops. The caller
        says the change (``on_change``) once what follows from it is done too."""
        self.router.end_canary()
        del self.upstreams.upstreams[c.upstream.position]
        self.upstreams.counting = False
        self.canary = None
        self.canary_outcomes[outcome] += 1
        self.last_canary = {
            "outcome": outcome,
            "reason": why,
            "draft": draft_of(c.profile),
            "started_at": c.started,
            "ended_at": time.time(),
            "measured_s": round(time.monotonic() - c.ready_at, 1) if c.ready_at is not None else None,
            **self._acceptances(c),
        }
        self._tasks.append(asyncio.get_running_loop().create_task(self._stop_canary(c, why)))

    async def _stop_canary(self, c: Canary, why: str) -> None:
        upstream = c.upstream
        upstream.down()
        if upstream.gen is not None and upstream.gen.inflight:
            p = self.upstreams.proxy
            await drain_generation(upstream.gen, p.drain_timeout if p is not None else 30.0, p)
        c.sup.request_stop(f"canary {why}")
        if c.run is not None:
            await asyncio.gather(c.run, return_exceptions=True)

    def _canary_snapshot(self) -> dict:
        c = self.canary
        now = None
        if c is not None:
            now = {
                "state": c.state,
                "draft": draft_of(c.profile),
                "share": c.profile.routing.canary.share,
                "started_at": c.started,
                "measured_s": round(time.monotonic() - c.ready_at, 1) if c.ready_at is not None else None,
                "reason": c.reason,
                "engine_state": c.sup.state.value,
                **self._acceptances(c),
            }
        return {"running": now, "last": self.last_canary, "outcomes": dict(self.canary_outcomes)}


def canary_metrics(t):
    """``routing.canary``: how canaries ended, and the running one's live acceptance per side."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    outcomes = CounterMetricFamily(
        "specops_canary_outcomes",
        "Canaries of a new draft by how they ended: rolled_out, rolled_back (worse live acceptance, not proven in "
        "max_duration, or its engine failed: the primary kept its draft), aborted (a newer profile came first)",
        labels=["outcome"],
    )
    for outcome, n in sorted(t.canary_outcomes.items()):
        outcomes.add_metric([outcome], n)
    yield outcomes
    running = GaugeMetricFamily("specops_canary_running", "A new draft is measured on live traffic now (1) or not (0)")
    running.add_metric([], 1.0 if t.canary is not None else 0.0)
    yield running
    acc = GaugeMetricFamily(
        "specops_canary_acceptance",
        "Live acceptance (accepted / drafted draft tokens, the answers' own counters) of the running canary and of "
        "the primary's current draft over the same period",
        labels=["side"],
    )
    c = t.canary
    if c is not None:
        for side, row in c.tally.to_dict().items():
            if row["acceptance"] is not None:
                acc.add_metric([side], row["acceptance"])
    yield acc
