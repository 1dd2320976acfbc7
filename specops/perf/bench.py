"""``specops bench``: the profile's engine with speculation and without, side by side, on real prompts.

One run launches the same engine and model twice per round — once as the profile says (speculation on),
once with ``method: none`` — and sends the same workload to each: every prompt set at every concurrency
level. Rounds alternate the order (on/off, then off/on, ...) so that drift of the machine (thermal, other
load) does not favour one side; numbers per cell are medians over rounds. A cell's speedup is its
speculative tokens/s divided by its baseline tokens/s, nothing else.

Acceptance per cell comes from the engine's own counters read before and after the cell (Δaccepted /
Δdrafted, and the mean acceptance length 1 + Δaccepted / Δdrafts); llama-server's per-response ``timings``
are the fallback when its build has no counters.

Each cell also records what could make it lie: the cores other processes kept busy meanwhile
(:mod:`specops.perf.cpuload`) and the longest silence of a streamed request after its first token; the
report flags busy, stalled and disagreeing cells (:mod:`specops.perf.bench_report`).

Outputs (:mod:`specops.perf.bench_report`): ``results.json`` (everything), ``summary.md`` (tables a person reads) and
PNG plots (:mod:`specops.perf.plots`) — speedup vs concurrency per prompt set, acceptance per prompt set,
tokens/s on vs off.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specops import __version__
from specops.config.profile import LoadedProfile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.perf import cpuload
from specops.perf.bench_flags import FlagThresholds
from specops.perf.bench_report import BASE, SPEC, summarize
from specops.perf.verifycost import CurveKey, covers, cpu_model, load_record, save_curve, usable_cores
from specops.perf.verifyprobe import probe_profile
from specops.perf.workload import BUILTIN_SETS, Prompt, load_prompts

DEFAULT_LEVELS = (1, 2, 4, 8)


@dataclass
class BenchConfig:
    """What to run. ``requests`` is per cell (prompt set × concurrency × mode); default max(8, 2·c)."""

    prompt_sets: list[str] = field(default_factory=lambda: list(BUILTIN_SETS))
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    requests: int | None = None
    duration: float | None = None
    max_tokens: int | None = None
    rounds: int = 2  # one round prints no headline: it cannot tell a busy machine or a stall from the engine
    warmup: int = 2
    step_index: int = 0
    ignore_eos: bool = False
    interleave: bool = False  # both engines at once, cells alternating (needs memory for two)
    probe: bool = True  # probe the verification cost on the baseline when no curve is stored
    draft_cost: float | None = None
    backend_version: str | None = None
    ready_timeout: float | None = None
    log_dir: Path | None = None
    flags: FlagThresholds = field(default_factory=FlagThresholds)

    def requests_for(self, level: int) -> int | None:
        if self.requests is not None:
            return self.requests
        return None if self.duration is not None else max(8, 2 * level)

    def check(self) -> None:
        if not self.prompt_sets:
            raise SpecopsError("no prompt sets to run")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise SpecopsError(f"concurrency levels must be integers >= 1, got {self.concurrency}")
        if self.rounds < 1:
            raise SpecopsError("--rounds must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise SpecopsError("--requests must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise SpecopsError("--duration must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SpecopsError("--max-tokens must be >= 1")
        self.flags.check()


def load_sets(names: list[str], max_tokens: int | None = None) -> dict[str, list[Prompt]]:
    """Prompt sets by name or JSONL path, keyed by set name (a file's prompts may name several sets)."""
    out: dict[str, list[Prompt]] = {}
    for name in names:
        for p in load_prompts(name):
            if max_tokens is not None:
                p = Prompt(p.text, max_tokens, p.temperature, p.set)
            out.setdefault(p.set, []).append(p)
    return out


def machine() -> dict:
    """The machine the numbers were measured on (stated in every report)."""
    cpu = cpu_model() or platform.processor() or ""
    cores = usable_cores()
    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": cores,
        "memory_gib": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------------
# running

Say = Callable[[str], None]


class _Progress:
    """Adapter for a progress display: ``start(label, total)``, ``advance()``, ``finish()``."""

    def start(self, label: str, total: int | None) -> None: ...
    def advance(self, label: str) -> None: ...
    def finish(self) -> None: ...


async def run_bench(
    loaded: LoadedProfile, registry, cfg: BenchConfig, *, say: Say = lambda m: None, progress: _Progress | None = None
) -> dict:
    """Run the comparison and return the report (a JSON-ready dict; see :func:`summarize`)."""
    cfg.check()
    bench = _Bench(loaded, registry, cfg, say, progress or _Progress())
    started = time.time()
    await bench.probe_verify_cost()
    for rnd in range(cfg.rounds):
        order = (SPEC, BASE) if rnd % 2 == 0 else (BASE, SPEC)
        if cfg.interleave:
            await bench.interleaved_round(rnd, order)
        else:
            await bench.sequential_round(rnd, order)
    return summarize(bench.cells, bench.meta(started))


class _Bench:
    """One comparison under way: the profile with speculation and without, the engine, the prompt sets,
    and the cells and launches measured so far."""

    def __init__(self, loaded: LoadedProfile, registry, cfg: BenchConfig, say: Say, progress: _Progress):
        from specops.perf.launch import profile_for_step, without_speculation

        self.loaded, self.registry, self.cfg, self.say, self.progress = loaded, registry, cfg, say, progress
        self.sets = load_sets(cfg.prompt_sets, cfg.max_tokens)
        spec = profile_for_step(loaded.profile, cfg.step_index)
        if spec.speculative.method is Method.NONE:
            raise SpecopsError(
                f"{loaded.path}: step {cfg.step_index} runs without speculation (method none): "
                "nothing to compare; bench a profile whose method drafts"
            )
        self.profiles = {SPEC: spec, BASE: without_speculation(spec)}
        self.engine = registry.backend(spec.backend).engine_info(spec, cfg.backend_version, probe=True)
        self.extra = {"ignore_eos": True} if cfg.ignore_eos else None
        self.levels = sorted(set(cfg.concurrency))
        self.cells: list[dict] = []
        self.launches: list[dict] = []
        self.per_engine_requests = sum((cfg.requests_for(c) or 0) for c in self.levels) * len(self.sets)
        self.fitted = False
        self.fit_notes: list[str] = []
        self.draft_length: dict | None = None  # what the speculating engine's backend says of its plan
        self.verify_cost: dict | None = None  # the probe's record (see specops.perf.verifycost)

    def grid(self) -> list[tuple[str, int]]:
        """Every (prompt set, concurrency) cell of a round, in the order they run."""
        return [(set_name, level) for set_name in self.sets for level in self.levels]

    async def sequential_round(self, rnd: int, order: tuple[str, str]) -> None:
        """One engine at a time: every cell on the first, then every cell on the second."""
        for mode in order:
            async with self.launch(mode, rnd) as eng:
                await self.ready(eng, mode, rnd)
                with self.progress_bar(f"round {rnd + 1}: {mode}", self.per_engine_requests):
                    for set_name, level in self.grid():
                        await self.cell(eng, mode, rnd, set_name, level)

    async def interleaved_round(self, rnd: int, order: tuple[str, str]) -> None:
        """Both engines up at once; every cell runs on one and then the other, the order alternating."""
        async with self.launch(order[0], rnd) as first, self.launch(order[1], rnd) as second:
            engines = {order[0]: first, order[1]: second}
            for mode in order:
                await self.ready(engines[mode], mode, rnd)
            with self.progress_bar(f"round {rnd + 1}: both engines", 2 * self.per_engine_requests):
                for i, (set_name, level) in enumerate(self.grid()):
                    for mode in order if i % 2 == 0 else order[::-1]:
                        await self.cell(engines[mode], mode, rnd, set_name, level)

    @contextlib.contextmanager
    def progress_bar(self, label: str, total: int):
        self.progress.start(label, total or None)
        try:
            yield
        finally:
            self.progress.finish()

    def launch(self, mode: str, rnd: int):
        from specops.perf.launch import launched

        prof, cfg = self.profiles[mode], self.cfg
        what = str(prof.speculative.method) if mode == SPEC else "no speculation"
        self.say(f"round {rnd + 1}/{cfg.rounds}: launching {prof.backend} {self.engine.version} with {what}")
        log_path = (cfg.log_dir / f"engine-{mode}-r{rnd + 1}.log") if cfg.log_dir else None
        return launched(
            self.loaded,
            self.registry,
            profile=prof,
            engine=self.engine,
            ready_timeout=cfg.ready_timeout,
            log_path=log_path,
        )

    async def fit(self, eng) -> None:
        """Fit every prompt set to the context one request gets on the first engine (its own tokenizer counts),
        once, so both modes and every round send the same prompts; say what was trimmed."""
        from specops.perf.workload import fit_workload

        self.fitted = True
        fit = await fit_workload([eng], self.sets, fallback_context=self.profiles[SPEC].model.max_model_len)
        self.sets = fit.sets
        for note in fit.notes:
            self.say(note)
            self.fit_notes.append(note)

    async def ready(self, eng, mode: str, rnd: int) -> None:
        drafts = eng.plan.draft_length
        self.say(f"ready in {eng.ready_s:.1f}s on {eng.base_url}" + (f", drafts {drafts.describe()}" if drafts else ""))
        if mode == SPEC and drafts is not None:
            self.draft_length = drafts.to_dict()
        if not self.fitted:
            await self.fit(eng)
        self.launches.append(
            {
                "mode": mode,
                "round": rnd + 1,
                "ready_s": round(eng.ready_s, 3),
                "argv": [eng.plan.redact(a) for a in eng.plan.argv],
            }
        )
        await _warmup(eng, self.sets, self.cfg, self.extra)

    async def probe_verify_cost(self) -> None:
        """The verification-cost record for the model column, before the rounds: the one stored for this engine,
        model and machine when it has timed speculative steps (and the draft model's step, where there is one;
        ``specops bench --probe-verify`` re-measures it), else probed now (:func:`probe_profile`: a few short
        launches) and stored for advise, init and tune. With --no-probe an older record is used as it is; without
        any, or when the probe fails, c_verify ≡ 1, said in the report."""
        key = CurveKey.of(self.profiles[BASE], self.engine.version)
        stored = load_record(key)
        if covers(stored, self.profiles[SPEC]) or (stored is not None and not self.cfg.probe):
            self.verify_cost = {**stored, "file": str(key.path()), "probed": False}
            self.say(f"verification cost: the curve measured {stored.get('date')} ({key.path()})")
            return
        if not self.cfg.probe:
            self.verify_cost = {"probed": False, "error": "not probed (--no-probe)"}
            self.say("verification cost not probed (--no-probe): the model column assumes c_verify ≡ 1")
            return
        loaded = LoadedProfile(self.profiles[SPEC], self.loaded.document, self.loaded.path)
        try:
            record, path = save_curve(key, await probe_profile(loaded, self.registry, self.engine, say=self.say))
            self.verify_cost = {**record, "file": str(path), "probed": True}
            self.say(f"verification cost probed: {record['relative']} (steps per speculative step over n tokens)")
        except SpecopsError as exc:
            self.verify_cost = {"probed": False, "error": str(exc)}
            self.say(f"verification cost not probed ({exc}): the model column assumes c_verify ≡ 1")

    async def cell(self, eng, mode: str, rnd: int, set_name: str, level: int) -> None:
        label = f"{mode} r{rnd + 1} {set_name} c={level}"
        out = await _run_cell(
            eng,
            self.sets[set_name],
            level,
            self.cfg,
            self.extra,
            lambda done, total, label=label: self.progress.advance(label),
        )
        self.cells.append({"set": set_name, "concurrency": level, "mode": mode, "round": rnd + 1, **out})
        if not eng.process.running:
            raise SpecopsError(
                f"the engine ({mode}) {eng.process.exit.describe()} during {set_name} at "
                f"concurrency {level}; see its log in {self.cfg.log_dir or 'the output folder'}"
            )

    def meta(self, started: float) -> dict:
        """What the report states besides the cells: versions, machine, profile, engine, settings."""
        spec, cfg, engine = self.profiles[SPEC], self.cfg, self.engine
        backend = self.registry.backend(spec.backend)
        return {
            "specops_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 1),
            "machine": machine(),
            "profile": {
                "name": spec.name,
                "path": self.loaded.path,
                "backend": spec.backend,
                "model": spec.model.id,
                "method": spec.speculative.method.value,
                "k": spec.speculative.k if backend.k_applies(spec.speculative.method) else None,
                "draft_length": self.draft_length,
                "draft": spec.speculative.draft,
                "parallel": spec.server.parallel,
                "min_acceptance": spec.fallback.min_acceptance,
            },
            "engine": {"backend": engine.backend, "version": engine.version, "source": engine.source},
            "settings": {
                "prompt_sets": list(self.sets),
                "concurrency": self.levels,
                "requests_per_cell": cfg.requests,
                "duration_per_cell": cfg.duration,
                "max_tokens": cfg.max_tokens,
                "rounds": cfg.rounds,
                "warmup": cfg.warmup,
                "ignore_eos": cfg.ignore_eos,
                "step": cfg.step_index,
                "interleave": cfg.interleave,
                "draft_cost_ratio": _draft_cost(cfg, spec),
                "fitted": self.fit_notes,
                "flag_thresholds": cfg.flags.to_dict(),
            },
            "launches": self.launches,
            "verify_cost": self.verify_cost,
        }


def _draft_cost(cfg: BenchConfig, profile) -> float | None:
    """The draft cost ratio c of the model speedup when one is given (--draft-cost, else the profile's); None:
    the report uses the probed one, else :data:`~specops.speedup.DEFAULT_DRAFT_COST` (and says which)."""
    return cfg.draft_cost if cfg.draft_cost is not None else profile.fallback.draft_cost_ratio


async def _warmup(eng, sets: dict[str, list[Prompt]], cfg: BenchConfig, extra) -> None:
    """A few short requests before measuring: first-request costs (allocation, compilation) excluded."""
    from specops.perf.workload import warm_up

    if cfg.warmup >= 1:
        await warm_up(eng, [ps[0] for ps in sets.values() if ps], requests=cfg.warmup, extra_body=extra)


async def _run_cell(eng, prompts: list[Prompt], level: int, cfg: BenchConfig, extra, on_progress) -> dict:
    from specops.perf.workload import run_workload

    before = await eng.counters()
    cpu_before = cpuload.sample()
    res = await run_workload(
        eng.base_url,
        eng.model_name,
        prompts,
        concurrency=level,
        requests=cfg.requests_for(level),
        duration=cfg.duration,
        api_key=eng.api_key,
        on_progress=on_progress,
        extra_body=extra,
    )
    other = cpuload.other_cores(cpu_before, cpuload.sample())
    stats = await eng.acceptance_since(before)
    out = res.summary()
    gaps = [max(r.itl) for r in res.ok if r.itl]
    out.update(other_load_cores=other, longest_gap_s=max(gaps) if gaps else None)
    acceptance = mal = draft_len = None
    source = None
    if stats.status == "ok":
        acceptance, mal, draft_len = stats.acceptance, stats.mean_acceptance_length, stats.mean_draft_length
        source = "metrics"
        out.update(draft_tokens=stats.draft_tokens, accepted=stats.accepted, drafts=stats.drafts)
    elif res.acceptance is not None:
        acceptance, source = res.acceptance, "response-timings"
        out.update(draft_tokens=res.draft_tokens, accepted=res.accepted, drafts=None)
    out.update(acceptance=acceptance, mean_acceptance_length=mal, mean_draft_length=draft_len, acceptance_source=source)
    return out


def run_bench_blocking(loaded: LoadedProfile, registry, cfg: BenchConfig, **kw) -> dict:
    return asyncio.run(run_bench(loaded, registry, cfg, **kw))
