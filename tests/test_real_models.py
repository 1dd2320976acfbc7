"""A real model on a real engine: Gemma 3 270M (real weights from the Python registry) on llama-server, through
`specops bench` with the demo's profile. Few and short on purpose (the speedups are benchmarks'); what is checked
is what synthetic models cannot show: real text drafts by prompt lookup, and the draft length the engine really
uses is the one reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support_engines import need_llama_server, need_real_model

from specops.devenv.realmodels import DEMO_MODEL, REAL_MODELS, header_problem

ROOT = Path(__file__).resolve().parent.parent
SPECOPS = [sys.executable, "-m", "specops.cli"]
DEMO = ROOT / "examples" / "llamacpp-cpu-gemma.yaml"


@pytest.mark.engines
def test_the_real_models_are_the_pinned_files():
    for name, spec in REAL_MODELS.items():
        path = need_real_model(name)
        assert path.stat().st_size == spec.size
        assert header_problem(path, spec) is None
        wrong = type(spec)(spec.wheels, spec.size, spec.sha256, spec.arch, spec.vocab + 1, spec.layers, spec.source)
        assert "vocab" in (header_problem(path, wrong) or "")  # the header check can refuse


@pytest.mark.engines
@pytest.mark.timeout(420)
def test_demo_profile_drafts_real_text_at_the_length_it_reports(tmp_path):
    need_llama_server()
    need_real_model(DEMO_MODEL)
    # the demo's profile with one compute thread: the suite runs a vLLM lane beside this one, and llama.cpp's
    # threads spin at their barriers when the two cores are oversubscribed (minutes instead of seconds)
    doc = yaml.safe_load(DEMO.read_text())
    doc["server"]["extra_args"] += ["-t", "1"]
    profile = tmp_path / "demo.yaml"
    profile.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    proc = subprocess.run(
        SPECOPS
        + ["bench", str(profile), "-o", str(out), "--json", "-p", "extraction", "-c", "1", "-n", "2", "--rounds", "1"]
        + ["--max-tokens", "48", "--warmup", "0", "--no-plots", "--no-probe", "-q"],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "SPECOPS_STATE": str(tmp_path / "state")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["errors"] == 0
    spec = next(c for c in rep["cells"] if c["mode"] == "spec")
    # answers that copy their input: most of what prompt lookup drafts on real text is accepted
    assert spec["drafts"] > 0 and spec["acceptance"] > 0.5
    # the profile's --spec-ngram-mod-n-max 12 is the length reported and the length drafted (not a k it ignores)
    assert rep["profile"]["draft_length"]["text"].startswith("up to 12")
    assert 2 <= spec["mean_draft_length"] <= 12
    assert rep["overall"].get("no_headline")  # one round: no headline
    # --no-probe: no curve stored in this state folder, none probed, and the model column says what it assumed
    assert rep["verify_cost"]["probed"] is False and "≡ 1" in rep["model_basis"]
