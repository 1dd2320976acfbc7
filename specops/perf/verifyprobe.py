"""The verification-cost probe: the steps an engine really takes, timed on the machine it runs on.

The speedup model (:mod:`specops.speedup`) needs c_verify(n): what one speculative step whose target pass covers
n = k + 1 tokens (k drafted) costs, in target decode steps, and c: what one draft step costs. A prompt pass is no
stand-in for the first: it computes the output layer for its last position only, verification for every drafted
one (on Gemma 3's 262,144 × 640 output layer that doubled a step's cost). So :func:`probe_profile` times the
steps the engine really takes:

- **a decode step** (t_step, measured): the target launched without speculation decodes a text, ``batch``
  requests at once; llama-server's ``timings.predicted_ms`` over its steps, vLLM's time between streamed chunks.
- **a speculative step of k drafts** (measured): the target relaunched with prompt-lookup drafts of exactly k
  tokens (llama-server: ngram-mod with ``--spec-ngram-mod-n-min`` = ``-n-max`` = k; vLLM: ngram with
  ``num_speculative_tokens`` k) decodes a prompt that repeats one sentence, so every step finds a draft and the
  target (greedy) accepts nearly all of it. A request's decode time and its steps come from the engine
  (llama-server: ``predicted_n - 1 - draft_n_accepted`` steps in ``predicted_ms``; vLLM: one streamed chunk a
  step); its drafts from ``draft_n`` (llama-server) or the spec-decode counters (vLLM). Steps without a draft are
  priced at t_step; c_verify(k + 1) = the rest per draft / t_step. It includes the lookup (what prompt-lookup
  drafting costs) and the sampling of every kept token, as the engine pays them.
- **batches**: both at one request and at the profile's ``server.parallel`` requests at once (what the engine
  batches at four clients); the model reads the curve of a cell's batch, interpolated between the two.
- **a step that found no draft** (measured): the target alone and the speculative engine (the prompt-lookup one
  of the size nearest the profile's k + 1) each decode a text
  without repeats, sampled at :data:`IDLE_TEMPERATURE`, so lookups find (almost) nothing; idle = the speculative
  engine's step over the target's on that text (its few drafting steps priced at its speculative step): what the
  engine's proposer and speculative bookkeeping cost on every step.
- **a draft model's cost** (measured from real steps, c inferred): the profile itself, drafting exactly its k
  tokens by its draft model, decodes the same prompt (the draft copies it too); c = (its step − prompt lookup's
  step at the same k, at the same batch) / (k · t_step): the draft's k steps, its catch-up pass over the kept
  tokens, and how the engine schedules them for a batch, as the engine pays them.

n = 1 is a plain decode step: exactly 1. On llama-server every n of :data:`SIZES` is probed (a launch takes
seconds); on vLLM (a launch takes a minute on 2 cores) n = 1 and the profile's own k + 1. With t_step in ms,
bench's model prices whole requests (:func:`specops.speedup.workload_speedup`): their prompt passes (the
baseline's time to first token; a draft model reads each prompt too, at its c) and their steps that found no
draft, beside the drafting steps.

The record is stored by :func:`specops.perf.verifycost.save_curve`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specops.errors import SpecopsError
from specops.methods import Method
from specops.perf import cpuload
from specops.perf.bench_flags import FlagThresholds
from specops.perf.verifycost import STEPS, CurveKey, draft_shape, drafts_by_model, model_identity, save_curve

#: Tokens per target pass probed, n = k + 1 (n = 1: a plain decode step).
SIZES = (1, 2, 4, 8, 16, 32, 64)
#: The probe's prompt: one sentence of this many tokens, repeated, so every step finds a draft to look up.
CYCLE_TOKENS = 32
CYCLE_REPEATS = 6
#: Tokens of the target's own greedy answer appended to it (see :func:`with_own_continuation`).
CONTINUATION_TOKENS = 64
#: Speculative steps a request makes (all drafts accepted); a plain decode makes DECODE_TOKENS steps.
STEPS_PER_REQUEST = 8
DECODE_TOKENS = 48
REPEATS = 3
#: Other processes' cores above which a probe is marked busy (the bench flags its cells at the same load).
BUSY_CORES = FlagThresholds().busy_cores
#: The probe's two ways to talk to an engine (a backend's ``verify_probe``).
LLAMA_SERVER, OPENAI = "llama-server", "openai"
#: A draftless step is timed on a text without repeats, sampled at this temperature, so lookups find (almost)
#: nothing: the speculative engine's step then costs its proposer and bookkeeping beside the decode step.
IDLE_TEMPERATURE = 1.0
#: Words the probe's text is made of (any text does: only token counts matter).
_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly boxed jam pots under "
    "bright harbour lamps and every sailor counted ropes beside old wooden crates of spice"
).split()


class _Http:
    """Plain JSON over loopback (no proxies), with the engine's API key when it has one."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        self.base, self.timeout = base_url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def open(self, path: str, body: dict):
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(), self.headers, method="POST")
        try:
            return self.opener.open(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise SpecopsError(f"{self.base}{path}: HTTP {exc.code} {exc.read(300).decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise SpecopsError(f"{self.base}{path}: {getattr(exc, 'reason', exc)}") from None

    def post(self, path: str, body: dict) -> dict:
        with self.open(path, body) as resp:
            try:
                return json.loads(resp.read())
            except ValueError:
                raise SpecopsError(f"{self.base}{path} did not answer JSON") from None


def _text(words: int) -> str:
    return " ".join(_WORDS[(i * 7 + i // len(_WORDS)) % len(_WORDS)] for i in range(words))


def cycle_prompt(http: _Http, protocol: str, model: str) -> list[int]:
    """The probe's prompt, by the engine's own tokenizer: one sentence of :data:`CYCLE_TOKENS` tokens, repeated."""
    return _tokenize(http, protocol, model, _text(CYCLE_TOKENS))[:CYCLE_TOKENS] * CYCLE_REPEATS


def _tokenize(http: _Http, protocol: str, model: str, text: str) -> list[int]:
    if protocol == LLAMA_SERVER:
        body: dict = {"content": text}
    else:
        body = {"model": model, "prompt": text, "add_special_tokens": False}
    out = http.post("/tokenize", body)
    ids = out.get("tokens") if isinstance(out, dict) else None
    if not isinstance(ids, list) or len(ids) < min(CYCLE_TOKENS, len(text.split())):
        raise SpecopsError(f"{http.base}/tokenize gave {len(ids or [])} tokens for {len(text.split())} words")
    return [int(t) for t in ids]


def with_own_continuation(http: _Http, protocol: str, model: str, prompt: list[int]) -> list[int]:
    """``prompt`` and what the target decodes after it (greedy): a real model copies the repeated sentence, a
    model that does not still repeats its own answer, so lookups find drafts either way."""
    if protocol == LLAMA_SERVER:
        body = {"prompt": prompt, "n_predict": CONTINUATION_TOKENS, "temperature": 0.0, "return_tokens": True}
        out = http.post("/completion", body)
        ids = out.get("tokens")
        text = out.get("content") or ""
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": CONTINUATION_TOKENS, "temperature": 0.0}
        ids, text = None, ((http.post("/v1/completions", body).get("choices") or [{}])[0].get("text") or "")
    if not (isinstance(ids, list) and ids):
        ids = _tokenize(http, protocol, model, text) if text.strip() else []
    return prompt + [int(t) for t in ids]


@dataclass(frozen=True)
class _Decode:
    """What one request of the probe took: ``wall_ms`` for ``steps`` decode steps after its first token, of which
    ``drafted`` tokens were drafted (None where the engine says so only in its counters)."""

    wall_ms: float
    steps: int
    drafted: int | None


def _llama_decode(http: _Http, model: str, prompt: list[int] | str, tokens: int, temperature: float) -> _Decode:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": temperature, "ignore_eos": True, "cache_prompt": True}
    tm = http.post("/completion", body).get("timings") or {}
    n, ms = tm.get("predicted_n"), tm.get("predicted_ms")
    if not isinstance(n, int) or not isinstance(ms, (int, float)) or n < 2:
        raise SpecopsError(f"{http.base}/completion reported no timings.predicted_n/predicted_ms")
    accepted = int(tm.get("draft_n_accepted") or 0)
    return _Decode(float(ms), n - 1 - accepted, int(tm.get("draft_n") or 0))


def _openai_decode(http: _Http, model: str, prompt: list[int] | str, tokens: int, temperature: float) -> _Decode:
    """A streamed completion: vLLM sends one chunk a step (every token that step kept)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": temperature, "stream": True}
    body["ignore_eos"] = True
    t0, stamps = time.perf_counter(), []
    with http.open("/v1/completions", body) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            try:
                choice = (json.loads(line[5:]).get("choices") or [{}])[0]
            except ValueError:
                continue
            if choice.get("text"):
                stamps.append(time.perf_counter() - t0)
    if len(stamps) < 3:
        raise SpecopsError(f"{http.base}: the engine streamed too few chunks to time a step")
    return _Decode((stamps[-1] - stamps[0]) * 1000, len(stamps) - 1, None)


def _burst(
    http: _Http, protocol: str, model: str, prompt: list[int] | str, tokens: int, batch: int, temperature: float
) -> list[_Decode]:
    """``batch`` identical requests at once (the engine decodes them as one batch)."""
    from concurrent.futures import ThreadPoolExecutor

    decode = _llama_decode if protocol == LLAMA_SERVER else _openai_decode
    with ThreadPoolExecutor(batch) as pool:
        return list(pool.map(lambda _: decode(http, model, prompt, tokens, temperature), range(batch)))


async def _decodes(
    eng, http: _Http, protocol: str, prompt: list[int] | str, tokens: int, batch: int, repeats: int,
    temperature: float = 0.0,
):  # fmt: skip
    """``repeats`` bursts, after one unmeasured; the requests, and the drafts the engine's counters saw."""
    import asyncio

    await asyncio.to_thread(_burst, http, protocol, eng.model_name, prompt, min(tokens, 8), batch, temperature)
    counted = eng.k and protocol == OPENAI  # llama-server says each request's drafts in its timings
    before = await eng.counters() if counted else None
    out: list[_Decode] = []
    for _ in range(repeats):
        out += await asyncio.to_thread(_burst, http, protocol, eng.model_name, prompt, tokens, batch, temperature)
    drafts = (await eng.acceptance_since(before)).drafts if counted else None
    return out, drafts


def _step_ms(decodes: list[_Decode]) -> float:
    return statistics.median(d.wall_ms / d.steps for d in decodes if d.steps > 0)


def _steps_and_drafts(decodes: list[_Decode], k: int, counted_drafts: float | None) -> tuple[int, float]:
    """The requests' decode steps and how many of them drafted: ``draft_n`` / k per request, rounded up for a last
    draft cut short by the request's end (llama-server), else the engine's counters (vLLM)."""
    steps = sum(d.steps for d in decodes)
    if all(d.drafted is not None for d in decodes):
        return steps, float(sum(-(-(d.drafted or 0) // k) for d in decodes))
    return steps, float(counted_drafts or 0.0)


def _spec_step_ms(decodes: list[_Decode], k: int, counted_drafts: float | None, t_step: float) -> tuple[float, float]:
    """The time of one speculative step with a k-token draft, and the share of steps that drafted: the requests'
    decode time, less their draft-less steps at ``t_step``, over their drafts (from ``draft_n`` / k, rounded up
    for a last draft cut short by the request's end, else the counters)."""
    steps, drafts = _steps_and_drafts(decodes, k, counted_drafts)
    drafts = min(drafts, float(steps))
    if steps <= 0 or drafts < steps / 2:
        raise SpecopsError(f"drafts of {k} tokens were found in {drafts:.0f} of {steps} steps: too few to time one")
    wall = sum(d.wall_ms for d in decodes)
    return (wall - (steps - drafts) * t_step) / drafts, drafts / steps


def _idle_step_ms(decodes: list[_Decode], k: int, counted_drafts: float | None, t_spec: float) -> float | None:
    """The time of one step of the speculative engine that found no draft: the requests' decode time, less their
    few drafting steps at ``t_spec``, over the rest; None where more than a quarter of the steps drafted (the
    text gave the lookup too much to copy to time its absence)."""
    steps, drafts = _steps_and_drafts(decodes, k, counted_drafts)
    if steps <= 0 or drafts > steps / 4:
        return None
    return (sum(d.wall_ms for d in decodes) - drafts * t_spec) / (steps - drafts)


def fixed_ngram(profile, k: int, protocol: str):
    """``profile`` drafting by prompt lookup exactly ``k`` tokens a step (the probe's speculative engine)."""
    spec = profile.speculative.model_copy(
        update={"method": Method.NGRAM, "draft": None, "draft_file": None, "num_speculative_tokens": k}
    )
    server = profile.server
    if protocol == LLAMA_SERVER:
        spec = spec.model_copy(update={"ngram": spec.ngram.model_copy(update={"type": "ngram-mod"})})
        args, skip = [], False
        for arg in server.extra_args:  # the profile's own n-gram sizes give way to the probe's
            if skip:
                skip = False
                continue
            if arg.startswith("--spec-ngram-mod-"):
                skip = "=" not in arg
                continue
            args.append(arg)
        args += ["--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", str(k), "--spec-ngram-mod-n-max", str(k)]
        server = server.model_copy(update={"extra_args": args})
    return profile.model_copy(update={"speculative": spec, "server": server})


def fixed_draft(profile, k: int, protocol: str):
    """``profile`` (a draft model) drafting exactly ``k`` tokens a step, as the engine runs it."""
    update: dict = {"num_speculative_tokens": k}
    if protocol == LLAMA_SERVER:
        update["num_speculative_tokens_min"] = k  # llama-server drafts fewer when the draft is unsure
    return profile.model_copy(update={"speculative": profile.speculative.model_copy(update=update)})


def probe_plan(profile, protocol: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sizes n (tokens per pass) and the batches the probe times for ``profile``: every size on llama-server,
    1 and the profile's k + 1 on an engine slow to launch (and k + 1 wherever a draft model drafts k); batch 1
    and ``server.parallel`` (when above 1)."""
    parallel = profile.server.parallel or 1
    batches = (1, parallel) if parallel > 1 else (1,)
    own = max(1, profile.speculative.k) + 1
    if protocol != LLAMA_SERVER:
        return (1, own), batches
    return tuple(sorted(set(SIZES) | ({own} if drafts_by_model(profile) else set()))), batches


def _fits(profile, n: int, batch: int) -> bool:
    """Whether ``batch`` requests of the probe's prompt and its drafts of n - 1 tokens fit the context."""
    need = CYCLE_TOKENS * CYCLE_REPEATS + CONTINUATION_TOKENS + 1 + STEPS_PER_REQUEST * n
    per_slot = profile.model.max_model_len // (profile.server.parallel or 1) if profile.model.max_model_len else need
    return need <= per_slot and batch >= 1


class _OtherLoad:
    """Cores other processes kept busy while the probe's engines ran, time-weighted over its launches. Only while
    an engine runs: one stopped can leave its children to be reaped by init (vLLM's engine core), and their CPU
    time would then count as another process's."""

    def __init__(self) -> None:
        self.busy = self.span = 0.0

    @contextlib.contextmanager
    def during(self):
        before = cpuload.sample()
        yield
        after = cpuload.sample()
        other = cpuload.other_cores(before, after)
        if other is not None and after is not None and before is not None:
            self.busy += other * (after.at - before.at)
            self.span += after.at - before.at

    @property
    def cores(self) -> float | None:
        return self.busy / self.span if self.span else None


async def probe_profile(loaded, registry, engine, *, repeats: int = REPEATS, say=lambda m: None) -> dict:
    """Time ``loaded``'s target on ``engine`` (decode steps, and speculative steps at each size of
    :func:`probe_plan`) and its draft model's decode step when it has one; returns the record (see the module)."""
    from specops.perf.launch import launched, without_speculation

    profile = loaded.profile
    base = without_speculation(profile)
    protocol = registry.backend(base.backend).verify_probe
    if protocol not in (LLAMA_SERVER, OPENAI):
        raise SpecopsError(f"no verification-cost probe for this engine (its backend's verify_probe is {protocol!r})")
    sizes, batches = probe_plan(profile, protocol)
    started, load = time.time(), _OtherLoad()
    idle_text, hot = " ".join(_WORDS), IDLE_TEMPERATURE

    async with launched(loaded, registry, profile=base, engine=engine) as eng:
        with load.during():
            http = _Http(eng.base_url, eng.api_key, 600.0)
            served = eng.model_name
            prompt = with_own_continuation(http, protocol, served, cycle_prompt(http, protocol, served))
            say(f"the target without speculation: ready in {eng.ready_s:.1f}s; decode steps at batch {batches}")
            t_step = {
                b: _step_ms((await _decodes(eng, http, protocol, prompt, DECODE_TOKENS + 1, b, repeats))[0])
                for b in batches
            }
            t_sampled = {
                b: _step_ms((await _decodes(eng, http, protocol, idle_text, DECODE_TOKENS + 1, b, repeats, hot))[0])
                for b in batches
            }
    curves: dict[int, dict] = {
        b: {"t_step_ms": t_step[b], "t_verify_ms": {1: t_step[b]}, "drafting": {}} for b in batches
    }
    skipped = []
    own = max(1, profile.speculative.k) + 1
    idle_n = min(sizes[1:], key=lambda n: (abs(n - own), n), default=None)  # draftless steps: nearest the own k
    for n in sizes[1:]:
        k, fit = n - 1, [b for b in batches if _fits(profile, n, b)]
        if not fit:
            skipped.append(n)
            continue
        async with launched(loaded, registry, profile=fixed_ngram(base, k, protocol), engine=engine) as eng:
            with load.during():
                http = _Http(eng.base_url, eng.api_key, 600.0)
                say(f"drafts of {k}: ready in {eng.ready_s:.1f}s")
                for b in fit:
                    decodes, drafts = await _decodes(eng, http, protocol, prompt, 1 + STEPS_PER_REQUEST * n, b, repeats)
                    ms, share = _spec_step_ms(decodes, k, drafts, t_step[b])
                    curves[b]["t_verify_ms"][n], curves[b]["drafting"][n] = ms, share
                    if n == idle_n:
                        decodes, drafts = await _decodes(
                            eng, http, protocol, idle_text, DECODE_TOKENS + 1, b, repeats, hot
                        )
                        curves[b]["t_idle_ms"] = _idle_step_ms(decodes, k, drafts, ms)
    record_drafts = {}
    if drafts_by_model(profile):  # c = what the profile's own steps cost beyond prompt lookup's, per draft token
        k = profile.speculative.k
        t_own: dict[int, float] = {}
        async with launched(loaded, registry, profile=fixed_draft(profile, k, protocol), engine=engine) as eng:
            with load.during():
                http = _Http(eng.base_url, eng.api_key, 600.0)
                say(f"the draft model, drafts of {k}: ready in {eng.ready_s:.1f}s")
                for b in batches:
                    if k + 1 in curves[b]["t_verify_ms"]:
                        decodes, drafts = await _decodes(
                            eng, http, protocol, prompt, 1 + STEPS_PER_REQUEST * (k + 1), b, repeats
                        )
                        t_own[b] = _spec_step_ms(decodes, k, drafts, t_step[b])[0]
        record_drafts[model_identity(profile.speculative.draft)] = {
            "path": profile.speculative.draft,
            "shape": draft_shape(profile.speculative.draft),
            "k": k,
            "t_spec_ms": {str(b): round(t, 4) for b, t in t_own.items()},
            "ratio": {
                str(b): round(max(0.0, t - curves[b]["t_verify_ms"][k + 1]) / (k * t_step[b]), 4)
                for b, t in t_own.items()
            },
        }
    by_batch = {
        str(b): {
            "t_step_ms": round(c["t_step_ms"], 4),
            "t_verify_ms": {str(n): round(v, 4) for n, v in sorted(c["t_verify_ms"].items())},
            "relative": {str(n): round(v / c["t_step_ms"], 4) for n, v in sorted(c["t_verify_ms"].items())},
            "steps_that_drafted": {str(n): round(v, 3) for n, v in sorted(c["drafting"].items())},
            **_idle_entry(c.get("t_idle_ms"), t_sampled[b]),
        }
        for b, c in curves.items()
    }
    other = load.cores
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        # cores other processes kept busy while its engines ran: a probe on a shared machine times its neighbours too
        "other_cores": None if other is None else round(other, 2),
        "busy": bool(other is not None and other > BUSY_CORES),
        "probe": STEPS,
        "served_model": served,
        "prompt_tokens": len(prompt),
        "repeats": repeats,
        **{key: by_batch["1"][key] for key in ("t_step_ms", "t_verify_ms", "relative")},
        "batches": by_batch,
        "drafts": record_drafts,
        "skipped_sizes": skipped,
        "how": {
            "measured": "t_step: decode steps of the target alone; t_verify(n): speculative steps with prompt-lookup "
            "drafts of n - 1 tokens on a repeated sentence (their lookup and sampling included), draft-less steps "
            "priced at t_step; idle: a step of the speculative engine that found no draft (a sampled text without "
            "repeats) over the target alone's on the same text; the profile's own steps at its k where a draft "
            "model drafts; at each batch",
            "inferred": "the cost at other n and batches (linear between the points); a draft model's c: its "
            "profile's steps less prompt lookup's at the same k, per draft token",
        },
    }


def _idle_entry(t_idle: float | None, t_sampled: float) -> dict:
    """A batch's draftless step in the record: its time, the target alone's on the same text, and their ratio
    (the model's ``idle``); nothing where the probe could not time it."""
    if t_idle is None or not t_sampled > 0:
        return {}
    return {"t_idle_ms": round(t_idle, 4), "t_sampled_ms": round(t_sampled, 4), "idle": round(t_idle / t_sampled, 4)}


def probe_launched(loaded, registry, backend_version: str | None = None, *, say=lambda m: None) -> tuple[dict, Path]:
    """Probe ``loaded``'s engine, model and draft (:func:`probe_profile`) and store the curve; the record and its
    file."""
    import asyncio

    from specops.perf.launch import without_speculation

    base = without_speculation(loaded.profile)
    engine = registry.backend(base.backend).engine_info(base, backend_version, probe=True)
    record = asyncio.run(probe_profile(loaded, registry, engine, say=say))
    return save_curve(CurveKey.of(base, engine.version), record)
