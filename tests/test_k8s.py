"""`specops k8s render`: golden manifests, schema validation, and the promises the manifests make.

Every rendered object is validated offline: built-in kinds against the Kubernetes OpenAPI schemas of
several minor versions (kubernetes-validate, strict: unknown fields fail), LeaderWorkerSet and
PodMonitor/ServiceMonitor against their published CRD schemas vendored in tests/k8s_schemas/ (made
strict the same way: an object schema with properties refuses unknown keys, as `kubectl --validate=strict`
does on a cluster). No API server can run here.

Update the goldens after an intended change with::

    SPECOPS_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_k8s.py

and review the diff of tests/golden/k8s/ by hand.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT, run
from support_k8s import K8S_VERSIONS, SCHEMAS, kubectl, objects, validate

from specops.k8s.manifests import metrics_port, relays_metrics

GOLDEN = Path(__file__).resolve().parent / "golden" / "k8s"
FIXTURES = Path(__file__).resolve().parent / "k8s_profiles"
UPDATE = os.environ.get("SPECOPS_UPDATE_GOLDEN") == "1"
SECRET = "sk-k8s-golden-MUST-NOT-LEAK-51c2"
#: The rendering machine has no secrets (as in CI or Argo CD's plugin); the pods get them from Secrets.
ENV = {"SPECOPS_API_KEY": None, "HF_TOKEN": None, "PROMETHEUS_URL": None}

#: golden name -> profile (ready-made ones, the GitOps overlays and the multi-node layouts)
CASES = {
    "llama31-8b-eagle3": "profiles/llama31-8b-eagle3.yaml",
    "llama33-70b-eagle3-tp4": "profiles/llama33-70b-eagle3-tp4.yaml",
    "qwen25-coder-32b-gguf": "profiles/qwen25-coder-32b-gguf.yaml",
    "llamacpp-ngram-cpu": "profiles/llamacpp-ngram-cpu.yaml",
    "llama31-8b-chat-prod": "profiles/gitops/prod/llama31-8b-chat.yaml",
    "llama31-405b-ray": "tests/k8s_profiles/vllm-405b-ray.yaml",
    "qwen3-235b-nnodes": "tests/k8s_profiles/vllm-nnodes.yaml",
    "qwen25-72b-rpc": "tests/k8s_profiles/llamacpp-rpc.yaml",
}


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def render(*paths: str, env: dict | None = None) -> tuple[str, str]:
    res = run("k8s", "render", *paths, env={**ENV, **(env or {})})
    assert res.code == 0, res.stderr
    return res.stdout, res.stderr


_RENDERED: dict[str, str] = {}


def rendered(case: str) -> str:
    if case not in _RENDERED:
        _RENDERED[case] = render(CASES[case])[0]
    return _RENDERED[case]


def by_kind(case: str) -> dict[str, dict]:
    return {o["kind"]: o for o in objects(rendered(case))}


def pod_specs(case: str) -> list[dict]:
    """(leader and worker, or the one) pod specs of a case."""
    kinds = by_kind(case)
    if "Deployment" in kinds:
        return [kinds["Deployment"]["spec"]["template"]["spec"]]
    t = kinds["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return [t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]]


def pod_templates(case: str) -> list[dict]:
    kinds = by_kind(case)
    if "Deployment" in kinds:
        return [kinds["Deployment"]["spec"]["template"]]
    t = kinds["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return [t["leaderTemplate"], t["workerTemplate"]]


def server_container(case: str) -> dict:
    return pod_specs(case)[0]["containers"][0]


def load(case: str):
    from specops.k8s.layout import pod_variables
    from specops.k8s.source import load_for_render
    from specops.plugins import get_registry

    return load_for_render(CASES[case], get_registry(), pod_variables).profile


# ------------------------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    text = rendered(case)
    path = GOLDEN / f"{case}.yaml"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden {path.relative_to(ROOT)}: run with SPECOPS_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), f"k8s render of {CASES[case]} differs from its golden"


def test_no_stale_goldens():
    assert {p.stem for p in GOLDEN.glob("*.yaml")} == set(CASES)


def test_render_is_deterministic_and_secret_free():
    a = render(*CASES.values(), env={"SPECOPS_API_KEY": SECRET, "HF_TOKEN": SECRET})[0]
    b = render(*CASES.values())[0]
    assert a == b  # the machine's secrets change nothing: they are never read into the manifests
    assert SECRET not in a


# ------------------------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_validates(case):
    objs = objects(rendered(case))
    assert objs
    for obj in objs:
        assert validate(obj) == [], obj["kind"]


def test_the_validation_catches_mistakes():
    """The checker itself: an unknown field, a wrong type, in a built-in kind and in a CRD kind."""
    kinds = by_kind("llama31-8b-eagle3")
    bad = json.loads(json.dumps(kinds["Deployment"]))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    assert validate(bad) and len(validate(bad)) == len(K8S_VERSIONS)
    bad = json.loads(json.dumps(kinds["Service"]))
    bad["spec"]["ports"][0]["port"] = "eighty"
    assert validate(bad)
    bad = json.loads(json.dumps(kinds["PodMonitor"]))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert validate(bad)
    lws = json.loads(json.dumps(by_kind("llama31-405b-ray")["LeaderWorkerSet"]))
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    assert validate(lws)
    lws = json.loads(json.dumps(by_kind("llama31-405b-ray")["LeaderWorkerSet"]))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["comand"] = ["x"]
    assert validate(lws)


def test_the_vendored_crd_schemas_name_their_source():
    for path in SCHEMAS.glob("*.json"):
        doc = json.loads(path.read_text())
        assert doc["source"].startswith("https://github.com/") and "/blob/" in doc["source"]
    kinds = {json.loads(p.read_text())["kind"] for p in SCHEMAS.glob("*.json")}
    assert kinds == {"LeaderWorkerSet", "PodMonitor", "ServiceMonitor", "InferencePool", "HTTPRoute"}


# ------------------------------------------------------------------------------------------- promises


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_run_specops_up_non_root_with_secrets_by_reference(case):
    specs = pod_specs(case)
    leader = specs[0]["containers"][0]
    for template in pod_templates(case):  # `kubectl logs` picks the container that exists
        names = [c["name"] for c in template["spec"]["containers"]]
        assert template["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] in names
    assert leader["command"] == ["specops"]
    assert leader["args"][0] == "up" or leader["args"][:2] == ["k8s", "leader"]
    assert leader["args"][-1] == "/etc/specops/profile.yaml"
    for spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            for e in c.get("env", []):
                if e["name"] in ("HF_TOKEN", "SPECOPS_API_KEY") or "KEY" in e["name"] or "TOKEN" in e["name"]:
                    assert "value" not in e and set(e["valueFrom"]) == {"secretKeyRef"}, e
        assert spec["enableServiceLinks"] is False  # no VLLM_PORT from a Service called vllm
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    # downloads land on the cache volume: HF_HOME, and LLAMA_CACHE for llama-server's own -hf downloads
    env = {e["name"]: e.get("value") for e in leader.get("env", [])}
    mounts = {m["mountPath"] for m in leader["volumeMounts"]}
    assert env["HF_HOME"] in mounts
    if load(case).backend == "llamacpp":
        assert env["LLAMA_CACHE"].startswith(env["HF_HOME"] + "/")


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes_and_termination_follow_the_profile(case):
    p = load(case)
    spec = pod_specs(case)[0]
    c = spec["containers"][0]
    start = c["startupProbe"]
    budget = p.deploy.startup_timeout or p.engine.ready_timeout + 300
    assert start["periodSeconds"] * start["failureThreshold"] >= budget >= p.engine.ready_timeout
    assert c["readinessProbe"]["exec"]["command"][:3] == ["specops", "k8s", "probe"]
    # liveness never depends on the engine: it only asks whether specops' proxy accepts connections
    assert set(c["livenessProbe"]) >= {"tcpSocket"} and c["livenessProbe"]["tcpSocket"]["port"] == "http"
    assert spec["terminationGracePeriodSeconds"] >= p.proxy.drain_timeout + p.supervisor.stop_timeout + 5
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[:3] == ["specops", "k8s", "prestop"] and pre[pre.index("--timeout") + 1] == str(
        math.ceil(p.proxy.drain_timeout)
    )
    # one replica stays ready through a switch (its proxy queues); several route around the switching one
    ready = c["readinessProbe"]["exec"]["command"]
    assert ("--accept-held" in ready) == (p.deploy.replicas <= 1)
    assert "--accept-held" not in start["exec"]["command"]  # the first readiness is the engine serving


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpus_are_tp_times_pp_per_node(case):
    p = load(case)
    nodes = p.deploy.multi_node.nodes
    want = (
        p.gpus.tensor_parallel_size * p.gpus.pipeline_parallel_size // nodes
        if p.backend == "vllm" and p.gpus.devices != []
        else (0 if p.gpus.devices == [] else len(p.gpus.devices or [0]))
    )
    for spec in pod_specs(case):
        limits = spec["containers"][0].get("resources", {}).get("limits", {})
        assert int(limits.get("nvidia.com/gpu", 0)) == want


@pytest.mark.parametrize("case", sorted(CASES))
def test_only_the_proxy_port_is_reachable(case):
    p = load(case)
    kinds = by_kind(case)
    svc = kinds["Service"]["spec"]["ports"]
    scraped = relays_metrics(p) and p.deploy.monitor == "servicemonitor"  # through the Service: its own port
    assert [s["targetPort"] for s in svc] == ["http", *(["metrics"] if scraped else [])]
    c = server_container(case)
    http = [port["containerPort"] for port in c["ports"] if port["name"] == "http"]
    assert http == [p.server.port]
    policy = kinds["NetworkPolicy"]["spec"]
    open_ports = [port["port"] for rule in policy["ingress"] for port in rule.get("ports", [])]
    assert open_ports == [p.server.port, *([metrics_port(p)] if relays_metrics(p) else [])]
    # the rest is only for the group's own pods (Ray, torch.distributed, RPC)
    assert all(rule.get("from") for rule in policy["ingress"] if "ports" not in rule)
    cm = yaml.safe_load(kinds["ConfigMap"]["data"]["profile.yaml"])
    assert cm["server"]["host"] == "0.0.0.0" and cm.get("proxy", {}).get("enabled", True) is True


def test_the_engine_port_is_listed_nowhere(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(
        "name: pinned-port\nbackend: vllm\nengine: {version: 0.32.0}\nmodel: {id: m/x}\n"
        "speculative: {method: ngram}\nproxy: {engine_port: 8123}\n"
    )
    text = render(str(prof))[0]
    docs = objects(text)
    for obj in docs:
        if obj["kind"] != "ConfigMap":
            assert "8123" not in json.dumps(obj), obj["kind"]


def test_a_profile_change_rolls_the_pods(tmp_path):
    prof = tmp_path / "p.yaml"
    body = "name: rolls\nbackend: vllm\nengine: {version: 0.32.0}\nmodel: {id: m/x}\nspeculative: {method: ngram}\n"
    prof.write_text(body)
    first = by_hash(render(str(prof))[0])
    prof.write_text(body + "fallback: {min_acceptance: 0.5}\n")
    second = by_hash(render(str(prof))[0])
    (tmp_path / "p.lock.json").write_text('{"pinned": true}\n')
    third_text = render(str(prof))[0]
    assert len({first, second, by_hash(third_text)}) == 3
    cm = next(o for o in objects(third_text) if o["kind"] == "ConfigMap")
    assert cm["data"]["profile.lock.json"] == '{"pinned": true}\n'


def by_hash(text: str) -> str:
    dep = next(o for o in objects(text) if o["kind"] == "Deployment")
    return dep["spec"]["template"]["metadata"]["annotations"]["specops.dev/profile-hash"]


def test_multi_node_layouts():
    ray = by_kind("llama31-405b-ray")["LeaderWorkerSet"]["spec"]
    t = ray["leaderWorkerTemplate"]
    assert t["size"] == 2 and ray["replicas"] == 2 and ray["startupPolicy"] == "LeaderCreated"
    assert t["workerTemplate"]["spec"]["containers"][0]["args"] == [
        "start",
        "--address=$(LWS_LEADER_ADDRESS):6379",
        "--block",
    ]
    cm = yaml.safe_load(by_kind("llama31-405b-ray")["ConfigMap"]["data"]["profile.yaml"])
    assert cm["server"]["extra_args"] == ["--distributed-executor-backend", "ray"]
    assert "gpus" in cm and "devices" not in cm["gpus"]
    assert by_kind("llama31-405b-ray")["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"

    nn = by_kind("qwen3-235b-nnodes")
    cm = yaml.safe_load(nn["ConfigMap"]["data"]["profile.yaml"])
    args = cm["server"]["extra_args"]
    assert args[args.index("--nnodes") + 1] == "${LWS_GROUP_SIZE}" and args[args.index("--node-rank") + 1] == "0"
    assert args[args.index("--master-addr") + 1] == "${LWS_LEADER_ADDRESS}"
    w = nn["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert w["args"][:2] == ["k8s", "worker"] and "ServiceMonitor" in nn

    rpc = by_kind("qwen25-72b-rpc")
    cm = yaml.safe_load(rpc["ConfigMap"]["data"]["profile.yaml"])
    assert cm["server"]["extra_args"] == ["--rpc", "${SPECOPS_RPC_WORKERS}"]
    w = rpc["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert w["command"] == ["rpc-server"] and w["args"] == ["-H", "0.0.0.0", "-p", "50052"]
    assert rpc["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["size"] == 3
    assert rpc["Service"]["spec"]["type"] == "LoadBalancer" and rpc["Service"]["spec"]["ports"][0]["port"] == 80


def test_the_rendered_profile_loads_in_the_pod(tmp_path, monkeypatch):
    """The ConfigMap's profile is a valid profile with the variables the pods have."""
    from specops.config.profile import load_profile

    for case in CASES:
        cm = by_kind(case)["ConfigMap"]["data"]["profile.yaml"]
        path = tmp_path / f"{case}.yaml"
        path.write_text(cm)
        pod_env = {
            "SPECOPS_API_KEY": "k" * 12,
            "LWS_LEADER_ADDRESS": "x-0.x.ns",
            "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": "0",
            "SPECOPS_RPC_WORKERS": "x-0-1.x.ns:50052",
        }
        # the variables the rendered pods list as public (extra_args may only read public ones)
        public = [e["value"] for e in _container_env(case) if e["name"] == "SPECOPS_PUBLIC_VARS"]
        if public:
            pod_env["SPECOPS_PUBLIC_VARS"] = public[0]
        loaded = load_profile(path, env=pod_env)
        assert loaded.profile.server.host == "0.0.0.0"


def _container_env(case: str) -> list[dict]:
    """The ``env`` entries of every container the rendered objects of ``case`` run."""
    out: list[dict] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                out.extend(e for c in node["containers"] for e in c.get("env") or [])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects(rendered(case)))
    return out


def test_kustomize_builds_the_output_folder(tmp_path):
    exe = kubectl()
    res = run("k8s", "render", CASES["llama31-8b-eagle3"], CASES["qwen25-72b-rpc"], "-o", str(tmp_path), env=ENV)
    assert res.code == 0, res.stderr
    built = subprocess.run([exe, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    kinds = sorted(o["kind"] for o in objects(built.stdout))
    assert kinds.count("ConfigMap") == 2 and "LeaderWorkerSet" in kinds and "Deployment" in kinds


# ------------------------------------------------------------------------------------------- errors


def _profile(tmp_path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nbackend: vllm\nengine: {version: 0.32.0}\nmodel: {id: m/x}\n" + text)
    return str(path)


@pytest.mark.parametrize(
    "text,where,message",
    [
        ("deploy:\n  multi_node: {nodes: 3}\ngpus: {tensor_parallel_size: 8}\n", "bad.yaml:6:", "split evenly"),
        ("deploy:\n  multi_node: {nodes: 2, mode: rpc}\n", "deploy.multi_node.mode", "ray or nnodes"),
        ("deploy:\n  multi_node: {mode: ray}\n", "deploy.multi_node.mode", "2 or more"),
        ("gpus: {devices: [0]}\ndeploy:\n  multi_node: {nodes: 2}\n", "gpus.devices", "device plugin"),
        ("deploy:\n  node_selector: {'bad key!': x}\n", "deploy.node_selector", "label key"),
        ("deploy:\n  image: 'x; rm -rf /'\n", "deploy.image", "image reference"),
        ("deploy:\n  resources: {memory: 16 GB}\n", "deploy.resources.memory", "quantity"),
        ("deploy:\n  secrets: {api_key: {name: Bad_Name, key: k}}\n", "deploy.secrets.api_key.name", "Kubernetes name"),
        ("deploy:\n  startup_timeout: 1m\n", "deploy.startup_timeout", "engine.ready_timeout"),
        ("deploy:\n  tolerations: [{operator: Exists, value: x}]\n", "deploy.tolerations[0].value", "any value"),
        ("deploy:\n  replicas: -1\n", "deploy.replicas", "greater than or equal"),
        ("deploy:\n  servce: {}\n", "deploy.servce", "service"),
    ],
)
def test_deploy_section_errors_are_located(tmp_path, text, where, message):
    res = run("validate", _profile(tmp_path, text), env=ENV)
    assert res.code == 1, res.stdout
    assert where in res.stderr + res.stdout and message in res.stderr + res.stdout, res.stderr + res.stdout


@pytest.mark.parametrize(
    "text,where,message",
    [
        ("server: {api_key: sk-literal-key}\n", "server.api_key", "ConfigMap"),
        ("server: {api_key: '${MY_KEY}'}\n", "server.api_key", "deploy.secrets.api_key"),
        ("deploy: {secrets: {api_key: {name: s, key: k}}}\n", "deploy.secrets.api_key", "${SPECOPS_API_KEY}"),
        ("server: {env: {HF_TOKEN: hf_literal}}\n", "server.env.HF_TOKEN", "ConfigMap"),
        ("proxy: {enabled: false}\n", "proxy.enabled", "proxy.enabled: true"),
        ("proxy: {admin_port: 9100}\n", "proxy.admin_port", "loopback"),
        (
            "certify: {spot_check: {enabled: true, reference: 'http://ref:8000', api_key_env: REF_KEY}}\n",
            "certify.spot_check.api_key_env",
            "no $REF_KEY",
        ),
        ("deploy: {secrets: {spot_reference_key: {name: s, key: k}}}\n", "deploy.secrets.spot_reference_key", "unset"),
    ],
)
def test_render_refuses_what_cannot_run_in_a_pod(tmp_path, text, where, message):
    res = run("k8s", "render", _profile(tmp_path, "speculative: {method: ngram}\n" + text), env={**ENV, "MY_KEY": "x"})
    assert res.code == 1, res.stdout
    assert "bad.yaml:" in res.stderr and where in res.stderr and message in res.stderr, res.stderr
    assert "sk-literal-key" not in res.stderr and "hf_literal" not in res.stderr


def test_a_variable_the_pods_do_not_get_stays_an_error(tmp_path):
    res = run("k8s", "render", _profile(tmp_path, "server: {env: {EXTRA: '${NOT_SET_ANYWHERE}'}}\n"), env=ENV)
    assert res.code == 1 and "NOT_SET_ANYWHERE" in res.stderr and "is not set" in res.stderr


# ------------------------------------------------------------------------------------------- in the pod


def test_probe_against_a_live_status_endpoint():
    import http.server
    import threading

    from specops.k8s.pod import leader_step, prestop, probe

    state = {"doc": {"proxy": {"state": "idle"}}, "auth": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            state["auth"].append(self.headers.get("Authorization"))
            if self.path != "/specops/status":
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps(state["doc"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        assert "idle" in probe(port)
        state["doc"] = {"proxy": {"state": "held"}}
        assert "held" in probe(port)
        state["doc"] = {"proxy": {"state": "serving"}}
        assert probe(port, "THE_KEY", env={"THE_KEY": "abc"}) == ""
        assert state["auth"][-1] == "Bearer abc"
        state["doc"] = {"proxy": {"state": "held"}}
        assert "held" in probe(port) and probe(port, accept=("serving", "held")) == ""
        # preStop: waits until nothing is in flight or queued
        seq = iter([{"in_flight": 2, "queue_depth": 1}, {"in_flight": 1, "queue_depth": 0}, {"in_flight": 0}])
        slept = []

        def next_doc(seconds):
            slept.append(seconds)
            if seconds == 0.5:
                state["doc"] = {"proxy": next(seq)}

        state["doc"] = {"proxy": {"in_flight": 3}}
        assert prestop(port, None, settle=5, timeout=60, sleep=next_doc) == "drained"
        assert slept == [5, 0.5, 0.5, 0.5]
        state["doc"] = {"proxy": {"in_flight": 1}}
        clock = iter([0.0, 1.0, 2.0, 99.0])
        out = prestop(port, None, settle=0, timeout=10, sleep=lambda s: None, clock=lambda: next(clock))
        assert out == "1 request(s) still in flight after 10s"
        # an nnodes worker follows the leader's chain step (its /specops/status)
        state["doc"] = {"proxy": {"state": "held"}, "step": 1, "method": "ngram"}
        env = {"LWS_LEADER_ADDRESS": f"127.0.0.1:{port}".rpartition(":")[0], "K": "key"}
        assert leader_step(port, "K", env) == 1 and state["auth"][-1] == "Bearer key"
        state["doc"] = {"step": True}
        assert leader_step(port, None, env) is None
    finally:
        srv.shutdown()
        srv.server_close()
    assert "does not answer" in probe(port)
    assert prestop(port, None, settle=0, timeout=5, sleep=lambda s: None) == "specops does not answer: nothing to drain"


def test_multi_node_helpers():
    from specops.k8s.pod import headless_argv, worker_addresses

    assert worker_addresses("chat-0.chat.prod", 3, 50052) == ["chat-0-1.chat.prod:50052", "chat-0-2.chat.prod:50052"]
    argv = ["vllm", "serve", "m", "--nnodes", "2", "--node-rank", "0", "--master-addr", "a"]
    assert headless_argv(argv, "1") == [
        "vllm",
        "serve",
        "m",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "a",
        "--headless",
    ]


def test_grace_covers_drain_and_stop():
    from specops.k8s.manifests import GRACE_MARGIN, PRESTOP_SLEEP, grace_seconds

    p = load("llama33-70b-eagle3-tp4")
    assert p.proxy.drain_timeout == 120
    assert grace_seconds(p) == PRESTOP_SLEEP + math.ceil(120 + p.supervisor.stop_timeout) + GRACE_MARGIN


def test_ray_is_asked_through_the_engines_interpreter(tmp_path, monkeypatch):
    """specops lives in its own virtualenv: the leader counts Ray nodes with the interpreter of `ray`."""
    import sys

    from specops.k8s.pod import script_python

    script = tmp_path / "ray"
    script.write_text("#!/usr/lib/vllm-python/bin/python3\nimport ray\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert script_python("ray") == "/usr/lib/vllm-python/bin/python3"
    script.write_text("#!/usr/bin/env python3\n")  # not a plain interpreter path: fall back to this one
    assert script_python("ray") == sys.executable
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert script_python("ray") == sys.executable


@pytest.mark.parametrize(
    "case,flags",
    [
        ("llama31-405b-ray", ["--distributed-executor-backend", "ray", "--tensor-parallel-size", "8"]),
        ("qwen3-235b-nnodes", ["--nnodes", "2", "--node-rank", "0", "--master-addr", "lws-0.lws.ns"]),
        ("qwen25-72b-rpc", ["--rpc", "lws-0-1.lws.ns:50052,lws-0-2.lws.ns:50052"]),
    ],
)
def test_the_leaders_engine_command(tmp_path, case, flags):
    """The leader's ConfigMap profile renders (through the backends' own checks) the multi-node flags."""
    path = tmp_path / "profile.yaml"
    path.write_text(by_kind(case)["ConfigMap"]["data"]["profile.yaml"])
    pod_env = {
        "SPECOPS_API_KEY": "k" * 12,
        "LWS_LEADER_ADDRESS": "lws-0.lws.ns",
        "LWS_GROUP_SIZE": "2",
        "LWS_WORKER_INDEX": "0",
        "SPECOPS_RPC_WORKERS": "lws-0-1.lws.ns:50052,lws-0-2.lws.ns:50052",
        "SPECOPS_PUBLIC_VARS": "LWS_LEADER_ADDRESS,LWS_GROUP_SIZE,LWS_WORKER_INDEX,SPECOPS_RPC_WORKERS",
    }
    res = run("render", str(path), "--format", "args", env=pod_env)
    assert res.code == 0, res.stderr
    args = res.stdout.split("\n")
    for i, flag in enumerate(flags[::2]):
        assert flag in args and args[args.index(flag) + 1] == flags[2 * i + 1], (flag, args)


def test_leader_prepares_the_group_then_execs_specops_up(monkeypatch):
    from specops.k8s import pod

    calls = []

    class Exec(Exception):
        pass

    def fake_exec(prog, argv, env):
        calls.append((prog, argv, env))
        raise Exec

    monkeypatch.setattr(pod.os, "execvpe", fake_exec)
    monkeypatch.setattr(pod, "_reachable", lambda address: calls.append(("reach", address)) or True)
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "chat-1.chat.prod.svc.cluster.local")
    with pytest.raises(Exec):
        pod.leader("rpc", 3, "/etc/specops/profile.yaml", ray_port=6379, rpc_port=50052, timeout=5)
    workers = ["chat-1-1.chat.prod.svc.cluster.local:50052", "chat-1-2.chat.prod.svc.cluster.local:50052"]
    assert [c[1] for c in calls[:2]] == workers
    prog, argv, env = calls[-1]
    assert argv == ["specops", "up", "/etc/specops/profile.yaml"] and env["SPECOPS_RPC_WORKERS"] == ",".join(workers)

    calls.clear()
    ran = []
    monkeypatch.setattr(pod.subprocess, "run", lambda argv, **kw: ran.append(argv))
    counts = iter([1, 1, 2])
    monkeypatch.setattr(pod, "_ray_nodes", lambda: next(counts))
    monkeypatch.setattr(pod.time, "sleep", lambda s: None)
    with pytest.raises(Exec):
        pod.leader("ray", 2, "/etc/specops/profile.yaml", ray_port=6379, rpc_port=50052, timeout=60)
    assert ran == [["ray", "start", "--head", "--port=6379", "--disable-usage-stats"]]
    assert calls[-1][1] == ["specops", "up", "/etc/specops/profile.yaml"]
    monkeypatch.setattr(pod, "_ray_nodes", lambda: 1)
    from specops.errors import SpecopsError

    with pytest.raises(SpecopsError, match="2 Ray nodes"):
        pod.leader("ray", 2, "/p.yaml", ray_port=6379, rpc_port=50052, timeout=0)


def test_auto_without_a_lock_is_pointed_out(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(
        "name: auto-draft\nbackend: vllm\nengine: {version: 0.32.0}\nmodel: {id: m/x}\n"
        "speculative: {method: eagle3, draft: auto}\n"
    )
    assert "run `specops lock`" in render(str(prof))[1]
    (tmp_path / "p.lock.json").write_text("{}\n")
    assert "specops lock" not in render(str(prof))[1]


def test_a_deployment_without_an_api_key_is_pointed_out():
    assert "no API key: anyone who reaches the Service" in render(CASES["qwen25-72b-rpc"])[1]
    note = render(CASES["llama31-8b-chat-prod"])[1]
    assert "reads ${SPECOPS_API_KEY} but no deploy.secrets.api_key provides it" in note
    assert "anyone" not in render(CASES["llama31-405b-ray"])[1]


def test_the_spot_check_reference_key_reaches_the_pod_by_reference(tmp_path):
    text = (
        "speculative: {method: ngram}\n"
        "certify: {spot_check: {enabled: true, reference: 'http://ref:8000', api_key_env: REF_KEY}}\n"
        "deploy: {secrets: {spot_reference_key: {name: ref-secret, key: token}}}\n"
    )
    res = run("k8s", "render", _profile(tmp_path, text), env=ENV)
    assert res.code == 0, res.stderr
    pod = next(o for o in objects(res.stdout) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["REF_KEY"] == {"name": "REF_KEY", "valueFrom": {"secretKeyRef": {"name": "ref-secret", "key": "token"}}}
