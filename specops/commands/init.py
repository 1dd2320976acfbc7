"""``specops init MODEL``: a first profile for your model on this machine, with each choice explained in it.

What it looks at: the engines installed here and their versions (the same discovery and probes as ``specops
doctor``), the GPUs and their memory (``nvidia-smi``; ``CUDA_VISIBLE_DEVICES`` hides some), the draft the
resolver finds for the model (catalog, Hub, HF cache: ``specops resolve``), and the weights' size. What it
decides: the backend, the method and draft, the GPUs and tensor parallel size (the fewest GPUs whose share of
the weights leaves room for the KV cache), the served context. It writes the profile with a comment beside
each choice, and its lock (``specops lock``), after checking that the profile validates and the lock
resolves. Nothing fits (the weights, no engine that loads the model's format, a method the engine lacks):
it refuses and says why, writing nothing.

N-gram drafts are sized for the device: llama-server's ngram-mod drafts 48–64 tokens by default, which a GPU
verifies for about the price of one step but a CPU does not. Where a verification-cost curve was measured here
for the engine and model (``specops bench PROFILE --probe-verify``), the draft length is the one the speedup
model finds best on that curve (:func:`ngram_size`); without one the profile says so and keeps the default.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import click

from specops.backends import DEFAULT_BACKEND
from specops.commands._common import echo_json, json_option, port_type
from specops.errors import SpecopsError
from specops.methods import Method

#: Share of a GPU's memory (or of the RAM, on CPU) the weights may take: the rest is the KV cache's.
WEIGHTS_SHARE = 0.8
#: Context served per request when the model states a longer one (raise it in the profile as clients need).
CONTEXT_GPU, CONTEXT_CPU = 8192, 4096
#: llama-server slots (``server.parallel``): its ``-c`` context is shared by them.
LLAMA_SLOTS = 4
#: Per-token acceptance assumed when sizing n-gram drafts on a measured curve: a prior, not a measurement
#: (llama-server's ngram-mod on real prompts accepted 40–100 % of its drafted tokens).
NGRAM_ALPHA = 0.8
#: llama-server's ngram-mod draft lengths (common/common.h: n_min 48, n_max 64) and the flags that set them.
NGRAM_MOD_MIN, NGRAM_MOD_MAX = 48, 64
NGRAM_MOD_FLAGS = ("--spec-ngram-mod-n-max", "--spec-ngram-mod-n-min")
GIB = 1024**3
METHOD_CHOICES = ["auto"] + [m.value for m in Method if m is not Method.AUTO]


class Refused(SpecopsError):
    """Nothing fits: no profile is written."""


@dataclass
class Engine:
    """One engine as discovery found it here."""

    backend: str
    display: str
    version: str | None = None
    where: str | None = None
    problem: str | None = None
    flags: frozenset[str] | None = None  # what the probed build's --help lists (None: not probed)

    def line(self, *, short: bool = False) -> str:
        if self.version:
            return f"{self.display} {self.version} ({self.where})"
        return f"{self.display}: not found" if short else f"{self.display}: {self.problem}"


@dataclass
class Gpu:
    index: int
    name: str
    memory_gib: float | None


@dataclass
class Machine:
    """What this machine offers the profile: GPUs (empty: CPU), how they were found, the engines."""

    gpus: list[Gpu]
    gpus_how: str
    engines: dict[str, Engine] = field(default_factory=dict)
    ram_gib: float | None = None

    @property
    def cpu(self) -> bool:
        return not self.gpus


@dataclass
class Layout:
    devices: list[int]
    tensor_parallel_size: int
    per_gpu_gib: float | None
    why: str


# ----------------------------------------------------------------------------------------------- detection


def detect_gpus(wanted: str | None) -> tuple[list[Gpu], str]:
    """The GPUs the profile may use and how they were found: ``wanted`` (``--gpus``: ``all``, ``none``/``cpu``,
    or indices ``0,1``), nvidia-smi's list, less what ``CUDA_VISIBLE_DEVICES`` hides."""
    from specops.doctor.base import nvidia_smi

    wanted = (wanted or "all").strip().lower()
    if wanted in ("none", "cpu", ""):
        return [], "CPU only (--gpus none)"
    listed, how = nvidia_smi()
    seen = {g["index"]: Gpu(g["index"], g["name"], g["memory_mib"] / 1024) for g in listed or []}
    if wanted != "all":
        try:
            indices = [int(x) for x in wanted.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter("--gpus takes all, none, or GPU indices such as 0,1") from None
        if listed is None:
            return [Gpu(i, "unknown", None) for i in indices], f"--gpus {wanted} ({how}: memory unknown)"
        missing = [i for i in indices if i not in seen]
        if missing:
            listed_text = ", ".join(str(i) for i in seen) or "none"
            raise Refused(f"--gpus {wanted}: {how} lists no GPU {missing[0]} (it lists: {listed_text})")
        return [seen[i] for i in indices], f"--gpus {wanted}, memory from {how}"
    if listed is None:
        return [], f"CPU only ({how})"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        visible = [x.strip() for x in cvd.split(",") if x.strip()]
        if not visible or visible == ["-1"]:
            return [], f"CPU only: CUDA_VISIBLE_DEVICES={cvd!r} hides the {len(seen)} GPU(s) {how} lists"
        if all(x.isdigit() for x in visible):
            kept = [seen[int(x)] for x in visible if int(x) in seen]
            return kept, f"{how}, those CUDA_VISIBLE_DEVICES={cvd!r} leaves visible"
    return list(seen.values()), how


def _no_profile(devices: list[int]) -> SimpleNamespace:
    """What engine discovery reads of a profile, for looking before there is one."""
    return SimpleNamespace(
        engine=SimpleNamespace(python=None, executable=None, version=None), gpus=SimpleNamespace(devices=devices)
    )


def detect_engines(registry, gpus: list[Gpu]) -> dict[str, Engine]:
    """Each registered backend's engine as discovery finds it for a profile on ``gpus`` (none: CPU, where
    specops' own CPU builds count), probed for its version."""
    devices = [g.index for g in gpus]
    out: dict[str, Engine] = {}
    for name, backend in sorted(registry.backends.items()):
        display = getattr(backend, "engine_name", name)
        probe_with = _no_profile(devices)
        found = backend.search(probe_with)
        where = found[0] if found is not None else None
        if found is not None and where is None:
            looked = "; ".join(found[1])
            out[name] = Engine(name, display, problem=f"not found ({looked}); {backend.install_hint}")
            continue
        try:
            info = backend.engine_info(probe_with, probe=True)
        except SpecopsError as exc:
            out[name] = Engine(name, display, problem=" ".join(str(exc).split())[:300])
            continue
        out[name] = Engine(name, display, info.version, where or info.source, flags=info.flags)
    return out


def ram_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------- decisions


def is_gguf_model(model: str) -> bool:
    """A local .gguf file, or a Hub repo of GGUF files (named ``…-GGUF`` / ``…gguf``, as they are published)."""
    return model.lower().endswith((".gguf", "-gguf", "_gguf", ".gguf/"))


def choose_backend(model: str, asked: str | None, machine: Machine, registry) -> tuple[str, str]:
    """The backend and why: ``--backend``; else an engine found here that loads the model's format (GGUF or
    Hugging Face), the default backend first."""
    if asked:
        if asked not in registry.backends:
            raise Refused(f"--backend {asked}: not a backend here (known: {', '.join(sorted(registry.backends))})")
        eng = machine.engines.get(asked)
        return asked, "--backend " + asked + (f": {eng.line()}" if eng else "")
    gguf = is_gguf_model(model)
    found = {n: e for n, e in machine.engines.items() if e.version}
    by_format = [n for n, b in sorted(registry.backends.items()) if (b.model_format == "gguf") == gguf]
    usable = [n for n in by_format if n in found]
    if usable:
        pick = DEFAULT_BACKEND if DEFAULT_BACKEND in usable else usable[0]
        fmt = "a GGUF model" if gguf else "a Hugging Face model"
        return pick, f"{fmt}; {found[pick].line()} loads it"
    kind = "GGUF" if gguf else "Hugging Face (safetensors)"
    if not by_format:
        raise Refused(f"{model} is a {kind} model and no backend here loads that format")
    want = DEFAULT_BACKEND if DEFAULT_BACKEND in by_format else by_format[0]
    other = [e.line() for e in found.values()]
    why_not = f"; found only {', '.join(other)}, which does not load {kind} models" if other else ""
    hint = registry.backends[want].install_hint
    raise Refused(
        f"no engine here loads {model} ({kind}){why_not}: {hint} — or name the engine of the machine that will "
        f"serve it with --backend {want}"
    )


def choose_layout(
    backend_obj, gpus: list[Gpu], target_gib: float | None, draft_gib: float, heads: int | None, ram: float | None
) -> Layout | None:
    """The fewest GPUs whose share of the weights is at most :data:`WEIGHTS_SHARE` of their memory (vLLM:
    tensor parallel over a power of two that divides the attention heads; llama.cpp: layers split over any
    number of devices, the draft whole on one). None when no layout fits."""
    if target_gib is None:
        devices = [gpus[0].index] if gpus else []
        return Layout(devices, 1, None, "the weights' size is unknown (no safetensors metadata or file sizes): one GPU")
    total = target_gib + draft_gib
    if not gpus:
        if ram is None or total <= WEIGHTS_SHARE * ram:
            room = f" of {ram:.0f} GiB RAM" if ram else ""
            return Layout([], 1, total, f"CPU: weights {_gib(total)}{room} (at most {WEIGHTS_SHARE:.0%} of it)")
        return None
    known = [g.memory_gib for g in gpus if g.memory_gib]
    if not known:
        return Layout([gpus[0].index], 1, None, "GPU memory unknown: one GPU")
    memory = min(known)
    parallel = getattr(backend_obj, "parallel_layout", True)
    n = 1
    while n <= len(gpus):
        if parallel and heads and heads % n:
            n *= 2
            continue
        per = target_gib / n + draft_gib  # a separate draft sits whole on the first GPU (draft TP 1)
        if per <= WEIGHTS_SHARE * memory:
            devices = [g.index for g in gpus[:n]]
            how = f"TP {n}" if parallel else f"{n} device(s)"
            why = (
                f"weights {target_gib:.1f} GiB target + {draft_gib:.1f} GiB draft → {per:.1f} GiB per GPU at {how}, "
                f"within {WEIGHTS_SHARE:.0%} of {memory:.0f} GiB (the rest holds the KV cache)"
            )
            return Layout(devices, n if parallel else 1, per, why)
        n = n * 2 if parallel else n + 1
    return None


def _gib(value: float) -> str:
    return f"{value:.1f} GiB" if value >= 0.1 else f"{value * 1024:.1f} MiB"


def ngram_size(curve, flags: frozenset[str] | None, device: str) -> tuple[list[str], str, bool]:
    """llama-server ngram-mod's draft length for the device: (extra_args, why, pays).

    On a measured ``curve`` (a :class:`specops.speedup.VerifyCost`): n-max is the k in 1..64 the speedup model
    finds best at α = :data:`NGRAM_ALPHA` (n-gram drafts cost nothing to make, c = 0), n-min keeps llama-server's
    own ratio (48 of 64: draft only matches that long); ``pays`` is False when no k beats no speculation.
    Without a curve, or on a build that lists no such flags, llama-server's defaults stay (no extra_args)."""
    from specops.speedup import best_k, cost_basis, expected_speedup

    if flags is not None and not set(NGRAM_MOD_FLAGS) <= flags:
        return [], f"this llama-server lists no {NGRAM_MOD_FLAGS[0]}: its own draft lengths", True
    if curve is None:
        return (
            [],
            f"draft length: llama-server's default ({NGRAM_MOD_MIN}–{NGRAM_MOD_MAX} tokens), since no verification "
            f"cost was measured on {device} for this model ({cost_basis(None)}); measure it with `specops bench "
            "PROFILE --probe-verify` and run init again, as a CPU's verification grows with the draft",
            True,
        )
    k = best_k(NGRAM_ALPHA, 0.0, NGRAM_MOD_MAX, curve)
    if k == 0:
        return [], f"no draft length pays on {device} at α {NGRAM_ALPHA} ({cost_basis(curve)})", False
    n_min = max(1, round(k * NGRAM_MOD_MIN / NGRAM_MOD_MAX))
    why = (
        f"drafts of {n_min}–{k} tokens (llama-server's default {NGRAM_MOD_MIN}–{NGRAM_MOD_MAX}): at α {NGRAM_ALPHA} "
        f"the speedup model finds k = {k} best, {expected_speedup(NGRAM_ALPHA, k, 0.0, curve):.2f}x against "
        f"{expected_speedup(NGRAM_ALPHA, NGRAM_MOD_MAX, 0.0, curve):.2f}x at {NGRAM_MOD_MAX}, a pass over "
        f"{k + 1} tokens costing {curve.at(k + 1):.2f} decode steps plus {curve.per_token:.2f} per token kept "
        f"({cost_basis(curve)})"
    )
    return [NGRAM_MOD_FLAGS[0], str(k), NGRAM_MOD_FLAGS[1], str(n_min)], why, True


def served_context(target_context: int | None, cpu: bool) -> tuple[int, str]:
    cap = CONTEXT_CPU if cpu else CONTEXT_GPU
    if target_context and target_context <= cap:
        return target_context, f"the model's trained context ({target_context})"
    if target_context:
        return (
            cap,
            f"the model was trained for {target_context}; {cap} keeps the KV cache small: raise it as clients need",
        )
    return cap, f"the model states no context length: {cap}"


def profile_name(model: str) -> str:
    base = Path(model.rstrip("/")).name if ("/" in model and Path(model).exists()) else model.split("/")[-1]
    base = re.sub(r"\.gguf$", "", base, flags=re.I)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-._").lower()[:63]
    return name or "model"


# ----------------------------------------------------------------------------------------------- writing


def _yaml(value) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def _comment(text: str, indent: int = 0, width: int = 110) -> list[str]:
    import textwrap

    pad = " " * indent + "# "
    wrapped = textwrap.wrap(
        text, width=width, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False, break_long_words=False
    )
    return wrapped or [pad.rstrip()]


@dataclass
class Plan:
    """Everything ``init`` decided, with its reasons: what the profile text is made of."""

    model: str
    name: str
    backend: str
    backend_why: str
    machine: Machine
    layout: Layout
    max_model_len: int
    context_why: str
    method: Method
    draft: str | None
    draft_file: str | None
    method_why: str
    alternatives: list[str]
    port: int
    parallel: int | None
    notes: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)  # server.extra_args (n-gram draft lengths)
    draft_size_why: str | None = None

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "name": self.name,
            "backend": self.backend,
            "engines": {n: {k: v for k, v in vars(e).items() if k != "flags"} for n, e in self.machine.engines.items()},
            "gpus": [vars(g) for g in self.machine.gpus],
            "gpus_found_by": self.machine.gpus_how,
            "devices": self.layout.devices,
            "tensor_parallel_size": self.layout.tensor_parallel_size,
            "method": self.method.value,
            "draft": self.draft,
            "max_model_len": self.max_model_len,
            "why": {
                "backend": self.backend_why,
                "layout": self.layout.why,
                "context": self.context_why,
                "method": self.method_why,
                "draft_size": self.draft_size_why,
            },
            "extra_args": self.extra_args,
            "alternatives": self.alternatives,
            "notes": self.notes,
        }


def profile_text(plan: Plan) -> str:
    """The profile, with a comment beside each choice (YAML values written by the YAML library)."""
    from specops import __version__

    m = plan.machine
    engines = "; ".join(e.line(short=True) for e in m.engines.values()) or "none"
    gpus = ", ".join(f"{g.index}: {g.name}" + (f" ({g.memory_gib:.0f} GiB)" if g.memory_gib else "") for g in m.gpus)
    lines = [
        f"# Written by `specops init {plan.model}` (specops {__version__}); each choice is explained beside it.",
        "# Check it: `specops validate FILE`; start it: `specops up FILE`; measure it: `specops certify FILE`.",
        *_comment(f"engines found here: {engines}"),
        *_comment(f"GPUs: {gpus} ({m.gpus_how})" if gpus else f"GPUs: none: {m.gpus_how}"),
        f"name: {_yaml(plan.name)}",
        f"description: {_yaml(f'{plan.model} with {plan.method.value} on {plan.backend} (specops init)')}",
        *_comment(f"backend: {plan.backend_why}"),
        f"backend: {plan.backend}",
        "model:",
        f"  id: {_yaml(plan.model)}",
        *_comment(
            f"{plan.max_model_len // plan.parallel} tokens per request × {plan.parallel} slots (llama.cpp shares -c "
            f"among them): {plan.context_why}"
            if plan.parallel
            else plan.context_why,
            2,
        ),
        f"  max_model_len: {plan.max_model_len}",
        "speculative:",
        *_comment(plan.method_why, 2),
    ]
    for alt in plan.alternatives:
        lines += _comment(f"also considered: {alt}", 2)
    lines.append(f"  method: {plan.method.value}")
    if plan.draft:
        lines.append(f"  draft: {_yaml(plan.draft)}")
    if plan.draft_file:
        lines.append(f"  draft_file: {_yaml(plan.draft_file)}")
    lines += ["gpus:", *_comment(plan.layout.why, 2), f"  devices: {_yaml(plan.layout.devices)}"]
    if plan.layout.tensor_parallel_size > 1:
        lines.append(f"  tensor_parallel_size: {plan.layout.tensor_parallel_size}")
    lines += [
        "server:",
        "  # loopback only: set 0.0.0.0 to serve other machines, and then an api_key: ${ENV_VAR}",
        "  host: 127.0.0.1",
        f"  port: {plan.port}",
    ]
    if plan.parallel:
        lines.append(f"  parallel: {plan.parallel}")
    if plan.draft_size_why:
        lines += _comment(f"n-gram {plan.draft_size_why}", 2)
    if plan.extra_args:
        lines.append(f"  extra_args: {_yaml(plan.extra_args)}")
    chain = "none" if plan.method in (Method.NGRAM, Method.SUFFIX, Method.NONE) else "ngram, then none"
    lines += _comment(
        "fallback: the defaults: when the acceptance stays below 0.6 over 60 s windows, specops switches to the "
        f"next method of the chain ({chain}) without losing a request"
    )
    for note in plan.notes:
        lines += _comment(f"note: {note}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- the command


def _resolve(model: str, backend: str, method: str, max_model_len: int, version: str | None, offline: bool, say):
    from specops.resolve.resolver import resolve, synthetic_profile

    profile = synthetic_profile(
        model, backend=backend, method=method, max_model_len=max_model_len, engine_version=version
    )
    return resolve(profile, offline=offline, progress=say)


def _cut(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _draft_gib(res) -> float:
    c = res.choice
    view = getattr(c, "view", None) if c is not None else None
    return view.weights.gib if view is not None and view.weights is not None else 0.0


def _heads(res) -> int | None:
    cfg = res.target.config if res.target is not None else None
    n = cfg.get("num_attention_heads") if isinstance(cfg, dict) else None
    return n if isinstance(n, int) and n > 0 else None


def plan_profile(model: str, *, backend, method, gpus, name, port, offline, registry, say) -> Plan:
    """Detect, resolve and decide (no file is written): the :class:`Plan`, or :class:`Refused`."""
    from specops.config.profile import check_version_text

    found, how = detect_gpus(gpus)
    machine = Machine(found, how, ram_gib=ram_gib())
    say(f"GPUs: {how}")
    machine.engines = detect_engines(registry, found)
    for e in machine.engines.values():
        say(f"engine: {e.line()}")
    chosen, backend_why = choose_backend(model, backend, machine, registry)
    backend_obj = registry.backends[chosen]
    wanted = Method(method)
    if wanted not in (Method.AUTO, Method.NONE) and wanted not in backend_obj.methods:
        raise Refused(backend_obj.unsupported_method_text(wanted))
    engine = machine.engines.get(chosen)
    version = engine.version if engine is not None else None
    notes = []
    if not version:
        notes.append(
            f"{backend_obj.engine_name} was not found here ({engine.problem if engine else 'no discovery'}): "
            "install it where the profile will run"
        )
    slots = LLAMA_SLOTS if not backend_obj.parallel_layout else None
    cap = CONTEXT_CPU if machine.cpu else CONTEXT_GPU  # resolved at the cap: the served context is at most it
    pin = None if not version or check_version_text(version) else version  # llama-server: a build text, no pin
    res = _resolve(model, chosen, wanted.value, cap * (slots or 1), pin, offline, say)
    if res.target is not None and res.target.fatal is not None:
        raise Refused(f"the model: {res.target.fatal}")
    facts = res.target.facts if res.target is not None else None
    per_request, context_why = served_context(facts.context if facts else None, machine.cpu)
    if res.choice is None:
        errors = "; ".join(f.message for f in res.errors) or "no candidate passes the checks"
        raise Refused(f"method {wanted.value}: {errors}")
    target_w = res.target.weights if res.target is not None else None
    target_gib = target_w.gib if target_w is not None else None
    draft_gib = _draft_gib(res)
    layout = choose_layout(backend_obj, found, target_gib, draft_gib, _heads(res), machine.ram_gib)
    if layout is None and draft_gib and wanted is Method.AUTO and Method.NGRAM in backend_obj.methods:
        plain = choose_layout(backend_obj, found, target_gib, 0.0, _heads(res), machine.ram_gib)
        if plain is not None:
            notes.append(
                f"{res.choice.draft} ({draft_gib:.1f} GiB) does not fit beside the target: n-gram drafts instead"
            )
            res = _resolve(model, chosen, Method.NGRAM.value, per_request * (slots or 1), pin, offline, say)
            layout = plain
    if layout is None:
        where = (
            f"{len(found)} GPU(s) of {min(g.memory_gib or 0 for g in found):.0f} GiB"
            if found
            else f"{machine.ram_gib or 0:.0f} GiB of RAM (CPU)"
        )
        need = (target_gib or 0) + draft_gib
        raise Refused(
            f"nothing fits: {model} needs {need:.1f} GiB of weights (target {target_gib or 0:.1f} + draft "
            f"{draft_gib:.1f}), and {where} give at most {WEIGHTS_SHARE:.0%} of their memory to weights; "
            "use more or larger GPUs (--gpus), or a quantized model"
        )
    spec = res.profile.speculative
    c = res.choice
    method_why = (
        f"{'asked for' if wanted is not Method.AUTO else 'auto resolved'}: {spec.method.value}"
        + (f" {spec.draft}" if spec.draft else "")
        + (f" — {c.why(popularity=False)}; {c.reason}" if c is not None else "")
    )
    alternatives = [
        f"{x.method.value} {x.draft or ''}".strip() + f" ({x.verdict}: {_cut(x.reason)})"
        for x in res.candidates
        if x is not c and x.verdict != "unchecked"
    ][:3]
    notes += [n for n in res.notes if not n.startswith("offline")]
    method, draft = spec.method, spec.draft
    extra_args, size_why = [], None
    if method is Method.NGRAM and backend_obj.ngram_variants() and not spec.ngram.type:
        extra_args, size_why, pays = _ngram_for_device(chosen, version, model, found, engine)
        if not pays:
            method_why += f"; method none instead: {size_why}"
            method, size_why = Method.NONE, None
    return Plan(
        model=model,
        name=name or profile_name(model),
        backend=chosen,
        backend_why=backend_why,
        machine=machine,
        layout=layout,
        max_model_len=per_request * (slots or 1),
        context_why=context_why,
        method=method,
        draft=draft,
        draft_file=spec.draft_file if not backend_obj.parallel_layout and spec.draft and "/" in spec.draft else None,
        method_why=method_why,
        alternatives=alternatives,
        port=port or (8080 if slots else 8000),
        parallel=slots,
        notes=notes,
        extra_args=extra_args,
        draft_size_why=size_why,
    )


def _ngram_for_device(backend: str, version: str | None, model: str, gpus: list[Gpu], engine: Engine | None):
    """:func:`ngram_size` on the curve measured here for the engine and model (None when none was)."""
    from specops.perf.verifycost import CurveKey, device_name, load_curve

    device = device_name([g.name for g in gpus])
    curve = load_curve(CurveKey.for_model(backend, version, model, None, device)) if version else None
    return ngram_size(curve, engine.flags if engine is not None else None, device)


def write_checked(plan: Plan, out: Path, *, offline: bool, force: bool, say) -> tuple[Path, Path]:
    """Write the profile and its lock at ``out`` once both check out in a scratch folder beside it (the profile
    validates, the lock resolves); an existing profile is kept unless ``force``."""
    from specops.commands._common import load
    from specops.resolve.lock import lock_path
    from specops.resolve.resolver import lock_profile

    if out.exists() and not force:
        raise Refused(f"{out} exists: choose another --output, or --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    text = profile_text(plan)
    scratch = Path(tempfile.mkdtemp(prefix=".specops-init-", dir=out.parent))
    try:
        trial = scratch / out.name
        trial.write_text(text, encoding="utf-8")
        loaded = load(str(trial))
        lock_profile(loaded, offline=offline, progress=say)
        for written in (trial, lock_path(trial)):
            written.chmod(0o600)
        trial.replace(out)
        lock_path(trial).replace(lock_path(out))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out, lock_path(out)


def check_text(plan: Plan) -> None:
    """That the profile text validates (``--dry-run``: in a scratch folder, removed after)."""
    from specops.commands._common import load

    with tempfile.TemporaryDirectory(prefix="specops-init-") as tmp:
        trial = Path(tmp) / f"{plan.name}.yaml"
        trial.write_text(profile_text(plan), encoding="utf-8")
        load(str(trial))


@click.command()
@click.argument("model")
@click.option("--backend", default=None, help="vllm or llamacpp (default: the engine here that loads MODEL).")
@click.option(
    "--method",
    type=click.Choice(METHOD_CHOICES),
    default="auto",
    show_default=True,
    help="Speculative method (auto: the best draft the resolver finds, else n-gram).",
)
@click.option("--gpus", default=None, help="GPUs to use: all (default), none (CPU), or indices such as 0,1.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Profile file (default: ./<name>.yaml).")
@click.option("--name", help="Deployment name (default: from MODEL).")
@click.option("--port", type=port_type, help="Public port (default: 8000, llama.cpp 8080).")
@click.option("--offline", is_flag=True, help="Use only the HF cache and the catalog (also HF_HUB_OFFLINE=1).")
@click.option("--non-interactive", is_flag=True, help="Ask nothing (also when stdin is not a terminal).")
@click.option("--dry-run", is_flag=True, help="Print the profile; write nothing.")
@click.option("--force", is_flag=True, help="Replace an existing profile file.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
def init(model, backend, method, gpus, output, name, port, offline, non_interactive, dry_run, force, quiet, as_json):
    """Write a profile for MODEL (a Hub id, a local directory or a .gguf file) on this machine.

    It detects the engines installed here and their versions, the GPUs and their memory (nvidia-smi,
    CUDA_VISIBLE_DEVICES), resolves the draft (catalog, Hub, HF cache), picks the method and the fewest
    GPUs (tensor parallel size) whose share of the weights leaves 20 % for the KV cache, and writes the
    profile with each choice explained in a comment, plus its lock. It refuses, writing nothing, when
    nothing fits. Exit code 1 then.

    \b
    Examples:
      specops init meta-llama/Llama-3.1-8B-Instruct
      specops init Qwen/Qwen2.5-7B-Instruct-GGUF --gpus 0 -o qwen.yaml
      specops init ./model.gguf --gpus none --dry-run
    """
    from specops.plugins import get_registry

    interactive = not (non_interactive or as_json or dry_run) and sys.stdin.isatty()
    say = (lambda m: None) if (quiet or as_json) else (lambda m: click.echo(f"  … {m}", err=True))
    if not name and output:
        name = profile_name(Path(output).stem)
    plan = plan_profile(
        model,
        backend=backend,
        method=method,
        gpus=gpus,
        name=name,
        port=port,
        offline=offline,
        registry=get_registry(),
        say=say,
    )
    out = Path(output) if output else Path(f"{plan.name}.yaml")
    if dry_run:
        check_text(plan)
        if as_json:
            echo_json({**plan.to_dict(), "profile": profile_text(plan), "written": None})
        else:
            click.echo(profile_text(plan), nl=False)
        return
    if interactive:
        click.echo(profile_text(plan), nl=False)
        if not click.confirm(f"write {out} and its lock?", default=True):
            raise SystemExit(1)
    path, lock = write_checked(plan, out, offline=offline, force=force, say=say)
    if as_json:
        echo_json({**plan.to_dict(), "profile": profile_text(plan), "written": str(path), "lock": str(lock)})
        return
    click.echo(f"wrote {path} ({plan.backend}, {plan.method.value}" + (f" {plan.draft}" if plan.draft else "") + ")")
    click.echo(f"wrote {lock}")
    click.echo(f"next: specops validate {path} && specops up {path}")
