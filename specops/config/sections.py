"""The profile's sections: the pydantic models that validate a profile, and the bounds of its numbers.

These classes are the single source of truth for the profile's shape: validation, defaults, the JSON Schema
(`specops schema`) and the field reference in the README (:mod:`specops.config.docs`) all come from them.
Rules that span fields live in :mod:`specops.config.rules`; loading in :mod:`specops.config.profile`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, model_validator

from specops.config.capture import Capture
from specops.config.deploy import Deploy
from specops.config.fields import (  # noqa: F401  (re-exported: the profile's bounds)
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_GPU_INDEX,
    MAX_K,
    MAX_LAYERS,
    MAX_NGRAM,
    MAX_PARALLEL,
    MAX_SEQUENCES,
    MAX_SHARE,
    Duration,
    Section,
)
from specops.config.routing import Routing
from specops.config.spotcheck import Certify
from specops.methods import DEFAULT_K, NEEDS_DRAFT, Method, default_chain
from specops.reponames import repo_file_problem

#: Environment variable names the engine gets (``server.env``): what a POSIX shell accepts.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Prometheus label names (``monitor.labels``).
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


#: Engine versions as they may be written (profile ``engine.version``, ``--backend-version``): PEP 440-ish
#: (``0.32.0``, ``0.11.0rc1``, ``0.8.5+cpu``), llama.cpp builds (``b9100``) and flag generations.
VERSION_TEXT = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$")


def check_version_text(text: str) -> str | None:
    """Why ``text`` cannot be an engine version (without repeating it: it may be anything), else None."""
    if isinstance(text, str) and VERSION_TEXT.match(text):
        return None
    return "not a version: use letters, digits and . + _ - (at most 64 characters), e.g. 0.32.0, b9100 or current"


def _version_text(value: str | None) -> str | None:
    if value is not None:
        problem = check_version_text(value)
        if problem:
            raise ValueError(problem)
    return value


VersionText = Annotated[str, AfterValidator(_version_text)]


def _repo_file(value: str | None) -> str | None:
    if value is not None:
        problem = repo_file_problem(value)
        if problem:
            raise ValueError(f"not a safe file name inside a repo: {problem}")
    return value


#: A file inside a Hub repo (``model.file``, ``speculative.draft_file``): relative, no ``..``, no NUL.
RepoFile = Annotated[str, AfterValidator(_repo_file)]


class EngineSpec(Section):
    """Where the engine comes from and which version to render for."""

    version: VersionText | None = Field(
        None,
        description="Engine version to render for (e.g. `0.32.0` for vLLM, "
        "a release build such as `b9100` or a flag generation `legacy|spec-type|spec-draft|current` "
        "for llama-server; letters, digits, `.+_-`, at most 64 characters). Unset: probe the "
        "installed engine.",
    )
    executable: str | None = Field(
        None,
        description="Path to the engine program (`vllm` or `llama-server`). "
        "Unset: search PATH and the specops engine cache.",
    )
    python: str | None = Field(
        None,
        description="vLLM only: a Python interpreter or virtualenv directory "
        "that has vLLM installed; specops runs `python -m vllm.entrypoints.openai.api_server`.",
    )
    ready_timeout: Duration = Field(
        600.0,
        description="How long the engine may take to answer `/health` with 200 before the launch counts as failed.",
    )


class ModelSpec(Section):
    """The target model that serves the requests."""

    id: str = Field(
        ...,
        min_length=1,
        description="Hugging Face repo id (`org/name`), a local directory, "
        "or for llama.cpp a local `.gguf` file or a GGUF repo id with `file`/`quantization`.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the target.")
    file: RepoFile | None = Field(None, description="llama.cpp: the `.gguf` file inside a Hub repo.")
    quantization: str | None = Field(
        None, description="vLLM `--quantization`; llama.cpp: which GGUF quant to pick from a Hub repo (e.g. `Q4_K_M`)."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        le=MAX_CONTEXT,
        description="Context length to serve (vLLM `--max-model-len`, "
        "llama.cpp `-c`). Also checked against the draft's trained context.",
    )
    dtype: str = Field("auto", description="vLLM `--dtype` (auto, float16, bfloat16, float32).")
    served_name: str | None = Field(
        None,
        description="Name clients use in requests (`--served-model-name` / `--alias`). Unset: the engine's default.",
    )
    trust_remote_code: bool = Field(False, description="vLLM `--trust-remote-code`.")


class NgramSpec(Section):
    """Prompt-lookup (n-gram) drafting: propose the tokens that followed the last n-gram in the context."""

    min: int = Field(2, ge=1, le=MAX_NGRAM, description="Shortest n-gram to match (vLLM `prompt_lookup_min`).")
    max: int = Field(5, ge=1, le=MAX_NGRAM, description="Longest n-gram to match (vLLM `prompt_lookup_max`).")
    type: str | None = Field(
        None,
        description="llama.cpp n-gram implementation: `ngram-mod` (default), "
        "`ngram-simple`, `ngram-map-k`, `ngram-map-k4v` or `ngram-cache`.",
    )


class ChainStep(Section):
    """One step of the fallback chain. A bare method name is shorthand for `{method: NAME}`."""

    method: Method = Field(..., description="Method of this step (`auto` is not allowed here).")
    draft: str | None = Field(None, description="Draft for this step when it needs one (`draft_model`, `eagle`, ...).")
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=MAX_K, description="k for this step; unset: the method default."
    )


def _method_name(v: Any) -> Any:
    return {"method": v} if isinstance(v, (str, Method)) else v


def _inlined_schema(model: type[BaseModel]) -> dict:
    """``model``'s JSON Schema with its local ``$defs`` written in place (so it can be embedded anywhere)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.rsplit("/", 1)[-1]])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


class _StepOrMethodSchema:
    """A chain step's JSON Schema: a method name, or the step written inline.

    Inline, because replacing ChainStep's own schema leaves a `$ref` to a definition pydantic never emits
    (`specops schema` failed with KeyError on it). Built when a schema is asked for, not at import: building
    it costs more than the rest of this module and `render`/`validate` never need it.
    """

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        return {"anyOf": [{"type": "string", "enum": [m.value for m in Method]}, _inlined_schema(ChainStep)]}


ChainItem = Annotated[ChainStep, BeforeValidator(_method_name), _StepOrMethodSchema()]


class Speculative(Section):
    """The speculative decoding method and its draft."""

    method: Method = Field(
        Method.NONE,
        description="eagle | eagle3 | medusa | mlp_speculator | draft_model | "
        "mtp | ngram | suffix | none | auto (pick the best that fits, see `specops resolve`).",
    )
    draft: str | None = Field(
        None,
        description="`auto` (resolved from the catalog and the Hub), a Hub repo id, "
        "a local directory, or a local `.gguf` file. Not used by mtp/ngram/suffix/none.",
    )
    draft_revision: str | None = Field(None, description="Hub revision of the draft.")
    draft_file: RepoFile | None = Field(None, description="llama.cpp: the `.gguf` file inside the draft's Hub repo.")
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_K,
        description="Draft tokens per step (k). Unset: 4 for EAGLE-family and draft models, 1 for MTP, 4 for n-gram.",
    )
    num_speculative_tokens_min: int | None = Field(None, ge=0, le=MAX_K, description="llama.cpp `--spec-draft-n-min`.")
    draft_p_min: float | None = Field(
        None, ge=0, le=1, description="llama.cpp `--spec-draft-p-min`: stop drafting below this draft probability."
    )
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    draft_tensor_parallel_size: int | None = Field(
        None, ge=1, le=MAX_PARALLEL, description="vLLM: TP of the draft; 1 or the target's tensor_parallel_size."
    )
    draft_max_model_len: int | None = Field(
        None, gt=0, le=MAX_CONTEXT, description="vLLM `max_model_len` of the draft."
    )
    draft_quantization: str | None = Field(
        None,
        description="vLLM `quantization` of the draft; llama.cpp: "
        "GGUF quant to pick from the draft repo (default Q4_K_M).",
    )
    per_batch_size: list[tuple[int, int, int]] | None = Field(
        None,
        description="vLLM `num_speculative_tokens_per_batch_size`: `[[start_bs, end_bs, k], ...]` "
        "to draft less under high concurrency (k may be 0).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra `--speculative-config` fields for "
        "vLLM, passed through after a check against the target version.",
    )
    checks: Literal["enforce", "warn"] = Field(
        "enforce",
        description="When specops' compatibility checks refuse "
        "the draft at `up`: `enforce` starts the next method of the chain "
        "(and says why); `warn` prints the findings and lets the engine decide.",
    )

    @property
    def k(self) -> int:
        """The number of speculative tokens in effect (explicit, else the method's published default)."""
        return self.num_speculative_tokens or DEFAULT_K.get(self.method, 0)


class Gpus(Section):
    """GPU layout. `devices: []` means CPU only."""

    devices: list[Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]] | None = Field(
        None, description="GPU indices to use (`CUDA_VISIBLE_DEVICES` / `--device`). Unset: engine default; [] = CPU."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_PARALLEL, description="vLLM `--tensor-parallel-size`.")
    pipeline_parallel_size: int = Field(1, ge=1, le=MAX_PARALLEL, description="vLLM `--pipeline-parallel-size`.")
    memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM `--gpu-memory-utilization` (unset: the engine's default, 0.92 in vLLM 0.32.0's CacheConfig).",
    )
    memory_gb: float | None = Field(
        None, gt=0, le=MAX_SHARE, description="Memory budget per GPU in GiB, for the fit check."
    )
    gpu_layers: Annotated[int, Field(ge=0, le=MAX_LAYERS)] | Literal["all", "auto"] | None = Field(
        None, description="llama.cpp `-ngl`: layers on GPU."
    )
    draft_gpu_layers: Annotated[int, Field(ge=0, le=MAX_LAYERS)] | Literal["all", "auto"] | None = Field(
        None, description="llama.cpp `-ngld`."
    )
    draft_devices: list[Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]] | None = Field(
        None, description="llama.cpp `-devd`: GPUs for the draft."
    )
    split_mode: Literal["none", "layer", "row", "tensor"] | None = Field(None, description="llama.cpp `-sm`.")
    tensor_split: list[Annotated[float, Field(ge=0, le=MAX_SHARE)]] | None = Field(
        None, description="llama.cpp `-ts`: share per GPU."
    )
    main_gpu: int | None = Field(None, ge=0, le=MAX_GPU_INDEX, description="llama.cpp `-mg`.")


class Server(Section):
    """Where clients reach the deployment."""

    host: str = Field("127.0.0.1", description="Address to bind. Loopback unless you mean to expose it.")
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description="Public port (served by the specops proxy, or the engine itself when the proxy is off).",
    )
    api_key: str | None = Field(
        None,
        description="API key clients must send (`--api-key`). Use `${ENV_VAR}`; it is redacted in every printed form.",
    )
    parallel: int | None = Field(
        None, ge=1, le=MAX_SEQUENCES, description="Concurrent sequences: llama.cpp `-np`, vLLM `--max-num-seqs`."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra engine arguments, appended after a check "
        "that they do not contradict rendered flags. No secrets (`--api-key`, `--hf-token`): "
        "argv is visible in `ps`; use `api_key` or `env`.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for the engine process "
        "(names: letters, digits, `_`, not starting with a digit).",
    )


class Retry(Section):
    """Trying the better method again after a fallback."""

    enabled: bool = Field(False, description="Try the original method again after `after`.")
    after: Duration = Field(1800.0, description="First wait before retrying; doubles each time the retry fails.")
    max_after: Duration = Field(8 * 3600.0, description="Upper bound of the doubling wait.")


class Goodput(Section):
    """`mode: goodput`: choose the step with the most predicted output tokens/s at the live load."""

    surface: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="The measured goodput surface: a `specops tune` record (`<profile>.tune.json`, or a lock file "
        "with a `tune` entry); a relative path is read from the folder of the profile file that sets it. Unset: learned "
        "online only.",
    )
    hysteresis: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Switch only when the best option's predicted tokens/s beats the current one's by this fraction.",
    )
    sustain: Duration = Field(
        30.0, description="The better option must stay better for this long (a sustained load change) before a switch."
    )
    min_dwell: Duration = Field(60.0, description="No switch within this long after the last one.")
    regime: Duration = Field(
        300.0,
        gt=0,
        description="Expected duration of a load regime (at least as long as it has lasted): the predicted gain over "
        "it must exceed the switch cost.",
    )
    switch_cost: Duration | None = Field(
        None,
        description="Seconds without service per switch (drain + restart + warm-up) until one is measured. Unset: "
        "the engine's measured start time. A switch to a step a live twin runs costs nothing (a route change).",
    )
    stale_half_life: Duration = Field(
        600.0,
        gt=0,
        description="A method that no longer runs keeps its last live acceptance, weighing half after this long (the "
        "surface's the rest), so the policy tries it again when the surface says it pays; a return it leaves within "
        "`regime` doubles this for that method.",
    )


class Fallback(Section):
    """When and how to leave a method whose acceptance is too low."""

    enabled: bool = Field(True, description="Switch methods automatically (false: watch and report only).")
    mode: Literal["threshold", "model", "goodput"] | None = Field(
        None,
        description="`threshold`: switch when acceptance < min_acceptance; `model`: switch when predicted speedup < 1 "
        "(on the verification-cost curve stored for this engine, model and machine, else c_verify = 1); `goodput`: run "
        "the step with the most predicted tokens/s at the live concurrency (see `fallback.goodput`). Unset: on tokens/s "
        "where known: `goodput` when `fallback.goodput.surface` is set, else `model` when a verification-cost curve is "
        "stored (`specops bench PROFILE --probe-verify`), else `threshold`.",
    )
    min_acceptance: float = Field(
        0.6,
        ge=0,
        le=1,
        description="Mode threshold: acceptance rate below which speculation costs more than it gains (published rule "
        "of thumb: 0.6; it knows nothing of what a draft costs).",
    )
    window: Duration = Field(60.0, gt=0, description="Acceptance is measured over this sliding window.")
    min_draft_tokens: int = Field(
        200, ge=1, le=MAX_COUNT, description="Decide only once the window holds this many drafted tokens."
    )
    consecutive_windows: int = Field(
        2, ge=1, le=1000, description="Hysteresis: this many consecutive low windows before a switch."
    )
    chain: list[ChainItem] | None = Field(
        None,
        description="Methods to fall back to, in order. Unset: model-based → [ngram, none]; ngram/suffix → [none].",
    )
    cooldown: Duration = Field(600.0, description="No further switch for this long after one.")
    max_switches_per_hour: int = Field(4, ge=1, le=3600, description="Flap guard: past this, hold the method and warn.")
    draft_cost_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Model mode: cost of one draft step relative to a target step (c). Unset: as measured on this "
        "machine where `specops bench --probe-verify` stored the engine's speculative steps (0 for n-gram and "
        "suffix, whose lookup is inside them; the draft model's own steps), else 0.05.",
    )
    retry: Retry = Field(default_factory=Retry)
    goodput: Goodput = Field(default_factory=Goodput)


class Monitor(Section):
    """Where acceptance is read from."""

    source: Literal["scrape", "promql"] = Field(
        "scrape", description="`scrape`: the engine's /metrics; `promql`: a Prometheus server."
    )
    interval: Duration = Field(5.0, gt=0, description="How often to read.")
    timeout: Duration = Field(3.0, gt=0, description="Timeout of each read.")
    prometheus_url: str | None = Field(None, description="Prometheus base URL for `promql`.")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Label matchers for PromQL "
        "(e.g. job, instance; for vLLM model_name defaults to the served model). Names "
        "follow Prometheus: letters, digits, `_`, not starting with a digit.",
    )


class SupervisorSettings(Section):
    """Process supervision: restarts, crash loops, stopping."""

    restart_backoff: Duration = Field(1.0, description="First wait before restarting a crashed engine (doubles).")
    restart_backoff_max: Duration = Field(60.0, description="Upper bound of the restart wait.")
    crash_loop_exits: int = Field(
        5,
        ge=1,
        le=1000,
        description="This many exits within `crash_loop_window` is a crash loop: move to the next method of the chain.",
    )
    crash_loop_window: Duration = Field(600.0, description="See `crash_loop_exits`.")
    stop_timeout: Duration = Field(30.0, description="After SIGTERM, wait this long before SIGKILL.")
    state_dir: str | None = Field(None, description="Where state and logs live. Unset: ~/.local/state/specops.")


class ProxySettings(Section):
    """The front proxy that keeps the public address stable across restarts and switches."""

    enabled: bool = Field(True, description="Serve `server.port` through specops (false: the engine binds it).")
    engine_port: int | None = Field(
        None, ge=1, le=65535, description="Internal loopback port of the engine. Unset: a free port."
    )
    queue_size: int = Field(256, ge=0, description="Requests that may wait while the engine is switching.")
    queue_timeout: Duration = Field(120.0, description="Longest wait in the queue before a 503 with Retry-After.")
    drain_timeout: Duration = Field(
        60.0,
        description="How long in-flight requests may finish before a switch, or a stop (SIGTERM), stops the engine.",
    )
    retry_unstarted: bool = Field(
        True, description="Retry once on the next engine a request that failed before any response byte (false: 502)."
    )
    admin_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve /specops/status and /specops/metrics only on this loopback port. Unset: on the public port.",
    )
    max_body_size: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest request body in bytes "
        "(16 MiB); larger ones get 413, refused from their Content-Length without reading.",
    )
    max_buffered_bytes: int = Field(
        128 * 1024 * 1024,
        ge=1024,
        le=64 * 1024**3,
        description="Request bodies the "
        "proxy may hold at once, queued ones included (128 MiB); past it a request gets "
        "503 with Retry-After.",
    )
    max_connections: int = Field(
        1024, ge=1, le=65536, description="Open client connections; past it a new one gets 503 and is closed at once."
    )
    header_timeout: Duration = Field(
        10.0,
        gt=0,
        le=3600,
        description="A client must send a request's headers within "
        "this long after connecting or after its previous answer, else it is "
        "disconnected (also the idle keep-alive timeout).",
    )
    body_timeout: Duration = Field(
        60.0, gt=0, le=3600, description="A request body must arrive within this long, else 408."
    )
    send_timeout: Duration = Field(
        30.0,
        gt=0,
        le=3600,
        description="A client that reads nothing of its answer for this long (the proxy has more to send) "
        "is disconnected and its engine request cancelled.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_http_layer(cls, data: Any) -> Any:
        """``proxy.http`` chose between two HTTP layers; one is left (benchmarks/RESULTS.md says why)."""
        if isinstance(data, dict) and "http" in data:
            raise ValueError(
                "proxy.http was removed: the proxy has one HTTP layer, aiohttp's (the `lean` one is gone); "
                "delete the `http` key"
            )
        return data


class Profile(Section):
    """One deployment: a target model, a speculative method, a GPU layout and the safety net around it."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="Deployment name (letters, digits, `.`, `_`, `-`); names state files and logs.",
    )
    description: str = Field("", description="Free text for humans.")
    backend: str = Field(..., min_length=1, description="`vllm`, `llamacpp`, or a backend a plugin registers.")
    engine: EngineSpec = Field(default_factory=EngineSpec)
    model: ModelSpec
    speculative: Speculative = Field(default_factory=Speculative)
    gpus: Gpus = Field(default_factory=Gpus)
    server: Server = Field(default_factory=Server)
    fallback: Fallback = Field(default_factory=Fallback)
    monitor: Monitor = Field(default_factory=Monitor)
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    proxy: ProxySettings = Field(default_factory=ProxySettings)
    deploy: Deploy = Field(default_factory=Deploy)
    certify: Certify = Field(default_factory=Certify)
    routing: Routing = Field(default_factory=Routing)
    capture: Capture = Field(default_factory=Capture)

    @property
    def chain(self) -> list[ChainStep]:
        """The fallback chain in effect (explicit, or the default for the method)."""
        if self.fallback.chain is not None:
            return list(self.fallback.chain)
        return [ChainStep(method=m) for m in default_chain(self.speculative.method)]

    @property
    def steps(self) -> list[ChainStep]:
        """The primary method followed by the fallback chain: what the supervisor and the policy walk."""
        spec = self.speculative
        primary = ChainStep(method=spec.method, draft=spec.draft, num_speculative_tokens=spec.num_speculative_tokens)
        return [primary] + self.chain

    def at_step(self, index: int) -> Profile:
        """This deployment running step ``index`` of :attr:`steps` (0: the primary method as written)."""
        return self if index == 0 else self.with_step(self.steps[index])

    def with_step(self, step: ChainStep) -> Profile:
        """This profile switched to a chain step: the method changes, the rest of the deployment stays."""
        spec = self.speculative.model_copy(
            update={
                "method": step.method,
                "draft": step.draft if step.method in NEEDS_DRAFT else None,
                "num_speculative_tokens": step.num_speculative_tokens,
            }
        )
        return self.model_copy(update={"speculative": spec})


#: The keys a file named by ``extends`` may have at its top level (else it is not a profile).
TOP_LEVEL_FIELDS = frozenset(Profile.model_fields) | {"extends"}
