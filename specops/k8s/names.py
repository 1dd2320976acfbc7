"""The names a profile's objects take in a cluster: the manifests, the Role and the pods' switch gate agree on them.

A leaf of the package: the renderer (:mod:`specops.k8s.manifests`, :mod:`specops.k8s.rbac`) and what runs in
the pods (:mod:`specops.k8s.lease`) both import it, and it imports neither.
"""

from __future__ import annotations


def k8s_name(name: str) -> str:
    """A profile name as a DNS-1035 label usable by every object and by LeaderWorkerSet pod hostnames."""
    out = "".join(c if c.isalnum() and c.isascii() else "-" for c in name.lower())
    if not out[:1].isalpha():
        out = "specops-" + out
    return out[:50].strip("-")


def lease_names(profile_name: str, slots: int) -> list[str]:
    """The Leases of a deployment's switch slots (also what the rendered Role allows)."""
    return [f"specops-{k8s_name(profile_name)}-switch-{i}" for i in range(slots)]


#: What a plain pool's name ends with (``deploy.pools.plain``).
PLAIN_SUFFIX = "-plain"


def plain_pool_name(model_id: str) -> str:
    """The plain pool of a model (``deploy.pools.plain``): named after the model alone, so that every speculating
    profile of that model routes to the same pool (and renders the same objects for it)."""
    return k8s_name(model_id)[: 50 - len(PLAIN_SUFFIX)].strip("-") + PLAIN_SUFFIX
