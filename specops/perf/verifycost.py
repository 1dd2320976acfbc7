"""The verification-cost curve of a running engine, probed on the machine it runs on, and kept per machine.

The speedup model (:mod:`specops.speedup`) needs c_verify(n): what one target pass over n new tokens (on top of
a cached context) costs, in target decode steps. On a GPU at batch 1 it is nearly 1 until the pass is
compute-bound; on a CPU it grows with n. :func:`probe` measures it at n = 1, 2, 4, … 64, against a decode step:

- **llama-server** (all measured, by the engine's own clock): a ``/completion`` whose prompt is a cached prefix
  (``cache_prompt: true``, pinned to slot 0) plus n new tokens, ``n_predict: 1``; its ``timings.prompt_ms``
  (requests whose ``timings.prompt_n`` is not exactly n are discarded). Before each, a primer request (the
  prefix + 5 other tokens): a model with sliding-window attention (Gemma 3) reuses its cache only up to a
  checkpoint 5 tokens before the previous prompt's end, so without it a pass would redo the prefix's tail.
  t_step is ``timings.predicted_per_token_ms`` of a short decode on the same prefix.
- **vLLM** (OpenAI API, prefix caching on): the time to first token (TTFT, measured here) of the cached prefix
  plus n tokens, and the inter-token time of a streamed decode (measured). t_verify(n) is *inferred* as
  t_step + max(0, TTFT(n) − TTFT(1)): what n tokens add to a pass over one.

Each point is the median of ``repeats`` requests, sizes interleaved so drift hits all alike. The relative cost
is t_verify(n) / t_step; below 1 at n = 1 it says how much of a decode step is paid per token outside the
forward pass (sampling over the vocabulary, …), which speculation does not amortize (:class:`VerifyCost`). One caveat, said in every curve: an engine's prompt pass computes the output layer
for its last position only, verification for all n; the curve is a lower bound where the output layer is a
large share of the model (Gemma 3: a 262,144 × 640 layer, most of its per-token compute).

The curve is stored as a small JSON in the state folder (``verify-cost/``: a measurement of this machine, like
an instance's state; ``$SPECOPS_STATE``), keyed by engine, engine version, model and device (CPU model and
cores, or GPU names), so another machine or model never reuses it.
"""

from __future__ import annotations

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
from specops.paths import private_dir, state_dir
from specops.speedup import VerifyCost

#: The draft lengths + 1 probed (n new tokens per pass).
SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Tokens of cached context every probed pass sits on.
PREFIX_TOKENS = 128
REPEATS = 5
#: Tokens after the prefix in the primer request (llama-server checkpoints an SWA cache this far before the end).
PRIMER_TOKENS = 5
#: Tokens decoded to time one step.
DECODE_TOKENS = 16
CAVEAT = (
    "a prompt pass computes the output layer for its last position only, verification for every position: "
    "a lower bound where the output layer is a large share of the model"
)
#: Words the probe's text is made of (any text does: only token counts matter).
#: The probe's two ways to talk to an engine (a backend's ``verify_probe``).
LLAMA_SERVER, OPENAI = "llama-server", "openai"

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
    """Write the probe's ``record`` (see :func:`probe`) for ``key``; returns it with the key, and the file."""
    path = key.path(root)
    private_dir(path.parent)
    data = {"engine": key.engine, "version": key.version, "model": key.model, "device": key.device, **record}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return data, path


def curve_of(record: dict) -> VerifyCost:
    """The :class:`VerifyCost` of a stored or fresh record; ValueError when it holds none."""
    source = f"{record.get('engine')} {record.get('version')} on {record.get('device')}, {record.get('date')}"
    return VerifyCost.from_mapping(record.get("relative") or {}, source)


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
    except (OSError, ValueError, RecursionError):
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


def _tokens(http: _Http, protocol: str, model: str, need: int) -> list[int]:
    """At least ``need`` token ids of the probe's text, by the engine's own tokenizer."""
    words = need * 2
    body = {"content": _text(words)} if protocol == LLAMA_SERVER else {"model": model, "prompt": _text(words)}
    out = http.post("/tokenize", body)
    ids = out.get("tokens") if isinstance(out, dict) else None
    if not isinstance(ids, list) or len(ids) < need:
        raise SpecopsError(f"{http.base}/tokenize gave {len(ids or [])} tokens for {words} words; {need} needed")
    return [int(t) for t in ids]


def _suffix(ids: list[int], rnd: int, n: int) -> list[int]:
    """n new tokens, a different slice every request (so nothing after the prefix is cached)."""
    start = PREFIX_TOKENS + (rnd * 13 + n * 5) % (len(ids) - PREFIX_TOKENS - n)
    return ids[start : start + n]


def _probe_llamacpp(http: _Http, ids: list[int], sizes, repeats: int) -> tuple[dict, float, dict]:
    prefix = ids[:PREFIX_TOKENS]
    common = {"cache_prompt": True, "id_slot": 0, "temperature": 0.0}
    http.post("/completion", {**common, "prompt": prefix, "n_predict": 1})  # the prefix, cached from now on
    http.post("/completion", {**common, "prompt": prefix + _suffix(ids, repeats, max(sizes)), "n_predict": 4})  # warm
    steps, times = [], {n: [] for n in sizes}
    discarded = 0
    primer = prefix + ids[-PRIMER_TOKENS:]
    for rnd in range(repeats):
        for n in sizes:
            http.post("/completion", {**common, "prompt": primer, "n_predict": 1})
            t = http.post("/completion", {**common, "prompt": prefix + _suffix(ids, rnd, n), "n_predict": 1})
            tm = t.get("timings") or {}
            if tm.get("prompt_n") == n and tm.get("prompt_ms"):
                times[n].append(float(tm["prompt_ms"]))
            else:
                discarded += 1
        body = {**common, "prompt": prefix, "n_predict": DECODE_TOKENS, "ignore_eos": True}
        tm = http.post("/completion", body).get("timings") or {}
        if tm.get("predicted_n", 0) >= 2 and tm.get("predicted_per_token_ms"):
            steps.append(float(tm["predicted_per_token_ms"]))
    if not steps:
        raise SpecopsError(f"{http.base}: no decode reported timings.predicted_per_token_ms")
    t_step = statistics.median(steps)
    verify = {n: statistics.median(v) for n, v in times.items() if v}
    how = {
        "measured": "t_verify(n): timings.prompt_ms of n new tokens on a cached prefix; t_step: "
        "timings.predicted_per_token_ms of a decode",
        "inferred": "nothing",
        "discarded": discarded,
    }
    return verify, t_step, how


def _stream(http: _Http, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from sending to each streamed chunk that carries text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    stamps = []
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
    return stamps


def _probe_vllm(http: _Http, model: str, ids: list[int], sizes, repeats: int) -> tuple[dict, float, dict]:
    prefix = ids[:PREFIX_TOKENS]
    _stream(http, model, prefix + ids[PREFIX_TOKENS : PREFIX_TOKENS + 1], 1)  # the prefix, cached from now on
    ttft, itl = {n: [] for n in sizes}, []
    for rnd in range(repeats):
        for n in sizes:
            stamps = _stream(http, model, prefix + _suffix(ids, rnd, n), 1)
            if stamps:
                ttft[n].append(stamps[0] * 1000)
        stamps = _stream(http, model, prefix, DECODE_TOKENS)
        if len(stamps) >= 3:
            itl.append((stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))
    if not itl or not ttft[1]:
        raise SpecopsError(f"{http.base}: the engine streamed too few tokens to time a step")
    t_step, base = statistics.median(itl), statistics.median(ttft[1])
    verify = {n: t_step + max(0.0, statistics.median(v) - base) for n, v in ttft.items() if v}
    how = {
        "measured": "TTFT of a cached prefix + n new tokens (max_tokens 1); t_step: the inter-token time of a "
        "streamed decode",
        "inferred": "t_verify(n) = t_step + max(0, TTFT(n) - TTFT(1))",
        "discarded": 0,
    }
    return verify, t_step, how


def probe(
    base_url: str,
    protocol: str,
    model: str,
    *,
    api_key: str | None = None,
    sizes=SIZES,
    repeats: int = REPEATS,
    timeout: float = 120.0,
) -> dict:
    """Probe the running engine at ``base_url`` (``protocol``: its backend's ``verify_probe``, ``llama-server`` or
    ``openai``; ``model``: the name it serves) and return the record: milliseconds per size, t_step, ``relative`` (n → t_verify(n) / t_step), how
    each was obtained, and when. Raises SpecopsError when the engine does not answer as expected."""
    if protocol not in (LLAMA_SERVER, OPENAI):
        raise SpecopsError(f"no verification-cost probe for this engine (its backend's verify_probe is {protocol!r})")
    if repeats < 1 or not sizes or 1 not in sizes:
        raise SpecopsError("the probe needs repeats >= 1 and sizes that include 1")
    http = _Http(base_url, api_key, timeout)
    need = PREFIX_TOKENS + 2 * max(sizes) + 13 * repeats
    ids = _tokens(http, protocol, model, need)
    started = time.time()
    if protocol == LLAMA_SERVER:
        verify, t_step, how = _probe_llamacpp(http, ids, sizes, repeats)
    else:
        verify, t_step, how = _probe_vllm(http, model, ids, sizes, repeats)
    if 1 not in verify:
        raise SpecopsError(f"{base_url}: no pass over one new token was timed")
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "served_model": model,
        "prefix_tokens": PREFIX_TOKENS,
        "repeats": repeats,
        "t_step_ms": round(t_step, 4),
        "t_verify_ms": {str(n): round(v, 4) for n, v in sorted(verify.items())},
        "relative": {str(n): round(v / t_step, 4) for n, v in sorted(verify.items())},
        "how": how,
        "caveat": CAVEAT,
    }


async def probe_engine(
    eng, key: CurveKey, protocol: str, *, repeats: int = REPEATS, root: Path | None = None
) -> tuple[dict, Path]:
    """Probe a launched engine (:class:`specops.perf.launch.LaunchedEngine`, running without speculation; its
    backend's ``verify_probe`` is ``protocol``) in a thread, and store the curve under ``key``; returns the record
    and its file."""
    import asyncio

    record = await asyncio.to_thread(
        probe, eng.base_url, protocol, eng.model_name, api_key=eng.api_key, repeats=repeats
    )
    return save_curve(key, record, root)


def format_curve(record: dict) -> str:
    """The curve as a person reads it."""
    lines = [
        f"verification cost of {record.get('engine')} {record.get('version')} on {record.get('device')}",
        f"model {record.get('model')}; measured {record.get('date')}, {record.get('repeats')} repeats, "
        f"{record.get('prefix_tokens')} cached tokens; t_step {record.get('t_step_ms')} ms",
        "   n   t_verify ms   cost (steps)",
    ]
    for n, rel in (record.get("relative") or {}).items():
        lines.append(f"  {int(n):2d}   {record['t_verify_ms'][n]:11.2f}   {rel:12.2f}")
    how = record.get("how") or {}
    lines.append(f"measured: {how.get('measured')}; inferred: {how.get('inferred')}")
    lines.append(f"caveat: {record.get('caveat')}")
    return "\n".join(lines) + "\n"


def probe_launched(loaded, registry, backend_version: str | None = None, *, say=lambda m: None) -> tuple[dict, Path]:
    """Launch ``loaded``'s engine without speculation, probe it, store the curve; the record and its file."""
    import asyncio

    from specops.perf.launch import launched, without_speculation

    base = without_speculation(loaded.profile)
    backend = registry.backend(base.backend)
    engine = backend.engine_info(base, backend_version, probe=True)
    key = CurveKey.of(base, engine.version)

    async def run():
        async with launched(loaded, registry, profile=base, engine=engine, say=say) as eng:
            say(f"{base.backend} {engine.version} ready in {eng.ready_s:.1f}s; probing {len(SIZES)} sizes × {REPEATS}")
            return await probe_engine(eng, key, backend.verify_probe)

    return asyncio.run(run())
