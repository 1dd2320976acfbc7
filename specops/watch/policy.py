"""The fallback policy: window statistics and a clock in, decisions out. Deterministic, no I/O, no wall clock.

The policy walks the *steps* of a deployment — the primary method (index 0) followed by the fallback chain,
exactly as :attr:`specops.config.profile.Profile.steps` lists them — and says, for each observed window, whether to
keep the method, switch to the next step, retry the primary, or hold. Rules, in the order they apply:

1. ``switch-pending`` — a switch or retry was decided and not yet confirmed (``on_switched``/``on_failed_start``).
2. ``source-unavailable`` — the metric source could not be read: keep, warn once per outage; the next
   readable window notes the recovery.
3. ``retry`` — retry enabled, the primary is not running, its back-off has elapsed, the cooldown is over
   and the flap guard allows: go back to the primary (the back-off doubles each time a retry fails, up to
   ``max_after``; a retry fails when it falls back again or does not start).
4. ``no-speculation`` — the current method is ``none``: nothing to measure.
5. ``spec-off`` / ``no-data`` — no speculative series / nothing drafted or too few samples: no decision
   (an idle engine is never "acceptance 0"; an absent series is never a failure).
6. ``window-filling`` — the samples do not yet span a whole window.
7. ``not-fresh`` — the window overlaps the last one that counted (or the last switch): hysteresis counts
   disjoint windows, so N windows below the threshold means N × ``window`` seconds of evidence.
8. ``coarse`` — only a lifetime ratio is available (vLLM V0) and ``act_on_coarse`` is off: report only.
9. ``min-draft-tokens`` — fewer drafted tokens than ``min_draft_tokens`` in the window: no verdict.
10. The verdict: ``threshold`` mode — low when acceptance < ``min_acceptance``; ``model`` mode — low when
    the predicted speedup τ / (k·c + c_verify(k + 1)) < 1 (Leviathan et al. 2023, see specops.speedup), with τ and k
    the window's measured mean acceptance and draft lengths, on the verification-cost curve measured for this
    engine, model and machine (c_verify = 1 without one). Which mode decides when the profile sets none is
    :func:`specops.watch.rule.rule_for`'s answer (on tokens/s where known). A good window resets the streak (and
    marks a retry as successful, resetting its back-off); a low one extends it (``hysteresis`` until it reaches
    ``consecutive_windows``).
11. With the streak complete: ``fallback-disabled`` (hold: watch-only), ``chain-end`` (hold: nothing left
    to fall back to), ``cooldown`` (keep: a switch happened less than ``cooldown`` ago), ``flap-guard``
    (hold: ``max_switches_per_hour`` switches in the last hour), else ``switch`` to the next step — or, when
    the method was a retry, back to the step the retry came from (``retry-failed``).

With ``mode: goodput`` rules 3 to 11 give way to :class:`specops.watch.goodput.GoodputPolicy`: each tick it
predicts every step's tokens/s at the live concurrency (the measured surface, live acceptance, online correction)
and switches to the best one with hysteresis, a sustain time, a minimum dwell and a switch-cost test (rules
``goodput-*``); ``fallback-disabled`` and ``flap-guard`` still hold a switch.

Every :class:`~specops.watch.decision.Decision` carries the rule that produced it, a sentence, and the numbers
behind it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from specops.config.profile import ChainStep
from specops.methods import DEFAULT_K, Method
from specops.speedup import VerifyCost
from specops.watch.decision import (
    HOLD,
    KEEP,
    RETRY,
    SWITCH,
    Action,
    Decision,
    PolicyConfig,
    step_k,
    verdict_numbers,
    window_numbers,
)
from specops.watch.goodput import GoodputModel, GoodputPolicy, Load, step_options, surface_verify_cost
from specops.watch.rule import GOODPUT, MODEL, Rule, rule_for
from specops.watch.surface import Surface, load_surface, profile_surface
from specops.watch.window import NO_DATA, OK, SPEC_OFF, UNAVAILABLE, WindowStats

FLAP_PERIOD_S = 3600.0


class Policy:
    """The decision engine for one deployment. Feed it windows (:meth:`observe`) and what the supervisor
    did (:meth:`on_switched`, :meth:`on_failed_start`); it never reads a clock — ``now`` is always given."""

    def __init__(
        self,
        config: PolicyConfig,
        steps: Sequence[ChainStep],
        current: int | ChainStep | Method = 0,
        *,
        surface: Surface | None = None,
        per_batch: Sequence[Sequence[int]] | None = None,
        rule: Rule | None = None,
    ):
        if not steps:
            raise ValueError("a policy needs at least one step (the primary method)")
        if rule is not None and rule.mode != config.mode:
            raise ValueError(f"the rule decides in mode {rule.mode}, the config in mode {config.mode}")
        self.config = config
        #: which rule decides and why (``specops status``, ``up``'s log); its curve is what mode model predicts on
        self.rule = rule or Rule(config.mode, f"mode {config.mode} given", min_acceptance=config.min_acceptance)
        #: the longest draft the engine of each step runs (its launch plan's), for a window that counts no drafts
        self.engine_k: dict[int, int] = {}
        self.steps: tuple[ChainStep, ...] = tuple(steps)
        self.index = self._index_of(current)
        self.streak = 0  # consecutive low windows of the current method
        self.last_verdict_end: float | None = None  # end of the last window that counted (or last switch)
        self.switch_times: list[float] = []  # confirmed switches, for cooldown and the flap guard
        self.pending: Decision | None = None
        self.retry_due: float | None = None
        self.retry_backoff = config.retry_after_s
        self.retry_origin: int | None = None  # the step a running retry came from
        self.down_since: float | None = None  # the source has been unreadable since
        self._warned: set[str] = set()  # one-time warnings for the current method
        #: mode goodput: the chooser (``per_batch``: the primary step's k per batch size, when it runs one)
        self.goodput: GoodputPolicy | None = None
        if config.mode == GOODPUT:
            self.goodput = GoodputPolicy(
                config.goodput, step_options(self.steps, DEFAULT_K, per_batch), GoodputModel(surface), config.window_s
            )
        #: what a request class is judged on (:meth:`speculation_pays`): predicted tokens/s on this curve when one
        #: is known (the rule's, else the one the goodput surface carries), else acceptance
        self.class_curve: VerifyCost | None = self.rule.curve or (
            surface_verify_cost(surface) if self.goodput is not None else None
        )

    @classmethod
    def from_profile(
        cls,
        profile: Any,
        current: int | ChainStep | Method = 0,
        *,
        surface: Surface | None = None,
        curve: VerifyCost | None = None,
        draft_cost: float | None = None,
    ) -> Policy:
        """The policy of ``profile``, deciding by the rule :func:`~specops.watch.rule.rule_for` gives it: its
        ``fallback.mode``, or unset, on tokens/s where known (``curve``: the verification-cost curve stored for its
        engine, model and machine). Mode goodput reads ``fallback.goodput.surface`` (once, here) unless ``surface`` is
        given (raises SpecopsError when that file holds no surface). Given the loaded profile (``LoadedProfile``), a
        relative surface path is read from the profile's folder and errors are located; given the bare model, from
        the current folder. ``draft_cost``: c as measured on this machine
        (:func:`specops.perf.verifycost.decision_draft_cost`), used where ``fallback.draft_cost_ratio`` is unset."""
        loaded = profile if hasattr(profile, "document") else None  # a LoadedProfile
        profile = loaded.profile if loaded is not None else profile
        fb = profile.fallback
        rule = rule_for(fb, curve)
        if rule.mode == GOODPUT and surface is None and fb.goodput.surface:
            surface = profile_surface(loaded) if loaded is not None else load_surface(fb.goodput.surface)
        config = PolicyConfig.from_profile(profile, rule.mode)
        if fb.draft_cost_ratio is None and draft_cost is not None:
            config = replace(config, draft_cost_ratio=draft_cost)
        return cls(
            config,
            profile.steps,
            current,
            surface=surface,
            per_batch=profile.speculative.per_batch_size,
            rule=rule,
        )

    def note_draft_length(self, step: int, longest: int | None) -> None:
        """The engine of ``step`` drafts at most ``longest`` tokens (its launch plan's draft length; None: unknown):
        mode model predicts with it where a window counts no drafts, instead of the profile's k."""
        if longest:
            self.engine_k[step] = int(longest)
        else:
            self.engine_k.pop(step, None)

    # ------------------------------------------------------------------ helpers
    @property
    def current(self) -> ChainStep:
        return self.steps[self.index]

    def _index_of(self, which: int | ChainStep | Method) -> int:
        if isinstance(which, bool):
            raise TypeError("a step is an index, a ChainStep or a Method")
        if isinstance(which, int):
            if not 0 <= which < len(self.steps):
                raise ValueError(f"step index {which} outside the chain (0..{len(self.steps) - 1})")
            return which
        for i, step in enumerate(self.steps):
            if step == which or (isinstance(which, Method) and step.method is which):
                return i
            if isinstance(which, ChainStep) and step.method is which.method:
                return i
        raise ValueError(f"{which} is not a step of this chain")

    def switches_in_last_hour(self, now: float) -> int:
        return sum(1 for t in self.switch_times if now - FLAP_PERIOD_S < t <= now)

    def cooldown_until(self) -> float | None:
        return self.switch_times[-1] + self.config.cooldown_s if self.switch_times else None

    def _decision(
        self,
        action: Action,
        rule: str,
        reason: str,
        now: float,
        numbers: Mapping[str, Any] | None = None,
        to: int | None = None,
        warning: str | None = None,
    ) -> Decision:
        return Decision(
            action=action,
            rule=rule,
            reason=reason,
            at=now,
            from_index=self.index,
            from_step=self.current,
            to_index=to,
            to_step=self.steps[to] if to is not None else None,
            numbers=dict(numbers or {}),
            warning=warning,
        )

    def _warn_once(self, key: str, text: str) -> str | None:
        if key in self._warned:
            return None
        self._warned.add(key)
        return text

    # ------------------------------------------------------------------ the verdict
    def observe(self, stats: WindowStats, now: float, load: Load | None = None) -> Decision:
        """The decision for the window ``stats`` observed at ``now`` (call once per monitor tick); ``load`` is the
        live concurrency and tokens/s (mode goodput decides with it)."""
        if self.goodput is not None:  # the load is the proxy's: it counts on every tick (a crossover route reads it)
            self.goodput.note_load(load, now)
        if self.pending is not None:
            p = self.pending
            return self._decision(
                KEEP,
                "switch-pending",
                f"waiting for the {p.action} to {p.to_method} decided at {p.at:g} to complete",
                now,
                to=None,
            )

        if stats.status == UNAVAILABLE:
            if self.down_since is None:
                self.down_since = now
                return self._decision(
                    KEEP,
                    "source-unavailable",
                    f"metrics unavailable: {stats.reason}; no decision until they return",
                    now,
                    warning=f"acceptance source unavailable: {stats.reason}",
                )
            return self._decision(
                KEEP,
                "source-unavailable",
                f"metrics unavailable for {now - self.down_since:g}s: {stats.reason}",
                now,
                {"down_s": now - self.down_since},
            )
        notes: list[str] = []
        if self.down_since is not None:
            notes.append(f"source recovered after {now - self.down_since:g}s")
            self.down_since = None

        if self.goodput is not None:
            return self._with_notes(self._goodput_decision(stats, now, load), notes)
        retry = self._maybe_retry(now)
        if retry is not None:
            return self._with_notes(retry, notes)
        return self._with_notes(self._evaluate(stats, now), notes)

    @staticmethod
    def _with_notes(d: Decision, notes: list[str]) -> Decision:
        if not notes:
            return d
        return replace(d, reason=d.reason + " (" + "; ".join(notes) + ")", numbers={**d.numbers, "recovered": True})

    def _goodput_decision(self, stats: WindowStats, now: float, load: Load | None) -> Decision:
        """Mode goodput: note the live acceptance of the running method, then the chooser's verdict."""
        g, cfg = self.goodput, self.config
        assert g is not None
        cur = self.current
        tau = stats.mean_acceptance_length
        if tau is None and stats.acceptance is not None and step_k(cur):
            # no count of drafts (llama-server's per-request timings): full drafts of k, τ = 1 + acceptance·k
            tau = 1.0 + stats.acceptance * step_k(cur)
        if (
            cur.method is not Method.NONE
            and stats.status == OK
            and stats.full
            and not stats.coarse
            and tau is not None
            and (stats.draft_tokens or 0.0) >= cfg.min_draft_tokens
        ):
            g.model.note_acceptance(cur.method, tau, stats.mean_draft_length or step_k(cur), now)
        choice = g.choose(self.index, load, now)
        numbers = dict(choice.numbers)
        if stats.status == OK:
            numbers.update(acceptance=stats.acceptance, mean_acceptance_length=tau)
            if stats.mean_acceptance_length is None and tau is not None:
                numbers["mean_acceptance_length_basis"] = "1 + acceptance × k (no count of drafts)"
        if choice.target is None:
            return self._decision(KEEP, choice.rule, choice.reason, now, numbers)
        target = choice.target
        if not cfg.enabled:
            return self._decision(
                HOLD,
                "fallback-disabled",
                f"{choice.reason}; fallback is disabled (watch only)",
                now,
                numbers,
                warning=f"goodput would switch {cur.method} → {self.steps[target].method}, but fallback is disabled",
            )
        recent = self.switches_in_last_hour(now)
        if recent >= cfg.max_switches_per_hour:
            numbers["switches_last_hour"] = recent
            return self._decision(
                HOLD,
                "flap-guard",
                f"{choice.reason}; {recent} switches in the last hour reached "
                f"max_switches_per_hour={cfg.max_switches_per_hour}: holding {cur.method}",
                now,
                numbers,
                warning=self._warn_once("flap", f"flap guard: holding {cur.method} after {recent} switches in an hour"),
            )
        d = self._decision(
            SWITCH, choice.rule, f"{choice.reason}: switching to {self.steps[target].method}", now, numbers, to=target
        )
        self.pending = d
        return d

    def note_switch_cost(self, seconds: float) -> None:
        """A switch took ``seconds`` from the decision to the new engine being ready (mode goodput)."""
        if self.goodput is not None:
            self.goodput.note_switch_cost(seconds)

    def note_engine_start(self, seconds: float) -> None:
        """An engine took ``seconds`` from launch to ready (mode goodput's switch-cost estimate until a switch)."""
        if self.goodput is not None:
            self.goodput.note_start(seconds)

    def _maybe_retry(self, now: float) -> Decision | None:
        cfg = self.config
        if (
            not cfg.retry_enabled
            or not cfg.enabled
            or self.retry_due is None
            or self.index == 0
            or now < self.retry_due
        ):
            return None
        numbers = {"retry_due": self.retry_due, "retry_backoff_s": self.retry_backoff}
        until = self.cooldown_until()
        if until is not None and now < until:
            return None  # the retry waits for the cooldown; the window is judged as usual meanwhile
        if self.switches_in_last_hour(now) >= cfg.max_switches_per_hour:
            return None
        d = self._decision(
            RETRY,
            "retry",
            f"retrying {self.steps[0].method} after a back-off of "
            f"{self.retry_backoff:g}s (current: {self.current.method})",
            now,
            numbers,
            to=0,
        )
        self.pending = d
        return d

    def _evaluate(self, stats: WindowStats, now: float) -> Decision:
        """Rules 4 to 11 for a readable window: no verdict, or a verdict and what follows from it."""
        waiting = self._no_verdict(stats, now)
        if waiting is not None:
            return waiting
        acceptance = stats.acceptance
        assert acceptance is not None  # _no_verdict answers every window without one
        # a verdict: this window counts
        self.last_verdict_end = stats.end
        numbers = verdict_numbers(
            stats, acceptance, self.config, self.current, self.rule.curve, self.engine_k.get(self.index)
        )
        low, measure, bound = self._judge(stats, acceptance, numbers, self.config.mode == MODEL)
        numbers["low"] = low
        if not low:
            return self._good_window(f"{measure} is not below {bound}", now, numbers)
        return self._low_window(measure, bound, now, numbers)

    def _no_verdict(self, stats: WindowStats, now: float) -> Decision | None:
        """Why the window gets no verdict (rules 4 to 9), or None when it gets one."""
        return self._nothing_measured(stats, now) or self._not_countable(stats, now)

    def _nothing_measured(self, stats: WindowStats, now: float) -> Decision | None:
        """Rules 4 and 5: no speculation, no speculative series, or no acceptance in the window."""
        method = self.current.method
        if method is Method.NONE:
            return self._decision(KEEP, "no-speculation", "method none: speculation is off, nothing to measure", now)
        if stats.status == SPEC_OFF:
            warning = self._warn_once(
                "spec-off",
                f"{method} is configured but the engine exposes no "
                "speculative-decoding series (speculation off or stats disabled)",
            )
            return self._decision(KEEP, "spec-off", stats.reason, now, warning=warning)
        if stats.status == NO_DATA:
            return self._decision(
                KEEP,
                "no-data",
                stats.reason or "no data in the window",
                now,
                {"window_start": stats.start, "window_end": stats.end},
            )
        if stats.status != OK or stats.acceptance is None:
            return self._decision(KEEP, "no-data", f"window status {stats.status}: {stats.reason}", now)
        return None

    def _not_countable(self, stats: WindowStats, now: float) -> Decision | None:
        """Rules 6 to 9 for a window with an acceptance: not whole, not fresh, coarse, or too few drafts."""
        cfg = self.config
        numbers = window_numbers(stats, cfg)
        if not stats.full:
            return self._decision(
                KEEP,
                "window-filling",
                f"the samples span {stats.span:g}s of a {stats.window_s:g}s window",
                now,
                numbers,
            )
        if self.last_verdict_end is not None and stats.start is not None and stats.start < self.last_verdict_end:
            return self._decision(
                KEEP,
                "not-fresh",
                f"the window overlaps the last counted one (ended at "
                f"{self.last_verdict_end:g}); hysteresis counts disjoint windows",
                now,
                numbers,
            )
        if stats.coarse and not cfg.act_on_coarse:
            warning = self._warn_once(
                "coarse", "only a lifetime acceptance ratio is available (vLLM V0): reported, never acted on"
            )
            return self._decision(
                KEEP,
                "coarse",
                f"lifetime acceptance {stats.acceptance:.3f} (coarse, not windowed): report only",
                now,
                numbers,
                warning=warning,
            )
        if not stats.coarse and (stats.draft_tokens or 0.0) < cfg.min_draft_tokens:
            return self._decision(
                KEEP,
                "min-draft-tokens",
                f"{stats.draft_tokens:g} drafted tokens in the "
                f"window, fewer than min_draft_tokens={cfg.min_draft_tokens}",
                now,
                numbers,
            )
        return None

    def _judge(
        self, stats: WindowStats, acceptance: float, numbers: Mapping[str, Any], on_speed: bool
    ) -> tuple[bool, str, str]:
        """Whether the window is low (rule 10): on the predicted speedup (``on_speed``) or on acceptance; the
        measure in words, and the bound it was held to."""
        cfg = self.config
        if on_speed:
            low = bool(numbers["predicted_speedup"] < 1.0)
            measured = "measured " if numbers["k_measured"] else ""
            measure = (
                f"predicted speedup {numbers['predicted_speedup']:.3f} "
                f"(α={numbers['alpha']:.3f}, τ={numbers['tokens_per_step']:.2f}, {measured}k={numbers['k']:.3g}, "
                f"c={numbers['draft_cost_ratio']:g}, {numbers['verify_cost']}; acceptance {acceptance:.3f})"
            )
            bound = "1"
        else:
            low = acceptance < cfg.min_acceptance
            measure = f"acceptance {acceptance:.3f}"
            bound = f"min_acceptance {cfg.min_acceptance:g}"
        return low, measure + f" over {stats.span:g}s ({stats.reason})", bound

    def speculation_pays(self, stats: WindowStats, step: int = 0) -> tuple[bool, str]:
        """Whether speculation on ``step`` pays for the traffic ``stats`` measured (an ``ok`` window with an
        acceptance), and why in words. Per-request routing asks it about each request class
        (:meth:`specops.watch.decide.FallbackDecider.route_class`): on the speedup predicted from the class's own
        mean acceptance and draft lengths where a verification-cost curve is known (:attr:`class_curve`) or the
        mode is model, else on its acceptance (modes threshold and goodput have no per-class tokens/s)."""
        acceptance = stats.acceptance
        if acceptance is None:
            raise ValueError("speculation_pays needs a window with an acceptance")
        curve = self.class_curve
        numbers = verdict_numbers(stats, acceptance, self.config, self.steps[step], curve, self.engine_k.get(step))
        on_speed = self.config.mode == MODEL or curve is not None
        low, measure, bound = self._judge(stats, acceptance, numbers, on_speed)
        return (not low), f"{measure} is {'below' if low else 'not below'} {bound}"

    def _good_window(self, verdict: str, now: float, numbers: dict[str, Any]) -> Decision:
        """A window that is not low: the streak resets, and a running retry has held."""
        self.streak = 0
        numbers["streak"] = 0
        if self.retry_origin is not None:
            self.retry_origin = None
            self.retry_backoff = self.config.retry_after_s
            self.retry_due = None
            return self._decision(
                KEEP,
                "retry-succeeded",
                f"{verdict}: the retry of {self.current.method} holds; retry back-off reset",
                now,
                numbers,
            )
        rule = "above-threshold" if self.config.mode == "threshold" else "speedup-above-1"
        return self._decision(KEEP, rule, verdict, now, numbers)

    def _low_window(self, measure: str, bound: str, now: float, numbers: dict[str, Any]) -> Decision:
        """A low window extends the streak; a complete streak switches (rule 11) unless a rule holds."""
        cfg = self.config
        self.streak += 1
        numbers.update(streak=self.streak, consecutive_windows=cfg.consecutive_windows)
        if self.streak < cfg.consecutive_windows:
            return self._decision(
                KEEP,
                "hysteresis",
                f"{measure} is below {bound}: low window {self.streak} of {cfg.consecutive_windows}",
                now,
                numbers,
            )
        why = f"{measure} is below {bound} for {self.streak} consecutive windows"
        retry_failed = self.retry_origin is not None
        target = self.retry_origin if self.retry_origin is not None else self.index + 1
        held = self._held(why, target, now, numbers)
        if held is not None:
            return held
        if retry_failed:
            numbers["retry_backoff_next_s"] = min(self.retry_backoff * 2, cfg.retry_max_after_s)
        rule = "retry-failed" if retry_failed else cfg.mode
        d = self._decision(SWITCH, rule, f"{why}: switching to {self.steps[target].method}", now, numbers, to=target)
        self.pending = d
        return d

    def _held(self, why: str, target: int, now: float, numbers: dict[str, Any]) -> Decision | None:
        """Why a complete streak may not switch to ``target`` now (watch-only, chain end, cooldown, flap
        guard), or None when it may."""
        cfg = self.config
        method = self.current.method
        if not cfg.enabled:
            nxt = self.steps[target].method if target < len(self.steps) else None
            return self._decision(
                HOLD,
                "fallback-disabled",
                f"{why}; fallback is disabled (watch only)" + (f", would switch to {nxt}" if nxt else ""),
                now,
                numbers,
                warning=f"acceptance too low on {method} and fallback is disabled",
            )
        if target >= len(self.steps):
            return self._decision(
                HOLD,
                "chain-end",
                f"{why}; {method} is the last step of the chain",
                now,
                numbers,
                warning=f"acceptance too low on {method}, and no fallback step is left",
            )
        until = self.cooldown_until()
        if until is not None and now < until:
            numbers["cooldown_until"] = until
            return self._decision(
                KEEP, "cooldown", f"{why}; in cooldown until {until:g} after the last switch", now, numbers
            )
        recent = self.switches_in_last_hour(now)
        if recent >= cfg.max_switches_per_hour:
            numbers["switches_last_hour"] = recent
            return self._decision(
                HOLD,
                "flap-guard",
                f"{why}; {recent} switches in the last hour reached "
                f"max_switches_per_hour={cfg.max_switches_per_hour}: holding {method}",
                now,
                numbers,
                warning=f"flap guard: holding {method} after {recent} switches in an hour",
            )
        return None

    # ------------------------------------------------------------------ what the supervisor did
    def on_switched(self, step: int | ChainStep | Method, now: float) -> None:
        """The engine now runs ``step`` (after a switch, a retry, or a fallback the supervisor made itself)."""
        new = self._index_of(step)
        old = self.index
        self.pending = None
        if new == old:
            return
        self.index = new
        self.switch_times.append(now)
        self.switch_times = [t for t in self.switch_times if now - t < FLAP_PERIOD_S]
        self.streak = 0
        self.last_verdict_end = now  # only windows that start after the switch count
        self._warned.clear()
        if self.goodput is not None:  # goodput moves both ways by itself: no retry bookkeeping
            self.goodput.switched(now, new)
            return
        cfg = self.config
        if new < old:  # moved up: a retry is running
            self.retry_origin = old
            self.retry_due = None
            return
        if self.retry_origin is not None:  # fell back from a retry: it failed
            self._retry_failed(now)
        elif cfg.retry_enabled and new != 0 and self.retry_due is None:
            self.retry_due = now + self.retry_backoff

    def cancel_pending(self) -> None:
        """The supervisor refused the decided switch (not ready, stopping): the streak stands, so the next
        fresh low window decides again."""
        self.pending = None

    def _retry_failed(self, now: float) -> None:
        self.retry_origin = None
        self.retry_backoff = min(self.retry_backoff * 2, self.config.retry_max_after_s)
        self.retry_due = now + self.retry_backoff if self.config.retry_enabled else None

    def on_failed_start(self, step: int | ChainStep | Method, now: float) -> Decision:
        """``step`` never became ready (or crash-looped): where to go instead.

        A failed retry goes back to the step it came from and doubles the retry back-off; any other failure
        moves to the step after it; with none left, ``hold`` on rule ``chain-end``.
        """
        failed = self._index_of(step)
        pending, self.pending = self.pending, None
        prev_index = self.index
        if pending is not None and pending.action == RETRY and pending.to_index == failed:
            self._retry_failed(now)
            numbers = {"retry_backoff_s": self.retry_backoff, "retry_due": self.retry_due}
            return Decision(
                SWITCH,
                "retry-failed-start",
                f"the retry of {self.steps[failed].method} did not "
                f"start; back to {self.steps[prev_index].method}, next retry in {self.retry_backoff:g}s",
                now,
                failed,
                self.steps[failed],
                prev_index,
                self.steps[prev_index],
                numbers,
            )
        target = failed + 1
        if target >= len(self.steps):
            return Decision(
                HOLD,
                "chain-end",
                f"{self.steps[failed].method} did not start and it is the last step of the chain",
                now,
                failed,
                self.steps[failed],
                warning=f"no method left to fall back to after {self.steps[failed].method}",
            )
        return Decision(
            SWITCH,
            "failed-start",
            f"{self.steps[failed].method} did not start: falling back to {self.steps[target].method}",
            now,
            failed,
            self.steps[failed],
            target,
            self.steps[target],
        )

    def snapshot(self, now: float) -> dict[str, Any]:
        """The policy's state, for ``specops status`` and the watcher's own metrics."""
        cfg = self.config
        return {
            "method": self.current.method.value,
            "index": self.index,
            "streak": self.streak,
            # the bound each window is held to and the hysteresis, so `specops status` can show the verdict
            "mode": cfg.mode,
            "rule": self.rule.to_dict(),
            "min_acceptance": cfg.min_acceptance,
            "consecutive_windows": cfg.consecutive_windows,
            "min_draft_tokens": cfg.min_draft_tokens,
            "fallback_enabled": cfg.enabled,
            "cooldown_until": self.cooldown_until(),
            "switches_last_hour": self.switches_in_last_hour(now),
            "retry_due": self.retry_due,
            "retry_backoff_s": self.retry_backoff,
            "retrying_from": self.retry_origin,
            "pending": self.pending.to_dict() if self.pending else None,
            "source_down_since": self.down_since,
            **({"goodput": self._goodput_snapshot(now)} if self.goodput is not None else {}),
        }

    def _goodput_snapshot(self, now: float) -> dict[str, Any]:
        g = self.goodput
        assert g is not None
        cost, basis = g.switch_cost_s
        s = g.model.surface
        return {
            "concurrency": g.concurrency(now),
            "switch_cost_s": cost,
            "switch_cost_basis": basis,
            "candidate": g.options[g.candidate].label if g.candidate is not None else None,
            "candidate_since": g.candidate_since,
            "correction": {str(b): round(v, 3) for b, v in sorted(g.model.correction.items())},
            "surface": None
            if s is None
            else {
                **{k: s.meta.get(k) for k in ("date", "engine_version", "draft_sha")},
                "levels": s.levels(),
                "crossover": s.crossovers(),
            },
        }
