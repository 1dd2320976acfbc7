"""Security review, Kubernetes: the Lease gate against a misbehaving API server (the fake in tests/fakekube.py,
spoken to by the real ``kubernetes`` client), and what the rendered manifests allow."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
from conftest import unavailable
from fakekube import FakeKube
from support_goodput import Events

from specops.k8s.lease import LeaseGate
from specops.methods import Method
from specops.run.events import SwitchOrder
from specops.run.switchgate import FleetCoordinator, GateError, Slot

pytestmark = pytest.mark.timeout(60)

SLOT = "specops-chat-prod-switch-0"


@pytest.fixture
def kube(tmp_path):
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        unavailable("the kubernetes client is not installed (pip install -e '.[test]')")
    with FakeKube() as fake:
        fake.config = fake.kubeconfig(tmp_path / "kubeconfig", namespace="fleet")
        yield fake


def gate(kube, who: str = "pod-a") -> LeaseGate:
    return LeaseGate.from_environment("chat.prod", 1, 10, {"KUBECONFIG": str(kube.config), "POD_NAME": who})


# ------------------------------------------------------------------------------------------- item 8: Leases


@pytest.mark.parametrize("answer", [{}, {"metadata": None}, {"metadata": {"name": SLOT}}])
def test_a_200_that_is_no_lease_is_a_gate_error(kube, answer):
    g = gate(kube)
    slot, _ = g.try_enter()
    kube.answer = answer
    for call in (g.try_enter, lambda: g.renew(slot), lambda: g.leave(slot)):
        with pytest.raises(GateError, match=f"lease {SLOT}"):
            call()
    kube.answer = None
    assert g.renew(slot) is True  # the same gate works once the server answers Leases again


def test_the_coordinator_waits_and_says_why_when_the_api_answers_no_lease(kube):
    """Before: the slot task died on an AttributeError ("Task exception was never retrieved") and the status
    kept whatever error it had; now it is a fleet error, and it clears when the server answers properly."""
    executed: list = []
    events = Events()

    def execute(order):
        executed.append(order)
        return True

    async def until(predicate):
        for _ in range(500):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("timed out")

    async def main():
        c = FleetCoordinator(gate(kube), execute=execute, events=events, say=lambda m: None, retry_interval=0.05)
        kube.answer = {"metadata": None}
        order = SwitchOrder(1, "low acceptance", {"from": "draft_model", "to": "ngram", "rule": "threshold"})
        c.want(order)
        await until(lambda: "fleet-error" in events.kinds())
        assert "without metadata" in c.snapshot()["fleet"]["error"] and not executed
        assert c._acquiring is not None and not c._acquiring.done()  # still asking, not dead
        kube.answer = None
        await until(lambda: executed)
        assert c.snapshot()["fleet"]["error"] is None
        await c.close()

    with warnings.catch_warnings(record=True):
        asyncio.run(main())
    gc.collect()
    assert executed and executed[0].decision["to"] == Method.NGRAM.value


def test_an_api_server_that_trickles_bytes_meets_the_call_deadline(kube):
    """A byte every 0.2 s never trips the client's 5 s read timeout; the call's own deadline cuts it."""
    g = gate(kube)
    slot, _ = g.try_enter()
    g.deadline_s = 1.0
    kube.trickle = 0.2
    with pytest.raises(GateError, match=r"no complete answer within 1s"):
        g.renew(slot)
    with pytest.raises(GateError, match=r"within 1s"):
        g.try_enter()
    kube.trickle = None
    g.deadline_s = 30.0  # the recovery is not a race with the clock: a loaded machine can take over 1 s to connect
    assert g.renew(slot) is True  # the client recovers: the cut connections are not reused
    kube.stop()
    assert kube.trickle_cut >= 1  # the client hung up on the trickled answers (the server did not finish them)


def test_a_lease_that_may_not_be_created_says_to_apply_the_rendered_leases(kube):
    kube.forbid_create = True
    with pytest.raises(GateError, match=r"may not create it: apply the Leases"):
        gate(kube).try_enter()
    # a Lease that exists (rendered and applied) is taken with get and update alone
    kube.objects[("fleet", SLOT)] = {
        "kind": "Lease",
        "apiVersion": "coordination.k8s.io/v1",
        "metadata": {
            "name": SLOT,
            "namespace": "fleet",
            "resourceVersion": "5",
            "uid": "u",
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {},
    }
    assert gate(kube).try_enter() == (Slot(0, SLOT), [])
    assert kube.holder(SLOT, "fleet") == "pod-a"
    assert not [r for r in kube.requests if r[0] == "POST" and r[2] == 201]


# ------------------------------------------------------------------------------------------- item 10: manifests


def render(tmp_path, **deploy) -> dict[str, list[dict]]:
    """``specops k8s render`` (the CLI) of a llama.cpp profile with ``deploy``, by kind."""
    import yaml
    from support_cli import ROOT, run

    src = yaml.safe_load((ROOT / "profiles/llamacpp-ngram-cpu.yaml").read_text())
    src["server"] = {**(src.get("server") or {}), "port": 8000, "api_key": "${SPECOPS_API_KEY}"}
    src["deploy"] = {"secrets": {"api_key": {"name": "chat-key", "key": "key"}}, **deploy}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(src))
    res = run("k8s", "render", str(path), env={"SPECOPS_API_KEY": None})
    assert res.code == 0, res.stderr
    out: dict[str, list[dict]] = {}
    for obj in yaml.safe_load_all(res.stdout):
        if obj:
            out.setdefault(obj["kind"], []).append(obj)
    return out


def test_the_role_cannot_create_leases_and_the_slot_leases_are_rendered(tmp_path):
    from specops.k8s.lease import lease_names

    kinds = render(tmp_path, max_switching=2)
    names = lease_names("llamacpp-ngram-cpu", 2)
    (role,) = kinds["Role"]
    assert all("create" not in rule["verbs"] for rule in role["rules"])
    assert all(rule.get("resourceNames") == names for rule in role["rules"])  # no rule without names
    assert [lease["metadata"]["name"] for lease in kinds["Lease"]] == names
    assert all("spec" not in lease for lease in kinds["Lease"])  # the replicas write it; git holds no holder


def test_the_network_policy_limits_egress_and_ingress(tmp_path):
    (policy,) = render(tmp_path)["NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert all(rule.get("from") == [{"namespaceSelector": {}}] for rule in spec["ingress"])  # ClusterIP: in-cluster
    allowed = sorted((p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"])
    assert allowed == [("TCP", 53), ("TCP", 443), ("TCP", 6443), ("UDP", 53)]
    assert all("to" not in rule for rule in spec["egress"])  # single node: no peers on other ports
    (public,) = render(tmp_path, service={"type": "LoadBalancer"})["NetworkPolicy"]
    assert "from" not in public["spec"]["ingress"][0]  # a load balancer's addresses are not known here


def test_no_service_account_token_without_coordination(tmp_path):
    pod = render(tmp_path, coordination="off")["Deployment"][0]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    pod = render(tmp_path)["Deployment"][0]["spec"]["template"]["spec"]  # Leases: the token is what takes them
    assert "automountServiceAccountToken" not in pod and pod["serviceAccountName"]


def test_containers_have_a_read_only_root_with_writable_scratch(tmp_path):
    from specops.k8s.manifests import HOME_DIR, STATE_DIR

    pod = render(tmp_path)["Deployment"][0]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in pod["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]
    server = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    for path in ("/tmp", HOME_DIR, STATE_DIR):
        assert "emptyDir" in volumes[mounts[path]], path
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["HOME"] == HOME_DIR and env["SPECOPS_STATE"].startswith(STATE_DIR)
    assert env["SPECOPS_CACHE"].startswith(STATE_DIR) and env["HF_HOME"] in mounts


def test_the_pod_monitor_holds_no_inference_key(tmp_path):
    kinds = render(tmp_path)
    (monitor,) = kinds["PodMonitor"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["path"] for e in endpoints] == ["/specops/metrics", "/metrics"]
    assert all(e["port"] == "metrics" and "authorization" not in e for e in endpoints)
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    (relay,) = [c for c in pod["containers"] if any(p["name"] == "metrics" for p in c.get("ports", []))]
    assert relay["args"][:2] == ["k8s", "metrics-relay"] and "--key-env" in relay["args"]


def test_the_metrics_relay_serves_the_metrics_and_nothing_else(monkeypatch):
    """The relay against a loopback server that, like specops' public port, wants the API key for everything:
    the scraper sends none and gets the metrics; any other path or method never reaches the server."""
    import threading
    import urllib.error
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from specops.k8s.pod import metrics_relay

    key = "inference-key-3b9d"
    seen: list[tuple[str, str | None]] = []

    class Specops(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            ok = self.headers.get("Authorization") == f"Bearer {key}"
            body = f"metric_of{self.path.replace('/', '_')} 1\n".encode() if ok else b"unauthorized"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Specops)
    relay = metrics_relay(0, upstream.server_address[1], "KEY_VAR", host="127.0.0.1", env={"KEY_VAR": key})
    for server in (upstream, relay):
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    base = f"http://127.0.0.1:{relay.server_address[1]}"
    try:
        for path in ("/specops/metrics", "/metrics"):
            with urllib.request.urlopen(base + path, timeout=10) as resp:
                assert resp.read() == f"metric_of{path.replace('/', '_')} 1\n".encode()
        for path, method, code in (
            ("/v1/chat/completions", "GET", 404),
            ("/specops/status", "GET", 404),
            ("/metrics", "POST", 405),
        ):
            req = urllib.request.Request(base + path, method=method, data=b"{}" if method == "POST" else None)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            assert err.value.code == code
    finally:
        relay.shutdown()
        upstream.shutdown()
        relay.server_close()
        upstream.server_close()
    assert [p for p, _ in seen] == ["/specops/metrics", "/metrics"]  # nothing else reached specops
    assert {auth for _, auth in seen} == {f"Bearer {key}"}
