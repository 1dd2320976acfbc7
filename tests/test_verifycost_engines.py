"""The verification-cost probe on a real llama-server (the tiny GGUF target and draft): ``specops bench
--probe-verify`` times real speculative steps (prompt-lookup drafts of fixed sizes) at one request and at the
profile's ``server.parallel``, and the draft model's own step, stores the record for this engine, model and
machine, and ``advise`` and ``init`` then use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specops.perf.verifycost import STEPS, curve_of, model_identity
from specops.perf.verifyprobe import SIZES

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
    target = tiny_gguf_models / "gguf-cycle.gguf"  # its greedy answer cycles: lookups find drafts in it
    env = {"SPECOPS_STATE": str(tmp_path / "state"), "CUDA_VISIBLE_DEVICES": None}
    draft = tiny_gguf_models / "gguf-draft-same.gguf"
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"name: probe\nbackend: llamacpp\nmodel:\n  id: {target}\n  max_model_len: 2048\n"
        f"speculative:\n  method: draft_model\n  draft: {draft}\n  num_speculative_tokens: 4\n"
        "gpus:\n  devices: []\nserver:\n  parallel: 2\nsupervisor:\n  stop_timeout: 10\n"
    )
    r = specops("bench", profile, "--probe-verify", "--json", "-q", env=env)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["probe"] == STEPS and rec["device"].startswith("CPU: ") and rec["model"].startswith(str(target))
    assert set(rec["batches"]) == {"1", "2"}  # one request, and server.parallel at once
    for batch in rec["batches"].values():
        timed = {int(n) for n in batch["relative"]}
        assert timed | set(rec["skipped_sizes"]) == {*SIZES, 5} and batch["relative"]["1"] == 1.0  # 5: its k + 1
        assert all(share >= 0.5 for share in batch["steps_that_drafted"].values())  # steps that really drafted
        assert batch["t_step_ms"] > 0
    assert rec["relative"] == rec["batches"]["1"]["relative"]  # the curve older readers read
    for batch in rec["batches"].values():  # a step that drafted nothing, beside the target alone's on the same text
        assert batch["t_idle_ms"] > 0 and batch["t_sampled_ms"] > 0
        assert batch["idle"] == pytest.approx(batch["t_idle_ms"] / batch["t_sampled_ms"], rel=1e-3)
    assert curve_of(rec, 2).idle == rec["batches"]["2"]["idle"]
    ratio = rec["drafts"][model_identity(str(draft))]["ratio"]
    assert set(ratio) == {"1", "2"} and all(v >= 0 for v in ratio.values())  # from the pair's own steps
    assert Path(rec["file"]).parent == tmp_path / "state" / "verify-cost"
    assert "speculative steps at batch 2" in curve_of(rec, 2).source

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
