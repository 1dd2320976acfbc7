"""Twins in a pod: ``specops k8s render`` of a profile with ``routing.twins``.

The pod runs one ``specops up``, which starts the primary and its twins as engines of their own behind its proxy,
in the same container: the twins share the pod's GPUs (vLLM: each engine its ``routing.memory_utilization`` share)
and its memory limit. What the render checks and says about that:

- a multi-node group (LeaderWorkerSet) runs one distributed engine whose worker pods follow the leader's method:
  a twin beside it has no ranks to run on, so the render refuses it;
- a remote twin (another deployment, ``routing.twins`` entry with ``url``) runs nowhere in the pod: none of these
  checks or notes concern it, so a profile whose twins are all remote renders as one without twins;
- with ``deploy.resources.memory`` set and the model files local (sizes known), the twins' memory floor must fit
  the container's limit (an OOM kill restarts the whole pod, every engine at once);
- a note says how many engines share the container, its GPUs and its memory, and what the readiness probe
  accepts (a pod stays ready while one engine serves: the router sends every request to a live engine).
"""

from __future__ import annotations

import re

from specops.config.profile import LoadedProfile
from specops.errors import Problem

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_UNITS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}


def quantity_bytes(quantity: str) -> int | None:
    """A Kubernetes memory quantity (``16Gi``, ``500M``) in bytes; None when it is not one."""
    m = _QUANTITY.match(quantity.strip())
    if m is None:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def twin_problems(loaded: LoadedProfile, mode: str | None) -> list[Problem]:
    """What stops a profile's twins from running in the rendered pod, each located at the field to change."""
    p = loaded.profile
    if not p.routing.local_twins:
        return []
    if mode is not None:
        return [
            loaded.problem(
                ("routing", "twins"),
                f"a {mode} group runs one engine across {p.deploy.multi_node.nodes} pods (its workers follow the "
                "leader's method): a twin has no ranks to run on; remove routing.twins or deploy.multi_node",
            )
        ]
    limit = quantity_bytes(p.deploy.resources.memory) if p.deploy.resources.memory else None
    if limit is None or p.gpus.devices:
        return []  # GPU memory is vLLM's shares' (checked by validate); the container's limit holds host memory
    from specops.resolve.memory import engine_drafts, local_size
    from specops.resolve.memory import twin_problems as fit_problems

    target = local_size(p.model.id)
    if target is None:
        return []  # a Hub model: its size is the resolver's (specops validate --resolve, doctor on the node)
    drafts = {ref: local_size(ref) for ref in engine_drafts(p)}
    _, problems = fit_problems(
        p, target, drafts, budget=limit, budget_from=f"deploy.resources.memory {p.deploy.resources.memory}"
    )
    return [
        loaded.problem(("deploy", "resources", "memory"), f"the container's memory limit holds every engine: {msg}")
        for _, msg in problems
    ]


def twin_notes(p) -> list[str]:
    """What the render says about a pod with twins running in it (nothing without them)."""
    if not p.routing.local_twins:
        return []
    from specops.config.engines import gpu_shares, splits_gpu_by_share

    engines = ["primary", *(m.value for m in p.routing.local_twins)]
    shares = gpu_shares(p) if splits_gpu_by_share(p.backend) else {}
    gpu = (
        "its GPUs, each engine with its --gpu-memory-utilization share ("
        + ", ".join(f"{k} {v:g}" for k, v in shares.items())
        + ")"
        if shares
        else "its CPUs"
        if p.gpus.devices == []
        else "its GPUs"
    )
    memory = (
        f"deploy.resources.memory ({p.deploy.resources.memory})"
        if p.deploy.resources.memory
        else "its memory (no deploy.resources.memory: no limit)"
    )
    return [
        f"{p.name}: {len(engines)} engines ({', '.join(engines)}) run in each pod's container behind one specops "
        f"proxy and share {gpu} and {memory}; a pod stays ready while one of them serves (`specops doctor` on a "
        "node counts their memory)"
    ]


def remote_twin_notes(p, pod_env: set[str]) -> list[str]:
    """What the render says about twins that are other deployments: the NetworkPolicy lets the pods reach each
    one's port at any address (a policy cannot name a host; `deploy.pools` renders a plain pool and opens only
    the path to it), and a key variable the pods are not given (``pod_env``) stops `specops up` at start."""
    out = []
    for twin in p.routing.remote_twins:
        line = (
            f"{p.name}: routing.twins: {twin.url} is another deployment; the NetworkPolicy lets the pods reach "
            "its port at any address (narrow it with a patch, or use deploy.pools)"
        )
        if twin.api_key_env and twin.api_key_env not in pod_env:
            line += (
                f"; the pods get no ${twin.api_key_env} (its api_key_env), without which `specops up` does not "
                "start: add it from a Secret with a kustomize patch"
            )
        out.append(line)
    return out
