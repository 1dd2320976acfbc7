"""What a deployment's pods listen on and may reach: the metrics sidecar's port, and the NetworkPolicy."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from specops.config.sections import Profile
from specops.k8s import rbac

#: The metrics sidecar's port (the next free one when the profile uses it).
METRICS_PORT = 9464


def relays_metrics(p: Profile) -> bool:
    """The pods get the metrics sidecar: the public port asks for the API key, and something scrapes."""
    return p.deploy.monitor != "none" and p.deploy.secrets.api_key is not None


def metrics_port(p: Profile) -> int:
    """:data:`METRICS_PORT`, or the next port the pod does not use already."""
    mn = p.deploy.multi_node
    taken = {p.server.port, p.proxy.engine_port, mn.ray_port, mn.master_port, mn.rpc_port}
    port = METRICS_PORT
    while port in taken:
        port += 1
    return port


def tcp_ports(*ports: int) -> list[dict]:
    return [{"port": port, "protocol": "TCP"} for port in sorted(set(ports))]


def url_port(url: str | None) -> int | None:
    if not url:
        return None
    parts = urlsplit(url)
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def networkpolicy(p: Profile, meta: dict, selector: dict[str, str], mode: str | None) -> dict:
    """Who may reach the pods, and what they may reach.

    In: the proxy port (the engine's is on loopback and listed nowhere) and the metrics sidecar's, from the
    pods of the cluster (any namespace: clients, an ingress controller, Prometheus) for a ClusterIP Service,
    from anywhere for a NodePort/LoadBalancer one (its load balancer's addresses are not known here); the
    kubelet's probes always pass. Out: DNS (53), HTTPS (443: the Hugging Face Hub, the API server's
    Service), 6443 with Leases (the API server's own port, after the Service's address translation), the
    spot checks' reference, Prometheus (``monitor.prometheus_url``) and remote twins (``routing.twins[].url``)
    on their ports; a multi-node group's pods also reach each other on any port (Ray, torch.distributed/NCCL,
    llama.cpp RPC).
    """
    anyone_in_cluster = [{"namespaceSelector": {}}]
    public: dict[str, Any] = {"ports": tcp_ports(p.server.port)}
    if p.deploy.service.type == "ClusterIP":
        public["from"] = anyone_in_cluster
    ingress: list[dict] = [public]
    if relays_metrics(p):
        ingress.append({"from": anyone_in_cluster, "ports": tcp_ports(metrics_port(p))})
    group = [{"podSelector": {"matchLabels": selector}}]
    if mode is not None:
        ingress.append({"from": group})
    outbound = {443}
    if rbac.uses_leases(p):
        outbound.add(6443)
    for url in (
        p.certify.spot_check.reference,
        p.monitor.prometheus_url if p.monitor.source == "promql" else None,
        *(t.url for t in p.routing.remote_twins),
    ):
        port = url_port(url)
        if port is not None:
            outbound.add(port)
    egress: list[dict] = [
        {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
        {"ports": tcp_ports(*outbound)},
    ]
    if mode is not None:
        egress.append({"to": group})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }
