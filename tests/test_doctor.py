"""`specops doctor`: each check finds the real problem and says what to fix; exit 1 only on an error.

Real parts throughout: the CPU development engines from the cache, real sockets for the port check, a real
HTTP server for Prometheus' /-/ready, the local fake Hub (tests/fakehub.py) behind the real huggingface_hub
client. Only nvidia-smi is a stand-in (a script on PATH that prints what the real one prints), since this
machine has no GPU.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub  # noqa: F401 - imported now, before any test sets HF_HUB_OFFLINE (read once, at import)
import pytest
from fakehub import FakeHub, seed_llama31
from support_cli import ROOT, run
from support_engines import need_dev_engine
from support_ports import free_port

NO_ENGINES_PATH = "/usr/bin:/bin"  # neither vllm nor llama-server lives there on a test machine
H100 = "0, NVIDIA H100 80GB HBM3, 81559, 512\n"


def doctor(*args, env: dict | None = None, online: bool = False) -> tuple[int, dict, str]:
    """``specops doctor ARGS --json`` (``--offline`` unless ``online``): exit code, the report, stderr."""
    res = run("doctor", *args, "--json", *(() if online else ("--offline",)), env=env)
    assert "Traceback" not in res.stderr
    return res.code, json.loads(res.stdout), res.stderr


def checks(report: dict, name: str) -> list[dict]:
    return [c for c in report["checks"] if c["check"] == name]


def one(report: dict, name: str) -> dict:
    found = checks(report, name)
    assert len(found) == 1, (name, report["checks"])
    return found[0]


@pytest.fixture
def env(tmp_path, request) -> dict:
    """Isolated state and HF folders, no engines on PATH, the Hub off unless a test turns it on. A test not
    marked ``engines`` sees an empty engine cache too: doctor probes the engines it finds there."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    engines = request.node.get_closest_marker("engines") is not None
    return {
        "PATH": NO_ENGINES_PATH,
        "SPECOPS_CACHE": os.environ.get("SPECOPS_CACHE") if engines else str(tmp_path / "no-engines-cache"),
        "SPECOPS_STATE": str(state),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": None,
        "HF_TOKEN": None,
        "HUGGING_FACE_HUB_TOKEN": None,
        "HF_TOKEN_PATH": None,
        "HF_HUB_OFFLINE": None,
        "TRANSFORMERS_OFFLINE": None,
        "HF_ENDPOINT": None,
        "CUDA_VISIBLE_DEVICES": None,
    }


def fake_nvidia_smi(tmp_path: Path, output: str, code: int = 0) -> str:
    """A directory with an `nvidia-smi` that answers the query specops sends; returns a PATH with it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in --query-gpu=index,name,memory.total,memory.used) ;; *) echo "unexpected $*" >&2; exit 9;; esac\n'
        f"printf '%s' '{output}'\nexit {code}\n",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return f"{bin_dir}:{NO_ENGINES_PATH}"


def gpu_profile(tmp_path: Path, devices: str = "[0]", extra: str = "") -> Path:
    path = tmp_path / "gpu.yaml"
    path.write_text(
        "name: doc-gpu\nbackend: vllm\nengine: {version: 0.32.0}\n"
        "model: {id: meta-llama/Llama-3.1-8B-Instruct, max_model_len: 8192}\n"
        "speculative: {method: eagle3, draft: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, num_speculative_tokens: 3}\n"
        f"gpus: {{devices: {devices}}}\nserver: {{port: {free_port()}}}\n{extra}",
        encoding="utf-8",
    )
    return path


def _dev_llama() -> Path:
    return need_dev_engine("llama-server-*/bin/llama-server")


# ------------------------------------------------------------------------------------------ profiles


@pytest.mark.engines
def test_cpu_demo_profile_is_ready(env, tmp_path):
    dev = _dev_llama()
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(
        f"extends: {ROOT / 'examples' / 'llamacpp-cpu-draft.yaml'}\nserver: {{port: {free_port()}}}\n", encoding="utf-8"
    )
    code, rep, _ = doctor(cpu, env={**env, "SPECOPS_PROFILE_ROOT": str(ROOT / "examples")})
    assert code == 0 and rep["ok"] and rep["errors"] == 0, rep
    engine = one(rep, "engine")
    assert engine["level"] == "ok" and str(dev) in engine["summary"] and "flag generation" in engine["summary"]
    assert "specops' CPU development engine" in engine["details"][0]
    assert one(rep, "gpus")["summary"] == "CPU only: no nvidia-smi on PATH"
    assert one(rep, "render")["level"] == "ok" and one(rep, "render")["details"][0].startswith(str(dev))
    assert one(rep, "hub")["summary"].startswith("offline (--offline)")
    assert [c["level"] for c in checks(rep, "state")] == ["ok"]


@pytest.mark.engines
def test_unset_devices_on_a_gpu_machine_do_not_quietly_get_the_cpu_engine(env, tmp_path):
    """gpus.devices unset counts as a CPU profile: on a machine with GPUs, doctor says the engine it would get is
    specops' CPU build."""
    need_dev_engine("vllm-*/bin/python")
    profile = ROOT / "examples" / "vllm-cpu-ngram.yaml"
    _, rep, _ = doctor(profile, env=env)
    assert one(rep, "engine")["level"] == "ok"  # no GPU here: the CPU engine is the right one
    _, rep, _ = doctor(profile, env={**env, "PATH": fake_nvidia_smi(tmp_path, H100)})
    engine = one(rep, "engine")
    assert engine["level"] == "warning" and "specops' CPU development engine" in engine["details"][0]
    assert engine["fix"].startswith("this machine has GPUs, but the profile leaves gpus.devices unset")


def test_gpu_profile_on_a_machine_without_its_engine_and_gpu(env, tmp_path):
    """Pinned vLLM GPU profile, no vLLM installed, nvidia-smi lists GPU 0 only, the profile wants GPU 1."""
    path = gpu_profile(tmp_path, "[1]")
    code, rep, _ = doctor(path, env={**env, "PATH": fake_nvidia_smi(tmp_path, H100)})
    assert code == 1 and not rep["ok"]
    engine = one(rep, "engine")
    assert engine["level"] == "error" and "vLLM not found (no `vllm` on PATH" in engine["summary"]
    assert "`render` works for the pinned 0.32.0, but `up` cannot start an engine" in engine["summary"]
    assert "pip install vllm" in engine["fix"] and "engine.python" in engine["fix"]
    gpus = one(rep, "gpus")
    assert gpus["level"] == "error" and "lists only 0: NVIDIA H100 80GB HBM3 (80 GiB)" in gpus["summary"]
    assert gpus["fix"] == "set gpus.devices to indices that exist (missing: [1])"
    assert one(rep, "render")["level"] == "ok"  # pinned: renders without the engine
    # the right device: that error is gone, the engine one stays
    code, rep, _ = doctor(gpu_profile(tmp_path, "[0]"), env={**env, "PATH": fake_nvidia_smi(tmp_path, H100)})
    assert one(rep, "gpus") == {
        "check": "gpus",
        "level": "ok",
        "summary": "1 GPU(s): 0: NVIDIA H100 80GB HBM3 (80 GiB)",
        "fix": "",
        "details": [],
    }
    assert code == 1 and rep["errors"] == 1


def test_gpu_profile_without_nvidia_smi_or_with_a_broken_driver(env, tmp_path):
    path = gpu_profile(tmp_path)
    _, rep, _ = doctor(path, env=env)
    gpus = one(rep, "gpus")
    assert gpus["level"] == "warning" and "no nvidia-smi on PATH, but the profile uses GPUs [0]" in gpus["summary"]
    broken = fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it could not communicate with the driver", 9)
    _, rep, _ = doctor(path, env={**env, "PATH": broken})
    assert "failed (exit 9): NVIDIA-SMI has failed" in one(rep, "gpus")["summary"]


def test_cuda_visible_devices_that_hides_every_gpu(env, tmp_path):
    code, rep, _ = doctor(env={**env, "PATH": fake_nvidia_smi(tmp_path, H100), "CUDA_VISIBLE_DEVICES": ""})
    gpus = one(rep, "gpus")
    assert gpus["level"] == "warning" and "hidden from the engine by CUDA_VISIBLE_DEVICES=''" in gpus["summary"]


def test_a_port_in_use_is_an_error_and_a_free_one_is_not(env, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "p.yaml"
        path.write_text(
            "name: doc-port\nbackend: llamacpp\nengine: {version: current}\nmodel: {id: /m/t.gguf}\n"
            f"speculative: {{method: ngram}}\ngpus: {{devices: []}}\nserver: {{port: {port}}}\n"
            f"proxy: {{admin_port: {free_port()}}}\n",
            encoding="utf-8",
        )
        code, rep, _ = doctor(path, env=env)
    assert code == 1
    used, admin = checks(rep, f"port {port}")[0], [c for c in rep["checks"] if c["check"].startswith("port ")][1]
    assert used["level"] == "error" and used["summary"] == f"server.port {port} is in use by another program"
    assert used["fix"].startswith("stop that program") and used["fix"].endswith("or change server.port")
    assert admin["level"] == "ok" and admin["summary"].startswith("proxy.admin_port ")


def test_state_folder_permissions(env, tmp_path):
    state = Path(env["SPECOPS_STATE"])
    state.chmod(0o755)
    _, rep, _ = doctor(env=env)
    st = one(rep, "state")
    assert st["level"] == "warning" and "mode 0755: other users can read state and logs" in st["summary"]
    assert st["fix"] == f"`chmod 700 {state}`"
    state.chmod(0o700)
    assert one(doctor(env=env)[1], "state")["level"] == "ok"
    not_dir = tmp_path / "afile"
    not_dir.write_text("x")
    code, rep, _ = doctor(env={**env, "SPECOPS_STATE": str(not_dir)})
    assert code == 1 and one(rep, "state")["summary"] == f"{not_dir} ($SPECOPS_STATE) is not a directory"
    fresh = tmp_path / "new" / "state"
    assert (
        "`up` creates it with mode 0700" in one(doctor(env={**env, "SPECOPS_STATE": str(fresh)})[1], "state")["summary"]
    )


def test_hf_token_is_reported_by_origin_and_never_printed(env, tmp_path):
    secret = "hf_doctorSecretValue123456"
    res = run("doctor", "--offline", env={**env, "HF_TOKEN": secret})
    assert "HF token: present (from HF_TOKEN)" in res.stdout and secret not in res.stdout + res.stderr
    _, rep, _ = doctor(env={**env, "HF_TOKEN": secret})
    assert secret not in json.dumps(rep)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(secret)
    _, rep, _ = doctor(env=env)
    assert one(rep, "hf-token")["summary"] == f"HF token: present (from the stored login {tmp_path / 'hf' / 'token'})"
    (tmp_path / "hf" / "token").unlink()
    assert one(doctor(env=env)[1], "hf-token")["summary"].startswith("HF token: absent")


@pytest.fixture
def hub_online(monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: a test that set it first must not decide this one."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_hub_unreachable_is_a_warning_and_a_gated_target_an_error(env, tmp_path, hub_online):
    closed = free_port()
    online = {**env, "SPECOPS_HUB_TIMEOUT": "1"}
    code, rep, _ = doctor(env={**online, "HF_ENDPOINT": f"http://127.0.0.1:{closed}"}, online=True)
    hub = one(rep, "hub")
    assert hub["level"] == "warning" and f"http://127.0.0.1:{closed} not usable" in hub["summary"]
    assert "HF_HUB_OFFLINE=1" in hub["fix"]
    with FakeHub() as fake:
        seed_llama31(fake)
        fake.add_model("meta-llama/Llama-Gated-8B", {"config.json": {"model_type": "llama"}}, gated="manual")
        hub_env = {**online, "HF_ENDPOINT": fake.url}
        _, rep, _ = doctor(gpu_profile(tmp_path), env=hub_env, online=True)
        assert one(rep, "hub") == {
            "check": "hub",
            "level": "ok",
            "summary": f"{fake.url} reachable; model.id meta-llama/Llama-3.1-8B-Instruct is accessible",
            "fix": "",
            "details": [],
        }
        gated = tmp_path / "gated.yaml"
        gated.write_text(gpu_profile(tmp_path).read_text().replace("Llama-3.1-8B-Instruct,", "Llama-Gated-8B,"))
        code, rep, _ = doctor(gated, env=hub_env, online=True)
        hub = one(rep, "hub")
        assert code == 1 and hub["level"] == "error" and "model.id meta-llama/Llama-Gated-8B" in hub["summary"]
        assert "set HF_TOKEN" in hub["fix"]


def test_memory_fit_against_the_gpus_nvidia_smi_lists(env, tmp_path, hub_online):
    """Weights from the Hub's safetensors metadata (16 GiB target + the EAGLE-3 head) against the GPU size."""
    with FakeHub() as fake:
        seed_llama31(fake)
        hub_env = {**env, "HF_ENDPOINT": fake.url}
        small = fake_nvidia_smi(tmp_path, "0, NVIDIA L4, 23034, 0\n")
        _, rep, _ = doctor(gpu_profile(tmp_path), env={**hub_env, "PATH": small}, online=True)
        mem = one(rep, "memory")
        assert mem["level"] == "ok" and mem["summary"].startswith("weights: target 15.0 GiB + draft ")
        tiny = fake_nvidia_smi(tmp_path, "0, NVIDIA T4, 15360, 0\n")
        code, rep, _ = doctor(gpu_profile(tmp_path), env={**hub_env, "PATH": tiny}, online=True)
        mem = one(rep, "memory")
        assert code == 1 and mem["level"] == "error" and "more than 0.9 of the smallest GPU (15 GiB)" in mem["summary"]
        assert checks(rep, "resolve")[0]["level"] == "ok"


def test_hf_cache_state_of_the_profiles_models(env, tmp_path):
    """A target in the HF cache (refs/main → a snapshot) is found; a draft that is not, with HF_HUB_OFFLINE=1
    in the engine's environment, is a warning: the engine could not download it."""
    sha = "a" * 40
    repo_dir = tmp_path / "hf" / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(sha)
    (repo_dir / "snapshots" / sha).mkdir(parents=True)
    path = gpu_profile(tmp_path)
    _, rep, _ = doctor(path, env=env)
    cache = checks(rep, "hf-cache")
    assert cache[0]["summary"] == f"{tmp_path / 'hf' / 'hub'}: 1 model repo(s) cached"
    assert cache[1]["summary"] == f"model.id meta-llama/Llama-3.1-8B-Instruct is in the cache (commit {sha[:10]})"
    assert cache[2]["level"] == "ok" and cache[2]["summary"].endswith("the engine downloads it at start")
    _, rep, _ = doctor(path, env={**env, "HF_HUB_OFFLINE": "1"}, online=True)
    draft = checks(rep, "hf-cache")[2]
    assert draft["level"] == "warning" and "HF_HUB_OFFLINE=1: the engine cannot download it" in draft["summary"]
    assert draft["fix"] == "download it where the Hub is reachable (`hf download yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`)"
    assert one(rep, "hub")["summary"].startswith("offline (HF_HUB_OFFLINE=1)")


# ----------------------------------------------------------------------------------------- Prometheus


class _Ready(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/-/ready" else 404)
        self.end_headers()
        self.wfile.write(b"Prometheus Server is Ready.\n")

    def log_message(self, *args):
        pass


def test_prometheus_is_checked_for_promql_profiles(env, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        path = tmp_path / "promql.yaml"
        body = (
            "name: doc-prom\nbackend: llamacpp\nengine: {version: current}\nmodel: {id: /m/t.gguf}\n"
            f"speculative: {{method: ngram}}\ngpus: {{devices: []}}\nserver: {{port: {free_port()}}}\n"
            "monitor: {source: promql, prometheus_url: '%s'}\n"
        )
        path.write_text(body % url, encoding="utf-8")
        _, rep, _ = doctor(path, env=env)
        assert one(rep, "prometheus") == {
            "check": "prometheus",
            "level": "ok",
            "summary": f"Prometheus at {url} is ready",
            "fix": "",
            "details": [],
        }
        path.write_text(body % f"http://127.0.0.1:{free_port()}", encoding="utf-8")
        code, rep, _ = doctor(path, env=env)
        prom = one(rep, "prometheus")
        assert code == 1 and prom["level"] == "error" and prom["summary"].startswith("cannot reach Prometheus at")
    finally:
        server.shutdown()
        server.server_close()
    # a scrape profile has no Prometheus to check
    assert not checks(doctor(gpu_profile(tmp_path), env=env)[1], "prometheus")


# ------------------------------------------------------------------------------------ output, failures


def test_a_malformed_profile_is_one_located_error_and_the_machine_is_still_checked(env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nbackend: vllm\nmodel: {id: a/b}\nspeculative: {method: eagle9}\n", encoding="utf-8")
    code, rep, _ = doctor(bad, env=env)
    prof = one(rep, "profile")
    assert code == 1 and prof["level"] == "error" and f"{bad}:4:" in prof["summary"] and "eagle9" in prof["summary"]
    assert "did you mean" in prof["summary"]
    assert checks(rep, "gpus") and checks(rep, "state") and not checks(rep, "render")
    missing = run("doctor", tmp_path / "nope.yaml", "--offline", env=env)
    assert missing.code == 1 and "Traceback" not in missing.stderr and "file not found" in missing.stdout


def test_text_output_names_each_check_with_its_fix_and_counts(env, tmp_path):
    Path(env["SPECOPS_STATE"]).chmod(0o750)
    res = run("doctor", "--offline", env=env)
    lines = res.stdout.splitlines()
    assert lines[0] == "specops doctor"
    state = next(i for i, line in enumerate(lines) if line.split()[:2] == ["warning", "state"])
    assert lines[state + 1].strip() == f"fix: `chmod 700 {env['SPECOPS_STATE']}`"
    n_err = sum(line.split()[0] == "error" for line in lines[1:-1] if line.startswith("  ") and line.split())
    assert lines[-1].startswith(f"{n_err} error") and res.code == (1 if n_err else 0)


def test_a_check_that_breaks_is_an_error_row_not_a_traceback(env, monkeypatch):
    from specops.doctor import run_doctor
    from specops.plugins import get_registry

    registry = get_registry()

    def broken(profile):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(registry.backends["vllm"], "search", broken)
    for k, v in env.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    report = run_doctor(None, offline=True, registry=registry)
    broke = [c for c in report.checks if c.name == "engine"]
    assert [c.summary for c in broke] == ["doctor could not check this: RuntimeError: disk on fire"]
    assert not report.ok and report.to_dict()["errors"] >= 1
    assert [c.name for c in report.checks][-1] == "hf-token"  # the checks after it still ran
