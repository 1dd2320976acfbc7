"""`specops k8s render` of a profile with pools (`deploy.pools`): a speculating pool and a plain pool of one model.

Every object is validated like the other manifests (the Kubernetes OpenAPI schemas of several versions; the
InferencePool and HTTPRoute CRD schemas vendored from the Gateway API Inference Extension and Gateway API
releases, tests/k8s_schemas/), `kubectl kustomize` builds the rendered folder and an overlay on it, and the
profiles the pods read are loaded by the real loader.

Update the golden after an intended change with::

    SPECOPS_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_k8s_pools.py

and review the diff of tests/golden/k8s-pools/ by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT, run
from support_k8s import kubectl, objects, validate

GOLDEN = Path(__file__).resolve().parent / "golden" / "k8s-pools"
PROFILE = ROOT / "tests/k8s_profiles/vllm-pools.yaml"
UPDATE = os.environ.get("SPECOPS_UPDATE_GOLDEN") == "1"
ENV = {"SPECOPS_API_KEY": None, "HF_TOKEN": None, "PROMETHEUS_URL": None}
SPEC = "llama31-8b-eagle3-pools"
PLAIN = "meta-llama-llama-3-1-8b-instruct-plain"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _render(*paths) -> tuple[int, str, str]:
    res = run("k8s", "render", *map(str, paths), env=ENV)
    return res.code, res.stdout, res.stderr


def _by(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _pods_profile(objs: list[dict], pool: str) -> dict:
    return yaml.safe_load(_by(objs, "ConfigMap", f"{pool}-profile")["data"]["profile.yaml"])


def _variant(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_two_pools_render_validate_and_build(tmp_path):
    """The golden; every object validates (built-in kinds on each Kubernetes version, the CRDs against their
    schemas); kubectl builds the rendered folder and an overlay that sets a namespace and the image."""
    code, out, err = _render(PROFILE)
    assert code == 0, err
    golden = GOLDEN / "llama31-8b-eagle3-pools.yaml"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out, encoding="utf-8")
    assert golden.read_text(encoding="utf-8") == out, "k8s render of the pool profile differs from its golden"
    objs = objects(out)
    kinds = sorted(o["kind"] for o in objs)
    for kind in (
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Lease",
        "HorizontalPodAutoscaler",
        "InferencePool",
    ):
        assert kinds.count(kind) == 2, kind
    assert kinds.count("HTTPRoute") == 1
    for obj in objs:
        assert validate(obj) == [], (obj["kind"], obj["metadata"]["name"])
    rendered = tmp_path / "rendered"
    assert run("k8s", "render", str(PROFILE), "-o", str(rendered), env=ENV).code == 0
    assert sorted(p.name for p in rendered.iterdir()) == ["kustomization.yaml", SPEC, PLAIN]
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: llm-prod\n"
        "resources: [../rendered]\n"
        "images: [{name: registry.example.com/specops-vllm, newTag: 0.2.0}]\n"
    )
    built = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    built_objs = objects(built.stdout)
    assert len(built_objs) == len(objs)
    for obj in built_objs:
        assert obj["metadata"]["namespace"] == "llm-prod"
        assert validate(obj) == [], obj["kind"]
    images = {
        c["image"] for o in built_objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"registry.example.com/specops-vllm:0.2.0"}


def test_the_speculating_pods_route_to_the_plain_pools_service(tmp_path):
    """The speculating pods' profile: the local `none` twin became a remote twin at the plain pool's Service (its
    name and port, the same key variable); the plain pods run the model without speculation or routing; the real
    loader accepts both pods' profiles."""
    from specops.config.profile import load_profile

    code, out, err = _render(PROFILE)
    assert code == 0, err
    objs = objects(out)
    spec = _pods_profile(objs, SPEC)
    service = _by(objs, "Service", PLAIN)
    port = service["spec"]["ports"][0]["port"]
    assert spec["routing"]["twins"] == [
        {"url": f"http://{PLAIN}:{port}", "method": "none", "api_key_env": "SPECOPS_API_KEY"}
    ]
    assert spec["routing"]["aliases"] == {"llama-fast": "on", "llama-exact": "off"}
    assert service["spec"]["type"] == "ClusterIP"
    plain = _pods_profile(objs, PLAIN)
    assert plain["speculative"] == {"method": "none"} and "routing" not in plain and "fallback" not in plain
    assert plain["model"] == spec["model"] and plain["server"] == spec["server"]
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(plain))
    loaded = load_profile(path, env={"SPECOPS_API_KEY": "k"})
    assert loaded.profile.speculative.method.value == "none" and not loaded.profile.routing.twins
    # and the speculating pods' profile, with its remote twin
    path = tmp_path / "speculating.yaml"
    path.write_text(yaml.safe_dump(spec))
    (twin,) = load_profile(path, env={"SPECOPS_API_KEY": "k"}).profile.routing.twins
    assert (twin.url, twin.api_key_env, twin.method.value) == (f"http://{PLAIN}:{port}", "SPECOPS_API_KEY", "none")
    # one engine per pod now: the GPU is the speculating engine's alone (no share), the twin is another pod
    deployment = _by(objs, "Deployment", SPEC)["spec"]["template"]["spec"]["containers"][0]
    assert deployment["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "2 engines" not in err and f"routes each request class that does not pay to {PLAIN}" in err


def test_the_network_policies_open_exactly_the_hop():
    """The speculating pods may reach the plain pool's pods on the proxy port; the plain pool admits pods that
    carry its name (the speculating pods of its model) and, with a gateway, the cluster's pods."""
    code, out, err = _render(PROFILE)
    objs = objects(out)
    spec_pod = _by(objs, "Deployment", SPEC)["spec"]["template"]["metadata"]["labels"]
    assert spec_pod["specops.dev/plain-pool"] == PLAIN and spec_pod["specops.dev/pool"] == "speculating"
    plain_pod = _by(objs, "Deployment", PLAIN)["spec"]["template"]["metadata"]["labels"]
    egress = _by(objs, "NetworkPolicy", SPEC)["spec"]["egress"]
    hop = [r for r in egress if "to" in r]
    assert len(hop) == 1 and hop[0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert hop[0]["to"][0]["podSelector"]["matchLabels"].items() <= plain_pod.items()
    ingress = _by(objs, "NetworkPolicy", PLAIN)["spec"]["ingress"][0]
    assert ingress["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert ingress["from"] == [
        {"podSelector": {"matchLabels": {"specops.dev/plain-pool": PLAIN}}},
        {"namespaceSelector": {}},
    ]


def test_without_a_gateway_only_the_speculating_pods_reach_the_plain_pool(tmp_path):
    text = PROFILE.read_text().replace(
        "    inference_gateway: {gateway: inference-gateway, namespace: gateway-system}\n", ""
    )
    code, out, err = _render(_variant(tmp_path, "nogw", text))
    assert code == 0, err
    objs = objects(out)
    assert not [o for o in objs if o["kind"] in ("InferencePool", "HTTPRoute")]
    assert _by(objs, "NetworkPolicy", PLAIN)["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"specops.dev/plain-pool": PLAIN}}}
    ]


def test_profiles_of_one_model_share_one_plain_pool(tmp_path):
    """A second speculating profile of the model (another name, method, aliases): its plain pool is the same
    objects, written once; a third that would change the plain pool (another image) is refused."""
    other = PROFILE.read_text().replace(f"name: {SPEC}", "name: llama31-8b-ngram-pools")
    other = other.replace(
        "speculative: {method: eagle3, draft: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, num_speculative_tokens: 3}",
        "speculative: {method: ngram}",
    ).replace("fallback: {chain: [ngram, none]}", "fallback: {chain: [none]}")
    other = other.replace("llama-fast", "llama-ngram").replace("llama-exact", "llama-plain")
    code, out, err = _render(PROFILE, _variant(tmp_path, "ngram", other))
    assert code == 0, err
    objs = objects(out)
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"] == [SPEC, PLAIN, "llama31-8b-ngram-pools"]
    assert (
        _by(objs, "Deployment", "llama31-8b-ngram-pools")["spec"]["template"]["metadata"]["labels"][
            "specops.dev/plain-pool"
        ]
        == PLAIN
    )
    differs = _variant(tmp_path, "differs", other.replace("specops-vllm:0.1.0", "specops-vllm:0.2.0"))
    code, out, err = _render(PROFILE, differs)
    assert code == 1 and f"the plain pool {PLAIN} is rendered differently" in err, err
    assert "configmap.yaml" in err and "deployment.yaml" in err


LOCK = {
    "lock_version": 1,
    "speculative": {"method": "eagle3", "draft": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
    "tune": {
        "surface": {
            "version": 1,
            "points": [
                {"method": m, "k": k, "concurrency": c, "tokens_per_s": t}
                for c, none, eagle in ((1, 40, 80), (4, 150, 220), (8, 280, 290), (16, 480, 400), (32, 560, 430))
                for m, k, t in (("none", 0, none), ("eagle3", 3, eagle))
            ],
        }
    },
}


def _hpa_target(objs: list[dict], name: str) -> tuple[str, str]:
    spec = _by(objs, "HorizontalPodAutoscaler", name)["spec"]
    metric = spec["metrics"][0]["pods"]
    return metric["metric"]["name"], metric["target"]["averageValue"]


def test_autoscalers_are_sized_from_the_goodput_surface(tmp_path):
    """Without targets in the profile: the speculating pool's from the surface's crossover (eagle3 k=3 beats none
    at 8 clients, 290 against 280, and loses at 16, 400 against 480: interpolated in log2, the first 1/8 octave
    where it no longer wins is 2^(25/8) = 8.72), on the engine's own running requests; the plain pool's where none reaches 90% of its best (560 at 32:
    504 first reached at 32), on specops' in-flight gauge. The workloads leave their replicas to the HPA."""
    text = PROFILE.read_text().replace(", target: 24}", "}").replace(", target: 6}", "}")
    path = _variant(tmp_path, "surface", text)
    code, out, err = _render(path)
    assert code == 1, out
    assert f"{path}:23:" in err and "deploy.pools.plain.autoscale: no goodput surface" in err, err
    assert f"{path}:24:" in err and "deploy.pools.autoscale: no goodput surface" in err, err
    (tmp_path / "surface.lock.json").write_text(json.dumps(LOCK))
    code, out, err = _render(path)
    assert code == 0, err
    objs = objects(out)
    assert _hpa_target(objs, SPEC) == ("vllm_num_requests_running", "8720m")
    assert _hpa_target(objs, PLAIN) == ("specops_proxy_in_flight", "32")
    assert "eagle3 k=3 stops beating none at 8.72 requests" in err
    assert "none reaches 90% of its best tokens/s at 32 requests" in err
    for name in (SPEC, PLAIN):
        deployment = _by(objs, "Deployment", name)
        assert "replicas" not in deployment["spec"]
        assert _by(objs, "HorizontalPodAutoscaler", name)["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        # min_replicas 2: a switching pod leaves the Service (another replica serves)
        readiness = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
        assert "--accept-held" not in readiness


def test_the_route_sends_explicit_choices_at_the_gateway(tmp_path):
    """`X-Specops-Speculation: off` goes to the plain pool, the aliases and the rest to the speculating pool; under
    `client_choice: forbid` the header is routed nowhere (the speculating proxies refuse it; the gateway must not
    route around them)."""
    code, out, err = _render(PROFILE)
    route = _by(objects(out), "HTTPRoute", SPEC)
    rules = route["spec"]["rules"]
    assert route["spec"]["parentRefs"][0] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "inference-gateway",
        "namespace": "gateway-system",
    }
    assert rules[0]["matches"] == [{"headers": [{"type": "Exact", "name": "X-Specops-Speculation", "value": "off"}]}]
    assert rules[0]["backendRefs"][0]["name"] == PLAIN and rules[0]["backendRefs"][0]["kind"] == "InferencePool"
    assert {m["headers"][0]["value"] for m in rules[1]["matches"]} == {"llama-fast", "llama-exact"}
    assert [r["backendRefs"][0]["name"] for r in rules[1:]] == [SPEC, SPEC]
    forbid = PROFILE.read_text().replace("  twins: [none]\n", "  twins: [none]\n  client_choice: forbid\n")
    code, out, err = _render(_variant(tmp_path, "forbid", forbid))
    assert code == 0, err
    rules = _by(objects(out), "HTTPRoute", SPEC)["spec"]["rules"]
    assert all(r["backendRefs"][0]["name"] == SPEC for r in rules)
    # the InferencePools select each pool's serving pods on specops' port
    objs = objects(out)
    for name in (SPEC, PLAIN):
        pool = _by(objs, "InferencePool", name)["spec"]
        assert pool["selector"]["matchLabels"] == _by(objs, "Service", name)["spec"]["selector"]
        assert pool["targetPorts"] == [{"number": 8000}] and pool["endpointPickerRef"]["name"] == f"{name}-epp"


def test_multi_node_pools_are_two_leaderworkersets(tmp_path):
    """A multi-node profile renders two LWS groups (the plain one the same layout without speculation); the
    autoscalers target the LeaderWorkerSets, the plain pool's policy and InferencePool select the leaders."""
    src = (ROOT / "tests/k8s_profiles/vllm-nnodes.yaml").read_text()
    text = (
        src.replace(
            "  multi_node: {nodes: 2, mode: nnodes}\n",
            "  multi_node: {nodes: 2, mode: nnodes}\n"
            "  pools:\n    plain: {replicas: 1, autoscale: {max_replicas: 3, target: 8}}\n"
            "    autoscale: {max_replicas: 2, target: 4}\n    inference_gateway: {gateway: gw}\n",
        )
        + "fallback: {chain: [none]}\nrouting: {twins: [none]}\n"
    )
    code, out, err = _render(_variant(tmp_path, "group", text))
    assert code == 0, err
    objs = objects(out)
    plain = "qwen-qwen3-235b-a22b-plain"
    groups = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    assert [g["metadata"]["name"] for g in groups] == ["qwen3-235b-nnodes", plain]
    for obj in objs:
        assert validate(obj) == [], (obj["kind"], obj["metadata"]["name"])
    assert _by(objs, "HorizontalPodAutoscaler", plain)["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    leader = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert _by(objs, "InferencePool", plain)["spec"]["selector"]["matchLabels"].items() >= leader.items()
    hop = [r for r in _by(objs, "NetworkPolicy", "qwen3-235b-nnodes")["spec"]["egress"] if "ports" in r and "to" in r]
    assert any(r["to"][0]["podSelector"]["matchLabels"].items() >= leader.items() for r in hop)


@pytest.mark.parametrize(
    ("change", "line", "says"),
    [
        (("  twins: [none]\n", "  twins: [ngram]\n"), 12, "routing.twins: the plain pool replaces the same-pod twin"),
        (("  twins: [none]\n", "  twins: [none]\n  canary: {enabled: true}\n"), 13, "routing.canary.enabled: a canary"),
    ],
)
def test_what_pools_refuse_is_located(tmp_path, change, line, says):
    path = _variant(tmp_path, "bad", PROFILE.read_text().replace(*change))
    code, out, err = _render(path)
    assert code == 1, out
    assert f"{path}:{line}:" in err and says in err, err
