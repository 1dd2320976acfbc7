"""Rules that span fields or need the backend: each problem points at the field to fix.

Pydantic checks each field on its own (:mod:`specops.config.sections`); these rules look at several at
once and at the backend the profile names, and give every problem the path of the field to change, which
:mod:`specops.config.located` maps back to file:line:column.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from specops.config.deploy import K8S_LABEL_KEY, K8S_LABEL_VALUE
from specops.config.engines import engine_names, served_names, splits_gpu_by_share
from specops.config.loaded import LoadedProfile
from specops.config.located import quote_value
from specops.config.routing import MAX_ALIAS, RemoteTwin
from specops.config.sections import (
    ENV_NAME,
    LABEL_NAME,
    MAX_K,
    MAX_SEQUENCES,
    Profile,
)
from specops.errors import Problem
from specops.methods import NEEDS_DRAFT, Method
from specops.redact import secret_flag
from specops.urls import redact_url

if TYPE_CHECKING:
    from specops.plugins import Registry

#: What a rule finds: the path of the field to fix and what is wrong with it.
Findings = Iterator[tuple[tuple, str]]


def semantic_problems(loaded: LoadedProfile, registry: Registry) -> list[Problem]:
    """Rules that span fields or need the backend: each problem points at the field to fix."""
    p = loaded.profile
    backend = registry.backends.get(p.backend)
    out: list[Problem] = []
    for findings in (
        _unknown_backend(p.backend, registry) if backend is None else iter(()),
        _draft_problems(p),
        _layout_problems(p, backend),
        _chain_problems(p, backend),
    ):
        out += [loaded.problem(path, msg) for path, msg in findings]
    # names that end up in a shell line, an environment, a PromQL selector
    out += _name_problems(loaded)
    for findings in (
        _secret_and_option_problems(p),
        _monitor_and_port_problems(p),
        _backend_problems(p, backend) if backend is not None else iter(()),
        _deploy_problems(p, backend),
        _routing_problems(p),
    ):
        out += [loaded.problem(path, msg) for path, msg in findings]
    out += _node_selector_problems(loaded)
    return out


def _unknown_backend(name: str, registry: Registry) -> Findings:
    names = sorted(registry.backends)
    hint = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    yield (
        ("backend",),
        (
            f"unknown backend {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" (installed: {', '.join(names) or 'none'})"
        ),
    )


def _draft_problems(p: Profile) -> Findings:
    """The draft must match what the method needs."""
    spec = p.speculative
    method = spec.method
    if method in NEEDS_DRAFT and not spec.draft:
        yield ("speculative", "draft"), f"method {method} needs a draft: a Hub id, a local path, or `auto`"
    if method in (Method.NGRAM, Method.SUFFIX, Method.NONE, Method.MTP) and spec.draft:
        extra = " (MTP uses the target's own MTP layers)" if method is Method.MTP else ""
        yield ("speculative", "draft"), f"method {method} takes no draft{extra}; remove `draft`"
    if method is Method.NONE and spec.num_speculative_tokens is not None:
        yield ("speculative", "num_speculative_tokens"), "method none drafts nothing; remove num_speculative_tokens"
    if spec.ngram.min > spec.ngram.max:
        yield ("speculative", "ngram", "min"), f"ngram.min ({spec.ngram.min}) must be <= ngram.max ({spec.ngram.max})"


def _layout_problems(p: Profile, backend: Any) -> Findings:
    """GPUs, parallelism and lengths that contradict each other."""
    spec, g = p.speculative, p.gpus
    tp = g.tensor_parallel_size
    if spec.draft_tensor_parallel_size not in (None, 1, tp):
        yield (
            ("speculative", "draft_tensor_parallel_size"),
            (f"draft TP must be 1 or the target's tensor_parallel_size ({tp}), not {spec.draft_tensor_parallel_size}"),
        )
    if g.devices:
        if len(set(g.devices)) != len(g.devices):
            yield ("gpus", "devices"), "a GPU is listed twice"
        elif len(g.devices) != tp * g.pipeline_parallel_size and getattr(backend, "parallel_layout", True):
            yield (
                ("gpus", "devices"),
                (
                    f"{len(g.devices)} devices listed but tensor_parallel_size × "
                    f"pipeline_parallel_size = {tp} × {g.pipeline_parallel_size} = "
                    f"{tp * g.pipeline_parallel_size}"
                ),
            )
    if g.devices == [] and (tp > 1 or g.pipeline_parallel_size > 1):
        yield ("gpus", "tensor_parallel_size"), "devices: [] means CPU only; tensor/pipeline parallelism needs GPUs"
    if g.tensor_split and g.devices and len(g.tensor_split) != len(g.devices):
        yield ("gpus", "tensor_split"), f"{len(g.tensor_split)} shares for {len(g.devices)} devices"
    if spec.draft_max_model_len and p.model.max_model_len and spec.draft_max_model_len > p.model.max_model_len:
        yield ("speculative", "draft_max_model_len"), "draft_max_model_len cannot exceed model.max_model_len"
    for i, (start, end, k) in enumerate(spec.per_batch_size or []):
        if not 1 <= start <= end <= MAX_SEQUENCES or not 0 <= k <= MAX_K:
            yield (
                ("speculative", "per_batch_size", i),
                (
                    f"[{_num(start)}, {_num(end)}, {_num(k)}]: need "
                    f"1 <= start_bs <= end_bs <= {MAX_SEQUENCES} and "
                    f"0 <= k <= {MAX_K}"
                ),
            )


def _chain_problems(p: Profile, backend: Any) -> Findings:
    """The fallback chain: no duplicates, no way back to the primary method, every step runnable."""
    method = p.speculative.method
    seen = {method}
    for i, step in enumerate(p.chain):
        path = ("fallback", "chain", i)
        if step.method is Method.AUTO:
            yield path, "`auto` cannot be a fallback step; name a method"
        elif step.method in seen:
            what = "the primary method" if step.method is method else "already in the chain"
            yield path, f"{step.method} is {what}: a chain must not repeat a method (cycle)"
        elif step.method in NEEDS_DRAFT and not step.draft:
            yield path, f"fallback step {step.method} needs a draft: write {{method: {step.method}, draft: ...}}"
        elif step.method not in NEEDS_DRAFT and step.draft:
            yield path, f"fallback step {step.method} takes no draft"
        elif backend is not None and step.method not in backend.methods:
            yield (
                path,
                (
                    f"backend {p.backend} does not support {step.method} "
                    f"(supported: {', '.join(sorted(m.value for m in backend.methods))})"
                ),
            )
        seen.add(step.method)


def _name_problems(loaded: LoadedProfile) -> list[Problem]:
    """Environment variable and Prometheus label names (located at the key, not the value)."""
    p = loaded.profile
    rules = (
        ("server", "env", ENV_NAME, "an environment variable"),
        ("monitor", "labels", LABEL_NAME, "a Prometheus label"),
    )
    out: list[Problem] = []
    for section, key, pattern, what in rules:
        for name in getattr(getattr(p, section), key):
            if not pattern.match(name):
                message = (
                    f"{quote_value(name)} is not {what} name: use letters, digits and _, not starting with a digit"
                )
                out.append(loaded.problem((section, key, name), message, key=True, field=f"{section}.{key}"))
    return out


def _secret_and_option_problems(p: Profile) -> Findings:
    """No secret in argv (``ps`` shows it), and pass-through numbers a JSON document can carry."""
    for i, arg in enumerate(p.server.extra_args):
        flag = secret_flag(arg)
        if flag:
            yield (
                ("server", "extra_args", i),
                (
                    f"{flag} would put a secret on the engine's command line, which "
                    "every user can read in `ps`: set server.api_key, or the engine's "
                    "variable in server.env (e.g. HF_TOKEN: ${HF_TOKEN})"
                ),
            )
    yield from _option_number_problems(p.speculative.options, ("speculative", "options"))


def _monitor_and_port_problems(p: Profile) -> Findings:
    if p.monitor.source == "promql" and not p.monitor.prometheus_url:
        yield ("monitor", "prometheus_url"), "monitor.source is promql: set prometheus_url"
    if p.proxy.enabled and p.proxy.engine_port == p.server.port:
        yield ("proxy", "engine_port"), f"the engine port must differ from the public port {p.server.port}"
    if p.proxy.admin_port is not None and p.proxy.admin_port in (p.server.port, p.proxy.engine_port):
        yield ("proxy", "admin_port"), "the admin port must differ from the public and the engine port"
    if p.certify.spot_check.enabled and not p.proxy.enabled:
        yield (
            ("certify", "spot_check", "enabled"),
            "live spot checks need specops' proxy (it samples the requests and keeps checks to idle moments): "
            "set proxy.enabled: true or turn spot checks off",
        )


def _backend_problems(p: Profile, backend: Any) -> Findings:
    """What the named backend supports, and its own checks of the profile."""
    method = p.speculative.method
    if method is not Method.AUTO and method not in backend.methods:
        yield ("speculative", "method"), backend.unsupported_method_text(method)
    elif p.engine.version:
        problem = backend.method_problem(method, p.engine.version, cpu=p.gpus.devices == [])
        if problem:
            yield ("speculative", "method"), problem
    yield from backend.check_profile(p)


def _num(n: int) -> str:
    text = str(n)
    return text if len(text) <= 12 else text[:8] + "…"


def _option_number_problems(value: Any, path: tuple) -> Findings:
    """Numbers in pass-through settings must be finite and fit in 64 bits (JSON has no Infinity)."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        yield path, "must be a finite number"
    elif isinstance(value, int) and not -(1 << 63) <= value < (1 << 63):
        yield path, "is out of range (a 64-bit integer)"
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _option_number_problems(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _option_number_problems(item, path + (i,))


def _multi_node_modes(backend: Any) -> tuple[str, ...]:
    """The multi-node modes ``backend`` can run (``deploy.multi_node.mode``, the first is the default);
    none for an unknown backend (None)."""
    return tuple(getattr(backend, "multi_node_modes", ()))


def multi_node_mode(p: Profile, backend: Any) -> str | None:
    """The multi-node mode in effect (None for a single node or a backend without one); ``backend``: the
    registered backend ``p.backend`` names (None: unknown)."""
    mn = p.deploy.multi_node
    if mn.nodes <= 1:
        return None
    modes = _multi_node_modes(backend)
    return mn.mode or (modes[0] if modes else None)


def _deploy_problems(p: Profile, backend: Any) -> Findings:
    """The ``deploy`` section against the rest of the profile (what ``specops k8s render`` needs)."""
    d, g = p.deploy, p.gpus
    mn = d.multi_node
    modes = _multi_node_modes(backend)
    # one replica uses exactly TP × PP GPUs (vLLM), split evenly over its nodes
    tp_layout = backend is not None and getattr(backend, "parallel_layout", True)
    if mn.mode is not None and mn.mode not in modes:
        yield (
            ("deploy", "multi_node", "mode"),
            f"backend {p.backend} runs across nodes with {' or '.join(modes) or 'no mode specops knows'}, not {mn.mode}",
        )
    if mn.nodes > 1:
        if not modes:
            yield ("deploy", "multi_node", "nodes"), f"specops has no multi-node layout for backend {p.backend}"
        if g.devices is not None:
            yield (
                ("gpus", "devices"),
                "a multi-node layout gets its GPUs from the device plugin on each node: remove gpus.devices "
                "(or set deploy.multi_node.nodes: 1)",
            )
        if tp_layout:
            total = g.tensor_parallel_size * g.pipeline_parallel_size
            if total % mn.nodes:
                yield (
                    ("deploy", "multi_node", "nodes"),
                    f"tensor_parallel_size × pipeline_parallel_size = {total} GPUs do not split evenly over "
                    f"{mn.nodes} nodes",
                )
            elif d.resources.gpus is not None and d.resources.gpus != total // mn.nodes:
                yield (
                    ("deploy", "resources", "gpus"),
                    f"each of the {mn.nodes} nodes runs {total // mn.nodes} GPUs of TP × PP = {total}, "
                    f"not {d.resources.gpus}",
                )
    elif mn.mode is not None:
        yield ("deploy", "multi_node", "mode"), "a multi-node mode needs deploy.multi_node.nodes of 2 or more"
    if (
        tp_layout
        and mn.nodes == 1
        and d.resources.gpus is not None
        and d.resources.gpus < g.tensor_parallel_size * g.pipeline_parallel_size
    ):
        yield (
            ("deploy", "resources", "gpus"),
            f"{d.resources.gpus} GPUs per pod but tensor_parallel_size × pipeline_parallel_size = "
            f"{g.tensor_parallel_size * g.pipeline_parallel_size}",
        )
    if d.coordination == "directory" and not d.coordination_dir:
        yield ("deploy", "coordination"), "coordination directory needs deploy.coordination_dir (a shared directory)"
    if d.coordination_dir and d.coordination in ("lease", "off"):
        yield (
            ("deploy", "coordination_dir"),
            f"used only with deploy.coordination directory or auto, not {d.coordination}: remove it",
        )
    if d.startup_timeout is not None and d.startup_timeout < p.engine.ready_timeout:
        yield (
            ("deploy", "startup_timeout"),
            f"shorter than engine.ready_timeout ({_num(int(p.engine.ready_timeout))}s): the kubelet would kill "
            "the pod while specops still waits for the engine",
        )
    for i, t in enumerate(d.tolerations):
        if t.operator == "Exists" and t.value is not None:
            yield ("deploy", "tolerations", i, "value"), "operator Exists matches any value: remove value"
        if t.operator == "Equal" and t.key is None:
            yield ("deploy", "tolerations", i, "key"), "operator Equal needs a key (or use operator: Exists)"
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            yield ("deploy", "tolerations", i, "toleration_seconds"), "toleration_seconds applies to NoExecute only"


def _node_selector_problems(loaded: LoadedProfile) -> list[Problem]:
    out: list[Problem] = []
    for name, value in loaded.profile.deploy.node_selector.items():
        if not K8S_LABEL_KEY.match(name):
            out.append(
                loaded.problem(
                    ("deploy", "node_selector", name),
                    f"{quote_value(name)} is not a Kubernetes label key",
                    key=True,
                    field="deploy.node_selector",
                )
            )
        elif not K8S_LABEL_VALUE.match(value):
            out.append(
                loaded.problem(
                    ("deploy", "node_selector", name),
                    f"{quote_value(value)} is not a Kubernetes label value (at most 63 letters, digits, `-_.`)",
                )
            )
    return out


# ---------------------------------------------------------------------------------------------------
# routing: the section against the rest of the profile


def _routing_problems(p: Profile) -> Findings:
    """The ``routing`` section against the rest of the profile: each problem with the path of the field to fix."""
    r = p.routing
    chain = [s.method for s in p.chain]
    seen: set[Method] = set()
    urls: set[str] = set()
    for i, (twin, method) in enumerate(zip(r.twins, r.twin_methods)):
        remote = isinstance(twin, RemoteTwin)
        path = ("routing", "twins", i, "method") if remote else ("routing", "twins", i)
        what = "a remote twin stands for" if remote else "a twin runs"
        if method is Method.AUTO:
            yield path, "`auto` cannot be a twin; name a step of fallback.chain"
        elif method is p.speculative.method:
            yield path, f"{method} is the primary method: {what} a step of the fallback chain beside it"
        elif method not in chain:
            yield (
                path,
                f"{method} is not a step of the fallback chain ({', '.join(m.value for m in chain) or 'empty'}): "
                f"{what} a chain step",
            )
        elif method in seen:
            yield path, f"{method} is listed twice (one engine, local or remote, per chain step)"
        seen.add(method)
        if remote:
            if twin.url in urls:
                yield ("routing", "twins", i, "url"), f"{redact_url(twin.url)} is listed twice"
            elif _is_own_address(twin.url, p):
                yield (
                    ("routing", "twins", i, "url"),
                    f"{redact_url(twin.url)} is this deployment's own address (server.port {p.server.port}): a remote "
                    "twin is another deployment",
                )
            urls.add(twin.url)
    if r.twins and not p.proxy.enabled:
        yield (
            ("routing", "twins"),
            "twins are served through specops' proxy (it routes each request): set proxy.enabled: true or remove twins",
        )
    if r.local_twins and p.proxy.engine_port is not None:
        yield (
            ("proxy", "engine_port"),
            "with twins every engine gets a free loopback port of its own: remove proxy.engine_port",
        )
    yield from _share_problems(p)
    yield from _alias_problems(p)
    yield from _canary_problems(p)
    if not r.twins:
        if r.rules:
            yield ("routing", "rules"), "route rules need an engine to route to: add routing.twins (e.g. [none])"
        if r.classes.key != "none":
            yield ("routing", "classes", "key"), "learned routing needs an engine to route to: add routing.twins"


def _is_own_address(url: str, p: Profile) -> bool:
    """Whether ``url`` reaches this deployment's own proxy on this machine (its requests would loop)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return port == p.server.port and parts.hostname in {"127.0.0.1", "localhost", "::1", p.server.host}


def _share_problems(p: Profile) -> Findings:
    shares = p.routing.memory_utilization
    if not shares:
        return
    path = ("routing", "memory_utilization")
    if not p.routing.twins:
        yield path, "per-engine GPU shares need twins: add routing.twins or remove routing.memory_utilization"
        return
    if p.gpus.devices == []:
        yield path, "a GPU memory share; this profile runs on CPU (gpus.devices: [])"
        return
    if not splits_gpu_by_share(p.backend):
        yield path, f"{p.backend} does not size GPU memory by a share (--gpu-memory-utilization is vLLM's)"
        return
    names = engine_names(p)
    for key in shares:
        if key not in names:
            yield (*path, key), f"not an engine of this profile (engines: {', '.join(names)})"
    missing = [n for n in names if n not in shares]
    if missing:
        yield path, f"name every engine: {', '.join(missing)} missing (engines: {', '.join(names)})"
    total = p.gpus.memory_utilization or 1.0
    used = sum(shares.values())
    if used > total + 1e-9:
        limit = f"gpus.memory_utilization ({total:g})" if p.gpus.memory_utilization else "1 (a whole GPU)"
        yield path, f"the engines' shares add up to {used:g}, over {limit}: they would not fit on one GPU together"


def _alias_problems(p: Profile) -> Findings:
    r = p.routing
    if not r.aliases:
        return
    if not r.twins:
        yield ("routing", "aliases"), "model aliases need an engine to route to: add routing.twins (e.g. [none])"
        return
    served = served_names(p)
    for name in r.aliases:
        if not name or len(name) > MAX_ALIAS or name != name.strip() or not name.isprintable():
            yield (  # located at the mapping: a key with odd characters is not printed as a field path
                ("routing", "aliases"),
                f"{quote_value(name)} is not a model name: 1 to {MAX_ALIAS} printable characters, no leading or "
                "trailing spaces",
            )
        elif name in served:
            yield (
                ("routing", "aliases", name),
                f"{name!r} is the model name the engines serve: an alias is another name (e.g. {name}-fast)",
            )
    for i, rule in enumerate(r.rules):
        said = r.aliases.get(rule.match.model) if rule.match.model is not None else None
        if said is not None and said != "auto":
            yield (
                ("routing", "rules", i, "match", "model"),
                f"{rule.match.model!r} is an alias ({said}): aliases are tried before the rules, so this rule never "
                "matches; remove it or make the alias `auto`",
            )


def _canary_problems(p: Profile) -> Findings:
    if not p.routing.canary.enabled:
        return
    path = ("routing", "canary", "enabled")
    if not p.routing.twins:
        yield (
            path,
            "a canary is an engine beside the primary, routed per request as twins are: add routing.twins "
            "(e.g. [none])",
        )
    elif p.speculative.method is Method.NONE:
        yield path, "the primary does not speculate (speculative.method: none): a canary compares draft acceptance"
