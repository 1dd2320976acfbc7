"""The one place fallbacks are decided and recorded.

:class:`FallbackDecider` owns the deployment's :class:`~specops.watch.policy.Policy` and is the only
object that turns what happened into a decision:

- a window of acceptance (the watcher calls :meth:`FallbackDecider.observe` each tick): keep, switch,
  retry or hold, by the policy's rules;
- a step that cannot run (the supervisor calls :meth:`FallbackDecider.decide_after_failure` with a launch
  failure, a crash loop or a refusal before launch): the next step of the chain, back to where a failed
  retry came from, or nothing (FATAL).

It writes every notable decision to the event log (``decision`` events, with the fields the log has always
had), keeps the last decision and counts the switches the supervisor executed (it listens to the
supervisor's :class:`~specops.run.events.StepChanged`/:class:`~specops.run.events.EngineReady` events),
and shows all of it in :meth:`FallbackDecider.snapshot` for ``specops status``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from specops.run.events import EngineReady, FallbackOrder, StepChanged, StepFailed, SupervisorEvent
from specops.speedup import VerifyCost
from specops.watch.canary import CanaryTally
from specops.watch.classes import RequestClass
from specops.watch.decision import Decision
from specops.watch.goodput import Load
from specops.watch.policy import Policy
from specops.watch.surface import Surface
from specops.watch.window import OK, WindowStats

#: The ``rule`` of a failure decision that leaves no step to run.
CHAIN_EXHAUSTED = "chain exhausted"


class FallbackDecider:
    """Decides with ``policy``; logs to ``events``; speaks warnings through ``say``.

    ``clock`` is the policy's (monotonic) clock; ``wall`` stamps ``last_decision`` for ``specops status``.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        events: Any,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.policy = policy
        self.events = events
        self.say = say
        self.clock = clock
        self.wall = wall
        self.switches = 0
        self.last_decision: dict[str, Any] | None = None
        #: The latest window's decision (rule and reason) and the last window that got a verdict (low or
        #: not, with its numbers), for ``specops status``.
        self.last_window: dict[str, Any] | None = None
        self.last_verdict: dict[str, Any] | None = None
        #: mode goodput: the last tick's concurrency, predicted tokens/s per option, switch cost and verdict
        self.last_goodput: dict[str, Any] | None = None
        self._goodput_shown: tuple[Any, ...] | None = None
        #: With twins: the step whose engine serves the default route is a twin's (a route change made it so),
        #: not the primary's; a start of the primary then does not move the policy (see :attr:`routed_step`).
        self.route_step: int | None = None

    @classmethod
    def from_profile(
        cls,
        profile: Any,
        *,
        surface: Surface | None = None,
        curve: VerifyCost | None = None,
        draft_cost: float | None = None,
        **kwargs: Any,
    ) -> FallbackDecider:
        """The decider for ``profile``, on the rule :meth:`Policy.from_profile` gives it (``curve``: the
        verification-cost curve stored for its engine, model and machine; ``draft_cost``: c measured there); says
        that rule in one line. Mode goodput
        reads ``fallback.goodput.surface`` unless ``surface`` is given (raises SpecopsError when that file holds
        no surface)."""
        decider = cls(Policy.from_profile(profile, surface=surface, curve=curve, draft_cost=draft_cost), **kwargs)
        decider.say(decider.policy.rule.line())
        return decider

    # ------------------------------------------------------------------ the supervisor's failures
    def decide_after_failure(self, failure: StepFailed) -> FallbackOrder:
        """Where to go when ``failure.index`` cannot run: the policy's verdict, logged as a decision."""
        d = self.policy.on_failed_start(failure.index, self.clock())
        if d.warning:
            self.say(f"warning: {d.warning}")
        if d.acts and d.to_index is not None and d.to_step is not None:
            record = {
                "action": "switch",
                "from": failure.method.value,
                "to": d.to_step.method.value,
                "reason": failure.reason,
                "rule": failure.rule,
            }
            self.last_decision = {**record, "at": self.wall()}
            self.events.emit("decision", **record, policy_rule=d.rule)
            return FallbackOrder(d.to_index, failure.reason)
        record = {"action": "fatal", "from": failure.method.value, "reason": failure.reason}
        self.last_decision = {**record, "at": self.wall()}
        self.events.emit("decision", **record, rule=CHAIN_EXHAUSTED, policy_rule=d.rule)
        return FallbackOrder(None, failure.reason)

    # ------------------------------------------------------------------ the watcher's windows
    def observe(self, stats: WindowStats, now: float, load: Load | None = None) -> Decision:
        """The policy's decision for one window (and, for mode goodput, the live ``load``); notable ones go to
        the event log with the window, and in mode goodput every change of verdict or best option too."""
        decision = self.policy.observe(stats, now, load)
        self.last_window = {"rule": decision.rule, "reason": decision.reason}
        if self.policy.goodput is not None:
            self._goodput_event(decision, stats)
        if "low" in decision.numbers:
            keep = ("low", "acceptance", "predicted_speedup", "verify_cost", "streak")
            self.last_verdict = {
                **{k: decision.numbers[k] for k in keep if k in decision.numbers},
                "rule": decision.rule,
                "at": self.wall(),
            }
        if decision.warning:
            self.say(f"warning: {decision.warning}")
        if decision.notable:
            self.events.emit("decision", **decision.to_dict(), window=stats.to_dict())
        return decision

    def _goodput_event(self, decision: Decision, stats: WindowStats) -> None:
        """Keep the goodput numbers for ``specops status``; log a ``goodput`` event when the verdict changes."""
        n = decision.numbers
        self.last_goodput = {
            "rule": decision.rule,
            "reason": decision.reason,
            "at": self.wall(),
            **{
                k: n[k]
                for k in (
                    "concurrency",
                    "concurrency_source",
                    "predicted",
                    "surface",
                    "best",
                    "live_tokens_per_s",
                    "correction",
                    "switch_cost_s",
                    "switch_cost_basis",
                    "gain_tokens",
                    "cost_tokens",
                    "regime_s",
                    "sustained_s",
                    "aged_acceptance",
                )
                if k in n
            },
        }
        shown = (decision.rule, n.get("best"), decision.from_index)
        if shown != self._goodput_shown and not decision.notable:
            self.events.emit("goodput", **decision.to_dict(), window=stats.to_dict())
        self._goodput_shown = shown

    def not_executed(self, decision: Decision) -> None:
        """The decided switch was not executed (the supervisor could not take it, or watching read-only):
        the streak stands, so the next fresh low window decides again."""
        self.policy.cancel_pending()

    # ------------------------------------------------------------------ per-request routing
    def route_class(self, stats: WindowStats, min_draft_tokens: int, step: int = 0) -> tuple[bool | None, str]:
        """Whether a request class (``routing.classes``) should be served by the speculating engine of ``step``:
        the policy's verdict on the class's own window (its predicted tokens/s where a verification-cost curve is
        known, else its acceptance: :meth:`Policy.speculation_pays`); None (no verdict yet) until the window holds
        ``min_draft_tokens`` drafted tokens. The same rule as a fallback, applied to one class of traffic."""
        if stats.status != OK or stats.acceptance is None:
            return None, stats.reason or "nothing drafted in the window"
        if (stats.draft_tokens or 0.0) < min_draft_tokens:
            return None, f"{stats.draft_tokens:g} drafted tokens, fewer than min_draft_tokens={min_draft_tokens}"
        return self.policy.speculation_pays(stats, step)

    def judge_class(
        self, c: RequestClass, stats: WindowStats, min_draft_tokens: int, step: int = 0
    ) -> tuple[bool | None, str]:
        """The verdict a request class keeps after one more look at its window, by the fallback's hysteresis: a
        class not decided yet takes its first verdict at once (it was measured on the speculating engine, as a
        deployment is before its first window); a decided class changes only after ``consecutive_windows``
        disjoint windows disagree with it (a window that overlaps the last counted one does not count). Keeps
        the streak on ``c``; returns the verdict (None: none yet) and why."""
        raw, why = self.route_class(stats, min_draft_tokens, step)
        if raw is None:
            return c.speculate, why
        if c.counted_end is not None and stats.start is not None and stats.start < c.counted_end:
            if raw == c.speculate:
                return c.speculate, why
            return c.speculate, f"{why}; the window overlaps the last counted one: hysteresis counts disjoint windows"
        c.counted_end = stats.end
        if c.speculate is None or raw == c.speculate:
            c.streak = 0
            return raw, why
        c.streak += 1
        need = self.policy.config.consecutive_windows
        if c.streak < need:
            return c.speculate, f"{why}: window {c.streak} of {need} against the verdict (hysteresis)"
        c.streak = 0
        return raw, f"{why} for {need} consecutive windows"

    def judge_canary(
        self, tally: CanaryTally, *, min_draft_tokens: int, tolerance: float, elapsed: float, max_duration: float
    ) -> tuple[bool | None, str]:
        """A new draft measured on live traffic (``routing.canary``): True (roll it out) once the canary and the
        current draft have each drafted ``min_draft_tokens`` over the same period and the canary's acceptance is
        not lower than the current one's by more than ``tolerance``; False (roll it back) when it is, or when
        ``max_duration`` passed without that evidence (not proven); None: keep measuring."""
        new, old = tally.canary, tally.current
        shown = f"canary {_acc(new.acceptance)} of {new.draft_tokens} drafted, current {_acc(old.acceptance)} of "
        shown += f"{old.draft_tokens} drafted"
        if new.draft_tokens >= min_draft_tokens and old.draft_tokens >= min_draft_tokens:
            a_new, a_old = new.acceptance or 0.0, old.acceptance or 0.0
            if a_new < a_old - tolerance:
                return (
                    False,
                    f"live acceptance {shown}: worse by {a_old - a_new:.3f}, more than tolerance {tolerance:g}",
                )
            return True, f"live acceptance {shown}: not worse by more than tolerance {tolerance:g}"
        if elapsed >= max_duration:
            return False, (
                f"{shown} after {elapsed:.0f}s: fewer than min_draft_tokens={min_draft_tokens} on a side within "
                f"max_duration ({max_duration:g}s); not proven"
            )
        return None, f"measuring: {shown} (min_draft_tokens={min_draft_tokens})"

    def set_warm(self, steps: Callable[[], Collection[int]]) -> None:
        """``steps()`` names the chain steps a live engine runs now (warm twins): mode goodput prices a switch to
        one as a route change (no engine start) instead of a restart."""
        if self.policy.goodput is not None:
            self.policy.goodput.warm = steps

    def load_route(self, now: float, step: int = 0) -> tuple[bool | None, str]:
        """With a measured goodput surface: False (every class to the engine without speculation) while the
        mean live concurrency is at or above the crossover load where step ``step``'s speculation stops beating
        ``none`` on that surface; True (the classes' own verdicts stand) below it, or without a surface; None
        (keep the route as it is) without a load reading. The vLLM goodput rule, applied as a route instead of
        a restart."""
        g = self.policy.goodput
        if g is None or g.model.surface is None or not 0 <= step < len(g.options):
            return True, "no goodput surface"
        option = g.options[step]
        if option.method.value == "none":
            return True, "the step does not speculate"
        conc = g.concurrency(now)
        if conc is None:
            return None, "no load reading"
        crossover = g.model.surface.crossover(option.method, option.k)
        if crossover is None:
            return True, f"{option.label} beats none at every load the surface measured"
        if conc >= crossover:
            return False, (
                f"concurrency {conc:.1f} is at or above {option.label}'s measured crossover {crossover:g}: "
                "none serves more tokens/s there"
            )
        return True, f"concurrency {conc:.1f} is below {option.label}'s measured crossover {crossover:g}"

    @property
    def routed_step(self) -> int | None:
        """The step a twin serves as the default route, when the policy runs it (None: the primary serves the
        policy's step). One truth: the policy's step; this only says which engine runs it."""
        step = self.route_step
        return step if step is not None and step == self.policy.index else None

    def on_route_change(
        self, index: int, reason: str, decision: dict[str, Any] | None = None, *, on_twin: bool = True
    ) -> None:
        """A switch executed as a route change (a warm twin runs step ``index``, or back to the primary:
        ``on_twin`` False): the policy runs that step from now on, as after a restart, but no engine started
        (no start cost is noted)."""
        self.route_step = index if on_twin else None
        old = self.policy.index
        self.switches += 1
        self.last_decision = {
            **(decision or {}),
            "reason": reason,
            "from": self.policy.steps[old].method.value,
            "to": self.policy.steps[index].method.value,
            "route_change": True,
            "at": self.wall(),
        }
        self.policy.on_switched(index, self.clock())

    # ------------------------------------------------------------------ what the supervisor did
    def on_event(self, event: SupervisorEvent) -> None:
        """A supervisor listener: counts executed switches and tells the policy which step runs."""
        if isinstance(event, StepChanged):
            self.switches += 1
            if event.requested:  # the primary restarts into the step ordered: the default route follows it
                self.route_step = None
            if event.requested:
                self.last_decision = {
                    **event.decision,
                    "reason": event.reason,
                    "from": event.from_method.value,
                    "to": event.to_method.value,
                    "at": self.wall(),
                }
        elif isinstance(event, EngineReady):
            self.policy.note_engine_start(event.seconds)
            length = getattr(event.plan, "draft_length", None)  # a plan the supervisor did not render has none
            self.policy.note_draft_length(event.index, length.most if length is not None else None)
            if self.routed_step is None:  # a twin serves the policy's step: the primary's (re)start moves nothing
                self.policy.on_switched(event.index, self.clock())

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """For the state file and ``/specops/status``: switches, the last decision, the policy's state."""
        return {
            "switches": self.switches,
            "last_decision": self.last_decision,
            "last_window": self.last_window,
            "last_verdict": self.last_verdict,
            **({"last_goodput": self.last_goodput} if self.policy.goodput is not None else {}),
            "policy": self.policy.snapshot(self.clock() if now is None else now),
        }


def _acc(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
