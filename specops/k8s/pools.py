"""Two pools of one model (``deploy.pools``): ``specops k8s render`` of a profile whose same-pod twin becomes another
Deployment.

A same-pod twin (``routing.twins: [none]``) doubles what one pod holds: a vLLM engine beside the speculating one
needs its own weights and KV cache on the same GPUs. With ``deploy.pools.plain`` the profile renders two pools
instead:

- the **speculating pool** (the profile's own name): its pods run the profile with ``routing.twins: [none]``
  replaced by a remote twin, the plain pool's Service, so the same class routing, aliases, header choice and
  failover send a request to the plain pool where speculation does not pay;
- the **plain pool** (``<model>-plain``): the same model, engine, GPUs and server settings without speculation
  and without routing. Its objects derive from the model and the deployment settings alone, so every speculating
  profile of the model that shares them renders the very same objects (kept once); profiles that would render it
  differently are refused.

Per pool: NetworkPolicy (the plain pool admits the speculating pods of its model, and the cluster when a gateway
routes to it), PDB, probes, Leases, and with ``autoscale`` an autoscaling/v2 HorizontalPodAutoscaler whose target
comes from the goodput surface (:func:`targets`). With ``inference_gateway``, an ``InferencePool`` per pool and an
``HTTPRoute`` that sends clients' explicit choices at the gateway (Gateway API Inference Extension).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from specops.config.profile import LoadedProfile
from specops.config.routing import SPECULATION_HEADER, Routing
from specops.config.sections import ChainStep, Profile
from specops.errors import Problem, ProfileError, SpecopsError
from specops.k8s.layout import backend_of, configmap_profile
from specops.k8s.manifests import Rendered, build, checked_source, key_variable, labels
from specops.k8s.names import plain_pool_name
from specops.methods import Method

SPECULATING, PLAIN = "speculating", "plain"
#: Every object of a pool carries its role; the PodMonitor copies it onto the series (``specops_dev_pool``).
POOL_LABEL = "specops.dev/pool"
#: On the speculating pods: the plain pool they may reach (its NetworkPolicy admits pods with this label).
PLAIN_POOL_LABEL = "specops.dev/plain-pool"
#: specops' gauge of the requests its proxy forwards now (every one is on the plain pool's own engine).
PROXY_IN_FLIGHT = "specops_proxy_in_flight"
#: The plain pool's target: the lowest concurrency where ``none`` reaches this share of its best tokens/s.
SATURATION = 0.9
#: Set by the extension's body-based routing from the request body's ``model``.
MODEL_HEADER = "X-Gateway-Model-Name"
#: Most matches one HTTPRoute rule holds (gateway.networking.k8s.io/v1).
MATCHES_PER_RULE = 64
INFERENCE_GROUP = "inference.networking.k8s.io"


def has_pools(p: Profile) -> bool:
    return p.deploy.pools.plain is not None


@dataclass(frozen=True)
class Targets:
    """Requests in flight per pod each pool's autoscaler holds, and where each number comes from."""

    speculating: float | None
    plain: float | None
    why_speculating: str = ""
    why_plain: str = ""


def pool_problems(loaded: LoadedProfile) -> list[Problem]:
    """What a profile with ``deploy.pools.plain`` must satisfy, located at the field to change."""
    p = loaded.profile
    if not has_pools(p):
        return []
    out = []
    if p.routing.twins != [Method.NONE]:  # one local twin, of method none
        out.append(
            loaded.problem(
                ("routing", "twins"),
                "the plain pool replaces the same-pod twin of method none: set routing.twins: [none] (the "
                "speculating pods route each class to the plain pool as that twin)",
            )
        )
    if p.speculative.method is Method.NONE:
        out.append(
            loaded.problem(
                ("speculative", "method"), "a plain pool beside a pool that does not speculate is the same pool"
            )
        )
    if p.routing.canary.enabled:
        out.append(
            loaded.problem(
                ("routing", "canary", "enabled"),
                "a canary runs beside the primary in its pod; with pools the pod holds one engine: unset it",
            )
        )
    aliases = len(p.routing.aliases)
    if p.deploy.pools.inference_gateway is not None and aliases > MATCHES_PER_RULE * 14:
        out.append(
            loaded.problem(("routing", "aliases"), f"an HTTPRoute holds at most {MATCHES_PER_RULE * 14} aliases")
        )
    return out


# ------------------------------------------------------------------------------------------- the pods' profiles


def remote_twin(plain: str, port: int, key_var: str | None) -> dict:
    """The ``routing.twins`` entry that reaches the plain pool's Service (same namespace)."""
    twin: dict[str, Any] = {"url": f"http://{plain}:{port}", "method": Method.NONE.value}
    if key_var:
        twin["api_key_env"] = key_var
    return twin


def speculating_source(source: dict, twin: dict) -> dict:
    """The profile the speculating pods run: the same-pod twin replaced by the remote one; the GPU shares go (one
    engine in the pod: it takes ``gpus.memory_utilization`` as without twins)."""
    doc = copy.deepcopy(source)
    routing = dict(doc.get("routing") or {})
    routing["twins"] = [twin]
    routing.pop("memory_utilization", None)
    doc["routing"] = routing
    return doc


#: What the plain pool keeps of a profile: the model and how it is served, not how it speculates or routes.
PLAIN_KEEPS = ("backend", "engine", "model", "gpus", "server", "supervisor", "proxy", "deploy")


def plain_source(source: dict, name: str) -> dict:
    """The profile the plain pods run, from what every profile of the model shares (see :data:`PLAIN_KEEPS`)."""
    doc: dict[str, Any] = {
        "name": name,
        "description": "The plain pool (no speculation) that speculating pools of this model route requests to.",
        "speculative": {"method": Method.NONE.value},
    }
    doc.update({k: copy.deepcopy(source[k]) for k in PLAIN_KEEPS if k in source})
    deploy = dict(doc.get("deploy") or {})
    pools = deploy.pop("pools", None) or {}
    deploy["replicas"] = (pools.get("plain") or {}).get("replicas", 1)
    service = dict(deploy.get("service") or {})
    service["type"] = "ClusterIP"  # reached by the speculating pods (and a gateway), never from outside
    deploy["service"] = service
    doc["deploy"] = deploy
    return doc


def plain_profile(p: Profile) -> Profile:
    """The plain pool as a validated profile (the speculating one without speculation, routing or its pools)."""
    plain = p.deploy.pools.plain
    assert plain is not None
    none = p.with_step(ChainStep(method=Method.NONE))
    service = p.deploy.service.model_copy(update={"type": "ClusterIP"})
    deploy = p.deploy.model_copy(update={"replicas": _replicas(plain.replicas, plain.autoscale), "service": service})
    return none.model_copy(update={"name": plain_pool_name(p.model.id), "routing": Routing(), "deploy": deploy})


def _replicas(replicas: int, autoscale) -> int:
    """The replicas a pod's probes assume: the autoscaler's fewest when it has one."""
    return autoscale.min_replicas if autoscale is not None else replicas


# ------------------------------------------------------------------------------------------- autoscaling


def surface_of(loaded: LoadedProfile, lock_text: str | None):
    """The goodput surface (``fallback.goodput.surface``, else the lock file's ``tune`` entry); None without one."""
    from specops.watch.surface import Surface, profile_surface

    surface = profile_surface(loaded)
    if surface is not None or lock_text is None:
        return surface
    try:
        record = json.loads(lock_text)
        return Surface.from_record(record) if isinstance(record, dict) else None
    except ValueError:
        return None


def targets(loaded: LoadedProfile, surface) -> Targets:
    """Each autoscaled pool's target in requests in flight per pod: the profile's ``target``, else the surface's.

    The speculating pool's is the crossover of its method (the concurrency above which it stops beating ``none``;
    of its ks, the one that pays longest): past it a pod's requests would be served faster without speculation,
    so the pool grows before its pods get there. The plain pool's is where ``none`` saturates (the lowest
    concurrency with :data:`SATURATION` of its best tokens/s): past it more requests per pod only queue.
    """
    pools = loaded.profile.deploy.pools
    spec_target = plain_target = None
    why_spec = why_plain = ""
    if pools.autoscale is not None:
        spec_target, why_spec = _speculating_target(loaded.profile, pools.autoscale.target, surface)
    if pools.plain is not None and pools.plain.autoscale is not None:
        plain_target, why_plain = _plain_target(pools.plain.autoscale.target, surface)
    return Targets(spec_target, plain_target, why_spec, why_plain)


def _speculating_target(p: Profile, explicit: float | None, surface) -> tuple[float | None, str]:
    if explicit is not None:
        return explicit, "deploy.pools.autoscale.target"
    if surface is None:
        return None, ""
    method = p.speculative.method
    ks = [k for k in surface.ks(method) if k > 0]
    if not ks or not surface.has(Method.NONE, 0):
        return None, ""
    top = float(max(surface.levels()))
    crossings = {k: surface.crossover(method, k) for k in ks}
    k, c = max(crossings.items(), key=lambda kc: top * 2 if kc[1] is None else kc[1])
    if c is None:
        return top, f"{method.value} k={k} beats none at every measured level up to {top:g}: the highest one"
    return c, f"{method.value} k={k} stops beating none at {c:g} requests (the surface's crossover)"


def _plain_target(explicit: float | None, surface) -> tuple[float | None, str]:
    if explicit is not None:
        return explicit, "deploy.pools.plain.autoscale.target"
    if surface is None or not surface.has(Method.NONE, 0):
        return None, ""
    levels = surface.levels()
    rates = {c: surface.tokens_per_s(Method.NONE, 0, c) or 0.0 for c in levels}
    best = max(rates.values())
    knee = next(c for c in levels if rates[c] >= SATURATION * best)
    return float(knee), f"none reaches {SATURATION:.0%} of its best tokens/s at {knee} requests"


def _quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as they are, else in thousandths (``2.5`` -> ``2500m``)."""
    return str(int(value)) if float(value).is_integer() else f"{math.ceil(value * 1000)}m"


def hpa(workload: dict, autoscale, metric: str, target: float) -> dict:
    """An autoscaling/v2 HPA of ``workload`` (Deployment or LeaderWorkerSet) on a per-pod metric's average."""
    meta = workload["metadata"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": meta["name"], "labels": dict(meta["labels"])},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": workload["apiVersion"],
                "kind": workload["kind"],
                "name": meta["name"],
            },
            "minReplicas": autoscale.min_replicas,
            "maxReplicas": autoscale.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": _quantity(target)},
                    },
                }
            ],
            # an engine takes minutes to load: grow at once, shrink only after 5 quiet minutes
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


# ------------------------------------------------------------------------------------------- the objects


def render_pools(loaded: LoadedProfile, lock_text: str | None, source_name: str | None) -> list[Rendered]:
    """The speculating pool and the plain pool of ``loaded`` (which sets ``deploy.pools.plain``)."""
    p = loaded.profile
    routing = p.routing.model_copy(update={"twins": [], "memory_utilization": {}})
    spec_p = p.model_copy(
        update={
            "routing": routing,
            "deploy": p.deploy.model_copy(update={"replicas": _replicas(p.deploy.replicas, p.deploy.pools.autoscale)}),
        }
    )
    # checked as the pods run it: one engine per pod (a same-pod twin's checks, e.g. in a multi-node group, do not apply)
    source = checked_source(LoadedProfile(spec_p, loaded.document, loaded.path))
    problems = pool_problems(loaded)
    pools = p.deploy.pools
    assert pools.plain is not None
    surface = surface_of(loaded, lock_text)
    wanted = targets(loaded, surface)
    for where, asked, got in (
        (("deploy", "pools", "autoscale"), pools.autoscale, wanted.speculating),
        (("deploy", "pools", "plain", "autoscale"), pools.plain.autoscale, wanted.plain),
    ):
        if asked is not None and got is None:
            problems.append(
                loaded.problem(
                    where,
                    "no goodput surface to size the autoscaler from (no fallback.goodput.surface, no `tune` entry "
                    "in the lock file with none measured beside the method): run `specops tune` and `specops "
                    "lock`, or set its target (requests in flight per pod)",
                )
            )
    if problems:
        raise ProfileError(problems)
    key_var = key_variable(source)
    plain = plain_pool_name(p.model.id)
    plain_p = plain_profile(p)
    port = plain_p.deploy.service.port or plain_p.server.port
    spec_doc = configmap_profile(loaded, speculating_source(source, remote_twin(plain, port, key_var)))
    spec = build(spec_p, spec_doc, key_var, lock_text, source_name)
    plain_doc = configmap_profile(loaded, plain_source(source, plain))
    shared = build(plain_p, plain_doc, key_var, None, f"deploy.pools.plain of the profiles of {p.model.id}")
    shared.shared = True
    _mark(spec, SPECULATING, {PLAIN_POOL_LABEL: plain})
    _mark(shared, PLAIN, {})
    selector = _serving_selector(shared)
    _open_egress(spec, selector, plain_p.server.port)
    gateway = pools.inference_gateway
    _admit(shared, plain, from_cluster=gateway is not None)
    backend = backend_of(p)
    if pools.autoscale is not None and wanted.speculating is not None:
        series = getattr(backend, "running_requests_metric", "") or PROXY_IN_FLIGHT
        metric = series.replace(":", "_")  # the custom metrics API takes no `:`: a prometheus-adapter rule renames it
        _autoscale(spec, pools.autoscale, metric, wanted.speculating)
        spec.notes.append(
            f"{p.name}: the speculating pool's autoscaler holds {series} (the speculating engine's own requests; "
            f"the proxy's in-flight count would include those it forwards to {plain}) at {wanted.speculating:g} "
            f"per pod: {wanted.why_speculating}"
        )
    if pools.plain.autoscale is not None and wanted.plain is not None:
        _autoscale(shared, pools.plain.autoscale, PROXY_IN_FLIGHT, wanted.plain)
        shared.notes.append(
            f"{plain}: the plain pool's autoscaler holds {PROXY_IN_FLIGHT} at {wanted.plain:g} per pod: {wanted.why_plain}"
        )
    if gateway is not None:
        spec.objects.append(("inferencepool.yaml", inference_pool(spec, gateway.endpoint_picker_port, p.server.port)))
        shared.objects.append(
            ("inferencepool.yaml", inference_pool(shared, gateway.endpoint_picker_port, plain_p.server.port))
        )
        spec.objects.append(("httproute.yaml", http_route(spec_p, spec.name, plain, gateway)))
    spec.notes.append(
        f"{p.name}: two pools of {p.model.id}: {spec.name} speculates and routes each request class that does not "
        f"pay to {plain} (http://{plain}:{port}, a remote twin), which runs the model without speculation "
        f"({'an engine' if backend is None else p.backend} per pod, no second copy of the weights in a pod)"
    )
    return [spec, shared]


def _workload(r: Rendered) -> dict:
    return next(obj for _, obj in r.objects if obj["kind"] in ("Deployment", "LeaderWorkerSet"))


def _templates(workload: dict) -> list[dict]:
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    t = workload["spec"]["leaderWorkerTemplate"]
    return [t["leaderTemplate"], t["workerTemplate"]]


def _mark(r: Rendered, role: str, pod_labels: dict[str, str]) -> None:
    """Label every object with the pool's role, the pods also with ``pod_labels``; the monitors copy the role."""
    for _, obj in r.objects:
        obj["metadata"]["labels"][POOL_LABEL] = role
        if obj["kind"] in ("Deployment", "LeaderWorkerSet"):
            for template in _templates(obj):
                template["metadata"]["labels"].update({POOL_LABEL: role, **pod_labels})
        elif obj["kind"] == "PodMonitor":
            obj["spec"]["podTargetLabels"].append(POOL_LABEL)
        elif obj["kind"] == "ServiceMonitor":
            obj["spec"]["targetLabels"].append(POOL_LABEL)


def _serving_selector(r: Rendered) -> dict[str, str]:
    """The labels of the pool's pods that serve HTTP (a group's leader only)."""
    service = next(obj for _, obj in r.objects if obj["kind"] == "Service")
    return dict(service["spec"]["selector"])


def _policy(r: Rendered) -> dict:
    return next(obj for _, obj in r.objects if obj["kind"] == "NetworkPolicy")["spec"]


def _open_egress(r: Rendered, selector: dict[str, str], port: int) -> None:
    """The speculating pods may reach the plain pool's serving pods on their proxy port."""
    _policy(r)["egress"].append(
        {"to": [{"podSelector": {"matchLabels": selector}}], "ports": [{"port": port, "protocol": "TCP"}]}
    )


def _admit(r: Rendered, plain: str, *, from_cluster: bool) -> None:
    """The plain pool's proxy port admits the speculating pods of its model (any profile's: they carry
    :data:`PLAIN_POOL_LABEL`), and with a gateway the cluster's pods too (the gateway's proxies)."""
    public = _policy(r)["ingress"][0]
    peers: list[dict] = [{"podSelector": {"matchLabels": {PLAIN_POOL_LABEL: plain}}}]
    if from_cluster:
        peers.append({"namespaceSelector": {}})
    public["from"] = peers


def _autoscale(r: Rendered, autoscale, metric: str, target: float) -> None:
    """The HPA owns the replica count: the workload leaves it out (a re-apply would reset it otherwise)."""
    workload = _workload(r)
    workload["spec"].pop("replicas", None)
    r.objects.append(("hpa.yaml", hpa(workload, autoscale, metric, target)))


def inference_pool(r: Rendered, picker_port: int, port: int) -> dict:
    """The pool's serving pods as an ``InferencePool``: the gateway's endpoint picker (``<pool>-epp``) picks among
    them, reaching each on specops' proxy port."""
    workload = _workload(r)
    meta = workload["metadata"]
    return {
        "apiVersion": f"{INFERENCE_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": {"name": meta["name"], "labels": dict(meta["labels"])},
        "spec": {
            "selector": {"matchLabels": _serving_selector(r)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": f"{meta['name']}-epp", "port": {"number": picker_port}},
        },
    }


def http_route(p: Profile, name: str, plain: str, gateway) -> dict:
    """Clients' explicit choices at the gateway: ``X-Specops-Speculation: off`` straight to the plain pool (not
    under ``client_choice: forbid``: the speculating proxies refuse the header there, the gateway must not route
    around them); the profile's aliases (``X-Gateway-Model-Name``, set from the body's ``model`` by the
    extension's body-based routing) and everything else to the speculating pool, whose proxies map an alias to
    its engine (the plain pool knows no alias: it is shared by profiles whose aliases differ)."""

    def to(pool: str) -> list[dict]:
        return [{"group": INFERENCE_GROUP, "kind": "InferencePool", "name": pool}]

    rules: list[dict] = []
    if p.routing.client_choice == "allow":
        off = {"headers": [{"type": "Exact", "name": SPECULATION_HEADER, "value": "off"}]}
        rules.append({"matches": [off], "backendRefs": to(plain)})
    aliases = sorted(p.routing.aliases)
    for i in range(0, len(aliases), MATCHES_PER_RULE):
        chunk = aliases[i : i + MATCHES_PER_RULE]
        matches = [{"headers": [{"type": "Exact", "name": MODEL_HEADER, "value": a}]} for a in chunk]
        rules.append({"matches": matches, "backendRefs": to(name)})
    rules.append({"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": to(name)})
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.gateway}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    meta = {"name": name, "labels": {**labels(p), "app.kubernetes.io/managed-by": "specops", POOL_LABEL: SPECULATING}}
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": meta,
        "spec": {"parentRefs": [parent], "rules": rules},
    }


def merge_shared(rendered: list[Rendered]) -> list[Rendered]:
    """Keep one of each shared (plain) pool that several profiles render alike; refuse two that differ."""
    out: list[Rendered] = []
    seen: dict[str, Rendered] = {}
    for r in rendered:
        if not r.shared:
            out.append(r)
            continue
        first = seen.get(r.name)
        if first is None:
            seen[r.name] = r
            out.append(r)
        elif first.objects != r.objects:
            differ = sorted(f for (f, a), (_, b) in zip(first.objects, r.objects) if a != b) or ["the object list"]
            raise SpecopsError(
                f"the plain pool {r.name} is rendered differently by two profiles of its model ({', '.join(differ)} "
                "differ): give them the same engine, gpus, server, proxy, supervisor and deploy settings, or a "
                "different model"
            )
    return out


# ------------------------------------------------------------------------------------------- instead of a same-pod twin


def same_pod_replacement(loaded: LoadedProfile) -> list[str]:
    """The profile lines that replace a same-pod twin that does not fit (``validate``, ``doctor``): a remote twin
    (another deployment of the model without speculation), or on Kubernetes the pools that render one."""
    from specops.k8s.source import merged_source

    p = loaded.profile
    plain = plain_pool_name(p.model.id)
    twin = remote_twin(plain, p.deploy.service.port or p.server.port, key_variable(merged_source(loaded.path)))
    flow = ", ".join(f"{k}: {v}" for k, v in twin.items())
    return [
        "instead of a twin in the same pod (the model twice on its GPUs), a remote twin: another deployment of "
        "the model without speculation (this profile with speculative.method: none), at its address:",
        "  routing:",
        f"    twins: [{{{flow}}}]",
        f"or on Kubernetes keep routing.twins: [none] and let `specops k8s render` run that deployment as a plain "
        f"pool ({plain}, the URL above):",
        "  deploy:",
        "    pools: {plain: {replicas: 1}}",
    ]
