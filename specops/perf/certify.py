"""``specops certify``: prove on the real engine that a profile's speculation is lossless, and measure what it buys.

The profile's engine is launched twice (:func:`specops.perf.launch.launched`): as the profile says, and with
the chain's ``none`` (speculation off). Each launch answers three passes over the same prompts (built-in
sets, :mod:`specops.perf.workload`, or the user's JSONL):

1. **greedy, one at a time** (temperature 0, ``logprobs``): the outputs of the two launches are compared
   token by token (token ids where the engine returns them); the first divergence is reported with both
   continuations and, from the baseline's top log-probabilities, the *margin* there (how much more likely
   the baseline's token was than the speculative one, in nats). ``tolerance`` > 0 accepts a divergence
   whose margin is at most that: a near tie that batch-verify numerics (another kernel, another reduction
   order in bf16/fp16) can legitimately flip. Anything else is a lossless failure. The engine's counters
   around each set give the greedy acceptance.
2. **each set as written, concurrency 1**: tokens/s with and without speculation; acceptance per draft
   position, acceptance rate and mean acceptance length per set from the engine's counters (the same
   series ``specops up`` watches), and, where the engine reports them per response (llama-server's
   ``timings``), the drafted/accepted totals of the responses, which must agree with the counters.
3. **each set as written, at the profile's concurrency** (``server.parallel``; skipped when that is 1).

Requests go to ``/v1/chat/completions`` with the prompt as one user message when the model has a chat
template (so the engine applies it, as for real clients), else to ``/v1/completions`` with the raw prompt,
and the report says which and why. The tiny test models have no template.

The report is the certificate (:mod:`specops.perf.certify_file`): identity + figures + verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops import __version__
from specops.config.profile import LoadedProfile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.perf.certify_compare import (  # noqa: F401 - re-exported: one answer and its comparison
    Generation,
    _parse_logprobs,
    compare_outputs,
    lossless_summary,
)
from specops.perf.certify_report import plot_certificate, summary_text  # noqa: F401 - re-exported
from specops.perf.workload import BUILTIN_SETS, DEFAULT_TIMEOUT, Prompt, RequestResult, WorkloadResult

SPEC, BASE = "spec", "none"
ENDPOINTS = ("auto", "chat", "completions")
#: Top log-probabilities asked for in the greedy pass (for the margin at a divergence).
TOP_LOGPROBS = 5

Say = Callable[[str], None]


@dataclass
class CertifyConfig:
    """What to run. ``prompts_per_set`` keeps the first n prompts of each set; ``max_tokens`` overrides."""

    prompt_sets: list[str] = field(default_factory=lambda: list(BUILTIN_SETS))
    prompts_per_set: int | None = None
    max_tokens: int | None = None
    concurrency: int | None = None  # default: server.parallel, else 1
    endpoint: str = "auto"
    tolerance: float = 0.0
    step_index: int = 0
    warmup: int = 1
    rounds: int = 1  # the c=1 and c=N passes are repeated this many times; tokens/s are medians
    both_at_once: bool = False  # start both engines together (memory for two; start-ups overlap)
    backend_version: str | None = None
    ready_timeout: float | None = None
    log_dir: Path | None = None
    timeout: float = DEFAULT_TIMEOUT

    def check(self) -> None:
        if not self.prompt_sets:
            raise SpecopsError("no prompt sets to run")
        if self.prompts_per_set is not None and self.prompts_per_set < 1:
            raise SpecopsError("--prompts-per-set must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SpecopsError("--max-tokens must be >= 1")
        if self.rounds < 1:
            raise SpecopsError("--rounds must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise SpecopsError("--concurrency must be >= 1")
        if self.endpoint not in ENDPOINTS:
            raise SpecopsError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if not self.tolerance >= 0:
            raise SpecopsError("--tolerance must be >= 0 (nats)")


def load_sets(names: list[str], per_set: int | None = None, max_tokens: int | None = None) -> dict[str, list[Prompt]]:
    """Prompt sets by name or JSONL path, keyed by set name, cut to ``per_set`` prompts each."""
    from specops.perf.bench import load_sets as bench_sets

    sets = bench_sets(names, max_tokens)
    return {k: v[:per_set] if per_set else v for k, v in sets.items()}


_CHAT_TURN = re.compile(r"^\s*User:\s*(.*?)\s*\n\s*Assistant:\s*$", re.S)


def messages_for(text: str) -> list[dict]:
    """A prompt as chat messages: ``User: …\\nAssistant:`` becomes the user's turn; anything else is sent
    whole as one user message (the engine's chat template adds the roles)."""
    m = _CHAT_TURN.match(text)
    return [{"role": "user", "content": m.group(1) if m else text}]


# ---------------------------------------------------------------------------------------------------
# one request


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server specops did not launch (a deployment, a reference instance)."""

    base_url: str
    model_name: str
    api_key: str | None = None

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def auth_headers(eng) -> dict[str, str]:
    """The headers that authenticate to ``eng``: a launched engine (its plan) or an :class:`Endpoint`."""
    plan = getattr(eng, "plan", None)
    return plan.auth_headers if plan is not None else eng.auth_headers


async def generate(
    session,
    eng,
    prompt: Prompt,
    *,
    chat: bool,
    temperature: float | None = None,
    logprobs: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> Generation:
    """One non-streamed request to ``eng`` (a launched engine or an :class:`Endpoint`); failures are recorded,
    never raised."""
    import aiohttp

    from specops.perf.workload import _take_final

    temp = prompt.temperature if temperature is None else temperature
    body: dict[str, Any] = {"model": eng.model_name, "max_tokens": prompt.max_tokens, "temperature": temp}
    if chat:
        body["messages"] = messages_for(prompt.text)
        if logprobs:
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS, return_token_ids=True)
    else:
        body["prompt"] = prompt.text
        if logprobs:
            body.update(logprobs=TOP_LOGPROBS, return_token_ids=True)
    url = eng.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Content-Type": "application/json", **auth_headers(eng)}
    start = time.monotonic()
    res = RequestResult(set=prompt.set, ok=False, start=start, end=start)
    gen = Generation(res)
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300].strip()}"
            else:
                data = await resp.json(content_type=None)
                choice = (data.get("choices") or [{}])[0]
                gen.text = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
                res.finish_reason = choice.get("finish_reason")
                _take_final(data, res)
                _parse_logprobs(choice, gen)
                res.chunks, res.ok = 1, True
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g}s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.end = time.monotonic()
    res.ttft = res.end - start if res.ok else None
    if res.ok and not res.usage_reported:
        res.output_tokens = len(gen.tokens)
    return gen


async def generate_all(
    eng,
    prompts: list[Prompt],
    *,
    concurrency: int,
    chat: bool,
    temperature: float | None = None,
    logprobs: bool = False,
    requests: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[list[Generation], WorkloadResult]:
    """``requests`` requests (default: each prompt once; cycling) from ``concurrency`` clients, in order."""
    import aiohttp

    n = requests or len(prompts)
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 2, force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def one(i: int) -> Generation:
            async with gate:
                p = prompts[i % len(prompts)]
                return await generate(
                    session, eng, p, chat=chat, temperature=temperature, logprobs=logprobs, timeout=timeout
                )

        gens = await asyncio.gather(*(one(i) for i in range(n)))
    results = [g.result for g in gens]
    wall = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    return list(gens), WorkloadResult(concurrency, results, wall)


# ---------------------------------------------------------------------------------------------------
# acceptance


def acceptance_figures(before, after) -> dict | None:
    """Acceptance between two counter reads: rate, mean acceptance length, per position (rate and raw
    counts); None when the engine has no spec-decode series (speculation is off)."""
    from specops.perf.launch import acceptance_between

    stats = acceptance_between(before, after)
    if after is None:
        return None
    raw = None
    if after.per_position:
        prev = before.per_position if before is not None else ()
        raw = [after.per_position[i] - (prev[i] if i < len(prev) else 0.0) for i in range(len(after.per_position))]
    return {
        "status": getattr(stats.status, "value", stats.status),
        "acceptance": stats.acceptance,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "per_position": list(stats.per_position),
        "per_position_accepted": raw,
        "drafts": stats.drafts,
        "draft_tokens": stats.draft_tokens,
        "accepted": stats.accepted,
        "source": stats.source,
    }


# ---------------------------------------------------------------------------------------------------
# the run


async def run_certify(loaded: LoadedProfile, registry, cfg: CertifyConfig, *, say: Say = lambda m: None) -> dict:
    """Launch, measure, compare; return the certificate (a JSON-ready dict)."""
    from specops.perf.bench import machine
    from specops.perf.certify_file import CERT_VERSION, identity
    from specops.perf.launch import profile_for_step, without_speculation

    cfg.check()
    started = time.time()
    spec = profile_for_step(loaded.profile, cfg.step_index)
    if spec.speculative.method is Method.NONE:
        raise SpecopsError(
            f"{loaded.path}: step {cfg.step_index} runs without speculation (method none): nothing to certify"
        )
    backend = registry.backend(spec.backend)
    engine = backend.engine_info(spec, cfg.backend_version, probe=True)
    ident = identity(LoadedProfile(spec, loaded.document, loaded.path), backend, engine.version)
    chat, endpoint_note = _endpoint(cfg.endpoint, ident)
    say(endpoint_note)
    sets = load_sets(cfg.prompt_sets, cfg.prompts_per_set, cfg.max_tokens)
    level = cfg.concurrency or spec.server.parallel or 1
    profiles = {SPEC: spec, BASE: without_speculation(spec)}
    launches: list[dict] = []
    drafts: dict = {}  # the speculating launch's draft length, as its engine runs it

    def launch(mode: str):
        from specops.perf.launch import launched

        prof = profiles[mode]
        what = f"{prof.speculative.method}" if mode == SPEC else "no speculation (none)"
        say(f"launching {prof.backend} {engine.version} with {what}")
        log_path = (cfg.log_dir / f"engine-{mode}.log") if cfg.log_dir else None
        return launched(
            loaded, registry, profile=prof, engine=engine, ready_timeout=cfg.ready_timeout, log_path=log_path, say=say
        )

    def ready(mode: str, eng) -> None:
        say(f"{mode}: ready in {eng.ready_s:.1f}s on {eng.base_url}")
        port = str(eng.plan.port)  # a free port each run: not part of what is certified (quiet git diffs)
        argv = ["<port>" if a == port else eng.plan.redact(a) for a in eng.plan.argv]
        launches.append({"mode": mode, "ready_s": round(eng.ready_s, 2), "argv": argv})
        if mode == SPEC and eng.plan.draft_length is not None:
            drafts.update(eng.plan.draft_length.to_dict())
            say(f"{mode}: drafts {eng.plan.draft_length.describe()}")

    fitted: dict[str, Any] = {}

    async def fit(engines) -> None:
        """The sets fitted once, to the first launch (or both at once): both modes get the same prompts."""
        nonlocal sets
        if fitted:
            return
        from specops.perf.workload import fit_workload

        fit = await fit_workload(engines, sets, fallback_context=spec.model.max_model_len)
        sets = fit.sets
        fitted.update(context_per_request=fit.context, counted_by=fit.counted_by, notes=fit.notes)
        for note in fit.notes:
            say(note)

    runs: dict[str, dict] = {}
    if cfg.both_at_once:
        async with _both(launch, ready) as engines:
            await fit([engines[SPEC], engines[BASE]])
            for mode in (SPEC, BASE):
                runs[mode] = await _passes(engines[mode], sets, level, chat, cfg, say)
    else:
        for mode in (SPEC, BASE):
            async with launch(mode) as eng:
                ready(mode, eng)
                await fit([eng])
                runs[mode] = await _passes(eng, sets, level, chat, cfg, say)
    launches.sort(key=lambda x: x["mode"] != SPEC)
    report = {
        "certificate_version": CERT_VERSION,
        "generated_by": f"specops {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "profile": Path(loaded.path).name,
        "identity": ident,
        "engine": {"backend": engine.backend, "version": engine.version, "source": engine.source},
        "launches": launches,
        "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
        "endpoint_note": endpoint_note,
        "settings": {
            "prompt_sets": list(sets),
            "prompts": {k: len(v) for k, v in sets.items()},
            "prompts_per_set": cfg.prompts_per_set,
            "max_tokens": cfg.max_tokens,
            "concurrency": sorted({1, level}),
            "rounds": cfg.rounds,
            "tolerance_nats": cfg.tolerance,
            "step": cfg.step_index,
            "method": spec.speculative.method.value,
            "k": spec.speculative.k if backend.k_applies(spec.speculative.method) else None,
            "draft_length": drafts or None,
            "min_acceptance": spec.fallback.min_acceptance,
            "fitted": fitted,
        },
        "machine": machine(),
    }
    report.update(summarize(runs, sets, level, cfg.tolerance, spec.fallback.min_acceptance))
    report["seconds"] = round(time.time() - started, 1)
    return report


@contextlib.asynccontextmanager
async def _both(launch, ready):
    """Both engines started at once (their start-ups overlap), each stopped on exit whatever happens; the
    measurements still run one engine at a time. A failed start cancels the other one's."""
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, Any] = {}

        async def start(mode: str) -> None:
            engines[mode] = await stack.enter_async_context(launch(mode))
            ready(mode, engines[mode])

        tasks = [asyncio.ensure_future(start(mode)) for mode in (SPEC, BASE)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:  # a failed start (or our own cancellation) stops the other start-up too
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
        if failed:
            raise next((e for e in failed if isinstance(e, SpecopsError)), failed[0])
        yield engines


def _endpoint(choice: str, ident: dict) -> tuple[bool, str]:
    has = ident.get("chat_template_sha256") is not None
    src = ident.get("chat_template_source")
    if choice == "chat":
        return True, (
            "requests go to /v1/chat/completions (--endpoint chat)"
            + (
                ""
                if has
                else f"; the model has no chat template ({src}): the engine's default template, if any, applies"
            )
        )
    if choice == "completions":
        return (
            False,
            "requests go to /v1/completions with raw prompts (--endpoint completions): no chat template applied",
        )
    if has:
        return (
            True,
            f"the model has a chat template ({src}): requests go to /v1/chat/completions, the engine applies it",
        )
    return False, f"the model has no chat template ({src}): raw prompts go to /v1/completions"


async def _passes(eng, sets: dict[str, list[Prompt]], level: int, chat: bool, cfg: CertifyConfig, say: Say) -> dict:
    """The three passes on one launched engine: greedy outputs, c=1 and c=level figures per set."""
    if cfg.warmup:
        first = [ps[0] for ps in sets.values()][: max(1, cfg.warmup)]
        gens, _ = await generate_all(eng, [Prompt(p.text, 8, 0.0, p.set) for p in first], concurrency=1, chat=chat)
        bad = [g for g in gens if not g.result.ok]
        if bad:
            raise SpecopsError(f"warm-up request to {eng.base_url} failed: {bad[0].result.error}")
    out: dict[str, Any] = {"greedy": {}, "by_level": {}}
    for set_name, prompts in sets.items():
        before = await eng.settled_counters()
        gens, res = await generate_all(
            eng, prompts, concurrency=1, chat=chat, temperature=0.0, logprobs=True, timeout=cfg.timeout
        )
        out["greedy"][set_name] = {
            "generations": gens,
            "workload": res,
            "acceptance": acceptance_figures(before, await eng.settled_counters()),
        }
    say(f"greedy pass done ({sum(len(p) for p in sets.values())} requests)")
    for lvl in sorted({1, level}):
        per_set = {}
        for set_name, prompts in sets.items():
            before = await eng.settled_counters()
            rounds = []
            for _ in range(cfg.rounds):
                _gens, res = await generate_all(
                    eng, prompts, concurrency=lvl, chat=chat, requests=max(len(prompts), lvl), timeout=cfg.timeout
                )
                rounds.append(res)
            per_set[set_name] = {
                "workloads": rounds,
                "acceptance": acceptance_figures(before, await eng.settled_counters()),
            }
        out["by_level"][lvl] = per_set
        say(f"concurrency {lvl} pass done")
    if not eng.process.running:
        raise SpecopsError(f"the engine {eng.process.exit.describe()} during the measurement")
    return out


def _tps(results: list[WorkloadResult]) -> float | None:
    tokens = sum(r.output_tokens for r in results)
    wall = sum(r.wall_s for r in results)
    return tokens / wall if wall > 0 else None


def _median_tps(rounds: list[list[WorkloadResult]]) -> float | None:
    """The median over rounds of each round's tokens/s (its output tokens over its wall time)."""
    from specops.perf.stats import median

    values = [v for v in (_tps(r) for r in rounds) if v is not None]
    return median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: dict, sets: dict[str, list[Prompt]], level: int, tolerance: float, min_acceptance: float) -> dict:
    """The figures and the verdict from both launches' passes."""
    comparisons = []
    for set_name in sets:
        for s, b in zip(
            runs[SPEC]["greedy"][set_name]["generations"], runs[BASE]["greedy"][set_name]["generations"], strict=True
        ):
            comparisons.append(compare_outputs(s, b, tolerance))
    lossless = lossless_summary(comparisons, tolerance)

    set_rows: dict[str, dict] = {}
    for set_name, prompts in sets.items():
        c1 = runs[SPEC]["by_level"][1][set_name]
        temps = sorted({p.temperature for p in prompts})
        row: dict[str, Any] = {"prompts": len(prompts), "temperature": temps[0] if len(temps) == 1 else temps}
        row.update(c1["acceptance"] or {"status": "spec-off"})
        all_c1 = WorkloadResult(1, [r for w in c1["workloads"] for r in w.requests], 0.0)
        row["response_draft_tokens"], row["response_accepted"] = all_c1.draft_tokens, all_c1.accepted
        greedy = runs[SPEC]["greedy"][set_name]["acceptance"] or {}
        row["greedy"] = {
            k: greedy.get(k)
            for k in ("acceptance", "mean_acceptance_length", "per_position", "draft_tokens", "accepted", "drafts")
        }
        row["speedup"] = {}
        for lvl in sorted({1, level}):
            spec_w = runs[SPEC]["by_level"][lvl][set_name]["workloads"]
            base_w = runs[BASE]["by_level"][lvl][set_name]["workloads"]
            on, off = _median_tps([[w] for w in spec_w]), _median_tps([[w] for w in base_w])
            row["speedup"][str(lvl)] = {
                "spec_tokens_per_s": on,
                "base_tokens_per_s": off,
                "speedup": _ratio(on, off),
                "spec_output_tokens": sum(w.output_tokens for w in spec_w),
                "base_output_tokens": sum(w.output_tokens for w in base_w),
            }
        set_rows[set_name] = row

    throughput = {}
    errors = 0
    for lvl in sorted({1, level}):
        by_round = {}
        for mode in (SPEC, BASE):
            per_set = [runs[mode]["by_level"][lvl][s]["workloads"] for s in sets]
            by_round[mode] = [list(r) for r in zip(*per_set, strict=True)]  # round i: every set's workload
            errors += sum(len(w.errors) for r in by_round[mode] for w in r)
        a, b = _median_tps(by_round[SPEC]), _median_tps(by_round[BASE])
        throughput[str(lvl)] = {"spec_tokens_per_s": a, "base_tokens_per_s": b, "speedup": _ratio(a, b)}
    return {
        "lossless": lossless,
        "sets": set_rows,
        "throughput": throughput,
        "errors": errors,
        "verdict": verdict(lossless, set_rows, throughput, min_acceptance, errors),
    }


def verdict(lossless: dict, sets: dict, throughput: dict, min_acceptance: float, errors: int = 0) -> dict:
    """certified = lossless (exactly or within the stated tolerance), the engine really speculated, and the
    draft fits the target: its greedy acceptance over every set is at least ``fallback.min_acceptance``
    (sampled sets legitimately accept less, so their acceptance is a finding, not a refusal).

    Findings that do not refuse the certificate but that a person must read: a set whose acceptance is
    below the profile's ``fallback.min_acceptance``, a concurrency where speculation is slower, failed
    requests.
    """
    findings = []
    drafted = sum((r.get("draft_tokens") or 0) for r in sets.values())
    speculating = drafted > 0
    g_drafted = sum((r["greedy"].get("draft_tokens") or 0) for r in sets.values())
    g_accepted = sum((r["greedy"].get("accepted") or 0) for r in sets.values())
    greedy_acceptance = g_accepted / g_drafted if g_drafted else None
    draft_fits = greedy_acceptance is not None and greedy_acceptance >= min_acceptance
    if not lossless["lossless"]:
        d = next((x for x in lossless["divergences"] if x["status"] != "tolerated"), None)
        if d is not None and d["status"] == "diverged":
            findings.append(
                f"NOT LOSSLESS: {lossless['diverged']} of {lossless['requests']} greedy requests differ; first in "
                f"{d['set']} at {d['unit']} {d['position']}: speculation {d['spec_token']!r} vs none {d['base_token']!r}"
                + (f" (margin {d['margin']:.4g} nats)" if d.get("margin") is not None else "")
            )
        else:
            first = next((x.get("error") for x in lossless["divergences"] if x["status"] == "failed"), None)
            findings.append(
                f"losslessness not established: {lossless['failed']} greedy requests failed"
                + (f" (first: {str(first)[:160]})" if first else "")
            )
    if not speculating:
        findings.append("the engine drafted no tokens: it ran without speculation (its counters did not move)")
    elif not draft_fits:
        findings.append(
            f"the draft does not fit the target: greedy acceptance {greedy_acceptance or 0:.3f} over every set "
            f"< fallback.min_acceptance {min_acceptance:g} (a wrong draft, tokenizer or sampling set-up?)"
        )
    for name, r in sets.items():
        acc = r.get("acceptance")
        if acc is not None and acc < min_acceptance:
            findings.append(
                f"{name}: acceptance {acc:.3f} < fallback.min_acceptance {min_acceptance:g} "
                f"(mean acceptance length {r.get('mean_acceptance_length') or 0:.2f}): speculation costs more than it gains here"
            )
    for lvl, t in throughput.items():
        if t["speedup"] is not None and t["speedup"] < 1:
            findings.append(f"concurrency {lvl}: speculation is slower ({t['speedup']:.2f}x the tokens/s of none)")
    if errors:
        findings.append(f"{errors} measurement requests failed")
    return {
        "certified": lossless["lossless"] and speculating and draft_fits,
        "lossless": lossless["lossless"],
        "speculating": speculating,
        "greedy_acceptance": greedy_acceptance,
        "draft_fits": draft_fits,
        "findings": findings,
    }


def run_certify_blocking(loaded: LoadedProfile, registry, cfg: CertifyConfig, **kw) -> dict:
    return asyncio.run(run_certify(loaded, registry, cfg, **kw))
