"""`specops k8s render` of a profile with twins: one pod, one `specops up`, the engines sharing its GPUs.

The golden (tests/golden/k8s-twins/) is validated like the other manifests (kubernetes-validate against the
OpenAPI schemas of several Kubernetes versions; `kubectl kustomize` builds the rendered folder). The readiness
probe is the pod's command (`specops k8s probe`, through the CLI) against a loopback HTTP server that answers
`/specops/status` as specops does with twins.

Update the golden after an intended change with::

    SPECOPS_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_k8s_twins.py

and review the diff of tests/golden/k8s-twins/ by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT, run
from support_k8s import kubectl, objects, validate

GOLDEN = Path(__file__).resolve().parent / "golden" / "k8s-twins"
PROFILE = "tests/k8s_profiles/vllm-twins.yaml"
UPDATE = os.environ.get("SPECOPS_UPDATE_GOLDEN") == "1"
ENV = {"SPECOPS_API_KEY": None, "HF_TOKEN": None, "PROMETHEUS_URL": None}


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _render(path: str):
    return run("k8s", "render", path, env=ENV)


def test_twins_render_into_one_pod_sharing_its_gpu(tmp_path):
    """The golden, validated; one Deployment, one server container running `specops up` on the profile that lists
    the twin, one GPU (the engines share it, each with its share), the memory limit for both; the note says so."""
    res = _render(PROFILE)
    assert res.code == 0, res.stderr
    golden = GOLDEN / "llama31-8b-eagle3-twins.yaml"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(res.stdout, encoding="utf-8")
    assert golden.read_text(encoding="utf-8") == res.stdout, "k8s render of the twin profile differs from its golden"
    for obj in objects(res.stdout):
        assert validate(obj) == [], obj["kind"]
    kinds = {o["kind"]: o for o in objects(res.stdout)}
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    servers = [c for c in pod["containers"] if c["args"][:1] == ["up"]]
    assert len(servers) == 1
    limits = servers[0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and limits["memory"] == "64Gi"
    profile = yaml.safe_load(kinds["ConfigMap"]["data"]["profile.yaml"])
    assert profile["routing"] == {"twins": ["none"], "memory_utilization": {"primary": 0.55, "none": 0.35}}
    assert "2 engines (primary, none) run in each pod's container" in res.stderr
    assert "(primary 0.55, none 0.35)" in res.stderr and "deploy.resources.memory (64Gi)" in res.stderr
    # kubectl reads the rendered folder
    assert run("k8s", "render", PROFILE, "-o", str(tmp_path), env=ENV).code == 0
    built = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    assert [o["kind"] for o in objects(built.stdout)].count("Deployment") == 1


def test_twins_are_refused_in_a_multi_node_group(tmp_path):
    src = (ROOT / "tests/k8s_profiles/vllm-nnodes.yaml").read_text()
    path = tmp_path / "group.yaml"
    path.write_text(src + "fallback: {chain: [none]}\nrouting: {twins: [none]}\n")
    res = _render(str(path))
    assert res.code == 1
    assert f"{path}:17:" in res.stderr and "routing.twins: a nnodes group runs one engine across 2 pods" in res.stderr


def test_remote_twins_render_in_a_multi_node_group(tmp_path):
    """A remote twin is another deployment: nothing of it runs in the group's pods, so the group renders (validated)
    with the twin in its profile, and no note says engines share the pod."""
    src = (ROOT / "tests/k8s_profiles/vllm-nnodes.yaml").read_text()
    path = tmp_path / "group.yaml"
    twin = {"url": "http://qwen3-plain:8000", "method": "none", "api_key_env": "SPECOPS_API_KEY"}
    path.write_text(src + "fallback: {chain: [none]}\nrouting: {twins: [" + json.dumps(twin) + "]}\n")
    res = _render(str(path))
    assert res.code == 0, res.stderr
    kinds = {o["kind"]: o for o in objects(res.stdout)}
    assert "LeaderWorkerSet" in kinds
    for obj in objects(res.stdout):
        assert validate(obj) == [], obj["kind"]
    assert yaml.safe_load(kinds["ConfigMap"]["data"]["profile.yaml"])["routing"]["twins"] == [twin]
    assert "run in each pod's container" not in res.stderr
    # the pods may reach the twin's port, and the render says what the policy allows
    egress = kinds["NetworkPolicy"]["spec"]["egress"]
    assert any({"port": 8000, "protocol": "TCP"} in rule.get("ports", []) and "to" not in rule for rule in egress)
    assert "http://qwen3-plain:8000 is another deployment" in res.stderr
    assert "the pods get no $SPECOPS_API_KEY" not in res.stderr  # the server's key, from deploy.secrets.api_key


def test_a_remote_twin_key_the_pods_are_not_given_is_named(tmp_path):
    src = (ROOT / "tests/k8s_profiles/vllm-nnodes.yaml").read_text()
    path = tmp_path / "group.yaml"
    twin = {"url": "https://plain.llm.svc:9443", "api_key_env": "PLAIN_KEY"}
    path.write_text(src + "fallback: {chain: [none]}\nrouting: {twins: [" + json.dumps(twin) + "]}\n")
    res = _render(str(path))
    assert res.code == 0, res.stderr
    egress = {o["kind"]: o for o in objects(res.stdout)}["NetworkPolicy"]["spec"]["egress"]
    assert any({"port": 9443, "protocol": "TCP"} in rule.get("ports", []) for rule in egress)
    assert "the pods get no $PLAIN_KEY (its api_key_env)" in res.stderr


def _tiny_gguf(dst: Path) -> Path:
    """A llama GGUF with the layer-skip fixture's attention shape (48 KiB of f16 KV cache a token), 4 MiB of
    weights."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(dst), arch="llama")
    writer.add_block_count(16)
    writer.add_embedding_length(768)
    writer.add_head_count(12)
    writer.add_head_count_kv(12)
    writer.add_context_length(2048)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((1024, 1024), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_the_container_memory_limit_holds_every_engine(tmp_path):
    """llama.cpp on CPU, model file at hand: the GGUF once (4 MiB) + two 96 MiB KV caches = 196 MiB; a 150Mi
    limit would OOM-kill the pod (every engine at once): refused at deploy.resources.memory; 300Mi renders."""
    target = _tiny_gguf(tmp_path / "target.gguf")
    path = tmp_path / "cpu.yaml"
    text = (
        "name: cpu-twins\nbackend: llamacpp\nengine: {version: current}\n"
        f"model: {{id: '{target}', max_model_len: 2048}}\n"
        "speculative: {method: ngram}\ngpus: {devices: []}\nserver: {port: 8000}\n"
        "fallback: {chain: [none]}\nrouting: {twins: [none]}\n"
        "deploy:\n  image: registry.example.com/specops-llamacpp:0.1.0\n  resources: {memory: 150Mi}\n"
    )
    path.write_text(text)
    res = _render(str(path))
    assert res.code == 1, res.stdout
    assert f"{path}:12:" in res.stderr and "deploy.resources.memory: the container's memory limit" in res.stderr
    assert "over 150 MiB (deploy.resources.memory 150Mi)" in res.stderr
    path.write_text(text.replace("150Mi", "300Mi"))
    res = _render(str(path))
    assert res.code == 0, res.stderr


class _Status(BaseHTTPRequestHandler):
    doc: dict = {}

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        body = json.dumps(self.doc).encode()
        self.send_response(200 if self.path == "/specops/status" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _probe(doc: dict):
    """`specops k8s probe` (the pod's readiness command) against a loopback server answering ``doc``."""
    handler = type("Handler", (_Status,), {"doc": doc})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        return run("k8s", "probe", "--port", str(server.server_address[1]), env=ENV)
    finally:
        server.shutdown()
        server.server_close()


def test_readiness_holds_while_a_twin_serves():
    """The primary restarts (its proxy state is held) while the twin serves: the pod stays ready. With both
    engines down, or without twins (several replicas), a held proxy is not ready, as before."""
    held = {"proxy": {"state": "held", "in_flight": 0, "queue_depth": 0}}
    res = _probe({**held, "engines": [{"engine": 0, "live": False}, {"engine": 1, "live": True}]})
    assert res.code == 0, res.stdout + res.stderr
    for doc in ({**held, "engines": [{"engine": 0, "live": False}, {"engine": 1, "live": False}]}, held):
        res = _probe(doc)
        assert res.code != 0 and "the proxy is held, not serving" in res.stdout + res.stderr
