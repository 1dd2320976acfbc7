"""``specops init MODEL`` as a user runs it: the installed console script in a subprocess.

Hub models come from the fake Hub (the real huggingface_hub client, pointed at it through HF_ENDPOINT).
GPUs cannot be had here: a stand-in ``nvidia-smi`` on PATH answers the query specops sends with the CSV
that nvidia-smi prints (index, name, memory.total, memory.used in MiB). The local GGUF is a generated tiny
model, and with the engines set up, ``specops up`` starts the written profile on llama-server.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakehub import fake_hub, seed_llama31  # noqa: F401
from support_procs import stop_group

pytestmark = pytest.mark.timeout(240)

SPECOPS = Path(sys.executable).with_name("specops")


def specops(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [str(SPECOPS)] if SPECOPS.exists() else [sys.executable, "-m", "specops.cli"]
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        cmd + [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in full.items() if v is not None},
        stdin=subprocess.DEVNULL,
    )


def gpus_on_path(tmp_path: Path, count: int, mib: int) -> dict:
    """An environment whose PATH starts with a stand-in nvidia-smi listing ``count`` GPUs of ``mib`` MiB."""
    bin_dir = tmp_path / "gpu-bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    rows = "".join(f'echo "{i}, NVIDIA A10, {mib}, 5"\n' for i in range(count))
    smi.write_text("#!/bin/sh\n" + rows)
    smi.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": None}


def no_gpus(tmp_path: Path) -> dict:
    """An environment with no nvidia-smi on PATH (this machine's own PATH has none either)."""
    return {"CUDA_VISIBLE_DEVICES": None}


# ------------------------------------------------------------------------------------------ Hub models


def test_init_writes_a_commented_profile_and_lock_that_validate(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    out = tmp_path / "llama.yaml"
    env = gpus_on_path(tmp_path, 2, 24564)  # two 24 GiB GPUs
    r = specops(
        "init", "meta-llama/Llama-3.1-8B-Instruct", "--backend", "vllm", "--non-interactive", "-o", out, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"wrote {out}" in r.stdout and f"wrote {tmp_path / 'llama.lock.json'}" in r.stdout
    text = out.read_text()
    # each choice with its reason beside it
    assert "method: eagle3\n" in text and "draft: RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3\n" in text
    assert "# auto resolved: eagle3 RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3" in text
    assert "also considered: draft_model meta-llama/Llama-3.2-1B-Instruct" in text
    assert "devices: [0]\n" in text and "tensor_parallel_size" not in text  # 16.7 GiB fits one 24 GiB GPU
    assert "→ 16.7 GiB per GPU at TP 1, within 80% of 24 GiB" in text
    assert "# GPUs: 0: NVIDIA A10 (24 GiB), 1: NVIDIA A10 (24 GiB)" in text
    assert "the model was trained for 131072; 8192" in text and "max_model_len: 8192" in text
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert specops("validate", out).returncode == 0
    check = specops("lock", "--check", out)
    assert check.returncode == 0, check.stdout + check.stderr
    lock = json.loads((tmp_path / "llama.lock.json").read_text())
    assert lock["speculative"]["draft"] == "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"
    assert lock["speculative"]["draft_revision"]  # pinned from the Hub


def test_init_spreads_the_weights_over_the_fewest_gpus_that_hold_them(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    env = gpus_on_path(tmp_path, 4, 8192)  # four 8 GiB GPUs: 15 GiB + 1.8 GiB needs TP 4
    r = specops("init", "meta-llama/Llama-3.1-8B-Instruct", "--backend", "vllm", "--dry-run", "-q", env=env)
    assert r.returncode == 0, r.stderr
    assert "devices: [0, 1, 2, 3]\n  tensor_parallel_size: 4\n" in r.stdout
    assert not list(Path.cwd().glob("*.lock.json.tmp"))
    # --gpus picks the GPUs; two of them cannot hold the weights: refused, with the numbers
    refused = specops("init", "meta-llama/Llama-3.1-8B-Instruct", "--backend", "vllm", "--gpus", "0,1", "-q", env=env)
    assert refused.returncode == 1
    assert "error: nothing fits: meta-llama/Llama-3.1-8B-Instruct needs 16.7 GiB of weights" in refused.stderr
    assert "2 GPU(s) of 8 GiB" in refused.stderr and "Traceback" not in refused.stderr
    missing = specops("init", "meta-llama/Llama-3.1-8B-Instruct", "--gpus", "7", "-q", env=env)
    assert missing.returncode == 1 and "lists no GPU 7" in missing.stderr


def test_init_refuses_what_nothing_here_can_serve_and_writes_nothing(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    out = tmp_path / "x.yaml"
    env = gpus_on_path(tmp_path, 1, 24564)
    # a GPU machine with no vLLM: no engine loads a safetensors model here
    r = specops("init", "meta-llama/Llama-3.1-8B-Instruct", "--non-interactive", "-o", out, env=env)
    assert r.returncode == 1
    assert "no engine here loads meta-llama/Llama-3.1-8B-Instruct (Hugging Face (safetensors))" in r.stderr
    assert "--backend vllm" in r.stderr
    # a method the engine does not have
    m = specops("init", "meta-llama/Llama-3.1-8B-Instruct", "--backend", "llamacpp", "--method", "eagle", env=env)
    assert m.returncode == 1 and "backend llamacpp does not support method eagle" in m.stderr
    # a repo the Hub does not have
    gone = specops("init", "nobody/missing", "--backend", "vllm", "-o", out, env=env)
    assert gone.returncode == 1 and "nobody/missing not found on the Hub" in gone.stderr
    assert not out.exists() and not (tmp_path / "x.lock.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".specops-init")] == []


def test_init_keeps_an_existing_profile_unless_forced(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    out = tmp_path / "mine.yaml"
    out.write_text("name: mine\n")
    env = gpus_on_path(tmp_path, 1, 24564)
    args = ("init", "meta-llama/Llama-3.1-8B-Instruct", "--backend", "vllm", "--non-interactive", "-o", out)
    r = specops(*args, env=env)
    assert r.returncode == 1 and f"{out} exists" in r.stderr and out.read_text() == "name: mine\n"
    forced = specops(*args, "--force", "--json", env=env)
    assert forced.returncode == 0, forced.stderr
    data = json.loads(forced.stdout)
    assert data["written"] == str(out) and data["method"] == "eagle3" and data["tensor_parallel_size"] == 1
    assert data["gpus"][0]["memory_gib"] == pytest.approx(24564 / 1024)
    assert out.read_text() == data["profile"]


# ------------------------------------------------------------------------------------------ a local GGUF


def test_init_for_a_local_gguf_on_cpu_picks_llamacpp_and_validates(tmp_path):
    from specops.devenv.testmodels import ensure_tiny_models

    target = ensure_tiny_models(["gguf"])["gguf-target.gguf"]
    out = tmp_path / "tiny.yaml"
    r = specops(
        "init", target, "--backend", "llamacpp", "--non-interactive", "--offline", "-o", out, env=no_gpus(tmp_path)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    assert "backend: llamacpp\n" in text and f"id: {target}\n" in text
    assert "devices: []\n" in text and "# GPUs: none: CPU only" in text
    assert "method: ngram\n" in text  # offline, a local file: no draft published for it; n-gram needs none
    assert "parallel: 4\n" in text and "× 4 slots (llama.cpp shares -c among them)" in text
    assert specops("validate", out).returncode == 0


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_init_profile_for_a_local_gguf_starts_on_llama_server(tmp_path):
    from support_engines import need_llama_server, tiny_model
    from support_ports import free_port

    need_llama_server()
    target = tiny_model("gguf-target.gguf")
    out = tmp_path / "tiny.yaml"
    port = free_port()
    env = {**no_gpus(tmp_path), "SPECOPS_STATE": str(tmp_path / "state")}
    r = specops("init", target, "--non-interactive", "--offline", "--port", port, "-o", out, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# backend: a GGUF model; llama.cpp " in out.read_text()  # found here, chosen for the format
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    cmd = [str(SPECOPS)] if SPECOPS.exists() else [sys.executable, "-m", "specops.cli"]
    up = subprocess.Popen([*cmd, "up", str(out), "--quiet-engine"], env=full, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        state = {}
        while time.monotonic() < deadline:
            s = specops("status", out, "--json", env=env)
            state = json.loads(s.stdout) if s.returncode == 0 and s.stdout.strip() else {}
            if state.get("state") == "ready" or up.poll() is not None:
                break
            time.sleep(1)
        assert state.get("state") == "ready", state
        import urllib.request

        body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        stop_group(up, timeout=60)  # SIGTERM: specops up stops its engine; SIGKILL to the group after 60 s


def test_init_takes_the_gpus_cuda_visible_devices_leaves_visible(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    env = gpus_on_path(tmp_path, 2, 24564)
    model = "meta-llama/Llama-3.2-1B-Instruct"  # 2.5 GiB: fits one GPU, and the RAM of any test machine
    second = specops("init", model, "--backend", "vllm", "--dry-run", "-q", env={**env, "CUDA_VISIBLE_DEVICES": "1"})
    assert second.returncode == 0, second.stderr
    assert "devices: [1]\n" in second.stdout and "CUDA_VISIBLE_DEVICES='1' leaves visible" in second.stdout
    hidden = specops("init", model, "--backend", "vllm", "--dry-run", "-q", env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert hidden.returncode == 0, hidden.stderr
    assert "devices: []\n" in hidden.stdout
    assert "CPU only: CUDA_VISIBLE_DEVICES='' hides the 2 GPU(s)" in hidden.stdout
