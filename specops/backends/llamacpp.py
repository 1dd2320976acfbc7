"""The llama.cpp backend: renders ``llama-server`` flags for the build that is installed.

llama-server renamed its speculative flags in 2026 and exits on a removed one, so the flags come from
the probed binary's ``--help`` (or a pinned flag generation; see :mod:`specops.backends.versions`). Facts with
their sources in :mod:`specops.backends.versions` (llama.cpp's ``common/arg.cpp``).
"""

from __future__ import annotations

import dataclasses
import os
import re
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
    flag_of,
    k_source,
    pinned_version,
)
from specops.backends.devengines import DEV_ENGINE, dev_engine_for
from specops.backends.versions import LLAMA_GENERATIONS, llama_generation, llama_generation_from_help
from specops.errors import SpecopsError
from specops.hookspecs import hookimpl
from specops.methods import Method

#: specops method → llama-server ``--spec-type`` value, per flag generation (absent: not supported).
SPEC_TYPE = {
    "legacy": {},
    # --spec-type here names n-gram drafters only: a draft model is `-md` alone (llama-server from
    # llama-cpp-python 0.3.20, commit f49e917, exits on `--spec-type draft`: "unknown speculative decoding
    # type without draft model"; seen by the support matrix)
    "spec-type": {Method.NGRAM: "ngram-simple"},
    "spec-draft": {Method.DRAFT_MODEL: "draft", Method.NGRAM: "ngram-mod"},
    "current": {
        Method.DRAFT_MODEL: "draft-simple",
        Method.EAGLE3: "draft-eagle3",
        Method.MTP: "draft-mtp",
        Method.NGRAM: "ngram-mod",
    },
}


def _generation_problem(method: Method, gen: str, version: str) -> str | None:
    """Why llama-server ``version`` of flag generation ``gen`` cannot run ``method`` (legacy builds run a draft
    model from ``-md`` alone, with no ``--spec-type``)."""
    types = SPEC_TYPE[gen]
    if method in types or (gen in DRAFT_WITHOUT_SPEC_TYPE and method is Method.DRAFT_MODEL):
        return None
    supported = sorted({Method.DRAFT_MODEL.value} | {m.value for m in types})
    return f"llama-server {version} (flag generation {gen}) cannot run {method}; it supports {', '.join(supported)}"


#: Generations whose draft model is enabled by ``-md`` alone, without a ``--spec-type``.
DRAFT_WITHOUT_SPEC_TYPE = ("legacy", "spec-type")
NGRAM_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
DEFAULT_DRAFT_QUANT = "Q4_K_M"
#: How long each n-gram drafter's drafts can be: the flag that sets it and llama-server's default, for flag
#: generation "current" (read in common/common.h and common/speculative.cpp of the llama.cpp that
#: llama-cpp-python 0.3.36 vendors, which `specops engines setup llamacpp` builds). ``--spec-draft-n-max``
#: sizes draft models only; ngram-mod drafts nothing shorter than --spec-ngram-mod-n-min (48); ngram-cache has
#: no flag (8 in speculative.cpp).
NGRAM_DRAFT_SIZE = {
    "ngram-mod": ("--spec-ngram-mod-n-max", 64),
    "ngram-simple": ("--spec-ngram-simple-size-m", 48),
    "ngram-map-k": ("--spec-ngram-map-k-size-m", 48),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-m", 48),
    "ngram-cache": (None, 8),
}
#: The note every render carries, naming the flag generation it rendered for.
GENERATION_NOTE = "llama-server flag generation: "

#: Spellings of the same option, so extra_args cannot sneak in a second value for a rendered flag.
ALIASES = [
    frozenset(g)
    for g in (
        {"-m", "--model"},
        {"-hf", "-hfr", "--hf-repo"},
        {"-hff", "--hf-file"},
        {"-md", "--model-draft", "--spec-draft-model"},
        {"-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf"},
        {"-c", "--ctx-size"},
        {"--api-key", "--api-key-file"},
        {"-np", "--parallel"},
        {"-a", "--alias"},
        {"-ngl", "--gpu-layers", "--n-gpu-layers"},
        {"-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"},
        {"-dev", "--device"},
        {"-devd", "--device-draft", "--spec-draft-device"},
        {"-sm", "--split-mode"},
        {"-ts", "--tensor-split"},
        {"-mg", "--main-gpu"},
        {"-fit", "--fit"},
        {"--draft", "--draft-n", "--draft-max", "--spec-draft-n-max"},
        {"--draft-min", "--draft-n-min", "--spec-draft-n-min"},
        {"--draft-p-min", "--spec-draft-p-min"},
    )
]
FORBIDDEN = {"--no-metrics": "specops reads acceptance from /metrics; it must stay on"}


class LlamaCppBackend(Backend):
    name = "llamacpp"
    methods = frozenset({Method.DRAFT_MODEL, Method.EAGLE3, Method.MTP, Method.NGRAM, Method.NONE})
    parallel_layout = False  # -dev takes any number of GPUs; -sm/-ts decide how layers are split
    metric_prefix = "llamacpp:"
    running_requests_metric = "llamacpp:requests_processing"
    display_name = "llama.cpp"
    model_format = "gguf"
    engine_only_methods = {
        "draft-dflash": "a --spec-type of llama-server commit 0c1e570 (2026-10); run it with method none + extra_args",
        "draft-dspark": "a --spec-type of llama-server commit 0c1e570 (2026-10); run it with method none + extra_args",
    }
    draft_vocab_tolerance = 128  # common/speculative.cpp: SPEC_VOCAB_MAX_SIZE_DIFFERENCE
    concurrency_note = (
        "llama-server has no per-batch-size k: under high concurrency keep "
        "num_speculative_tokens small or serve fewer parallel slots"
    )
    live_timings = True  # with timings_per_token the proxy sees acceptance chunk by chunk
    verify_probe = "llama-server"
    log_acceptance = True  # builds without spec_decode counters still log `draft acceptance = …`
    install_hint = (
        "llama-server not found: put it on PATH, set engine.executable, "
        "or run `specops engines setup llamacpp` to build it from source"
    )

    #: llama-server logs these and keeps serving *without* speculation (e.g. a draft with another vocab).
    SPEC_FAILED = re.compile(
        r"failed to initiali[sz]e speculative decoding|target and draft vocabs are not compatible"
        r"|draft model vocab type must match|failed to load draft model"
    )

    #: llama-server's own words when it cannot listen (then it exits), besides Python's and uvicorn's.
    BIND_FAILED = re.compile(r"couldn't bind HTTP server socket|" + Backend.BIND_FAILED.pattern, re.I)

    def method_version_problem(self, method, version):
        """Judged only for a pinned version (a flag generation or a release build such as b9100): a probed
        binary's own version text carries an unreliable build number (a source build says "build 1"), so
        its render judges it by the flags its --help lists instead."""
        if not re.fullmatch(r"\s*(?:b?\d+|[a-z-]+)\s*", version, re.IGNORECASE):
            return None
        try:
            gen = llama_generation(version)
        except ValueError:
            return None
        return _generation_problem(method, gen, version)

    def generated_tokens(self, metrics_text):
        return counter_total(metrics_text, "llamacpp:tokens_predicted_total")

    def launch_problem(self, line):
        m = self.SPEC_FAILED.search(line)
        return f"llama-server runs without speculation: {line[m.start() :].strip()[:200]}" if m else None

    # ------------------------------------------------------------------ what `specops tune` sweeps
    launch_prior_s = 3.0  # llama-server on tiny models is ready in < 1 s

    def k_applies(self, method):
        """Draft methods take k; the n-gram drafters size their drafts with their own flags."""
        return method not in (Method.NONE, Method.NGRAM)

    def ngram_variants(self, engine=None):
        """The ``--spec-type`` n-gram drafters (those the probed build lists, when it lists any)."""
        known = (engine.flag_values or {}).get("--spec-type") if engine is not None else None
        return tuple(t for t in NGRAM_TYPES if not known or t in known)

    def ngram_variant_of(self, plan):
        """The ``--spec-type`` value the plan passes."""
        return _flag_value(plan.argv, "--spec-type")

    def draft_length(self, profile, plan):
        """A draft model's ``--spec-draft-n-max`` (``--draft-max``); an n-gram drafter's own size flag, from
        ``server.extra_args`` or llama-server's default (never the profile's k, which n-gram drafters ignore)."""
        spec_type = _flag_value(plan.argv, "--spec-type")
        if spec_type in NGRAM_TYPES:
            return _ngram_draft_length(spec_type, plan)
        for flag in ("--spec-draft-n-max", "--draft-max"):
            value = _flag_value(plan.argv, flag)
            if value is not None:
                return DraftLength(_count(value), f"{flag} from {k_source(profile.speculative)}")
        return None

    # ------------------------------------------------------------------ profile checks
    def check_profile(self, p):
        spec, g = p.speculative, p.gpus
        vllm_only = [
            (("model", "dtype"), p.model.dtype != "auto"),
            (("model", "trust_remote_code"), p.model.trust_remote_code),
            (("gpus", "tensor_parallel_size"), g.tensor_parallel_size > 1),
            (("gpus", "pipeline_parallel_size"), g.pipeline_parallel_size > 1),
            (("gpus", "memory_utilization"), g.memory_utilization is not None),
            (("speculative", "draft_tensor_parallel_size"), spec.draft_tensor_parallel_size is not None),
            (("speculative", "draft_max_model_len"), spec.draft_max_model_len is not None),
            (("speculative", "per_batch_size"), spec.per_batch_size is not None),
            (("speculative", "options"), bool(spec.options)),
        ]
        for path, is_set in vllm_only:
            if is_set:
                hint = "; split layers with gpus.split_mode / gpus.tensor_split" if path[0] == "gpus" else ""
                yield path, f"{'.'.join(path)} is a vLLM setting; llama.cpp does not use it{hint}"
        yield from _check_gguf_ref(("model", "id"), p.model.id, p.model.file)
        if spec.draft and spec.draft != "auto":
            yield from _check_gguf_ref(("speculative", "draft"), spec.draft, spec.draft_file)
        if spec.ngram.type is not None and spec.ngram.type not in NGRAM_TYPES:
            yield (
                ("speculative", "ngram", "type"),
                (f"unknown llama.cpp n-gram type {spec.ngram.type!r} (one of {', '.join(NGRAM_TYPES)})"),
            )
        if g.tensor_split and not g.devices:
            yield ("gpus", "tensor_split"), "tensor_split needs gpus.devices"
        # llama-server's n-gram drafters have their own knobs; specops renders none of these for them,
        # so accepting them would silently ignore what the profile asks for.
        for key in ("min", "max"):
            if key in spec.ngram.model_fields_set:
                yield (
                    ("speculative", "ngram", key),
                    (
                        f"ngram.{key} is vLLM's prompt_lookup_{key}; llama-server's n-gram drafters take their own "
                        f"flags (e.g. --spec-ngram-mod-n-match, --spec-ngram-simple-size-n): put them in server.extra_args"
                    ),
                )
        if spec.method is Method.NGRAM and spec.num_speculative_tokens is not None:
            yield (
                ("speculative", "num_speculative_tokens"),
                (
                    "llama-server's n-gram drafters size their drafts with their own flags (e.g. "
                    "--spec-ngram-mod-n-max, --spec-ngram-simple-size-m): put them in server.extra_args"
                ),
            )

    # ------------------------------------------------------------------ engine discovery
    program = "llama-server"
    engine_setting = "engine.executable"
    dev_engine_pattern = "llama-server-*/bin/llama-server"
    multi_node_modes = ("rpc",)
    download_cache_env = "LLAMA_CACHE"  # llama-server's own downloads (-hf)
    download_cache_dir = "llama.cpp"

    def flag_generation(self, engine):
        try:
            if engine.flags is not None:
                return llama_generation_from_help(engine.flags, frozenset(engine.flag_values.get("--spec-type", ())))
            return llama_generation(engine.version)
        except ValueError:
            return ""

    def pin_matches(self, pinned, engine):
        """The same flag generation (what a render of llama-server depends on), not the same build."""
        try:
            return llama_generation(pinned) == self.flag_generation(engine)
        except ValueError:
            return False

    def search(self, profile) -> tuple[str | None, list[str]]:
        """The llama-server program, and every place looked at on the way (for messages and `doctor`).

        In order: ``engine.executable``; ``llama-server`` on PATH; then specops' own CPU build
        (``specops engines setup llamacpp``, only once its build finished) — for CPU profiles only
        (``gpus.devices`` unset or ``[]``): it has no GPU support, so a profile that names GPUs never gets it
        by accident (point ``engine.executable`` at it to use it anyway).
        """
        if profile.engine.executable:
            return profile.engine.executable, [f"engine.executable {profile.engine.executable}"]
        found = shutil.which("llama-server")
        if found:
            return found, [f"`llama-server` on PATH: {found}"]
        looked = ["no `llama-server` on PATH"]
        return dev_engine_for(profile, self.dev_engine_pattern, self.engine_setting, looked), looked

    def find_executable(self, profile) -> str | None:
        """The llama-server program (see :meth:`search`), or None."""
        return self.search(profile)[0]

    def engine_info(self, profile, version=None, *, probe=True):
        pinned, source = pinned_version(profile, version)
        if pinned and not (probe and profile.engine.executable):
            try:
                llama_generation(pinned)
            except ValueError as exc:
                raise SpecopsError(str(exc)) from None
            return EngineInfo(self.name, pinned, source, ("llama-server",))
        exe, looked = self.search(profile) if probe else (None, [])
        if exe is None:
            where = f"; looked at: {'; '.join(looked)}" if looked else ""
            raise SpecopsError(f"{self.install_hint}{where} (or render for a pinned version with --backend-version)")
        info = probe_llama_server(exe)
        if looked and looked[-1].startswith(DEV_ENGINE):
            info = dataclasses.replace(info, source=f"{DEV_ENGINE}, {info.source}")
        return info

    # ------------------------------------------------------------------ rendering
    def render(self, profile, engine, *, host=None, port=None):
        p, g = profile, profile.gpus
        gen = (
            llama_generation_from_help(engine.flags, _spec_types(engine))
            if engine.flags is not None
            else llama_generation(engine.version)
        )
        host = host or p.server.host
        port = port or p.server.port
        argv: list[str] = list(engine.invocation or ("llama-server",))
        argv += _model_args(p.model.id, p.model.file, p.model.quantization, "-m", "-hf", "-hff")
        if p.model.max_model_len:
            argv += ["-c", str(p.model.max_model_len)]
        argv += ["--host", host, "--port", str(port), "--metrics"]
        if p.model.served_name:
            argv += ["-a", p.model.served_name]
        if p.server.parallel:
            argv += ["-np", str(p.server.parallel)]
        env = dict(p.server.env)
        if p.server.api_key:  # in the environment, not argv: argv is visible to every user in `ps`
            env["LLAMA_API_KEY"] = p.server.api_key

        # layout
        explicit = bool(g.devices) or g.gpu_layers is not None or g.tensor_split or g.split_mode
        if g.devices is not None:
            argv += ["-dev", ",".join(f"CUDA{d}" for d in g.devices) or "none"]
        if g.gpu_layers is not None:
            argv += ["-ngl", str(g.gpu_layers)]
        if g.split_mode:
            argv += ["-sm", g.split_mode]
        if g.tensor_split:
            argv += ["-ts", ",".join(f"{x:g}" for x in g.tensor_split)]
        if g.main_gpu is not None:
            argv += ["-mg", str(g.main_gpu)]
        if explicit and (engine.knows("-fit") or (engine.flags is None and gen == "current")):
            argv += ["-fit", "off"]

        argv += self._spec_args(p, gen, engine)
        check_extra_args(p.server.extra_args, tuple(argv), ALIASES, FORBIDDEN, engine.flags)
        argv += p.server.extra_args
        return self.launch_plan(
            p,
            engine,
            argv,
            env,
            host,
            port,
            model_name=p.model.served_name or _default_alias(p.model.id),
            notes=(f"{GENERATION_NOTE}{gen}",),
            api_key=p.server.api_key,
        )

    def _spec_args(self, p, gen: str, engine: EngineInfo) -> list[str]:
        spec, g, method = p.speculative, p.gpus, p.speculative.method
        if method is Method.NONE:
            return []
        if method is Method.AUTO or spec.draft == "auto":
            raise RenderError(
                ("speculative", "method" if method is Method.AUTO else "draft"),
                "`auto` must be resolved first: run `specops resolve` / `specops lock`",
            )
        types = SPEC_TYPE[gen]
        problem = _generation_problem(method, gen, engine.version)
        if problem:
            raise RenderError(("speculative", "method"), problem)
        out: list[str] = []
        if spec.draft:
            out += _model_args(
                spec.draft, spec.draft_file, spec.draft_quantization or DEFAULT_DRAFT_QUANT, "-md", "-hfd", None
            )
        if method is Method.NGRAM:
            ngram_type = spec.ngram.type or types[Method.NGRAM]
            if gen == "spec-type" and ngram_type == "ngram-mod":
                raise RenderError(("speculative", "ngram", "type"), "ngram-mod needs a newer llama-server")
            out += ["--spec-type", ngram_type]
            return out
        if gen not in DRAFT_WITHOUT_SPEC_TYPE:
            out += ["--spec-type", types[method]]
        k = spec.k
        new_names = gen in ("spec-draft", "current")
        out += ["--spec-draft-n-max" if new_names else "--draft-max", str(k)]
        if spec.num_speculative_tokens_min is not None:
            out += ["--spec-draft-n-min" if new_names else "--draft-min", str(spec.num_speculative_tokens_min)]
        if spec.draft_p_min is not None:
            out += ["--spec-draft-p-min" if new_names else "--draft-p-min", f"{spec.draft_p_min:g}"]
        if g.draft_gpu_layers is not None:
            out += ["-ngld", str(g.draft_gpu_layers)]
        if g.draft_devices is not None:
            out += ["-devd", ",".join(f"CUDA{d}" for d in g.draft_devices) or "none"]
        elif g.devices == [] and spec.draft:
            out += ["-devd", "none"]
        return out


def _flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    """The value of the last ``flag`` in ``argv`` (``--flag VALUE`` or ``--flag=VALUE``), else None."""
    value = None
    for i, arg in enumerate(argv):
        if flag_of(arg) != flag:
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            value = argv[i + 1]
    return value


def _count(value: str) -> int | None:
    """A flag's value as a token count; None when it is not one (llama-server refuses it at start)."""
    return int(value) if value.strip().isdigit() else None


def _ngram_draft_length(spec_type: str, plan) -> DraftLength:
    """The drafts of llama-server's n-gram drafter ``spec_type`` in ``plan``: its size flag when extra_args
    set it, else the default of the flag generation whose defaults specops read."""
    flag, default = NGRAM_DRAFT_SIZE[spec_type]
    value = _flag_value(plan.argv, flag) if flag else None
    if value is not None:
        return DraftLength(_count(value), f"{flag} {value} in server.extra_args")
    gen = next((n[len(GENERATION_NOTE) :] for n in plan.notes if n.startswith(GENERATION_NOTE)), None)
    if gen != "current":
        return DraftLength(None, f"{spec_type}: llama-server {plan.engine_version} ({gen} flags) sizes its drafts")
    what = f"{flag}, llama-server default" if flag else "fixed in llama-server"
    return DraftLength(default, f"{spec_type} {what}")


def _is_local(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref.endswith(".gguf") or os.path.exists(ref)


def _check_gguf_ref(path: tuple, ref: str, file: str | None):
    if _is_local(ref):
        if not ref.endswith(".gguf"):
            yield path, f"{ref!r}: llama.cpp needs a .gguf file (or a Hub repo id of GGUF files)"
        if file:
            yield path[:-1] + (("file",) if path[-1] == "id" else ("draft_file",)), "`file` is only for Hub repos"
    elif ref.count("/") != 1:
        yield path, f"{ref!r} is neither a local .gguf file nor a Hub repo id (org/name)"


def _model_args(
    ref: str, file: str | None, quant: str | None, local_flag: str, hub_flag: str, hub_file_flag: str | None
) -> list[str]:
    """``-m FILE`` for local files; ``-hf repo[:QUANT]`` (plus ``-hff FILE``) for Hub repos."""
    if _is_local(ref):
        return [local_flag, ref]
    if file and hub_file_flag:
        return [hub_flag, ref, hub_file_flag, file]
    tag = _quant_of(file) if file else quant
    return [hub_flag, f"{ref}:{tag}" if tag else ref]


def _quant_of(filename: str) -> str | None:
    m = re.search(r"(I?Q\d+_[A-Z0-9_]+|F16|BF16|F32|Q8_0)", filename.upper())
    return m.group(1) if m else None


def _default_alias(model_id: str) -> str:
    return Path(model_id).name if _is_local(model_id) else model_id


# ---------------------------------------------------------------------- probing a llama-server binary


def probe_llama_server(exe: str) -> EngineInfo:
    """Version from ``--version`` (stderr) and the flag set from ``--help`` (flags marked removed excluded)."""

    def run(flag: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(
                [exe, flag], capture_output=True, text=True, timeout=30, env={**os.environ, "LLAMA_LOG_COLORS": "0"}
            )
        except FileNotFoundError:
            raise SpecopsError(
                f"llama-server not found at {exe}: fix engine.executable, or unset it to search PATH "
                "(and, for CPU profiles, specops' engine cache)"
            ) from None
        except PermissionError:
            raise SpecopsError(f"{exe} is not executable") from None
        except subprocess.TimeoutExpired:
            raise SpecopsError(f"{exe} {flag} did not answer within 30 s") from None

    ver = run("--version")
    m = re.search(r"version:\s*(.+)", ver.stdout + ver.stderr)
    version = m.group(1).strip() if m else "unknown"
    helptext = run("--help")
    if helptext.returncode != 0 or "--port" not in helptext.stdout:
        raise SpecopsError(f"{exe} --help failed (exit {helptext.returncode}); is it llama-server?")
    flags, spec_types = parse_help(helptext.stdout)
    return EngineInfo(
        "llamacpp", version, f"probed {exe}", (exe,), frozenset(flags), exe, {"--spec-type": frozenset(spec_types)}
    )


def parse_help(text: str) -> tuple[set[str], set[str]]:
    """Flags a llama-server ``--help`` lists (each alias), minus removed ones, and the --spec-type values.

    An entry is a line starting with ``-`` (aliases separated by a comma and padding, ``-t,    --threads N``, then
    the value name) plus its indented continuation lines; the description starts at the first run of spaces that
    does not follow a comma. Entries whose text says "has been removed" do not count.
    """
    flags: set[str] = set()
    entries: list[tuple[list[str], str]] = []
    for line in text.splitlines():
        m = re.match(r"^(-[^\s].*?)(?<![,\s])(?:\s{2,}(.*))?$", line)
        if m:
            names = [tok.split("=")[0] for tok in re.split(r",\s*", m.group(1))]
            names = [n.split()[0] for n in names if n.startswith("-")]
            entries.append((names, line))
        elif entries and line.startswith(" "):
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    spec_types: set[str] = set()
    for names, desc in entries:
        if "has been removed" in desc:
            continue
        flags.update(names)
        if "--spec-type" in names:
            spec_types.update(re.findall(r"\b((?:draft|ngram)-[a-z0-9-]+[a-z0-9]|draft\b|none)", desc))
    return flags, spec_types


def _spec_types(engine: EngineInfo) -> frozenset[str]:
    return engine.flag_values.get("--spec-type", frozenset())


@hookimpl
def specops_backends():
    return [LlamaCppBackend()]


assert set(SPEC_TYPE) == set(LLAMA_GENERATIONS)
