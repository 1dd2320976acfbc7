"""What every backend provides, and the plan it renders.

A backend is an object registered through the ``specops_backends`` hook. It knows its name, the methods
it can run, how to find and probe its engine, how to render a :class:`LaunchPlan` for a profile, where
health and metrics live, and how to read acceptance from its metrics. Rendering is pure: the same profile
and :class:`EngineInfo` always give the byte-identical plan.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property

from specops.backends import measured
from specops.config.profile import check_version_text  # re-exported for backends
from specops.errors import SpecopsError
from specops.methods import Method
from specops.redact import MARK, MIN_SUBSTRING, Redactor, looks_secret, shell_quote, unmark
from specops.urls import http_url  # re-exported for backends

__all__ = [
    "Backend",
    "DraftLength",
    "EngineInfo",
    "LaunchPlan",
    "RenderError",
    "check_extra_args",
    "check_version_text",
    "counter_total",
    "flag_of",
    "http_url",
    "k_source",
    "looks_secret",
    "pinned_version",
]


@dataclass(frozen=True)
class EngineInfo:
    """The engine a plan is rendered for: its version, how to invoke it, and which flags it knows."""

    backend: str
    version: str
    source: str  # where the version came from, for messages
    invocation: tuple[str, ...] = ()  # program prefix, e.g. ("vllm", "serve") or (python, "-m", ...)
    flags: frozenset[str] | None = None  # flags the binary's --help lists (None: not probed)
    executable: str | None = None  # resolved program path when probed
    flag_values: dict = field(default_factory=dict, compare=False, hash=False)  # flag -> values its help lists

    def knows(self, flag: str) -> bool | None:
        """Whether the probed binary lists ``flag``; None when the flag set is unknown."""
        return None if self.flags is None else flag in self.flags


@dataclass(frozen=True)
class DraftLength:
    """How many tokens one draft of a rendered plan can have, as the engine runs it, and what sets that.

    Not always the profile's k: llama-server's n-gram drafters size their drafts with their own flags
    (ngram-mod drafts up to 64 tokens by default), so reports show this instead of a k the engine ignores.
    ``most``: the longest draft (None: the engine decides and specops cannot tell); ``exact``: every draft
    is that long (vLLM's draft models), else drafts may be shorter; ``source``: the setting and whose value
    it is, e.g. ``--spec-ngram-mod-n-max, llama-server default``.
    """

    most: int | None
    source: str
    exact: bool = False

    @property
    def text(self) -> str:
        """``4``, ``up to 64`` or ``set by the engine``."""
        if self.most is None:
            return "set by the engine"
        return str(self.most) if self.exact else f"up to {self.most}"

    def describe(self) -> str:
        """``up to 64 (--spec-ngram-mod-n-max, llama-server default)``."""
        return f"{self.text} ({self.source})" if self.source else self.text

    def to_dict(self) -> dict:
        return {
            "most": self.most,
            "exact": self.exact,
            "source": self.source,
            "length": self.text,
            "text": self.describe(),
        }


@dataclass(frozen=True)
class LaunchPlan:
    """Exactly what will be executed: argv, extra environment, and where the engine will answer."""

    backend: str
    engine_version: str
    method: Method
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    host: str
    port: int
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    model_name: str = ""  # the name the engine reports in metrics and /v1/models
    secrets: tuple[str, ...] = field(default=(), repr=False)
    notes: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # for specops' own requests (e.g. llama /metrics)
    #: Secret texts with their masked form (``x/sk-…`` → ``x/`` + MARK), for text that contains them.
    masks: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)
    #: The printed form of :meth:`raw_dict` with each known secret position marked (see specops.redact),
    #: set by :func:`specops.backends.render.render_plan` for values interpolated from the environment; None: no such values.
    display: dict | None = field(default=None, repr=False, compare=False)
    #: What the backend says the drafts of this plan are (:meth:`Backend.draft_length`; set by
    #: :meth:`Backend.launch_plan`); None: no speculation, or a plan built without it.
    draft_length: DraftLength | None = field(default=None, compare=False)

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def base_url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def health_url(self) -> str:
        return self.base_url + self.health_path

    @property
    def metrics_url(self) -> str:
        return self.base_url + self.metrics_path

    @cached_property
    def _redactor(self) -> Redactor:
        return Redactor(list(self.secrets) + [v for k, v in self.env if looks_secret(k)], self.masks)

    @cached_property
    def _known(self) -> dict[str, str]:
        """Whole argv elements and environment values known to contain a secret → their printed form."""
        shown = self._marked()
        pairs = list(zip(self.argv, shown["argv"])) + [(v, shown["env"].get(k, v)) for k, v in self.env]
        out: dict[str, str] = {}
        for real, marked in pairs:
            if MARK in marked:
                out.setdefault(real, unmark(marked))
        # a short text that is also printed plainly elsewhere (a secret `1` and `--tensor-parallel-size 1`)
        # cannot be told apart by its text alone: print it as is rather than mask the plain one too
        plain = {real for real, marked in pairs if MARK not in marked}
        return {k: v for k, v in out.items() if len(k) >= MIN_SUBSTRING or k not in plain}

    def redact(self, text: str) -> str:
        """``text`` (an argument, a value, an engine output line) with every secret of this plan as ``***``.

        A text equal to an argument or environment value that holds a secret prints as that one does;
        otherwise secrets are searched for (long ones only, see specops.redact), and URL passwords hidden.
        """
        known = self._known.get(text)
        return known if known is not None else unmark(self._redactor.marked(text))

    def printed_argv(self) -> list[str]:
        """The argv as every printed form shows it (secrets as ``***`` where they stand)."""
        return self.to_dict()["argv"]

    def printed_env(self) -> dict[str, str]:
        """The extra environment as every printed form shows it."""
        return self.to_dict()["env"]

    def raw_dict(self) -> dict:
        """Everything a printed form shows, unredacted (never print this)."""
        return {
            "backend": self.backend,
            "engine_version": self.engine_version,
            "method": self.method.value,
            "argv": list(self.argv),
            "env": dict(self.env),
            "url": self.base_url,
            "health_url": self.health_url,
            "metrics_url": self.metrics_url,
            "model_name": self.model_name,
            "notes": list(self.notes),
        }

    def _marked(self) -> dict:
        """:meth:`raw_dict` with every secret part replaced by MARK, each value on its own (before quoting)."""
        base = self.display if self.display is not None else self.raw_dict()
        mark = self._redactor.marked

        def walk(value):
            if isinstance(value, str):
                return mark(value)
            if isinstance(value, list):
                return [walk(v) for v in value]
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            return value

        out = {k: walk(v) for k, v in base.items() if k not in ("backend", "method")}
        out["backend"], out["method"] = self.backend, self.method.value
        out["env"] = {k: (MARK if looks_secret(k) and v else v) for k, v in out["env"].items()}
        return {k: out[k] for k in base}

    def shell(self) -> str:
        """A POSIX shell line (environment assignments, then the command); secrets redacted.

        Each value is redacted before it is quoted, so a secret with a quote in it cannot leak in pieces,
        and ``***`` stands outside the quotes (``KEY=***``).
        """
        shown = self._marked()
        env = " ".join(f"{k}={shell_quote(v)}" for k, v in shown["env"].items())
        return (env + " " if env else "") + " ".join(shell_quote(a) for a in shown["argv"])

    def to_dict(self) -> dict:
        """A JSON-ready description; secrets redacted."""

        def walk(value):
            if isinstance(value, str):
                return unmark(value)
            if isinstance(value, list):
                return [walk(v) for v in value]
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            return value

        return walk(self._marked())


class RenderError(ValueError):
    """The profile cannot be rendered for this engine version; the message says why and what to do."""

    def __init__(self, path: tuple, message: str):
        self.path = path
        super().__init__(message)


class Backend:
    """Base class for backends. Subclasses set the class attributes and override the methods."""

    name: str = ""
    methods: frozenset[Method] = frozenset()
    health_path = "/health"
    metrics_path = "/metrics"
    #: True when one replica uses exactly tensor_parallel_size × pipeline_parallel_size GPUs (vLLM); False
    #: when the engine splits layers over however many ``gpus.devices`` it is given (llama.cpp).
    parallel_layout: bool = True
    #: One line that tells an operator how to get the engine when it is missing.
    install_hint: str = ""
    #: Prefix of the engine's Prometheus series (``vllm:``, ``llamacpp:``).
    metric_prefix: str = ""
    #: The engine's own gauge of the requests it runs now (an autoscaler of a speculating pool reads it); empty:
    #: none, and specops' proxy in-flight gauge stands in.
    running_requests_metric: str = ""
    #: True when responses carry per-request speculative ``timings`` the proxy can add up live (llama.cpp),
    #: so the window stays current during long generations; False: acceptance only from the engine's metrics.
    live_timings: bool = False
    #: True when the engine logs per-request acceptance lines (llama-server) that can stand in for missing
    #: spec-decode counters; False: its log is not read for acceptance.
    log_acceptance: bool = False
    #: The engine's name in messages (``vLLM``, ``llama.cpp``); empty: the backend's ``name``.
    display_name: str = ""
    #: How :mod:`specops.perf.verifyprobe` times a pass over n new tokens on this engine: ``"llama-server"``
    #: (``/tokenize`` with ``content``, the engine's own ``timings.prompt_ms``), ``"openai"`` (``/tokenize`` with
    #: ``prompt``, time to first token over the OpenAI API: inferred, vLLM); empty: no probe.
    verify_probe: str = ""
    #: What the engine loads: ``"hf"`` (Hugging Face repos/directories) or ``"gguf"`` (GGUF files, llama.cpp);
    #: decides which drafts the resolver finds, fetches and accepts.
    model_format: str = "hf"
    #: How many tokens a separate draft model's vocabulary may differ from the target's (llama.cpp: 128,
    #: comparing token text); 0: the vocabularies must be equal.
    draft_vocab_tolerance: int = 0
    #: True when the engine labels its series with ``model_name`` (vLLM), so a query may select the served
    #: model by it; False: adding that label would match nothing.
    model_name_label: bool = False
    #: What ``specops advise`` tells an operator about high concurrency when the engine takes no k per batch
    #: size (see :meth:`takes_per_batch_size`); empty: nothing.
    concurrency_note: str = ""
    #: Speculative methods the engine has that specops does not render, in the engine's own spelling, each
    #: with what it is and how to run it anyway (so ``specops plugins`` and errors say so instead of
    #: pretending the method does not exist).
    engine_only_methods: dict[str, str] = {}

    @property
    def engine_name(self) -> str:
        """:attr:`display_name`, or the backend's name when it sets none."""
        return self.display_name or self.name

    def unsupported_method_text(self, method: Method) -> str:
        """Why a profile cannot use ``method`` with this backend, naming what it can use instead."""
        text = (
            f"backend {self.name} does not support method {method} "
            f"(supported: {', '.join(sorted(m.value for m in self.methods))})"
        )
        near = [f"{name} ({what})" for name, what in self.engine_only_methods.items() if method.value in name]
        return text + (f"; {self.engine_name} itself has {', '.join(near)}" if near else "")

    def method_problem(self, method: Method, version: str | None, *, cpu: bool = False) -> str | None:
        """Why engine ``version`` cannot run ``method``: its version gate (read in the engine's source), or a
        refusal the support matrix measured on that version (``cpu``: for a CPU profile, where refusals the
        CPU build raised count too). None when it can, or when nothing is known."""
        if not version or method in (Method.NONE, Method.AUTO):
            return None
        return self.method_version_problem(method, version) or measured.refusal(
            self.name, method.value, version, self.engine_name, cpu=cpu
        )

    def support(self, method: Method, version: str | None) -> tuple[str, str] | None:
        """``("measured" | "inferred", why)``: was ``method`` on ``version`` seen running on the engine."""
        if not version or method in (Method.NONE, Method.AUTO):
            return None
        return measured.support(self.name, method.value, version, self.engine_name)

    def heterogeneous_vocab(self, version: str | None) -> dict | None:
        """Speculative options that let a separate draft model with another vocabulary run on ``version``
        (None: the engine needs equal vocabularies there). An unknown version is assumed to have them."""
        return None

    def method_version_problem(self, method: Method, version: str) -> str | None:
        """Why engine ``version`` (as a profile pins it) cannot run ``method``, else None (also when unsure).

        Lets ``specops validate --resolve`` refuse a pin before anything is rendered; the default knows no
        version gates, and render() still refuses what it cannot express.
        """
        return None

    def check_profile(self, profile) -> Iterable[tuple[tuple, str]]:
        """Backend-specific rules: yield ``(field_path, message)`` for each problem."""
        return ()

    def engine_info(self, profile, version: str | None = None, *, probe: bool = True) -> EngineInfo:
        """Which engine to render for: ``version`` if given, else ``engine.version``, else probe it."""
        raise NotImplementedError

    def render(self, profile, engine: EngineInfo, *, host: str | None = None, port: int | None = None) -> LaunchPlan:
        """The plan for ``profile`` on ``engine``; binds ``host:port`` (default: the profile's server)."""
        raise NotImplementedError

    def launch_plan(
        self,
        profile,
        engine: EngineInfo,
        argv: Iterable[str],
        env: dict[str, str],
        host: str,
        port: int,
        *,
        model_name: str,
        notes: Iterable[str] = (),
        secrets: Iterable[str] = (),
        api_key: str | None = None,
    ) -> LaunchPlan:
        """The plan a render ends with, the same for every backend.

        Values of secret-named environment variables, and ``secrets`` (e.g. a key an engine takes in argv),
        are kept out of every printed form; ``api_key`` is what specops itself sends to the engine.
        """
        env_items = tuple(sorted(env.items()))
        plan = LaunchPlan(
            backend=self.name,
            engine_version=engine.version,
            method=profile.speculative.method,
            argv=tuple(argv),
            env=env_items,
            host=host,
            port=port,
            health_path=self.health_path,
            metrics_path=self.metrics_path,
            model_name=model_name,
            secrets=(*secrets, *(v for k, v in env_items if looks_secret(k))),
            notes=tuple(notes),
            api_key=api_key,
        )
        return replace(plan, draft_length=self.draft_length(profile, plan))

    def draft_length(self, profile, plan: LaunchPlan) -> DraftLength | None:
        """How long the drafts of ``plan`` (rendered from ``profile``) are, as the engine runs it; None without
        speculation. Reports print this, never a k the engine ignores. The default: the profile's k where
        the method takes one (:meth:`k_applies`), else "set by the engine"; a backend whose engine sizes
        drafts otherwise says so here."""
        spec = profile.speculative
        if spec.method is Method.NONE:
            return None
        if not self.k_applies(spec.method):
            return DraftLength(None, f"{self.engine_name} sizes {spec.method} drafts itself")
        return DraftLength(spec.k, k_source(spec))

    def acceptance_counters(self, metrics_text: str, model_name: str | None = None, openmetrics: bool = False):
        """Spec-decode counters (a :class:`specops.backends.counters.SpecCounters`) from this engine's /metrics text.

        ``None`` means the engine exposes no speculative series (speculation off or stats disabled), which
        is not a failure. Raises ``ValueError`` for text that is not a Prometheus exposition. The default
        reads the ``<metric_prefix>spec_decode_*`` counters; a backend with other metrics overrides this.
        """
        from specops.backends.counters import parse_spec_counters  # prometheus_client: only when watching

        return parse_spec_counters(metrics_text, self.metric_prefix, model_name, openmetrics=openmetrics)

    def generated_tokens(self, metrics_text: str) -> float | None:
        """Total generated tokens in this engine's /metrics text (for tokens/s in ``specops status``).

        None: the backend knows no such counter (the default, safe for any engine); a backend that knows
        one returns its sum over all series, 0.0 when the text has none yet.
        """
        return None

    #: Output lines by which the engine says it cannot bind its HTTP address (the port is taken, or not
    #: allowed): Python's and uvicorn's wording (vLLM); a backend adds its engine's own.
    BIND_FAILED = re.compile(r"address already in use|\[Errno 98\]|error while attempting to bind", re.I)

    def bind_failure(self, line: str) -> str | None:
        """The engine's words when ``line`` says it could not bind its address, else None. No speculative
        method fixes that: ``up`` stops the instance instead of restarting it or falling back."""
        m = self.BIND_FAILED.search(line)
        return line[m.start() :].strip()[:200] if m else None

    def launch_problem(self, line: str) -> str | None:
        """Why an engine output line shows the speculative method did not take effect, else None.

        Some engines keep serving without speculation when the draft cannot be used (llama-server logs the
        error and carries on); the supervisor treats such a line, seen before ready, as a failed launch.
        """
        return None

    # ---- what `specops doctor` asks of an engine (the defaults: a backend that finds its engine itself)
    #: The program ``up`` runs from PATH for a pinned ``engine.version`` when the profile names no
    #: ``engine.python``/``engine.executable`` (``vllm``, ``llama-server``); empty: none doctor can look for.
    program: str = ""
    #: The profile setting that points specops at an installed engine (``engine.python`` for vLLM,
    #: ``engine.executable`` for llama.cpp): named in advice, and set by doctor to probe a program it found.
    engine_setting: str = "engine.executable"
    #: Glob, under specops' engine cache, of the program of this engine's CPU development build (see
    #: :mod:`specops.backends.devengines`); empty: the backend has none.
    dev_engine_pattern: str = ""

    def search(self, profile) -> tuple[str | None, list[str]] | None:
        """Where the engine for ``profile`` is (None: not found), and every place looked at on the way.

        None (the default): the backend has no discovery to show, and :meth:`engine_info` finds (or
        probes) its engine by itself.
        """
        return None

    def flag_generation(self, engine: EngineInfo) -> str:
        """The flag generation of ``engine`` (probed: from its --help, else from its version), for messages;
        empty: the engine has no such generations, or it cannot be told."""
        return ""

    def pin_matches(self, pinned: str, engine: EngineInfo) -> bool:
        """Whether a profile pinned to ``engine.version: pinned`` renders as it would for the probed ``engine``
        (the default: the same version text)."""
        return pinned == engine.version

    # ---- what `specops k8s render` asks of an engine
    #: The ways it runs one replica across several nodes (``deploy.multi_node.mode``); the first is the
    #: default; empty: specops has no multi-node layout for it.
    multi_node_modes: tuple[str, ...] = ()
    #: The variable that says where the engine's own downloads go (llama-server ``-hf``: ``LLAMA_CACHE``), and
    #: the folder under the pods' HF cache volume it points at; empty: the engine downloads through HF_HOME.
    download_cache_env: str = ""
    download_cache_dir: str = ""

    # ---- what `specops tune` asks of an engine (capabilities; the defaults suit an engine without quirks)
    #: Seconds the engine typically takes to become ready, before a start was measured (sizes a tune budget).
    launch_prior_s: float = 30.0

    def k_applies(self, method: Method) -> bool:
        """Whether ``method`` takes a number of draft tokens (k) on this engine."""
        return method is not Method.NONE

    def ngram_variants(self, engine: EngineInfo | None = None) -> tuple[str, ...]:
        """N-gram drafters the engine selects by name (for ``engine``: those its build knows); empty: tuned by k."""
        return ()

    def ngram_variant_of(self, plan: LaunchPlan) -> str | None:
        """The n-gram drafter a rendered plan runs (the engine's default when the profile names none)."""
        return None

    def takes_per_batch_size(self, engine_version: str | None) -> bool:
        """Whether this engine (at ``engine_version``; None: unknown) takes a k per batch-size range."""
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def k_source(spec) -> str:
    """Where a rendered k comes from: ``speculative.num_speculative_tokens``, or the method's default."""
    if spec.num_speculative_tokens is not None:
        return "speculative.num_speculative_tokens"
    return f"specops' default k for {spec.method}"


def pinned_version(profile, version: str | None) -> tuple[str | None, str]:
    """The engine version asked for (``--backend-version``, else the profile's ``engine.version``; None when
    neither names one) and where it came from, for messages; a malformed version is an error naming its source."""
    pinned, source = (version, "--backend-version") if version else (profile.engine.version, "profile engine.version")
    if pinned and (problem := check_version_text(pinned)):
        raise SpecopsError(f"{source}: {problem}")
    return pinned, source


def counter_total(metrics_text: str, name: str) -> float:
    """The sum of every sample of the counter ``name`` (any labels) in classic-format /metrics text."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)", re.M)
    return float(sum(float(v) for v in pattern.findall(metrics_text)))


def flag_of(arg: str) -> str | None:
    """``--port=8000`` → ``--port``; a value (not a flag) → None. Negative numbers are values."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    return arg.split("=", 1)[0]


def check_extra_args(
    extra: list[str],
    rendered: tuple[str, ...],
    aliases: list[frozenset[str]],
    forbidden: dict[str, str] | None = None,
    known: frozenset[str] | None = None,
) -> None:
    """Refuse extra args that contradict the rendered flags, are forbidden, or the engine does not know.

    ``aliases`` lists groups of spellings of the same flag (``-tp``/``--tensor-parallel-size``).
    """

    def group(flag: str) -> frozenset[str]:
        for g in aliases:
            if flag in g:
                return g
        return frozenset({flag})

    taken = {f for f in map(flag_of, rendered) if f}
    for i, arg in enumerate(extra):
        flag = flag_of(arg)
        if flag is None:
            continue
        path = ("server", "extra_args", i)
        if forbidden and flag in forbidden:
            raise RenderError(path, f"{flag}: {forbidden[flag]}")
        clash = sorted(group(flag) & taken)
        if clash:
            raise RenderError(
                path,
                f"{flag} contradicts {clash[0]}, which specops renders from the profile; set the profile field instead",
            )
        if known is not None and not (group(flag) & known):
            raise RenderError(path, f"{flag} is not an option of this engine build (not in its --help)")
