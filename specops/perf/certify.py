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
from specops.perf.workload import BUILTIN_SETS, DEFAULT_TIMEOUT, Prompt, RequestResult, WorkloadResult

SPEC, BASE = "spec", "none"
ENDPOINTS = ("auto", "chat", "completions")
#: Top log-probabilities asked for in the greedy pass (for the margin at a divergence).
TOP_LOGPROBS = 5
#: Divergences kept in the certificate (all are counted).
KEEP_DIVERGENCES = 5
#: Tokens of each continuation shown after a divergence.
SHOW_TOKENS = 12

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


@dataclass
class Generation:
    """One request's answer: timing and counts (as a workload result), the text and the tokens."""

    result: RequestResult
    text: str = ""
    tokens: list = field(default_factory=list)  # token ids where the engine gives them, else token texts
    texts: list[str] = field(default_factory=list)  # token texts (for showing a divergence)
    top: list[dict] = field(default_factory=list)  # per position: token (id or text) -> logprob
    by_id: bool = False


def _parse_logprobs(choice: dict, gen: Generation) -> None:
    """Tokens and top log-probabilities from either shape engines answer in.

    ``logprobs.content`` (chat, and llama-server's completions): a list of ``{id?, token, logprob,
    top_logprobs: [{id?, token, logprob}]}``; the legacy completions shape (vLLM): ``{tokens, token_logprobs,
    top_logprobs: [{token: logprob}]}``; ``token_ids`` on the choice (vLLM ``return_token_ids``).
    """
    lp = choice.get("logprobs")
    ids = choice.get("token_ids")
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):
        content = [c for c in lp["content"] if isinstance(c, dict)]
        gen.texts = [str(c.get("token", "")) for c in content]
        if content and all(isinstance(c.get("id"), int) for c in content):
            gen.tokens, gen.by_id = [c["id"] for c in content], True
        else:
            gen.tokens = list(gen.texts)
        for c in content:
            top = {}
            for t in c.get("top_logprobs") or ():
                key = t.get("id") if gen.by_id and isinstance(t.get("id"), int) else t.get("token")
                if key is not None and isinstance(t.get("logprob"), (int, float)):
                    top[key] = float(t["logprob"])
            gen.top.append(top)
    elif isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        gen.texts = [str(t) for t in lp["tokens"]]
        gen.tokens = list(gen.texts)
        gen.top = [
            {k: float(v) for k, v in (d or {}).items() if isinstance(v, (int, float))}
            for d in lp.get("top_logprobs") or []
        ]
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        if not gen.by_id:  # ids are better keys for the comparison; top log-probs stay keyed by text
            gen.tokens, gen.by_id = list(ids), True
            gen.top = [{("text", k): v for k, v in d.items()} for d in gen.top]


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
# losslessness


def compare_outputs(spec: Generation, base: Generation, tolerance: float = 0.0) -> dict:
    """Token-by-token comparison of the same greedy request with speculation (``spec``) and without (``base``).

    ``status``: ``identical``; ``tolerated`` (the first differing token was a near tie in the baseline:
    ``margin`` = logprob of the baseline's token − logprob of the speculative token ≤ ``tolerance``);
    ``diverged``; ``failed`` (a request failed). The comparison uses token ids when both sides have them,
    else token texts, else the text itself.
    """
    out: dict[str, Any] = {"set": base.result.set}
    if not (spec.result.ok and base.result.ok):
        out.update(status="failed", error=spec.result.error or base.result.error)
        return out
    if spec.by_id == base.by_id and spec.tokens and base.tokens:
        a, b, unit = spec.tokens, base.tokens, "token"
    else:
        a, b, unit = list(spec.text), list(base.text), "character"
    pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if pos is None and len(a) == len(b):
        out.update(status="identical", tokens=len(b), unit=unit)
        return out
    if pos is None:  # one is a prefix of the other: it stopped earlier
        pos = min(len(a), len(b))
    margin = _margin(spec, base, pos) if unit == "token" else None
    status = "tolerated" if margin is not None and margin <= tolerance and tolerance > 0 else "diverged"
    out.update(
        status=status,
        unit=unit,
        position=pos,
        tokens=len(b),
        margin=margin,
        spec_token=_shown(spec, pos, unit),
        base_token=_shown(base, pos, unit),
        common_prefix=_join(base, 0, pos, unit)[-80:],
        spec_continuation=_join(spec, pos, pos + SHOW_TOKENS, unit),
        base_continuation=_join(base, pos, pos + SHOW_TOKENS, unit),
        spec_finish=spec.result.finish_reason,
        base_finish=base.result.finish_reason,
    )
    return out


def _margin(spec: Generation, base: Generation, pos: int) -> float | None:
    """How much likelier the baseline's token was than the speculative one at ``pos`` (nats), from the
    baseline's top log-probabilities; None when either token is missing there (a clear divergence)."""
    if pos >= len(base.top) or pos >= len(spec.tokens) or pos >= len(base.tokens):
        return None
    top = base.top[pos]

    def key(gen: Generation) -> Any:
        if top and all(isinstance(k, tuple) for k in top):  # keyed by text while tokens are ids
            return ("text", gen.texts[pos] if pos < len(gen.texts) else None)
        return gen.tokens[pos]

    mine, theirs = top.get(key(base)), top.get(key(spec))
    if mine is None or theirs is None:
        return None
    return round(max(0.0, mine - theirs), 6)


def _shown(gen: Generation, pos: int, unit: str) -> str | None:
    if unit == "token":
        return gen.texts[pos] if pos < len(gen.texts) else None  # None: this side stopped here
    return gen.text[pos] if pos < len(gen.text) else None


def _join(gen: Generation, start: int, end: int, unit: str) -> str:
    if unit == "token" and gen.texts:
        return "".join(gen.texts[start:end])
    return gen.text[start:end]


def lossless_summary(comparisons: list[dict], tolerance: float) -> dict:
    """The losslessness verdict over every compared request."""
    counts = {s: sum(c["status"] == s for c in comparisons) for s in ("identical", "tolerated", "diverged", "failed")}
    if counts["diverged"] or counts["failed"]:
        verdict = "diverged" if counts["diverged"] else "incomplete"
    elif counts["tolerated"]:
        verdict = "within-tolerance"
    else:
        verdict = "exact"
    bad = [c for c in comparisons if c["status"] in ("diverged", "tolerated", "failed")]
    margins = [c["margin"] for c in comparisons if c.get("margin") is not None]
    return {
        "verdict": verdict,
        "lossless": verdict in ("exact", "within-tolerance"),
        "requests": len(comparisons),
        **counts,
        "tolerance_nats": tolerance,
        "largest_margin_nats": max(margins) if margins else None,
        "compared_by": sorted({c.get("unit") for c in comparisons if c.get("unit")}),
        "divergences": bad[:KEEP_DIVERGENCES],
    }


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

    def launch(mode: str):
        from specops.perf.launch import launched

        prof = profiles[mode]
        what = f"{prof.speculative.method} k={prof.speculative.k}" if mode == SPEC else "no speculation (none)"
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

    runs: dict[str, dict] = {}
    if cfg.both_at_once:
        async with _both(launch, ready) as engines:
            for mode in (SPEC, BASE):
                runs[mode] = await _passes(engines[mode], sets, level, chat, cfg, say)
    else:
        for mode in (SPEC, BASE):
            async with launch(mode) as eng:
                ready(mode, eng)
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
            "k": spec.speculative.k,
            "min_acceptance": spec.fallback.min_acceptance,
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


# ---------------------------------------------------------------------------------------------------
# output


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def summary_text(cert: dict) -> str:
    """What a person reads: identity, losslessness, acceptance per set and position, tokens/s, findings."""
    ident, eng, s, lo = cert["identity"], cert["engine"], cert["settings"], cert["lossless"]
    lines = [
        f"certificate for {cert['profile']}: {eng['backend']} {eng['version']}, {s['method']} k={s['k']}, "
        f"target {ident['target']} ({ident['target_revision'] or 'no revision'})"
        + (f", draft {ident['draft']} ({ident['draft_revision'] or 'no revision'})" if ident.get("draft") else ""),
        f"chat template: {cert['endpoint_note']}"
        + (f" [{ident['chat_template_sha256']}]" if ident.get("chat_template_sha256") else ""),
        "",
    ]
    tol = f" (tolerance {lo['tolerance_nats']:g} nats)" if lo["tolerance_nats"] else ""
    lines.append(
        f"lossless: {lo['verdict'].upper()}{tol}: {lo['identical']} identical, {lo['tolerated']} tolerated, "
        f"{lo['diverged']} diverged, {lo['failed']} failed of {lo['requests']} greedy requests "
        f"(compared by {', '.join(lo['compared_by']) or '-'})"
    )
    for d in lo["divergences"]:
        if d["status"] == "failed":
            lines.append(f"  {d['set']}: failed: {d.get('error')}")
            continue
        margin = (
            f", margin {d['margin']:.4g} nats"
            if d.get("margin") is not None
            else ", not in the baseline's top log-probs"
        )
        lines += [
            f"  {d['set']}: {d['status']} at {d['unit']} {d['position']}{margin}: after {d['common_prefix'][-40:]!r}",
            f"    with speculation: {d['spec_continuation']!r}",
            f"    without:          {d['base_continuation']!r}",
        ]
    levels = list(cert["throughput"])
    lines += [
        "",
        "| set | temp | acceptance | mean acc. length | per position | greedy acc. | "
        + " | ".join(f"c={lv} on/off tok/s" for lv in levels)
        + " |",
    ]
    lines.append("|---" * (6 + len(levels)) + "|")
    for name, r in cert["sets"].items():
        per = " ".join(f"{x:.2f}" for x in (r.get("per_position") or [])) or "-"
        cells = []
        for lv in levels:
            sp = r["speedup"][lv]
            cells.append(
                f"{_f(sp['spec_tokens_per_s'], '.1f')}/{_f(sp['base_tokens_per_s'], '.1f')} ({_f(sp['speedup'], '.2f')}x)"
            )
        temp = r["temperature"] if isinstance(r["temperature"], list) else f"{r['temperature']:g}"
        lines.append(
            f"| {name} | {temp} | {_f(r.get('acceptance'))} | {_f(r.get('mean_acceptance_length'), '.2f')} | {per} | "
            f"{_f(r['greedy'].get('acceptance'))} | " + " | ".join(cells) + " |"
        )
    tp = " · ".join(
        f"c={lv}: {_f(t['spec_tokens_per_s'], '.1f')} vs {_f(t['base_tokens_per_s'], '.1f')} tok/s ({_f(t['speedup'], '.2f')}x)"
        for lv, t in cert["throughput"].items()
    )
    lines += ["", f"tokens/s with vs without speculation: {tp}"]
    v = cert["verdict"]
    lines.append("")
    lines.append(
        f"CERTIFIED: lossless, speculating, greedy acceptance {v['greedy_acceptance']:.3f}"
        if v["certified"]
        else "NOT CERTIFIED"
    )
    lines += [f"  - {f}" for f in v["findings"]]
    return "\n".join(lines) + "\n"


def plot_certificate(cert: dict, out_dir: Path) -> list[Path]:
    """PNG: acceptance per draft position for each prompt set, with the fallback threshold. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in cert["sets"].items():
        per = r.get("per_position") or []
        if per:
            ax.plot(range(1, len(per) + 1), per, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted per draft")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance per position")
    ax.legend(fontsize=8)
    names = list(cert["sets"])
    levels = list(cert["throughput"])
    width = 0.8 / max(1, len(levels))
    for j, lv in enumerate(levels):
        vals = [cert["sets"][n]["speedup"][lv]["speedup"] or 0 for n in names]
        bx.bar([i + j * width for i in range(len(names))], vals, width, label=f"c={lv}")
    bx.axhline(1.0, color="#d62728", lw=1)
    bx.set_xticks([i + width * (len(levels) - 1) / 2 for i in range(len(names))], names)
    bx.set_ylabel("tokens/s on ÷ off")
    bx.set_title("speedup")
    bx.legend(fontsize=8)
    eng, s = cert["engine"], cert["settings"]
    fig.suptitle(
        f"{cert['profile']} · {eng['backend']} {eng['version']} · {s['method']} k={s['k']} · lossless: {cert['lossless']['verdict']}"
    )
    fig.tight_layout()
    path = out_dir / "certificate.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]
