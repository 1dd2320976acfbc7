"""The verification-cost probe on a real llama-server (the tiny GGUF target): ``specops bench --probe-verify``
measures a curve, stores it for this engine, model and machine, and ``advise`` and ``init`` then use it."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from specops.perf.verifycost import SIZES, curve_of

SPECOPS = Path(sys.executable).with_name("specops")


def specops(*args, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run(
        [str(SPECOPS), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_probed_curve_is_stored_and_used_by_advise_and_init(tmp_path, tiny_gguf_models):
    target = tiny_gguf_models / "gguf-target.gguf"
    env = {"SPECOPS_STATE": str(tmp_path / "state"), "CUDA_VISIBLE_DEVICES": None}
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"name: probe\nbackend: llamacpp\nmodel:\n  id: {target}\n  max_model_len: 2048\n"
        "speculative:\n  method: ngram\ngpus:\n  devices: []\nsupervisor:\n  stop_timeout: 10\n"
    )
    r = specops("bench", profile, "--probe-verify", "--json", "-q", env=env)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    rel = {int(n): v for n, v in rec["relative"].items()}
    assert sorted(rel) == list(SIZES) and rec["t_step_ms"] > 0
    assert rec["how"]["discarded"] <= len(SIZES)  # nearly every pass processed exactly its n new tokens
    assert rec["device"].startswith("CPU: ") and rec["model"].startswith(str(target))
    # the cost grows with the tokens verified (not strictly: one timed pass is a few tenths of a ms here)
    assert rel[64] > rel[1]
    assert statistics.median([rel[16], rel[32], rel[64]]) > statistics.median([rel[1], rel[2], rel[4]])
    curve = curve_of(rec)
    assert curve.at(1) + curve.per_token == pytest.approx(1.0)  # a step without speculation costs one step
    assert Path(rec["file"]).parent == tmp_path / "state" / "verify-cost"

    a = specops("advise", profile, "--alpha", "0.9", "-k", "4", "--json", env=env)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["cost_model"]["verify_cost"].startswith("c_verify measured (llamacpp ")

    out = tmp_path / "init.yaml"
    i = specops("init", target, "--backend", "llamacpp", "--non-interactive", "--offline", "-o", out, env=env)
    assert i.returncode == 0, i.stdout + i.stderr
    text = out.read_text()
    comments = " ".join(line.strip().lstrip("# ") for line in text.splitlines())  # comments unwrapped
    assert "c_verify measured (llamacpp " in comments  # the profile says what sized its drafts
    if "method: none" in text:  # the tiny model's curve may leave no draft length that pays
        assert "method none instead: no draft length pays" in comments
        return
    assert "extra_args: [--spec-ngram-mod-n-max, '" in text and "--spec-ngram-mod-n-min" in text
    rendered = specops("render", out, env=env)  # the flags the built llama-server lists
    assert rendered.returncode == 0 and "--spec-ngram-mod-n-max" in rendered.stdout, rendered.stderr
