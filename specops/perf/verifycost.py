"""The verification-cost curve of an engine, probed on the machine it runs on from real speculative steps, and
kept per machine.

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
- **a draft model's cost** (measured from real steps, c inferred): the profile itself, drafting exactly its k
  tokens by its draft model, decodes the same prompt (the draft copies it too); c = (its step − prompt lookup's
  step at the same k, at the same batch) / (k · t_step): the draft's k steps, its catch-up pass over the kept
  tokens, and how the engine schedules them for a batch, as the engine pays them.

n = 1 is a plain decode step: exactly 1. On llama-server every n of :data:`SIZES` is probed (a launch takes
seconds); on vLLM (a launch takes a minute on 2 cores) n = 1 and the profile's own k + 1. With t_step in ms,
bench's model prices whole requests (:func:`specops.speedup.workload_speedup`): their prompt passes (the
baseline's time to first token; a draft model reads each prompt too, at its c) and their steps that found no
draft, beside the drafting steps.

The curve is stored as a small JSON in the state folder (``verify-cost/``: a measurement of this machine, like
an instance's state; ``$SPECOPS_STATE``), keyed by engine, engine version, model and device (CPU model and
cores, or GPU names), so another machine or model never reuses it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specops.errors import SpecopsError
from specops.methods import Method
from specops.paths import private_dir, state_dir
from specops.perf import cpuload
from specops.perf.bench_flags import FlagThresholds
from specops.speedup import VerifyCost

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
#: What :func:`probe_profile` writes in ``probe`` (a record without it timed prompt passes: a lower bound).
STEPS = "speculative-steps"
#: Other processes' cores above which a probe is marked busy (the bench flags its cells at the same load).
BUSY_CORES = FlagThresholds().busy_cores
#: The probe's two ways to talk to an engine (a backend's ``verify_probe``).
LLAMA_SERVER, OPENAI = "llama-server", "openai"
#: Words the probe's text is made of (any text does: only token counts matter).
_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly boxed jam pots under "
    "bright harbour lamps and every sailor counted ropes beside old wooden crates of spice"
).split()


# ----------------------------------------------------------------------------------------------- the device


def cpu_model() -> str:
    """The CPU model as ``/proc/cpuinfo`` names it ("" where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 0


def cpu_name() -> str:
    """The CPU model and the cores this process may use."""
    return f"{cpu_model() or 'unknown CPU'}, {usable_cores()} cores"


def gpu_names(devices: list[int] | None) -> list[str]:
    """Names of the GPUs ``devices`` (None: all) as nvidia-smi lists them; [] without nvidia-smi or GPUs."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        idx, _, name = line.partition(",")
        if idx.strip().isdigit() and (devices is None or int(idx) in devices):
            names.append(name.strip())
    return names


def device_of(profile) -> str:
    """What the profile's engine runs on: ``GPU: <names>``, or ``CPU: <model>, <cores> cores``."""
    devices = profile.gpus.devices
    return device_name(gpu_names(devices) if devices != [] else [])


def device_name(gpus: list[str]) -> str:
    """``GPU: <names>`` for the GPUs an engine uses; ``CPU: <model>, <cores> cores`` without any."""
    return f"GPU: {', '.join(gpus)}" if gpus else f"CPU: {cpu_name()}"


def model_identity(model_id: str) -> str:
    """A local file as its real path and size (a changed file is another model); a Hub id as given."""
    p = Path(model_id).expanduser()
    if p.is_file():
        return f"{p.resolve()} ({p.stat().st_size} bytes)"
    return model_id


@dataclass(frozen=True)
class CurveKey:
    """What a curve is valid for."""

    engine: str
    version: str
    model: str
    device: str

    @classmethod
    def of(cls, profile, engine_version: str | None) -> CurveKey:
        """The key of ``profile``'s engine (at ``engine_version``), model and device."""
        return cls.for_model(profile.backend, engine_version, profile.model.id, profile.model.file, device_of(profile))

    @classmethod
    def for_model(cls, engine: str, version: str | None, model_id: str, file: str | None, device: str) -> CurveKey:
        ident = model_identity(model_id) + (f" {file}" if file else "")
        return cls(engine, version or "unknown", ident, device)

    def path(self, root: Path | None = None) -> Path:
        digest = hashlib.sha256(json.dumps([self.engine, self.version, self.model, self.device]).encode()).hexdigest()
        return (root or curves_dir()) / f"{self.engine}-{digest[:16]}.json"


def curves_dir() -> Path:
    return state_dir() / "verify-cost"


# ----------------------------------------------------------------------------------------------- storing


def save_curve(key: CurveKey, record: dict, root: Path | None = None) -> tuple[dict, Path]:
    """Write the probe's ``record`` (see :func:`probe_profile`) for ``key``; returns it with the key, and the file.
    Draft costs stored earlier for the same key and kind of probe are kept beside the new ones."""
    path = key.path(root)
    private_dir(path.parent)
    old = load_record(key, root)
    drafts = (old or {}).get("drafts") if (old or {}).get("probe") == record.get("probe") else None
    data = {"engine": key.engine, "version": key.version, "model": key.model, "device": key.device, **record}
    if drafts:
        data["drafts"] = {**drafts, **(record.get("drafts") or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return data, path


def _batches(record: dict) -> dict[int, dict]:
    """The record's curves by batch size: ``batches``, or its one curve (``relative``) at batch 1."""
    out = {}
    for b, curve in (record.get("batches") or {}).items():
        if isinstance(curve, dict) and str(b).isdigit() and int(b) >= 1 and curve.get("relative"):
            out[int(b)] = curve["relative"]
    return out or {1: record.get("relative") or {}}


def _between(by_batch: dict[int, dict], batch: int) -> tuple[dict, str]:
    """The relative costs at ``batch``: a measured batch's, else linear between the two around it (at the sizes
    both have), else the nearest one's; and which batches it came from."""
    sizes = sorted(by_batch)
    lo = max((b for b in sizes if b <= batch), default=sizes[0])
    hi = min((b for b in sizes if b >= batch), default=sizes[-1])
    if lo == hi:
        return by_batch[lo], f"batch {lo}"
    w = (batch - lo) / (hi - lo)
    common = [n for n in by_batch[lo] if n in by_batch[hi]]
    mixed = {n: float(by_batch[lo][n]) + w * (float(by_batch[hi][n]) - float(by_batch[lo][n])) for n in common}
    return mixed, f"batch {batch} between {lo} and {hi}"


def curve_of(record: dict, batch: int = 1) -> VerifyCost:
    """The :class:`VerifyCost` of a stored or fresh record at ``batch`` requests decoded at once; ValueError when
    it holds none."""
    costs, which = _between(_batches(record), max(1, int(batch)))
    source = f"{record.get('engine')} {record.get('version')} on {record.get('device')}, {record.get('date')}"
    if record.get("probe") == STEPS:
        source += f", speculative steps at {which}"
    return VerifyCost.from_mapping(costs, source)


def step_ms(record: dict, batch: int = 1) -> float | None:
    """The target's decode step in ms at ``batch`` (interpolated as the curve is), or None in a record without it."""
    steps = {int(b): {"t": c["t_step_ms"]} for b, c in (record.get("batches") or {}).items()
             if str(b).isdigit() and isinstance(c, dict) and c.get("t_step_ms")}  # fmt: skip
    if not steps and record.get("t_step_ms"):
        steps = {1: {"t": record["t_step_ms"]}}
    return float(_between(steps, max(1, int(batch)))[0]["t"]) if steps else None


def draft_ratio(record: dict, draft: str | None, batch: int = 1) -> float | None:
    """c: the measured cost of a step of the draft model ``draft`` in target steps at ``batch`` (interpolated as
    the curve is), or None when the record has not measured that draft."""
    drafts = record.get("drafts") or {}
    entry = drafts.get(model_identity(draft)) if draft else None
    entry = entry or next((d for d in drafts.values() if draft and d.get("path") == draft), None)
    ratios = {int(b): {"c": v} for b, v in ((entry or {}).get("ratio") or {}).items() if str(b).isdigit()}
    if not ratios:
        return None
    return float(_between(ratios, max(1, int(batch)))[0]["c"])


def covers(record: dict | None, profile) -> bool:
    """Whether ``record`` holds what the model needs for ``profile``: speculative steps, and the cost of its
    draft model when it has one."""
    if not record or record.get("probe") != STEPS:
        return False
    spec = profile.speculative
    return spec.method is not Method.DRAFT_MODEL or draft_ratio(record, spec.draft) is not None


def load_record(key: CurveKey, root: Path | None = None) -> dict | None:
    """The record stored for exactly ``key`` (engine, version, model, device), or None. A file that is not a
    curve, or whose key differs (a hash collision, a hand edit), counts as none."""
    try:
        data = json.loads(key.path(root).read_text(encoding="utf-8"))
        fields = [data.get(f) for f in ("engine", "version", "model", "device")] if isinstance(data, dict) else None
        if fields != [key.engine, key.version, key.model, key.device]:
            return None
        curve_of(data)
        return data
    except (OSError, ValueError, RecursionError, TypeError, AttributeError):
        return None


def load_curve(key: CurveKey, root: Path | None = None) -> VerifyCost | None:
    """The curve stored for exactly ``key``, or None."""
    record = load_record(key, root)
    return None if record is None else curve_of(record)


def curve_for(profile, engine_version: str | None) -> VerifyCost | None:
    """The curve measured for ``profile``'s engine, model and device here, or None (none probed yet)."""
    return load_curve(CurveKey.of(profile, engine_version))


def decision_curve(profile, engine_version: str | None) -> VerifyCost | None:
    """:func:`curve_for`, its ``source`` the file it was read from: the fallback's decisions name the curve they
    predicted on (:mod:`specops.watch.rule`)."""
    key = CurveKey.of(profile, engine_version)
    curve = load_curve(key)
    return None if curve is None else VerifyCost(curve.points, str(key.path()))


def decision_draft_cost(profile, engine_version: str | None) -> float | None:
    """c as the stored record of ``profile``'s engine, model and machine measured it, for the fallback's model:
    0 for prompt lookup (its lookup is inside the speculative steps the record timed), the draft model's own
    steps for a draft model the record timed; None where the record has no speculative steps or that draft."""
    record = load_record(CurveKey.of(profile, engine_version))
    if record is None or record.get("probe") != STEPS:
        return None
    if profile.speculative.method in (Method.NGRAM, Method.SUFFIX):
        return 0.0
    return draft_ratio(record, profile.speculative.draft) if _drafts_by_model(profile) else None


# ----------------------------------------------------------------------------------------------- probing


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


def _llama_decode(http: _Http, model: str, prompt: list[int], tokens: int) -> _Decode:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": True}
    tm = http.post("/completion", body).get("timings") or {}
    n, ms = tm.get("predicted_n"), tm.get("predicted_ms")
    if not isinstance(n, int) or not isinstance(ms, (int, float)) or n < 2:
        raise SpecopsError(f"{http.base}/completion reported no timings.predicted_n/predicted_ms")
    accepted = int(tm.get("draft_n_accepted") or 0)
    return _Decode(float(ms), n - 1 - accepted, int(tm.get("draft_n") or 0))


def _openai_decode(http: _Http, model: str, prompt: list[int], tokens: int) -> _Decode:
    """A streamed completion: vLLM sends one chunk a step (every token that step kept)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True}
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


def _burst(http: _Http, protocol: str, model: str, prompt: list[int], tokens: int, batch: int) -> list[_Decode]:
    """``batch`` identical requests at once (the engine decodes them as one batch)."""
    from concurrent.futures import ThreadPoolExecutor

    decode = _llama_decode if protocol == LLAMA_SERVER else _openai_decode
    with ThreadPoolExecutor(batch) as pool:
        return list(pool.map(lambda _: decode(http, model, prompt, tokens), range(batch)))


async def _decodes(eng, http: _Http, protocol: str, prompt: list[int], tokens: int, batch: int, repeats: int):
    """``repeats`` bursts, after one unmeasured; the requests, and the drafts the engine's counters saw."""
    import asyncio

    await asyncio.to_thread(_burst, http, protocol, eng.model_name, prompt, min(tokens, 8), batch)
    counted = eng.k and protocol == OPENAI  # llama-server says each request's drafts in its timings
    before = await eng.counters() if counted else None
    out: list[_Decode] = []
    for _ in range(repeats):
        out += await asyncio.to_thread(_burst, http, protocol, eng.model_name, prompt, tokens, batch)
    drafts = (await eng.acceptance_since(before)).drafts if counted else None
    return out, drafts


def _step_ms(decodes: list[_Decode]) -> float:
    return statistics.median(d.wall_ms / d.steps for d in decodes if d.steps > 0)


def _spec_step_ms(decodes: list[_Decode], k: int, counted_drafts: float | None, t_step: float) -> tuple[float, float]:
    """The time of one speculative step with a k-token draft, and the share of steps that drafted: the requests'
    decode time, less their draft-less steps at ``t_step``, over their drafts (from ``draft_n`` / k, rounded up
    for a last draft cut short by the request's end, else the counters)."""
    steps = sum(d.steps for d in decodes)
    if all(d.drafted is not None for d in decodes):
        drafts = float(sum(-(-(d.drafted or 0) // k) for d in decodes))
    else:
        drafts = float(counted_drafts or 0.0)
    drafts = min(drafts, float(steps))
    if steps <= 0 or drafts < steps / 2:
        raise SpecopsError(f"drafts of {k} tokens were found in {drafts:.0f} of {steps} steps: too few to time one")
    wall = sum(d.wall_ms for d in decodes)
    return (wall - (steps - drafts) * t_step) / drafts, drafts / steps


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
    return tuple(sorted(set(SIZES) | ({own} if _drafts_by_model(profile) else set()))), batches


def _drafts_by_model(profile) -> bool:
    return profile.speculative.method is Method.DRAFT_MODEL and bool(profile.speculative.draft)


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
    curves: dict[int, dict] = {
        b: {"t_step_ms": t_step[b], "t_verify_ms": {1: t_step[b]}, "drafting": {}} for b in batches
    }
    skipped = []
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
    record_drafts = {}
    if _drafts_by_model(profile):  # c = what the profile's own steps cost beyond prompt lookup's, per draft token
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
            "priced at t_step; the profile's own steps at its k where a draft model drafts; at each batch",
            "inferred": "the cost at other n and batches (linear between the points); a draft model's c: its "
            "profile's steps less prompt lookup's at the same k, per draft token",
        },
    }


def probe_launched(loaded, registry, backend_version: str | None = None, *, say=lambda m: None) -> tuple[dict, Path]:
    """Probe ``loaded``'s engine, model and draft (:func:`probe_profile`) and store the curve; the record and its
    file."""
    import asyncio

    from specops.perf.launch import without_speculation

    base = without_speculation(loaded.profile)
    engine = registry.backend(base.backend).engine_info(base, backend_version, probe=True)
    record = asyncio.run(probe_profile(loaded, registry, engine, say=say))
    return save_curve(CurveKey.of(base, engine.version), record)


def format_curve(record: dict) -> str:
    """The curve as a person reads it."""
    lines = [
        f"verification cost of {record.get('engine')} {record.get('version')} on {record.get('device')}",
        f"model {record.get('model')}; measured {record.get('date')} ({record.get('probe') or 'prompt passes'}), "
        f"{record.get('repeats')} repeats",
    ]
    for b, c in sorted(_record_batches(record).items()):
        lines.append(f"batch {b}: a decode step takes {c.get('t_step_ms')} ms")
        lines.append("   n   t_step+verify ms   cost (steps)")
        for n, rel in (c.get("relative") or {}).items():
            lines.append(f"  {int(n):2d}   {c['t_verify_ms'][n]:16.2f}   {rel:12.2f}")
    for draft in (record.get("drafts") or {}).values():
        ratio = ", ".join(f"{v} at batch {b}" for b, v in (draft.get("ratio") or {}).items())
        lines.append(f"draft {draft.get('path')}: a step costs {ratio} target steps")
    how = record.get("how") or {}
    lines.append(f"measured: {how.get('measured')}; inferred: {how.get('inferred')}")
    if record.get("busy"):
        lines.append(
            f"⚠ busy machine: other processes kept {record.get('other_cores')} cores busy during the probe, so these "
            "costs include theirs; probe again when the machine is quiet (specops bench PROFILE --probe-verify)"
        )
    return "\n".join(lines) + "\n"


def _record_batches(record: dict) -> dict[int, dict]:
    batches = {int(b): c for b, c in (record.get("batches") or {}).items() if str(b).isdigit()}
    return batches or {1: record}
