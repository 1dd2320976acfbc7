"""What a newcomer runs first: `specops resolve` for the engine they have, and the demo's workloads.

Each test runs the installed ``specops`` console script (or the library it calls) as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SPECOPS = Path(sys.executable).with_name("specops")


def specops(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(SPECOPS)] if SPECOPS.exists() else [sys.executable, "-m", "specops.cli"]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=full_env)


# ------------------------------------------------------------------ item 6: the known line names the engine


def _known_lines(out: str) -> list[str]:
    return [line.split("known", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("known ")]


def test_resolve_for_vllm_says_how_the_pair_is_known_on_vllm_not_llamacpp():
    # The catalog lists Qwen2.5-7B + 0.5B for llama.cpp only; asked for vLLM, the line speaks of vLLM.
    r = specops("resolve", "Qwen/Qwen2.5-7B-Instruct", "--method", "draft_model", "--backend", "vllm", "--offline")
    known = _known_lines(r.stdout)
    assert known, r.stdout + r.stderr
    line = known[0]
    assert "on vLLM" in line, line
    assert "not documented on vLLM (the catalog lists the pair for llama.cpp)" in line
    assert "not measured on llamacpp" not in line and "not measured on llama.cpp" not in line
    # the measured part is vLLM's own: the support matrix's HF draft-model cells on vLLM
    assert "measured speculating on vLLM " in line


def test_resolve_json_evidence_names_the_engine_asked_for():
    r = specops(
        "resolve", "Qwen/Qwen2.5-7B-Instruct", "--method", "draft_model", "--backend", "vllm", "--offline", "--json"
    )
    data = json.loads(r.stdout)
    evidence = data["candidates"][0]["catalog"]["evidence"]
    assert evidence.startswith("not documented on vLLM"), evidence


def test_resolve_for_llamacpp_of_a_vllm_pair_says_llamacpp():
    r = specops("resolve", "Qwen/Qwen3-8B", "--method", "draft_model", "--backend", "llamacpp", "--offline")
    known = _known_lines(r.stdout)
    assert known and known[0].startswith("not documented on llama.cpp (the catalog lists the pair for vLLM)"), (
        r.stdout + r.stderr
    )


# ------------------------------------------------------------------ item 3: built-in workloads fit the deployment


def slot_profile(tmp_path: Path) -> Path:
    """The tiny llama.cpp pair as the old demo profile ran it: 1024 tokens of -c over 4 slots, 256 tokens a
    request, less than the longer built-in prompts take (its certify sent prompts of 398 tokens)."""
    from support_engines import need_llama_server, tiny_model

    need_llama_server()
    profile = tmp_path / "small.yaml"
    profile.write_text(
        f"name: small-slots\nbackend: llamacpp\nmodel:\n  id: {tiny_model('gguf-target.gguf')}\n  max_model_len: 1024\n"
        f"speculative:\n  method: draft_model\n  draft: {tiny_model('gguf-draft-same.gguf')}\n"
        "  num_speculative_tokens: 4\ngpus:\n  devices: []\nserver:\n  parallel: 4\n"
        '  extra_args: ["-t", "1", "-td", "1"]\nsupervisor:\n  stop_timeout: 10\n'
    )
    return profile


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_certify_fits_its_prompts_to_the_slot_context_so_no_request_fails(tmp_path):
    profile = slot_profile(tmp_path)
    r = specops(
        "certify",
        str(profile),
        "--json",
        "-q",
        "-w",
        "code,summarize",
        "-n",
        "3",
        "--max-tokens",
        "48",
        "-c",
        "1",
        "--tolerance",
        "0.01",  # random tiny weights: batch-verify numerics may flip a near tie (seen: 0.001 nats)
        env={"SPECOPS_STATE": str(tmp_path / "state")},
    )
    cert = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    assert cert, r.stdout[-2000:] + r.stderr[-2000:]
    assert cert["errors"] == 0 and cert["lossless"]["failed"] == 0, cert["verdict"]["findings"]
    fitted = cert["settings"]["fitted"]
    assert fitted["context_per_request"] == 256 and fitted["counted_by"] == "the engine's /tokenize"
    assert any("trimmed from the start to fit 256 tokens per request" in n for n in fitted["notes"])
    assert r.returncode == 0 and cert["verdict"]["certified"], cert["verdict"]


@pytest.mark.engines
@pytest.mark.timeout(180)
def test_spot_check_probes_fit_the_deployment_and_its_reference(tmp_path):
    """Built-in probes longer than a slot's context: fitted before the first check, so none fails."""
    import asyncio

    from specops.config.profile import load_profile
    from specops.perf.certify import Endpoint, load_sets
    from specops.perf.certify_spot import SpotChecker, SpotConfig
    from specops.perf.launch import launched
    from specops.plugins import get_registry

    profile = slot_profile(tmp_path)
    said: list[str] = []

    async def main():
        async with launched(load_profile(profile), get_registry()) as eng:
            # the engine stands for both: the deployment and a reference with the same context per request
            live = Endpoint(eng.base_url, eng.model_name, eng.api_key)
            ref = Endpoint(eng.base_url, eng.model_name, eng.api_key)
            prompts = [p for ps in load_sets(["summarize"], 3).values() for p in ps]
            cfg = SpotConfig(sample=3, max_tokens=16, tolerance=0.01)
            checker = SpotChecker(live, ref, prompts, cfg, say=said.append)
            return await checker.check_once()

    record = asyncio.run(main())
    assert record["requests"] == 3 and record["failed"] == 0, record
    assert any("trimmed from the start to fit 256 tokens per request" in m for m in said), said
