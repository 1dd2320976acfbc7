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
