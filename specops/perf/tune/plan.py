"""One ``specops tune`` run, start to end (the CLI is a thin layer over this): what to sweep, from the
profile and the options (:func:`prepare`), then the race on the real engine (:func:`run_sweep`).

The plan prices verification with the curve measured here for the engine and model
(:mod:`specops.perf.verifycost`), when there is one: a k whose verification costs more than k + 1 tokens are
worth, so that it loses even with every draft token accepted, is not measured (on a CPU, long drafts).
Without a curve every k is kept (c_verify ≡ 1), and the plan's notes say which."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.errors import SpecopsError
from specops.methods import NEEDS_DRAFT, Method
from specops.perf.tune.driver import EngineDriver, default_requests_per_round, load_workload
from specops.perf.tune.race import Event, TuneOptions, Tuner
from specops.perf.tune.results import TuneResult
from specops.perf.tune.settings import MethodChoice, Setting, current_setting, plan_settings
from specops.perf.verifycost import curve_for
from specops.resolve.prelaunch import resolve_for_launch
from specops.speedup import DEFAULT_DRAFT_COST, VerifyCost, cost_basis, max_paying_k


@dataclass
class TuneConfig:
    """What ``specops tune`` was asked for (parsed CLI options)."""

    workload: str | None = None
    max_tokens: int | None = None
    budget_s: float = 600.0
    k_values: list[int] | None = None
    methods: str | None = None
    ngram_pairs: list[tuple[int, int]] | None = None
    ngram_types: list[str] | None = None
    concurrency: str | None = None
    min_rounds: int = 3
    max_rounds: int = 7
    margin: float = 0.05
    requests_per_round: int | None = None
    backend_version: str | None = None
    offline: bool = False
    ready_timeout: float | None = None
    ignore_eos: bool = False
    prune: bool = True


@dataclass
class TunePlan:
    """Everything decided before the first engine starts."""

    resolved: Any
    engine: Any
    current: Setting
    choices: list[MethodChoice]
    settings: list[Setting]
    levels: tuple[int, ...]
    prompts: list
    workload: dict
    notes: list[str] = field(default_factory=list)
    #: measured for the goodput surface only, never written: ``none`` as its baseline (when the sweep has no
    #: such setting) and, on an engine that takes a k per batch size, the draft idle at k 0
    reference: list[Setting] = field(default_factory=list)
    widen: bool = False
    #: the verification-cost curve measured here for the engine and model (None: c_verify ≡ 1 assumed)
    verify_cost: VerifyCost | None = None


def prepare(loaded, registry, cfg: TuneConfig) -> TunePlan:
    """Resolve the profile as ``up`` would, probe the engine, and plan the sweep (no engine is started)."""
    notes: list[str] = []
    resolved_loaded, refused = resolve_for_launch(loaded, cfg.offline, notes.append)
    if refused:
        raise SpecopsError(
            f"the profile's draft is refused by the checks: {refused}; fix it (or tune another "
            "method with --methods) first"
        )
    resolved = resolved_loaded.profile
    backend = registry.backend(resolved.backend)
    engine = backend.engine_info(resolved, cfg.backend_version, probe=True)
    current = current_setting(resolved, _rendered_ngram_variant(resolved_loaded, registry, engine))
    choices = method_choices(loaded, resolved, registry, cfg.methods, offline=cfg.offline)
    if [c.method for c in choices] == [Method.NONE]:
        raise SpecopsError(
            f"{loaded.path} runs without speculation (method none): nothing to tune; compare "
            "methods with --methods fitting (or e.g. --methods ngram,none)"
        )
    _check_options(cfg, backend, choices, notes)
    types = cfg.ngram_types
    if types is None and backend.ngram_variants():
        types = list(backend.ngram_variants(engine))
    settings = plan_settings(
        current,
        choices,
        backend,
        k_values=cfg.k_values,
        ngram_pairs=cfg.ngram_pairs,
        ngram_types=types,
        ngram_default=(resolved.speculative.ngram.min, resolved.speculative.ngram.max),
    )
    curve = curve_for(resolved, getattr(engine, "version", None))
    settings = priced_settings(settings, current, curve, resolved.fallback.draft_cost_ratio, notes)
    levels = concurrency_levels(resolved, cfg.concurrency)
    prompts, workload = load_workload(cfg.workload, cfg.max_tokens)
    workload.update(requests_per_round=cfg.requests_per_round or "max(4, 2 x concurrency)", ignore_eos=cfg.ignore_eos)
    reference = []
    if Method.NONE in backend.methods and Setting(Method.NONE) not in settings:
        reference.append(Setting(Method.NONE))
        notes.append("none (no speculation) is measured last as the goodput surface's baseline; it is never written")
    idle = _idle_setting(current, choices, backend, engine, levels)
    if idle is not None:
        reference.append(idle)
        notes.append(
            f"{idle.label} (the draft loaded, drafting nothing) is measured last as what a per_batch_size range "
            "of k 0 yields; it is never written"
        )
    widen = not cfg.k_values and any(backend.k_applies(c.method) for c in choices)
    if widen:
        notes.append("k is widened past the grid while the best k is at its edge (the curve has not turned down)")
    return TunePlan(
        resolved, engine, current, choices, settings, levels, prompts, workload, notes, reference, widen, curve
    )


def priced_settings(
    settings: list[Setting], current: Setting, curve: VerifyCost | None, c: float | None, notes: list[str]
) -> list[Setting]:
    """``settings`` less the k that cannot pay on the measured verification cost even at full acceptance (the
    profile's current setting is kept: it is what the others are compared with); a note says which cost applied."""
    c = DEFAULT_DRAFT_COST if c is None else c
    ks = [s.k for s in settings if s.k]
    if curve is None or not ks:
        notes.append(f"verification cost: {cost_basis(curve)}")
        return settings
    limit = max_paying_k(c, curve, max(ks))
    kept = [s for s in settings if not s.k or s.k <= limit or s == current]
    dropped = sorted({s.k for s in settings if s not in kept})
    notes.append(
        f"verification cost: {cost_basis(curve)}"
        + (
            f"; k {', '.join(map(str, dropped))} not measured: above k = {limit} a step costs more than every "
            f"draft token accepted would give (c = {c:g})"
            if dropped
            else ""
        )
    )
    return kept


def _idle_setting(current: Setting, choices: list[MethodChoice], backend, engine, levels) -> Setting | None:
    """The speculative method at k 0 (:attr:`Setting.idle`) where the engine takes a k per batch size and the
    surface has two levels or more: what a schedule's k 0 range costs is measured, not assumed to be ``none``'s
    (vLLM still runs the draft's forward pass at k 0)."""
    if len(levels) < 2 or not backend.takes_per_batch_size(getattr(engine, "version", None)):
        return None
    for c in sorted(choices, key=lambda c: c.method is not current.method):
        if c.method is not Method.NONE and backend.k_applies(c.method):
            return Setting(c.method, 0, draft=c.draft)
    return None


def _check_options(cfg: TuneConfig, backend, choices: list[MethodChoice], notes: list[str]) -> None:
    """Options that do not apply: --k without a method that takes k (a note), --ngram pairs where n-gram
    drafters are picked by name (refused)."""
    if cfg.k_values and not any(backend.k_applies(c.method) for c in choices):
        notes.append(f"--k is ignored: {', '.join(c.method.value for c in choices)} on {backend.name} take no k")
    if cfg.ngram_pairs and backend.ngram_variants():
        raise SpecopsError(
            "--ngram (min:max) is vLLM's prompt_lookup_min/max; llama-server's n-gram drafters "
            "are swept by type (--ngram-types)"
        )


def _rendered_ngram_variant(loaded, registry, engine) -> str | None:
    """The n-gram drafter the engine runs for the profile as it is (the default of this build, when the
    profile names none); None unless the profile runs n-gram on an engine that picks drafters by name."""
    backend = registry.backend(loaded.profile.backend)
    if loaded.profile.speculative.method is not Method.NGRAM or not backend.ngram_variants():
        return None
    from specops.backends.render import render_plan

    return backend.ngram_variant_of(render_plan(loaded, registry, engine=engine))


async def run_sweep(
    loaded, registry, plan: TunePlan, cfg: TuneConfig, *, on_event: Event | None = None, log_path: Path | None = None
) -> TuneResult:
    """Measure ``plan`` on the real engine."""
    rpr = (lambda c: cfg.requests_per_round) if cfg.requests_per_round else default_requests_per_round
    driver = EngineDriver(
        loaded,
        plan.resolved,
        registry,
        plan.engine,
        plan.prompts,
        requests_per_round=rpr,
        offline=cfg.offline,
        log_path=log_path,
        ready_timeout=cfg.ready_timeout,
        extra_body={"ignore_eos": True} if cfg.ignore_eos else None,
        workload=plan.workload,
    )
    opts = TuneOptions(
        budget_s=cfg.budget_s,
        levels=plan.levels,
        min_rounds=cfg.min_rounds,
        max_rounds=cfg.max_rounds,
        margin=cfg.margin,
        prune=cfg.prune,
        widen=plan.widen,
    )
    return await Tuner(
        plan.settings, driver, opts, current=plan.current, on_event=on_event, reference=plan.reference
    ).run()


# ---------------------------------------------------------------------------------------------------
# which methods, which concurrency levels


def method_choices(loaded, resolved, registry, methods: str | None, *, offline: bool = False) -> list[MethodChoice]:
    """The methods to sweep: the profile's (default); ``chain``: it and its fallback chain; ``fitting``: those
    the resolver finds fitting (checked drafts, plus n-gram and none); or a comma list of method names
    (drafts from the profile, its chain, or the resolver)."""
    backend = registry.backend(resolved.backend)
    spec = resolved.speculative
    primary = MethodChoice(spec.method, spec.draft if spec.method in NEEDS_DRAFT else None)
    if not methods:
        return [primary]
    if methods.strip() == "chain":
        return [primary] + [
            MethodChoice(st.method, st.draft)
            for st in resolved.chain
            if st.method in backend.methods and st.method is not spec.method
        ]
    if methods.strip() in ("fitting", "auto"):
        return _fitting_choices(primary, resolved, backend, offline)
    return _named_choices(methods, resolved, backend, offline)


def _fitting_choices(primary: MethodChoice, resolved, backend, offline: bool) -> list[MethodChoice]:
    out = [primary]
    for c in _fitting_candidates(resolved, offline):
        if c.method not in {x.method for x in out} and c.method in backend.methods:
            out.append(MethodChoice(c.method, c.draft))
    for m in (Method.NGRAM, Method.NONE):
        if m in backend.methods and m not in {x.method for x in out}:
            out.append(MethodChoice(m))
    return out


def _named_choices(methods: str, resolved, backend, offline: bool) -> list[MethodChoice]:
    """``--methods a,b``: each method (that the backend runs) with its draft; the profile's method first."""
    spec = resolved.speculative
    chain = {st.method: st for st in resolved.chain}
    out = []
    for name in filter(None, (x.strip() for x in methods.split(","))):
        try:
            m = Method(name)
        except ValueError:
            raise SpecopsError(
                f"--methods: unknown method {name!r} (one of {', '.join(x.value for x in Method)}, "
                "or `chain`, or `fitting`)"
            ) from None
        if m is Method.AUTO or m not in backend.methods:
            raise SpecopsError(
                f"--methods: backend {resolved.backend} cannot run {name} (it runs "
                f"{', '.join(sorted(x.value for x in backend.methods))})"
            )
        draft = None
        if m in NEEDS_DRAFT:
            if m is spec.method and spec.draft:
                draft = spec.draft
            elif m in chain and chain[m].draft:
                draft = chain[m].draft
            else:
                draft = _resolved_draft(resolved, m, offline)
        out.append(MethodChoice(m, draft))
    out.sort(key=lambda c: c.method is not spec.method)
    return list(dict.fromkeys(out))


def _fitting_candidates(profile, offline: bool):
    from specops.resolve import resolve

    prof = profile.model_copy(
        update={
            "speculative": profile.speculative.model_copy(
                update={"method": Method.AUTO, "draft": None, "draft_revision": None, "draft_file": None}
            )
        }
    )
    res = resolve(prof, offline=offline)
    return [c for c in res.candidates if c.verdict in ("ok", "warning")]


def _resolved_draft(profile, method: Method, offline: bool) -> str:
    from specops.resolve import resolve

    prof = profile.model_copy(
        update={
            "speculative": profile.speculative.model_copy(
                update={"method": method, "draft": "auto", "draft_revision": None, "draft_file": None}
            )
        }
    )
    res = resolve(prof, offline=offline)
    if res.choice is None or not res.choice.draft:
        why = "; ".join(f.message for f in res.errors) or "no candidate passed the checks"
        raise SpecopsError(f"--methods: no draft for {method} ({why}); add it to the fallback chain with its draft")
    return res.choice.draft


def concurrency_levels(profile, text: str | None) -> tuple[int, ...]:
    """The levels to measure, the one the choice is made for first: ``server.parallel`` (what the profile
    declares it serves), then 1; or the ``--concurrency`` list as given (its first is the choice's)."""
    if text:
        vals = []
        for part in filter(None, (x.strip() for x in text.split(","))):
            if not part.isdigit() or int(part) < 1:
                raise SpecopsError(f"--concurrency: {part!r} is not an integer >= 1")
            vals.append(int(part))
        if not vals:
            raise SpecopsError("--concurrency: no levels")
        return tuple(dict.fromkeys(vals))
    p = profile.server.parallel or 1
    return (p, 1) if p > 1 else (1,)
