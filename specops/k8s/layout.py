"""What a profile's pods are before any object is built: the backend they run, the GPUs each pod asks for and
the nodes that hold them, the profile the ConfigMap carries (with the multi-node flags), and what ``specops k8s
render`` refuses (located problems) or notes about them.
"""

from __future__ import annotations

import math
from typing import Any

from specops.config.deploy import MAX_NODES
from specops.config.profile import LoadedProfile
from specops.config.rules import multi_node_mode
from specops.config.sections import Profile
from specops.errors import Problem
from specops.k8s.pod import RPC_WORKERS_VAR
from specops.k8s.source import env_reference, merged_source
from specops.k8s.twins import twin_problems
from specops.redact import looks_secret

#: Variables LeaderWorkerSet injects; the profile may read them, and they are no secrets.
LWS_VARS = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


def backend_of(p: Profile) -> Any:
    """The registered backend ``p`` names (None: unknown), for what differs between engines."""
    from specops.plugins import get_registry

    return get_registry().backends.get(p.backend)


def pod_variables(loaded: LoadedProfile) -> set[str]:
    """Variables the rendered pods get that the machine rendering them may lack (Secrets, LeaderWorkerSet)."""
    p = loaded.profile
    out: set[str] = set()
    key_var = env_reference((merged_source(loaded.path).get("server") or {}).get("api_key"))
    if p.deploy.secrets.api_key is not None and key_var is not None:
        out.add(key_var)
    if p.deploy.secrets.hf_token is not None:
        out.add("HF_TOKEN")
    if p.deploy.secrets.spot_reference_key is not None and p.certify.spot_check.api_key_env:
        out.add(p.certify.spot_check.api_key_env)
    if multi_node_mode(p, backend_of(p)) is not None:
        out.update((*LWS_VARS, RPC_WORKERS_VAR))
    return out


def profile_problems(loaded: LoadedProfile, source: dict) -> list[Problem]:
    """What a profile must satisfy to run in a pod (each located at the field to change)."""
    p = loaded.profile
    out: list[Problem] = []
    if not p.proxy.enabled:
        out.append(
            loaded.problem(
                ("proxy", "enabled"),
                "the pods run specops' proxy in front of the engine (readiness, drain on switches, the engine "
                "port stays private): set proxy.enabled: true",
            )
        )
    raw_key = (source.get("server") or {}).get("api_key")
    key_var = env_reference(raw_key)
    if raw_key is not None and key_var is None:
        out.append(
            loaded.problem(
                ("server", "api_key"),
                "a literal API key would be written into the ConfigMap: write api_key: ${VAR} and set "
                "deploy.secrets.api_key to the Secret that holds it",
            )
        )
    if p.deploy.secrets.api_key is not None and key_var is None:
        out.append(
            loaded.problem(
                ("deploy", "secrets", "api_key"),
                "server.api_key must read the key from the pod's environment: api_key: ${SPECOPS_API_KEY}",
            )
        )
    if key_var is not None and p.deploy.secrets.api_key is None and ":-" not in str(raw_key):
        out.append(
            loaded.problem(
                ("server", "api_key"),
                f"reads ${{{key_var}}}, which the pods do not have: set deploy.secrets.api_key",
            )
        )
    spot_var = p.certify.spot_check.api_key_env
    if bool(spot_var) != (p.deploy.secrets.spot_reference_key is not None):
        where, what = ("certify", "spot_check", "api_key_env"), f"the pods get no ${spot_var}"
        if not spot_var:
            where, what = ("deploy", "secrets", "spot_reference_key"), "certify.spot_check.api_key_env is unset"
        out.append(loaded.problem(where, f"{what}: set both (the Secret and the variable it goes into)"))
    for name, value in ((source.get("server") or {}).get("env") or {}).items():
        if (looks_secret(str(name)) or str(name) == "HF_TOKEN") and env_reference(value) is None:
            out.append(
                loaded.problem(
                    ("server", "env", name),
                    f"a literal {name} would be written into the ConfigMap: use deploy.secrets (HF_TOKEN) or "
                    "${VAR} with a Secret in a kustomize patch",
                )
            )
    out += schedule_problems(loaded, source)
    out += twin_problems(loaded, multi_node_mode(p, backend_of(p)))
    if p.proxy.admin_port is not None and p.deploy.monitor != "none":
        out.append(
            loaded.problem(
                ("proxy", "admin_port"),
                "the admin port listens on the pod's loopback only, so Prometheus could not scrape "
                "/specops/metrics: unset proxy.admin_port (the metrics then need the API key) or set "
                "deploy.monitor: none",
            )
        )
    return out


def nodes_for(total: int, gpus_per_node: int) -> int | None:
    """The fewest nodes that split ``total`` GPUs evenly with at most ``gpus_per_node`` on each (None: none do)."""
    for nodes in range(max(1, math.ceil(total / gpus_per_node)), min(total, MAX_NODES) + 1):
        if total % nodes == 0:
            return nodes
    return None


def schedule_problems(loaded: LoadedProfile, source: dict) -> list[Problem]:
    """A pod that asks for more GPUs than a node has stays Pending forever: refuse it, saying what splits it
    (located at ``deploy.multi_node.nodes`` when the profile sets it, else at the parallel sizes)."""
    p = loaded.profile
    per_node = p.deploy.gpus_per_node
    gpus = gpus_per_pod(p)
    if gpus <= per_node:
        return []
    why = f"each pod would ask for {gpus} GPUs and a node has {per_node} (deploy.gpus_per_node)"
    if p.deploy.resources.gpus is not None:
        return [loaded.problem(("deploy", "resources", "gpus"), f"{why}: lower it, or raise deploy.gpus_per_node")]
    if not getattr(backend_of(p), "parallel_layout", False):
        return [loaded.problem(("gpus", "devices"), f"{why}: list at most {per_node} devices")]
    total = p.gpus.tensor_parallel_size * p.gpus.pipeline_parallel_size
    split = nodes_for(total, per_node)
    fix = (
        f"set deploy.multi_node.nodes: {split} (a LeaderWorkerSet group of {split} pods of {total // split} GPUs)"
        if split
        else f"no number of nodes splits TP × PP = {total} into pods of at most {per_node} GPUs"
    )
    multi_node = (
        ((source.get("deploy") or {}).get("multi_node") or {}) if isinstance(source.get("deploy"), dict) else {}
    )
    where = ("deploy", "multi_node", "nodes") if isinstance(multi_node, dict) and "nodes" in multi_node else ("gpus",)
    return [loaded.problem(where, f"{why}: {fix}", field="deploy.multi_node.nodes")]


def group_notes(p: Profile, mode: str) -> list[str]:
    """What the multi-node rows of the support matrix saw a group of this engine and mode do with the methods
    of the profile's chain, where it failed (measured on CPU builds on loopback: a warning, not a refusal)."""
    from specops.backends.measured import group_refusal

    out = []
    version = p.engine.version if p.engine.version and p.engine.version[:1].isdigit() else None
    for method in dict.fromkeys(step.method.value for step in p.steps):
        row = group_refusal(p.backend, version, mode, method)
        if row:
            out.append(
                f"{p.name}: a {mode} group of {p.backend} {row['version']} with method {method} was measured "
                f"{row['outcome']} (specops engines matrix --multi-node): {' '.join(str(row['detail']).split())[:200]}"
            )
    return out


#: Hub organisations whose repos are gated: a pod downloads them only with a token that was granted access.
GATED_ORGS = ("meta-llama/",)


def gated_note(p: Profile) -> str | None:
    """A note when a gated repo is rendered without deploy.secrets.hf_token: the pods cannot download it."""
    if p.deploy.secrets.hf_token is not None:
        return None
    repos = [r for r in (p.model.id, p.speculative.draft) if isinstance(r, str) and r.startswith(GATED_ORGS)]
    if not repos:
        return None
    return (
        f"{p.name}: {repos[0]} is gated on the Hugging Face Hub and no deploy.secrets.hf_token is set: the pods "
        "cannot download it (set deploy.secrets.hf_token to a Secret with a token that was granted access, or "
        "pre-download the weights into deploy.hf_cache)"
    )


def gpus_per_pod(p: Profile) -> int:
    """GPUs each (leader or worker) pod requests: TP × PP (per node for a group) for vLLM."""
    if p.deploy.resources.gpus is not None:
        return p.deploy.resources.gpus
    g = p.gpus
    if g.devices == []:
        return 0
    if getattr(backend_of(p), "parallel_layout", False):  # one replica uses exactly TP × PP GPUs
        return (g.tensor_parallel_size * g.pipeline_parallel_size) // max(1, p.deploy.multi_node.nodes)
    return len(g.devices) if g.devices else 1


def configmap_profile(loaded: LoadedProfile, source: dict) -> dict:
    """The profile the pods run: ``extends`` merged, the proxy on every interface, the multi-node flags."""
    p = loaded.profile
    order = list(Profile.model_fields)
    doc = {k: source[k] for k in sorted(source, key=lambda k: order.index(k) if k in order else len(order))}
    server = dict(doc.get("server") or {})
    server["host"] = "0.0.0.0"  # the pod's own network namespace; the Service and probes reach the pod IP
    mode = multi_node_mode(p, backend_of(p))
    mn = p.deploy.multi_node
    extra = list(server.get("extra_args") or [])
    if mode == "ray":
        extra += ["--distributed-executor-backend", "ray"]
    elif mode == "nnodes":
        extra += [
            "--nnodes",
            "${LWS_GROUP_SIZE}",
            "--node-rank",
            "0",
            "--master-addr",
            "${LWS_LEADER_ADDRESS}",
            "--master-port",
            str(mn.master_port),
        ]
    elif mode == "rpc":
        extra += ["--rpc", "${" + RPC_WORKERS_VAR + "}"]
    if extra:
        server["extra_args"] = extra
    doc["server"] = server
    return doc
