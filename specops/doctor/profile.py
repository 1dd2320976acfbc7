"""``specops doctor`` for a profile: its validation, lock, resolution, render and memory fit."""

from __future__ import annotations

from specops.doctor.base import ERROR, OK, WARNING, Check, Context, one_line
from specops.errors import ProfileError, SpecopsError


def check_profile(ctx: Context) -> list[Check]:
    if ctx.profile_path is None:
        return []
    from specops.config.profile import load_profile

    try:
        ctx.loaded = load_profile(ctx.profile_path, registry=ctx.registry)
    except ProfileError as exc:
        problems = [str(p) for p in exc.problems]
        return [
            Check(
                "profile",
                ERROR,
                f"does not validate: {one_line(problems[0])}",
                "fix the field named above (`specops validate` lists every problem); "
                "the profile checks below are skipped",
                [one_line(p) for p in problems[1:8]],
            )
        ]
    except SpecopsError as exc:
        return [Check("profile", ERROR, f"cannot load: {one_line(str(exc))}", "the profile checks below are skipped")]
    p = ctx.loaded.profile
    layout = (
        "CPU only" if p.gpus.devices == [] else f"GPUs {p.gpus.devices}" if p.gpus.devices else "GPUs: engine default"
    )
    return [Check("profile", OK, f"{p.name}: {p.backend}, method {p.speculative.method.value}, {layout}")]


def check_lock(ctx: Context) -> list[Check]:
    if ctx.loaded is None:
        return []
    from specops.resolve.lock import lock_path, read_lock, stale_reason
    from specops.resolve.prelaunch import needs_resolution

    path = lock_path(ctx.loaded.path)
    needs = needs_resolution(ctx.loaded)
    if not path.is_file():
        if needs:
            return [
                Check(
                    "lock",
                    WARNING,
                    f"the profile has `auto` and no {path.name}: each `up` resolves afresh (and may pick another draft)",
                    f"`specops lock {ctx.loaded.path}` and commit {path.name}",
                )
            ]
        return [Check("lock", OK, "nothing to lock (no `auto` in the profile)")]
    try:
        lock = read_lock(path)
    except SpecopsError as exc:
        return [Check("lock", ERROR, one_line(str(exc)), f"`specops lock {ctx.loaded.path}` rewrites it")]
    stale = stale_reason(lock, ctx.loaded.profile)
    if stale:
        return [Check("lock", WARNING, f"{path.name} is stale: {one_line(stale)}", f"`specops lock {ctx.loaded.path}`")]
    return [Check("lock", OK, f"{path.name} is current")]


def check_resolve(ctx: Context) -> list[Check]:
    if ctx.loaded is None:
        return []
    from specops.config.profile import LoadedProfile
    from specops.resolve import resolve_profile

    offline = ctx.offline or not ctx.hub_ok
    res = resolve_profile(ctx.loaded, offline=offline, use_lock=True, raise_errors=False)
    ctx.resolution = res
    ctx.resolved = LoadedProfile(res.profile, ctx.loaded.document, ctx.loaded.path)
    spec = res.profile.speculative
    what = spec.method.value + (f" {spec.draft}" if spec.draft else "")
    out = []
    errors = [f for f in res.findings if f.severity == "error"]
    warnings = [f for f in res.findings if f.severity == "warning" and f.check != "memory"]
    how = " (offline: lock, HF cache and catalog only)" if offline else ""
    if errors:
        out.append(
            Check(
                "resolve",
                ERROR,
                f"{what}: {one_line(errors[0].message)}",
                "`up` would start the next method of the fallback chain (checks: enforce); "
                "`specops resolve` lists drafts that fit",
                [one_line(f.message) for f in errors[1:6]],
            )
        )
    else:
        out.append(Check("resolve", OK, f"{what}: the compatibility checks pass{how}"))
    for f in warnings[:6]:
        out.append(Check("resolve", WARNING, one_line(f.message), _field_fix(f.path)))
    return out


def _field_fix(path: tuple) -> str:
    return f"see {'.'.join(str(p) for p in path)} in the profile" if path else ""


def check_render(ctx: Context) -> list[Check]:
    if ctx.loaded is None:
        return []
    from specops.backends.render import render_plan

    loaded = ctx.resolved or ctx.loaded
    try:
        plan = render_plan(loaded, ctx.registry)
    except ProfileError as exc:
        return [Check("render", ERROR, one_line(str(exc.problems[0])), "fix the field named above")]
    except SpecopsError as exc:
        pinned = "" if loaded.profile.engine.version else " (or pin engine.version to render without an engine)"
        return [Check("render", ERROR, f"cannot render: {one_line(str(exc))}", "see the engine check above" + pinned)]
    ctx.engine_version = plan.engine_version
    return [
        Check(
            "render",
            OK,
            f"{plan.backend} {plan.engine_version}, method {plan.method.value}",
            details=[one_line(plan.shell(), 1000), *[one_line(n, 300) for n in plan.notes]],
        )
    ]


def check_fallback(ctx: Context) -> list[Check]:
    """Which rule decides the fallback, and why: on tokens/s where specops can know them (a goodput surface, the
    verification-cost curve stored for the engine version rendered above, this model and machine), else acceptance."""
    if ctx.loaded is None:
        return []
    from specops.perf.verifycost import decision_curve
    from specops.watch.rule import THRESHOLD, rule_for

    p = (ctx.resolved or ctx.loaded).profile
    if ctx.engine_version is None:
        rule = rule_for(p.fallback, None, "no engine version to match a stored verification-cost curve (see render)")
    else:
        rule = rule_for(p.fallback, decision_curve(p, ctx.engine_version))
    fix = ""
    if rule.mode == THRESHOLD and not rule.explicit:
        fix = f"`specops bench {ctx.loaded.path} --probe-verify` stores this machine's verification-cost curve"
    return [Check("fallback", OK, one_line(rule.line()), fix)]


def check_memory(ctx: Context) -> list[Check]:
    return _weights_fit(ctx) + _twins_fit(ctx)


def _twins_fit(ctx: Context) -> list[Check]:
    """With twins: the engines beside each other against this machine's GPUs (each engine's share of the smallest
    one the profile uses) or, for engines on CPU whose memory adds up, its available memory."""
    res = ctx.resolution
    if ctx.loaded is None or res is None or not res.profile.routing.twins:
        return []
    from specops.config.engines import splits_gpu_by_share
    from specops.resolve.check import resolved_twin_memory
    from specops.resolve.memory import available_memory

    p = res.profile
    budget, budget_from = None, ""
    gpus = {g["index"]: g for g in ctx.gpus or []}
    sizes = [gpus[d]["memory_mib"] * 1024 * 1024 for d in p.gpus.devices or [] if d in gpus]
    if sizes:
        budget, budget_from = min(sizes), f"the smallest GPU of gpus.devices: {min(sizes) / 1024**3:.0f} GiB"
    elif not p.gpus.devices and not splits_gpu_by_share(p.backend):
        budget, budget_from = available_memory(), "this machine's available memory (MemAvailable)"
    findings = resolved_twin_memory(res)  # against gpus.memory_gb, when set
    if budget is not None and not any(f.severity == "error" for f in findings):
        findings = resolved_twin_memory(res, budget=budget, budget_from=budget_from)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        from specops.k8s.pools import same_pod_replacement

        instead = same_pod_replacement(ctx.loaded)
        return [
            Check(
                "memory",
                ERROR,
                one_line(f.message, 600),
                f"see {'.'.join(str(x) for x in f.path)} in the profile",
                details=instead if i == 0 else [],  # once: every error is the same twin's
            )
            for i, f in enumerate(errors)
        ]
    return [Check("memory", OK, one_line(f.message, 600)) for f in findings]


def _weights_fit(ctx: Context) -> list[Check]:
    res = ctx.resolution
    if ctx.loaded is None or res is None:
        return []
    est = res.memory
    if est is None:
        from specops.resolve.memory import estimate

        target = getattr(res.target, "weights", None) if res.target is not None else None
        if target is None:
            return [Check("memory", OK, "no weight sizes known (offline without the HF cache, or a local model)")]
        est = estimate(res.profile, target, None, has_draft=False)
    if est.per_gpu_bytes is None:
        return [Check("memory", OK, "no weight sizes known (offline without the HF cache, or a local model)")]
    line = est.line()
    if res.profile.gpus.devices == []:
        line = "CPU run: " + line.replace(" per GPU", " in memory")
    if est.over_budget:
        return [
            Check(
                "memory",
                ERROR,
                f"{line}: over gpus.memory_gb before any KV cache",
                "more GPUs (TP), a smaller draft or a quantized model",
            )
        ]
    devices = res.profile.gpus.devices or []
    gpus = {g["index"]: g for g in ctx.gpus or []}
    sizes = [gpus[d]["memory_mib"] * 1024 * 1024 for d in devices if d in gpus]
    if sizes:
        util = res.profile.gpus.memory_utilization or 0.9
        room = min(sizes) * util
        if est.per_gpu_bytes > room:
            return [
                Check(
                    "memory",
                    ERROR,
                    f"{line}: more than {util:g} of the smallest GPU ({min(sizes) / 1024**3:.0f} GiB) before any KV cache",
                    "more GPUs (tensor_parallel_size), a smaller draft or a quantized model",
                )
            ]
        return [
            Check(
                "memory",
                OK,
                f"{line}; fits {util:g} × {min(sizes) / 1024**3:.0f} GiB with room for the KV cache"
                if est.per_gpu_bytes < 0.8 * room
                else f"{line}; tight: little room for the KV cache",
            )
        ]
    return [Check("memory", OK, line)]
