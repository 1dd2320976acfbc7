"""Launch one engine for a profile, for as long as a block of code runs: the harness of bench and tune.

``specops up`` supervises an engine for hours and moves down the fallback chain; measuring needs less:
start exactly one configuration (a chain step, or a profile variant such as "the same with speculation
off"), wait until it answers, run traffic, read its acceptance counters, and stop it — always, even when
the measurement fails::

    async with launched(loaded, registry, step_index=0) as eng:
        before = await eng.counters()
        result = await run_workload(eng.base_url, eng.model_name, prompts, concurrency=4)
        stats = await eng.acceptance_since(before)     # Δaccepted/Δdrafted, 1 + Δaccepted/Δdrafts

The engine binds a free loopback port unless told otherwise, so a launched engine never collides with a
deployment running under ``specops up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from specops.backends.base import EngineInfo, LaunchPlan
from specops.backends.counters import SpecCounters
from specops.config.profile import ChainStep, LoadedProfile, Profile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.resolve.prelaunch import Address, check_before_launch, resolve_for_launch
from specops.run.process import EngineProcess
from specops.run.start import EngineStart, free_port
from specops.watch.window import Sample, WindowStats, window_stats


@dataclass
class LaunchedEngine:
    """A ready engine: its plan, its process, and where to reach it."""

    plan: LaunchPlan
    process: EngineProcess
    base_url: str
    metrics_url: str
    model_name: str
    profile: Profile
    backend: object
    ready_s: float
    lines: list[str] = field(default_factory=list, repr=False)

    @property
    def method(self) -> Method:
        return self.profile.speculative.method

    @property
    def k(self) -> int:
        """Draft tokens per step of the running method (0 without speculation)."""
        return 0 if self.method is Method.NONE else self.profile.speculative.k

    @property
    def api_key(self) -> str | None:
        return self.plan.api_key

    async def counters(self, timeout: float = 5.0) -> SpecCounters | None:
        """The engine's spec-decode counters now (None: it exposes none, i.e. speculation is off)."""
        return await read_counters(
            self.metrics_url, self.backend, self.model_name, headers=self.plan.auth_headers, timeout=timeout
        )

    async def settled_counters(self, settle: float = 0.2, max_wait: float = 3.0) -> SpecCounters | None:
        """Counters read until two reads ``settle`` seconds apart agree (the engine may publish a step late)."""
        deadline = time.monotonic() + max_wait
        last = await self.counters()
        while time.monotonic() < deadline:
            await asyncio.sleep(settle)
            cur = await self.counters()
            if cur == last:
                return cur
            last = cur
        return last

    async def acceptance_since(self, before: SpecCounters | None) -> WindowStats:
        """Acceptance between ``before`` and now (status ``spec-off`` without spec series, ``no-data`` if idle)."""
        return acceptance_between(before, await self.settled_counters())


async def read_counters(
    metrics_url: str, backend, model_name: str | None, *, headers: dict | None = None, timeout: float = 5.0
) -> SpecCounters | None:
    """GET ``metrics_url`` and read it with ``backend.acceptance_counters`` (raises SpecopsError)."""
    from specops.watch.sources import ScrapeSource, SourceError

    src = ScrapeSource(metrics_url, backend.metric_prefix, model_name, timeout, headers)
    try:
        text, openmetrics = await asyncio.to_thread(src.fetch)
    except SourceError as exc:
        raise SpecopsError(f"cannot read acceptance: {exc}") from None
    try:
        return backend.acceptance_counters(text, model_name, openmetrics)
    except ValueError as exc:
        raise SpecopsError(f"cannot read acceptance from {metrics_url}: {exc}") from None


def acceptance_between(before: SpecCounters | None, after: SpecCounters | None) -> WindowStats:
    """One run's acceptance from the counters read before and after it.

    ``acceptance`` = Δaccepted/Δdraft_tokens, ``mean_acceptance_length`` = 1 + Δaccepted/Δdrafts,
    ``mean_draft_length`` = Δdraft_tokens/Δdrafts (the k in effect), ``per_position`` = Δaccepted at each
    draft position / Δdrafts. A counter that fell (engine restarted) counts from zero, as in a window.
    """
    return window_stats([Sample(0.0, before), Sample(1.0, after)], 1.0, 1.0)


def profile_for_step(profile: Profile, step_index: int) -> Profile:
    """``profile`` switched to chain step ``step_index`` (0: the primary method as written)."""
    steps = profile.steps
    if not 0 <= step_index < len(steps):
        raise SpecopsError(
            f"step {step_index} does not exist: the chain is "
            f"{' → '.join(s.method.value for s in steps)} (0..{len(steps) - 1})"
        )
    return profile.at_step(step_index)


def without_speculation(profile: Profile) -> Profile:
    """The same deployment with speculation off (method ``none``): the baseline of every comparison."""
    return profile.with_step(ChainStep(method=Method.NONE))


def with_k(profile: Profile, k: int) -> Profile:
    """The same deployment drafting ``k`` tokens per step."""
    spec = profile.speculative.model_copy(update={"num_speculative_tokens": k})
    return profile.model_copy(update={"speculative": spec})


@contextlib.asynccontextmanager
async def launched(
    loaded: LoadedProfile,
    registry,
    *,
    step_index: int = 0,
    profile: Profile | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    ready_timeout: float | None = None,
    log_path: str | Path | None = None,
    engine: EngineInfo | None = None,
    on_line: Callable[[str], None] | None = None,
    offline: bool = False,
    stop_timeout: float | None = None,
    say: Callable[[str], None] | None = None,
) -> AsyncIterator[LaunchedEngine]:
    """Start the engine for ``loaded`` (chain step ``step_index``, or ``profile`` instead) and yield it ready.

    What no method can fix is checked first, as ``up`` does (the target model, a taken ``port``: raises
    :class:`~specops.resolve.prelaunch.CannotLaunch`, nothing launched). An ``auto`` method or draft is
    resolved (``say`` gets the notes); the plan is rendered (probing the installed engine unless ``engine``
    is given) on ``host:port`` (default: loopback, a free port); the health URL is awaited (default:
    ``engine.ready_timeout``); the process group is stopped on exit, whatever happens. Raises
    :class:`SpecopsError` with the engine's last lines when it never becomes ready, or when it starts
    without the speculation asked for (llama-server keeps serving without a bad draft).
    """
    from specops.backends.render import render_plan

    prof = profile if profile is not None else profile_for_step(loaded.profile, step_index)
    check_before_launch(LoadedProfile(prof, loaded.document, loaded.path), [Address(host, port)] if port else [])
    prof = _resolved(LoadedProfile(prof, loaded.document, loaded.path), offline, say)
    backend = registry.backend(prof.backend)
    port = port or free_port(host)
    the_plan = render_plan(
        LoadedProfile(prof, loaded.document, loaded.path), registry, engine=engine, host=host, port=port
    )
    lines: list[str] = []
    start = EngineStart(
        the_plan,
        on_line=_keep_last(lines, on_line),
        launch_problem=backend.launch_problem,
        bind_failure=backend.bind_failure,
        log_path=Path(log_path) if log_path else None,
    )
    proc = start.process
    timeout = ready_timeout if ready_timeout is not None else prof.engine.ready_timeout
    try:
        result = await start.run(timeout, interval=0.1)
        if not result.ready:
            raise _not_ready(prof, the_plan, result)
        yield LaunchedEngine(
            plan=the_plan,
            process=proc,
            base_url=the_plan.base_url,
            metrics_url=the_plan.metrics_url,
            model_name=the_plan.model_name,
            profile=prof,
            backend=backend,
            ready_s=result.seconds,
            lines=lines,
        )
    finally:
        await _stop(proc, stop_timeout if stop_timeout is not None else prof.supervisor.stop_timeout)


def _resolved(loaded: LoadedProfile, offline: bool, say: Callable[[str], None] | None) -> Profile:
    """The profile with an ``auto`` method or draft resolved; raises when the checks refuse the draft."""
    prof = loaded.profile
    resolved, refused = resolve_for_launch(loaded, offline, say or (lambda msg: None), only_auto=True)
    if refused:
        raise SpecopsError(f"{prof.backend} ({prof.speculative.method}): the draft is refused by the checks: {refused}")
    return resolved.profile


def _keep_last(lines: list[str], on_line: Callable[[str], None] | None) -> Callable[[str], None]:
    """An on_line that keeps the engine's recent lines (200 to 400 of them) in ``lines`` and passes each on."""

    def take(line: str) -> None:
        lines.append(line)
        if len(lines) > 400:
            del lines[:200]
        if on_line is not None:
            on_line(line)

    return take


def _not_ready(prof: Profile, plan: LaunchPlan, result) -> SpecopsError:
    """Why the engine never became ready, with its last lines."""
    tail = "\n".join(f"    {line}" for line in result.last_lines)
    return SpecopsError(
        f"{prof.backend} ({prof.speculative.method}) on {plan.base_url}: {result.reason}"
        + (f"; last engine lines:\n{tail}" if tail else "")
    )


async def _stop(proc: EngineProcess, timeout: float) -> None:
    """Stop the engine's process group; killed outright when stopping is itself cancelled or interrupted."""
    try:
        await proc.stop(timeout)
    except BaseException:  # never leave the group behind
        proc.kill_now()
        raise
