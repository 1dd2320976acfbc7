"""`specops tune` against a real llama-server on tiny GGUF models: a k sweep within a small budget writes a
profile that still validates and renders, keeps its comments, and chooses the best median it recorded; a
budget too small for one setting changes nothing; an overlay with a lock; the n-gram type sweep."""

from __future__ import annotations

import json
import re

import pytest
from support_cli import run
from support_engines import need_llama_server

from specops.config.profile import load_profile
from specops.paths import tiny_models_dir

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]

PROFILE = """# tune test: a tiny llama.cpp target with a same-weights draft (acceptance ~0.97 when greedy)
name: tune-llama
backend: llamacpp
model:
  id: {models}/gguf-target.gguf   # the target
  max_model_len: 2048
speculative:
  method: draft_model
  # same weights as the target
  draft: {models}/gguf-draft-same.gguf
  num_speculative_tokens: 3
gpus:
  devices: []                     # CPU only
server:
  parallel: 2
supervisor:
  stop_timeout: 10
# what to fall back to
fallback:
  chain: [ngram, none]
"""
FAST = ["--max-tokens", "48", "--rounds", "4", "--min-rounds", "3", "-q"]


@pytest.fixture(scope="module")
def models():
    need_llama_server()
    from specops.devenv.testmodels import ensure_tiny_models

    ensure_tiny_models(("gguf",))
    return tiny_models_dir()


@pytest.fixture
def env(clean_env):
    return {"SPECOPS_STATE": str(clean_env / "state")}


def comment_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "#" in line and "specops tune" not in line]


def swept(record: dict) -> list[dict]:
    """The swept settings' results: without ``none``, measured only as the goodput surface's baseline."""
    return [r for r in record["results"] if r["label"] not in record.get("reference_only", [])]


def best_recorded(record: dict) -> str:
    """The label with the best median at the deciding concurrency, from the recorded table alone."""
    level = str(record["primary_concurrency"])
    rows = [
        r
        for r in swept(record)
        if r["status"] in ("measured", "pruned")
        and len(r["levels"].get(level, {}).get("rounds", [])) >= record["min_rounds"]
    ]
    return max(rows, key=lambda r: r["levels"][level]["median_tokens_per_s"])["label"]


def test_sweep_writes_the_best_recorded_k_and_the_profile_still_validates_and_renders(tmp_path, models, env):
    path = tmp_path / "tune-llama.yaml"
    original = PROFILE.format(models=models)
    path.write_text(original)
    res = run("tune", path, "--k", "1,2,4", "--budget", "90s", *FAST, env=env)
    assert res.code == 0, res.stdout + res.stderr
    record = json.loads((tmp_path / "tune-llama.tune.json").read_text())
    assert [r["k"] for r in swept(record)][0] in (1, 2, 4) and {r["k"] for r in swept(record)} == {1, 2, 4}
    assert record["reference_only"] == ["none"]  # the baseline is measured too, and never chosen
    # rounds are planned from the rounds measured so far: a machine that slows down mid-run overshoots a little
    assert record["levels"] == [2, 1] and record["elapsed_s"] <= 90 + 30
    chosen = record["chosen"]
    assert chosen["label"] == best_recorded(record)  # the choice matches the recorded table
    assert record["winner"] == chosen and chosen["k"] in (1, 2, 4)
    measured = [r for r in swept(record) if r["status"] == "measured"]
    assert measured and all(r["levels"]["2"]["acceptance"] > 0.3 for r in measured)
    assert all(r["levels"]["2"]["mean_acceptance_length"] > 1.0 for r in measured)

    text = path.read_text()
    assert comment_lines(text) == comment_lines(original)  # every comment kept, in order
    assert re.search(
        rf"\n  # specops tune \d{{4}}-\d\d-\d\d: draft_model k={chosen['k']} best at concurrency 2, "
        rf"[0-9.]+ tok/s median.*; record tune-llama.tune.json\n  num_speculative_tokens: "
        rf"{chosen['k']}\n",
        text,
    ), text
    assert load_profile(path).profile.speculative.k == chosen["k"]
    rendered = run("render", path, env=env)
    assert rendered.code == 0 and f"--spec-draft-n-max {chosen['k']}" in rendered.stdout
    assert (tmp_path / "tune-llama.tune.png").read_bytes()[:4] == b"\x89PNG"
    # the table marks the chosen row, and only it, with a *
    marked = [line for line in res.stdout.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and re.match(rf"\*\s+{re.escape(chosen['label'])}\s", marked[0]), res.stdout
    assert f"wrote {path}" in res.stdout


def test_a_budget_too_small_for_one_setting_says_so_and_changes_nothing(tmp_path, models, env):
    path = tmp_path / "tune-llama.yaml"
    original = PROFILE.format(models=models)
    path.write_text(original)
    res = run("tune", path, "--k", "1,2,4", "--budget", "2s", "-q", env=env)
    assert res.code == 1
    assert re.search(
        r"error: a budget of 2s is too small to measure one setting: .*give --budget \d+s or more\. "
        r"Nothing was changed\.",
        res.stderr,
    ), res.stderr
    assert path.read_text() == original
    # refused before any engine started: no record, no plot, not even a state folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tune-llama.yaml"]


def test_an_overlay_with_a_lock_gets_k_and_the_lock_the_record(tmp_path, models, env):
    base = tmp_path / "base.yaml"
    base.write_text(PROFILE.format(models=models).replace("name: tune-llama\n", ""))
    overlay = tmp_path / "prod.yaml"
    overlay.write_text(
        "# production overlay\nextends: base.yaml\nname: tune-prod\nserver:\n  parallel: 1   # one client\n"
    )
    assert run("lock", overlay, "--offline", env=env).code == 0
    lock_before = json.loads((tmp_path / "prod.lock.json").read_text())

    dry = run("tune", overlay, "--k", "2,5", "--budget", "60s", "--dry-run", *FAST, env=env)
    assert dry.code == 0, dry.stderr
    assert "dry run: nothing written" in dry.stdout and "+++ b/prod.yaml" in dry.stdout
    assert json.loads((tmp_path / "prod.lock.json").read_text()) == lock_before
    assert not (tmp_path / "prod.tune.png").exists()

    res = run("tune", overlay, "--k", "2,5", "--budget", "60s", *FAST, env=env)
    assert res.code == 0, res.stderr
    assert "note: prod.yaml extends base.yaml: the change is written into prod.yaml" in res.stdout
    assert base.read_text() == PROFILE.format(models=models).replace("name: tune-llama\n", "")
    lock = json.loads((tmp_path / "prod.lock.json").read_text())
    k = lock["tune"]["chosen"]["k"]
    assert lock["tune"]["chosen"]["label"] == best_recorded(lock["tune"])
    assert lock["speculative"] == lock_before["speculative"] and not (tmp_path / "prod.tune.json").exists()
    assert load_profile(overlay).profile.speculative.k == k
    rendered = run("render", overlay, env=env)
    assert rendered.code == 0 and "using prod.lock.json" in rendered.stdout + rendered.stderr
    assert "stale" not in rendered.stdout + rendered.stderr and f"--spec-draft-n-max {k}" in rendered.stdout
    assert "# production overlay" in overlay.read_text() and "parallel: 1   # one client" in overlay.read_text()


def test_llama_ngram_is_swept_by_type_and_never_gets_a_k(tmp_path, models, env):
    path = tmp_path / "ngram.yaml"
    path.write_text(
        f"name: tune-ngram\nbackend: llamacpp\nmodel:\n  id: {models}/gguf-cycle.gguf\n"
        f"  max_model_len: 2048\nspeculative:\n  method: ngram   # lookups are free\ngpus:\n  devices: []\n"
        f"supervisor:\n  stop_timeout: 10\n"
    )
    res = run("tune", path, "--ngram-types", "ngram-simple,ngram-mod", "--budget", "60s", *FAST, env=env)
    assert res.code == 0, res.stderr
    record = json.loads((tmp_path / "ngram.tune.json").read_text())
    assert {r["label"] for r in swept(record)} == {"ngram ngram-simple", "ngram ngram-mod"}
    assert record["chosen"]["label"] == best_recorded(record)
    prof = load_profile(path).profile
    assert prof.speculative.num_speculative_tokens is None
    assert prof.speculative.ngram.type == record["chosen"]["ngram_type"]
    assert "method: ngram   # lookups are free" in path.read_text()


VLLM = """# tune test: tiny vLLM target whose draft is the target itself (greedy: acceptance ~1)
name: tune-vllm
backend: vllm
model:
  id: {models}/hf-target
  dtype: float32
  max_model_len: 1024
speculative:
  method: draft_model
  draft: {models}/hf-target   # the target itself
  num_speculative_tokens: 3
server:
  parallel: 2
  extra_args: ["--enforce-eager"]   # the suite's vLLM engines skip torch.compile (support_engines.VLLM_TEST_ARGS)
  env:
    VLLM_CPU_KVCACHE_SPACE: "1"
engine:
  ready_timeout: 5m
supervisor:
  stop_timeout: 30
"""


@pytest.mark.timeout(600)
def test_vllm_sweep_over_k_writes_the_best_recorded_k(tmp_path, env):
    from support_engines import tiny_model

    models = tiny_model("hf-target").parent
    path = tmp_path / "tune-vllm.yaml"
    original = VLLM.format(models=models)
    path.write_text(original)
    res = run(
        "tune",
        path,
        "--k",
        "1,4",  # two settings: a vLLM restart each (the choice among three is the llama-server sweep's test)
        "--budget",
        "6m",
        "--workload",
        "code",
        "--max-tokens",
        "16",
        "--rounds",
        "2",
        "--min-rounds",
        "2",
        "-c",
        "2",
        "-q",
        env=env,
    )
    assert res.code == 0, res.stdout + res.stderr
    record = json.loads((tmp_path / "tune-vllm.tune.json").read_text())
    assert {r["k"] for r in swept(record)} == {1, 4} and record["levels"] == [2]
    assert record["chosen"]["label"] == best_recorded(record)
    assert all(r["levels"]["2"]["acceptance"] > 0.9 for r in swept(record) if r["status"] == "measured")
    assert comment_lines(path.read_text()) == comment_lines(original)
    k = record["chosen"]["k"]
    assert load_profile(path).profile.speculative.k == k
    rendered = run("render", path, env=env)
    assert rendered.code == 0 and f'"num_speculative_tokens":{k}' in rendered.stdout


def test_methods_are_swept_side_by_side_and_a_switch_still_validates(tmp_path, models, env):
    path = tmp_path / "tune-llama.yaml"
    original = PROFILE.format(models=models)
    path.write_text(original)
    res = run(
        "tune",
        path,
        "--methods",
        "draft_model,ngram,none",
        "--k",
        "2,4",
        "--ngram-types",
        "ngram-simple",
        "--budget",
        "90s",
        *FAST,
        env=env,
    )
    assert res.code == 0, res.stdout + res.stderr
    record = json.loads((tmp_path / "tune-llama.tune.json").read_text())
    assert {r["label"] for r in record["results"]} == {
        "draft_model k=2",
        "draft_model k=4",
        "ngram ngram-simple",
        "none",
    }
    assert record["reference"]["what"] == "none"  # the table shows speedups over none
    assert record["chosen"]["label"] == best_recorded(record)
    prof = load_profile(path).profile  # whatever won, the profile validates
    assert prof.speculative.method.value == record["chosen"]["method"]
    assert run("render", path, env=env).code == 0
    assert comment_lines(path.read_text())[:3] == comment_lines(original)[:3]
