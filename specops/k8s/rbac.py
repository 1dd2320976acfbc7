"""What the pods need to take the fleet's switch slots as Leases (:mod:`specops.k8s.lease`).

The slot Leases themselves (``specops-<name>-switch-<i>``, ``i`` < ``deploy.max_switching``, with no spec: the
replicas write it), a ServiceAccount for the pods, a Role that lets it get and update those Leases and
nothing else, a RoleBinding, and the pod's name and namespace through the downward API (the holder identity,
and where the Leases live). The Role has no ``create``: RBAC cannot limit ``create`` to names (the authorizer
sees no name before the object exists), so a Role with it could create any Lease in the namespace, those of
other controllers' leader elections included. Nothing of it is rendered when ``deploy.coordination`` is
``directory`` or ``off``; then the pods get no service account token either.
"""

from __future__ import annotations

from collections.abc import Callable

from specops.config.sections import Profile
from specops.k8s.names import lease_names

GROUP = "coordination.k8s.io"


def uses_leases(p: Profile) -> bool:
    """The pods coordinate their switches through Leases (``auto`` picks them in a pod)."""
    return p.deploy.coordination in ("auto", "lease")


def downward_env(p: Profile) -> list[dict]:
    """``POD_NAME`` (the slot holder's identity) and ``POD_NAMESPACE`` (where the Leases are)."""
    if not uses_leases(p):
        return []
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def service_account(p: Profile, name: str) -> str | None:
    return name if uses_leases(p) else None


def objects(p: Profile, name: str, meta: Callable[[Profile, str], dict]) -> list[tuple[str, dict]]:
    """The slot Leases, ServiceAccount, Role and RoleBinding (file name, object), or none."""
    if not uses_leases(p):
        return []
    role = f"{name}-switch-slots"
    names = lease_names(p.name, p.deploy.max_switching)
    rules = [{"apiGroups": [GROUP], "resources": ["leases"], "resourceNames": names, "verbs": ["get", "update"]}]
    leases = []
    for index, lease in enumerate(names):
        metadata = meta(p, lease)
        metadata["labels"] = {**metadata["labels"], "specops.dev/role": "switch-slot"}
        leases.append((f"lease-{index}.yaml", {"apiVersion": f"{GROUP}/v1", "kind": "Lease", "metadata": metadata}))
    return leases + [
        ("serviceaccount.yaml", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(p, name)}),
        (
            "role.yaml",
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(p, role), "rules": rules},
        ),
        (
            "rolebinding.yaml",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": meta(p, role),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                # no namespace: a RoleBinding's ServiceAccount subject defaults to the binding's own
                "subjects": [{"kind": "ServiceAccount", "name": name}],
            },
        ),
    ]
