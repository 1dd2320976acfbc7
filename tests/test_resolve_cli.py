"""``specops resolve``, ``specops lock`` and ``specops validate --resolve`` as a user runs them: the installed
console script in a subprocess, pointed at the fake Hub through HF_ENDPOINT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import QWEN25_05B, QWEN25_7B, TEST_TOKEN, fake_hub, seed_llama31  # noqa: F401

pytestmark = pytest.mark.timeout(180)

SPECOPS = Path(sys.executable).with_name("specops")


def specops(*args, cwd=None) -> subprocess.CompletedProcess:
    cmd = [str(SPECOPS)] if SPECOPS.exists() else [sys.executable, "-m", "specops.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=dict(os.environ), cwd=cwd)


def test_resolve_prints_ranked_candidates_with_verdicts(fake_hub):
    seed_llama31(fake_hub)
    r = specops("resolve", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "8192", "--memory-gb", "24")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "target   meta-llama/Llama-3.1-8B-Instruct @ " in out
    assert "warning  context: draft context 2048 < served context 8192" in out
    assert "choice   eagle3 RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3@" in out
    assert "catalog, speculators verifier" in out
    assert "memory   weights: target 15.0 GiB + draft 1.8 GiB → 16.7 GiB per GPU of 24 GiB" in out
    lines = [ln for ln in out.splitlines() if ln[:3].strip().rstrip("*").strip().isdigit()]
    assert [ln.split()[-1] for ln in lines][-1] == "built-in"  # n-gram last
    assert "downloading meta-llama/Llama-3.1-8B-Instruct/config.json" in r.stderr  # progress on stderr


def test_resolve_json_is_machine_readable(fake_hub):
    fake_hub.add_model("Qwen/Qwen2.5-7B-Instruct", {"config.json": QWEN25_7B})
    fake_hub.add_model("Qwen/Qwen2.5-0.5B-Instruct", {"config.json": QWEN25_05B})
    r = specops(
        "resolve", "Qwen/Qwen2.5-7B-Instruct", "--method", "draft_model", "--backend-version", "0.24.0", "--json"
    )
    assert r.returncode == 1  # nothing passes for vLLM 0.24 (no use_heterogeneous_vocab before 0.25)
    data = json.loads(r.stdout)
    assert data["choice"] is None
    cand = data["candidates"][0]
    assert (cand["draft"], cand["verdict"]) == ("Qwen/Qwen2.5-0.5B-Instruct", "refused")
    assert "vocab_size 151936 != target's 152064" in cand["reason"]
    assert data["target"]["vocab_size"] == 152064
    assert "downloading" not in r.stdout


def test_hub_errors_are_one_line_each(fake_hub, monkeypatch):
    seed_llama31(fake_hub)
    fake_hub.repos["meta-llama/Llama-3.1-8B-Instruct"].gated = "manual"
    r = specops("resolve", "nobody/missing")
    assert r.returncode == 1
    assert "error    target: nobody/missing not found on the Hub" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    gated = specops("resolve", "meta-llama/Llama-3.1-8B-Instruct", "--method", "draft_model")
    assert "meta-llama/Llama-3.1-8B-Instruct is gated: accept its license" in gated.stdout
    monkeypatch.setenv("HF_TOKEN", TEST_TOKEN)
    ok = specops("resolve", "meta-llama/Llama-3.1-8B-Instruct", "--method", "draft_model")
    assert ok.returncode == 0 and "choice   draft_model meta-llama/Llama-3.2-1B-Instruct@" in ok.stdout
    assert TEST_TOKEN not in ok.stdout + ok.stderr + gated.stdout + gated.stderr
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    down = specops("resolve", "Qwen/Qwen3-8B")
    assert down.returncode == 0
    assert sum("is unreachable" in ln for ln in down.stdout.splitlines() if ln.startswith("note")) == 1
    assert "choice   eagle3 " in down.stdout


def test_lock_then_render_inputs_and_check(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    prof = tmp_path / "llama.yaml"
    prof.write_text(
        "name: llama\nbackend: vllm\nengine: {version: 0.32.0}\n"
        "model: {id: meta-llama/Llama-3.1-8B-Instruct, max_model_len: 2048}\n"
        "speculative: {method: auto}\n"
    )
    r = specops("lock", str(prof))
    assert r.returncode == 0, r.stdout + r.stderr
    lock = tmp_path / "llama.lock.json"
    assert f"wrote {lock}" in r.stdout
    data = json.loads(lock.read_text())
    assert data["speculative"]["method"] == "eagle3"
    check = specops("lock", "--check", str(prof))
    assert check.returncode == 0 and "llama.lock.json is up to date" in check.stdout
    prof.write_text(prof.read_text().replace("2048", "4096"))
    stale = specops("lock", "--check", str(prof))
    assert stale.returncode == 1
    assert "llama.lock.json is stale: the profile changed since it was locked (model.max_model_len)" in stale.stderr


def test_validate_resolve_reports_checks_at_the_profile_line(fake_hub, tmp_path):
    fake_hub.add_model("Qwen/Qwen2.5-7B-Instruct", {"config.json": QWEN25_7B})
    fake_hub.add_model("Qwen/Qwen2.5-0.5B-Instruct", {"config.json": QWEN25_05B})
    seed_llama31(fake_hub)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\nbackend: vllm\nengine: {version: 0.24.0}\nmodel: {id: Qwen/Qwen2.5-7B-Instruct}\n"
        "speculative:\n  method: draft_model\n  draft: Qwen/Qwen2.5-0.5B-Instruct\n"
    )
    warn = tmp_path / "warn.yaml"
    warn.write_text(
        "name: warn\nbackend: vllm\nmodel:\n  id: meta-llama/Llama-3.1-8B-Instruct\n  max_model_len: 8192\n"
        "speculative: {method: eagle3, draft: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B}\n"
    )
    plain = specops("validate", str(bad))
    assert plain.returncode == 0  # schema-valid; the Hub is only asked with --resolve
    r = specops("validate", "--resolve", str(bad), str(warn))
    assert r.returncode == 1
    assert f"error   {bad}:7:10: speculative.draft: draft vocab_size 151936 != target's 152064" in r.stdout
    assert f"warning {warn}:5:18: model.max_model_len: draft context 2048 < served context 8192" in r.stdout
    assert f"ok      {warn}" in r.stdout
