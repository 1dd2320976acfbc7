"""The race of ``specops tune``: successive halving without relaunches, within a time budget.

Each setting is launched once, warmed up, and measured in rounds at the profile's concurrency (then at the
other levels); once it has ``min_rounds`` and even its best round is ``margin`` below the best median so
far, it is clearly worse and stops early; the others get up to ``max_rounds``. Rounds are sized from the
time budget; a setting that would not fit is skipped. The engine work goes through a :class:`Driver` (the
real one, :class:`specops.perf.tune.driver.EngineDriver`, starts engines through
:mod:`specops.perf.launch` and sends :mod:`specops.perf.workload` requests; tests use a scripted one).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from specops.config.durations import format_duration
from specops.errors import SpecopsError
from specops.perf.stats import median
from specops.perf.tune.results import LevelResult, Round, SettingResult, TuneResult
from specops.perf.tune.settings import Setting, k_widen_cap, next_k
from specops.resolve.prelaunch import CannotLaunch

#: Seconds one round takes before one was measured (only for the up-front budget check).
ROUND_PRIOR_S = 1.0
#: Seconds an engine start, warm-up or round may run past the deadline before it counts as failed.
GRACE_S = 30.0
#: A failed setting's reason starts with this when the engine refused the requests themselves (HTTP 4xx).
REQUESTS_REFUSED = "the engine refused the requests: "


class BudgetTooSmall(SpecopsError):
    """The time budget does not cover measuring even one setting; nothing was changed."""


class Session(Protocol):
    """One running engine with one setting. Every round sends the same prompts, so rounds are repeats of
    one measurement (their median is comparable whatever their number) and settings see the same work."""

    async def warmup(self, concurrency: int) -> None:
        """A few short requests that are not measured (first-request costs: allocation, caches)."""

    async def run(self, concurrency: int) -> Round:
        """One measured round: the round's prompts from ``concurrency`` clients."""

    async def counters(self):
        """The engine's spec-decode counters now (:class:`specops.backends.counters.SpecCounters`), or None."""

    async def acceptance_since(self, before):
        """Acceptance since ``before`` (a :class:`specops.watch.window.WindowStats`)."""


class Driver(Protocol):
    """Starts engines: ``session(setting)`` is an async context manager that launches, waits until ready,
    yields a :class:`Session` and always stops the engine."""

    launch_prior_s: float

    def session(self, setting: Setting) -> AbstractAsyncContextManager[Session]: ...


@dataclass
class TuneOptions:
    budget_s: float = 600.0
    levels: tuple[int, ...] = (1,)  # the profile's concurrency first
    min_rounds: int = 3  # rounds before a setting may be pruned (and for a valid median)
    max_rounds: int = 7
    margin: float = 0.05  # "clearly worse": even the best round is this far below the best median
    prune: bool = True  # False: every setting gets its rounds (an exhaustive sweep)
    widen: bool = False  # past the planned settings, widen k while the best is at an edge (see Tuner.widen)

    def check(self) -> None:
        if self.min_rounds < 1 or self.max_rounds < self.min_rounds:
            raise SpecopsError(f"rounds: need 1 <= min rounds ({self.min_rounds}) <= max rounds ({self.max_rounds})")
        if not self.levels or any(c < 1 for c in self.levels):
            raise SpecopsError("concurrency levels must be >= 1")
        if not 0 <= self.margin < 1:
            raise SpecopsError("margin must be within [0, 1)")
        if self.budget_s <= 0:
            raise SpecopsError("the budget must be positive")


Event = Callable[..., None]


class Tuner:
    """Runs the race over ``settings`` through ``driver`` within ``options.budget_s`` (see module doc)."""

    def __init__(
        self,
        settings: Sequence[Setting],
        driver: Driver,
        options: TuneOptions,
        *,
        current: Setting,
        clock: Callable[[], float] = time.monotonic,
        on_event: Event | None = None,
        reference: Sequence[Setting] = (),
    ):
        options.check()
        if not settings:
            raise SpecopsError("nothing to tune: the sweep is empty")
        #: measured after the sweep for the goodput surface: its baseline, the idle draft (never pruned or the winner)
        self.reference = [r for r in reference if r not in settings]
        self.settings = list(settings) + self.reference
        self.driver = driver
        self.o = options
        self.current = current
        self.clock = clock
        self.emit = on_event or (lambda kind, **kw: None)
        self._round_s: dict[int, list[float]] = {}
        self._overhead_s: list[float] = []
        self._measured_s = 0.0  # seconds of measured rounds of the setting being measured

    # ---- estimates (from what was measured so far; priors before that)
    def round_est(self, level: int) -> float:
        seen = self._round_s.get(level) or [x for v in self._round_s.values() for x in v]
        return median(seen[-9:]) if seen else ROUND_PRIOR_S  # one stalled round must not skew it

    def overhead_est(self) -> float:
        return max(self._overhead_s) if self._overhead_s else self.driver.launch_prior_s

    def min_cost(self) -> float:
        return self.overhead_est() + self.o.min_rounds * sum(self.round_est(c) for c in self.o.levels)

    # ---- the race
    async def run(self) -> TuneResult:
        t0 = self.clock()
        deadline = t0 + self.o.budget_s
        result = TuneResult(
            [SettingResult(s) for s in self.settings],
            self.o.levels,
            self.current,
            self.o.min_rounds,
            self.o.budget_s,
            reference_only=frozenset(self.reference),
        )
        self._refuse_a_small_budget()
        n = len(self.settings)
        for i, res in enumerate(result.results):
            # the baseline still to come keeps its share: the sweep stops short of it, not the other way round
            # (but the first setting always gets its own minimum)
            until = deadline - self._reserve(result.results[i + 1 :])
            measured = any(r.status == "measured" for r in result.results)
            if not measured:
                until = min(deadline, max(until, self.clock() + self.min_cost()))
            remaining = until - self.clock()
            if measured and remaining < self.min_cost():
                res.status, res.reason = "skipped", "the budget ran out"
                self.emit("skipped", result=res)
                continue
            alike = [r for r in result.results[i:] if self._is_reference(r) == self._is_reference(res)]
            rounds = self._rounds_for(remaining / len(alike))
            self.emit("setting", index=i, total=n, setting=res.setting, rounds=rounds)
            await self._measure(res, rounds, until, result)
            self.emit("done", index=i, total=n, result=res)
            self._stop_early_if_hopeless(i, res, result)
        if self.o.widen:
            await self.widen(result, deadline)
        result.elapsed_s = self.clock() - t0
        self._refuse_an_empty_result(result)
        return result

    async def widen(self, result: TuneResult, deadline: float) -> None:
        """While a method's best k is the largest (or, above 1, the smallest) k measured, measure the next k
        past it (:func:`~specops.perf.tune.settings.next_k`), up to the method's cap and within the budget;
        ``result.widening`` says per method where and why the range ended."""
        while True:
            todo: list[Setting] = []
            for method in dict.fromkeys(r.setting.method for r in result.results if r.setting.k is not None):
                nxt = self._next_setting(result, method)
                if nxt is not None:
                    todo.append(nxt)
            if not todo:
                return
            if deadline - self.clock() < self.min_cost():
                for st in todo:
                    best = max(result.k_curve(st.method), key=lambda kv: kv[1])[0]
                    result.widening[st.method.value] = (
                        f"the budget ran out while the best was k={best}, at the edge of what was tried "
                        f"(next: k={st.k})"
                    )
                return
            for st in todo:
                res = SettingResult(st)
                result.results.append(res)
                self.emit("setting", index=len(result.results) - 1, total=len(result.results), setting=st, rounds=0)
                await self._measure(res, self._rounds_for(deadline - self.clock()), deadline, result)
                self.emit("done", index=len(result.results) - 1, total=len(result.results), result=res)

    def _next_setting(self, result: TuneResult, method) -> Setting | None:
        """The next setting to widen ``method``'s k range to, or None (with the reason in ``result.widening``)."""
        curve = result.k_curve(method)
        if not curve:
            return None
        ks = [k for k, _ in curve]
        best_k = max(curve, key=lambda kv: kv[1])[0]
        cap = k_widen_cap(method)
        k = next_k(ks, best_k, cap)
        if k is None:
            if best_k == max(ks) and best_k >= cap:
                why = f"k={best_k} is the cap for {method.value} ({cap}): the curve may still rise past it"
            elif best_k == max(ks):
                why = f"k={best_k} is the only k measured"
            else:
                after = next(v for kk, v in curve if kk > best_k)
                why = f"the curve turns down after k={best_k} ({dict(curve)[best_k]:.1f} tok/s; next k: {after:.1f})"
            result.widening[method.value] = why
            return None
        template = next(r.setting for r in result.eligible() if r.setting.method is method and r.setting.k == best_k)
        candidate = dataclasses.replace(template, k=k)
        tried = result.result_for(candidate)
        if tried is not None:  # measured before and not eligible: it failed or was skipped
            result.widening[method.value] = (
                f"the best is k={best_k}, at the edge: k={k} could not be measured ({tried.status}: {tried.reason})"
            )
            return None
        return candidate

    def _is_reference(self, res: SettingResult) -> bool:
        return res.setting in self.reference

    def _reserve(self, rest: Sequence[SettingResult]) -> float:
        """Seconds held back for the reference settings in ``rest``: one setting's minimum cost each."""
        return sum(self.min_cost() for r in rest if self._is_reference(r))

    def _rounds_for(self, share: float) -> int:
        """Rounds per level for a setting given ``share`` seconds of the budget (within min/max rounds)."""
        per_round = sum(self.round_est(c) for c in self.o.levels)
        rounds = int((share - self.overhead_est()) // per_round) if per_round > 0 else self.o.max_rounds
        return max(self.o.min_rounds, min(self.o.max_rounds, rounds))

    def _refuse_a_small_budget(self) -> None:
        """Raise :class:`BudgetTooSmall` (before any engine starts) when not even one setting fits."""
        need = self.min_cost()
        if self.o.budget_s < need:
            raise BudgetTooSmall(
                f"a budget of {format_duration(self.o.budget_s)} is too small to measure one setting: starting the "
                f"engine alone takes about {format_duration(self.driver.launch_prior_s)}, plus {self.o.min_rounds} "
                f"rounds at each of {len(self.o.levels)} concurrency level(s); give --budget "
                f"{format_duration(_nice(need * 3))} or more. Nothing was changed."
            )

    def _stop_early_if_hopeless(self, i: int, res: SettingResult, result: TuneResult) -> None:
        """Raise when setting ``i`` shows that no other setting can do better (nothing measured yet)."""
        if res.status == "failed" and res.reason.startswith(REQUESTS_REFUSED) and not result.eligible():
            # the engine refused the requests themselves (HTTP 4xx: a prompt longer than the context, ...):
            # every other setting would refuse them too
            raise SpecopsError(
                f"the workload does not fit this deployment ({res.setting.label}: {res.reason}); "
                "pick prompts that fit (--workload, --max-tokens) or give the engine more "
                "context (model.max_model_len; llama-server splits it over server.parallel). "
                "Nothing was changed."
            )
        if i == 0 and res.status == "skipped" and not result.eligible():
            raise BudgetTooSmall(self._too_small_message(res))

    def _refuse_an_empty_result(self, result: TuneResult) -> None:
        """Raise when no setting got its rounds: why they failed, or that the budget was too small."""
        if result.eligible():
            return
        failed = [r for r in result.results if r.status == "failed"]
        if failed:
            reasons = list(dict.fromkeys(r.reason for r in failed))
            raise SpecopsError(
                "no setting could be measured: "
                + "; ".join(
                    f"{', '.join(r.setting.label for r in failed if r.reason == why)}: {why}" for why in reasons
                )
                + ". Nothing was changed."
            )
        raise BudgetTooSmall(self._too_small_message(result.results[0]))

    def _too_small_message(self, res: SettingResult) -> str:
        got = ", ".join(f"{res.rounds(c)} of {self.o.min_rounds} rounds at concurrency {c}" for c in self.o.levels)
        need = self.min_cost()
        launch = f"started in {format_duration(res.launch_s)}, " if res.launch_s is not None else ""
        return (
            f"a budget of {format_duration(self.o.budget_s)} is too small to measure one setting: "
            f"{res.setting.label} {launch}then measured {got} (a round takes about "
            f"{format_duration(self.round_est(self.o.levels[0]))}); give --budget "
            f"{format_duration(_nice(need * 3))} or more. Nothing was changed."
        )

    def _best_median(self, result: TuneResult) -> float | None:
        ranked = result.eligible()
        return ranked[0].median(self.o.levels[0]) if ranked else None

    # ---- one setting
    async def _measure(self, res: SettingResult, rounds: int, deadline: float, result: TuneResult) -> None:
        """Launch ``res.setting``, warm it up and measure it at every level; ``res`` records what happened."""
        t_start = self.clock()
        self._measured_s = 0.0
        best = self._best_median(result)
        try:
            async with contextlib.AsyncExitStack() as stack:
                if deadline - self.clock() < self.overhead_est() * 0.5:
                    res.status, res.reason = "skipped", "the budget ran out"
                    return
                session = await self._start(stack, res, t_start, deadline)
                await self._measure_levels(session, res, rounds, deadline, best)
        except asyncio.TimeoutError:
            res.status, res.reason = "failed", "did not finish within the budget"
        except CannotLaunch:  # the target model, a taken port: no setting can launch, so the sweep stops
            raise
        except SpecopsError as exc:
            res.status, res.reason = "failed", str(exc).splitlines()[0][:300]
        finally:
            res.seconds = self.clock() - t_start
            if res.launch_s is not None:
                self._overhead_s.append(max(0.0, res.seconds - self._measured_s))

    def _timeout(self, deadline: float) -> float:
        return max(1.0, deadline - self.clock()) + GRACE_S

    async def _start(
        self, stack: contextlib.AsyncExitStack, res: SettingResult, t_start: float, deadline: float
    ) -> Session:
        """Launch the engine (stopped when ``stack`` closes) and warm it up."""
        session = await asyncio.wait_for(
            stack.enter_async_context(self.driver.session(res.setting)), timeout=self._timeout(deadline)
        )
        res.launch_s = self.clock() - t_start
        self.emit("ready", setting=res.setting, seconds=res.launch_s)
        await asyncio.wait_for(session.warmup(self.o.levels[0]), timeout=self._timeout(deadline))
        res.status = "measured"
        return session

    async def _measure_levels(
        self, session: Session, res: SettingResult, rounds: int, deadline: float, best: float | None
    ) -> None:
        for level in self.o.levels:
            lr = LevelResult(level)
            res.levels[level] = lr
            before = await session.counters()
            await self._measure_rounds(session, res, lr, rounds, deadline, best)
            lr.set_acceptance(await session.acceptance_since(before))
            if res.status != "measured" or self.clock() >= deadline:
                break

    async def _measure_rounds(
        self, session: Session, res: SettingResult, lr: LevelResult, rounds: int, deadline: float, best: float | None
    ) -> None:
        """Up to ``rounds`` rounds at ``lr.concurrency``; stops at the deadline, an error, or when pruned."""
        level = lr.concurrency
        for _ in range(rounds):
            if self.clock() + self.round_est(level) > deadline:
                if len(lr.rounds) < self.o.min_rounds:
                    if level == self.o.levels[0]:
                        res.status = "skipped"
                    res.reason = f"the budget ran out after {len(lr.rounds)} round(s) at concurrency {level}"
                return
            rnd = await self._one_round(session, level, deadline)
            if rnd.errors:
                res.status = "failed"
                res.reason = f"{rnd.errors} of {rnd.requests} requests failed: {rnd.first_error}"
                if re.match(r"HTTP 4\d\d\b", rnd.first_error or ""):
                    res.reason = REQUESTS_REFUSED + res.reason
                return
            lr.rounds.append(rnd)
            self.emit(
                "round",
                setting=res.setting,
                level=level,
                round=len(lr.rounds),
                rounds=rounds,
                tokens_per_s=rnd.tokens_per_s,
            )
            # the surface's baseline is measured in full, never pruned
            why = None if self._is_reference(res) else self._clearly_worse(lr, best)
            if why:
                res.status, res.reason = "pruned", why
                return

    async def _one_round(self, session: Session, level: int, deadline: float) -> Round:
        t_r = self.clock()
        rnd = await asyncio.wait_for(session.run(level), timeout=self._timeout(deadline))
        took = self.clock() - t_r
        self._measured_s += took
        self._round_s.setdefault(level, []).append(took)
        return rnd

    def _clearly_worse(self, lr: LevelResult, best: float | None) -> str | None:
        """Why the setting stops early (its best round is clearly below the best median), else None."""
        if not (
            self.o.prune
            and lr.concurrency == self.o.levels[0]
            and best is not None
            and len(lr.rounds) >= self.o.min_rounds
            and max(lr.samples) < best * (1 - self.o.margin)
        ):
            return None
        return (
            f"clearly worse after {len(lr.rounds)} rounds: best round {max(lr.samples):.1f} < "
            f"{1 - self.o.margin:.2f} × best median {best:.1f} tok/s"
        )


def _nice(seconds: float) -> float:
    """Round a suggested budget up to a whole 10 s / minute."""
    return math.ceil(seconds / 10) * 10 if seconds < 120 else math.ceil(seconds / 60) * 60
