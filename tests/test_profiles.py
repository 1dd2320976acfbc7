"""The ready-made profiles in profiles/: coverage, documentation and the GitOps example."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from support_cli import PROFILES, ROOT, ready_made_profiles, run

from specops.config.profile import load_profile

READY = ready_made_profiles()


def _load(path: Path, **env):
    return load_profile(path, env={"SPECOPS_API_KEY": "", **env})


LOADED = {p: _load(p).profile for p in READY}

#: Published (target, draft, method) pairs (from the drafts' model cards and the EAGLE/vLLM docs) that a profile may use.
PUBLISHED_PAIRS = {
    ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "eagle"),
    ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
    ("meta-llama/Llama-3.1-8B-Instruct", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", "eagle3"),
    ("meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "eagle3"),
    ("Qwen/Qwen3-8B", "AngelSlim/Qwen3-8B_eagle3", "eagle3"),
    ("Qwen/Qwen3-8B", "RedHatAI/Qwen3-8B-speculator.eagle3", "eagle3"),
    ("lmsys/vicuna-7b-v1.3", "abhigoyal/vllm-medusa-vicuna-7b-v1.3", "medusa"),
    ("meta-llama/Llama-3.1-8B-Instruct", "ibm-ai-platform/llama3-8b-accelerator", "mlp_speculator"),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", "draft_model"),
    ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", "draft_model"),
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B", "draft_model"),
    ("Qwen/Qwen3-32B", "Qwen/Qwen3-0.6B", "draft_model"),
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-1.7B", "draft_model"),
    ("Qwen/Qwen3-32B", "Qwen/Qwen3-1.7B", "draft_model"),
    # llama.cpp: the Qwen2.5-Coder GGUF pair (vocab sizes 128 apart: accepted by llama.cpp, not by vLLM)
    ("Qwen/Qwen2.5-Coder-32B-Instruct-GGUF", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "draft_model"),
}
MTP_TARGETS = {"XiaomiMiMo/MiMo-7B-RL", "Qwen/Qwen3-Next-80B-A3B-Instruct"}


def test_at_least_twelve_profiles():
    assert len(READY) >= 12


def test_every_method_is_covered_on_each_engine():
    by_backend: dict[str, set[str]] = {}
    for profile in LOADED.values():
        by_backend.setdefault(profile.backend, set()).add(profile.speculative.method.value)
    assert by_backend["vllm"] >= {
        "eagle",
        "eagle3",
        "medusa",
        "mlp_speculator",
        "draft_model",
        "mtp",
        "ngram",
        "suffix",
        "none",
    }
    assert by_backend["llamacpp"] >= {"draft_model", "ngram"}


def test_names_are_unique_and_match_the_file():
    names = [p.name for p in LOADED.values()]
    assert len(names) == len(set(names))
    for path, profile in LOADED.items():
        if path.parent == PROFILES:
            assert profile.name == path.stem, path
        else:  # gitops/<env>/<service>.yaml
            assert profile.name == f"{path.stem}-{path.parent.name}", path


def test_drafts_are_published_pairs():
    for path, p in LOADED.items():
        method = p.speculative.method.value
        if method in ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model"):
            assert (p.model.id, p.speculative.draft, method) in PUBLISHED_PAIRS, path
        elif method == "mtp":
            assert p.model.id in MTP_TARGETS and p.speculative.draft is None, path


def test_most_profiles_pin_the_engine():
    unpinned = [path.name for path, p in LOADED.items() if not p.engine.version]
    assert unpinned == ["llama31-8b-baseline.yaml"]  # the one that shows probing


def test_profiles_explain_their_choices():
    """Each file has a header; k, tensor parallelism and explicit chains carry a comment nearby."""
    for path, p in LOADED.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("# ") and sum(ln.lstrip().startswith("#") for ln in lines) >= 2, path

        def commented(key: str, lines: list[str] = lines) -> bool:
            for i, ln in enumerate(lines):
                if re.match(rf"^\s*{key}:", ln):
                    return "#" in ln or any(lines[j].lstrip().startswith("#") for j in range(max(0, i - 3), i))
            return True  # not set in this file (inherited from a base)

        if p.speculative.num_speculative_tokens is not None:
            assert commented("num_speculative_tokens") or commented("speculative"), f"{path}: why this k?"
        text = "\n".join(lines)
        if p.gpus.tensor_parallel_size > 1:
            assert re.search(r"#.*\bTP\d?\b|#.*tensor parallel", text), f"{path}: why TP?"
        if "chain:" in text:
            assert commented("chain") or commented("fallback"), f"{path}: why this chain?"


def test_medusa_and_mlp_speculator_profiles_pin_a_version_that_runs_them():
    """Medusa and MLP speculators run only on some vLLM versions: the profile must pin one of them."""
    from specops.backends.versions import Version, vllm_method_problem

    pinned = [(path, p) for path, p in LOADED.items() if p.speculative.method.value in ("medusa", "mlp_speculator")]
    assert len(pinned) == 2
    for path, p in pinned:
        assert p.engine.version, path
        assert vllm_method_problem(p.speculative.method.value, Version(p.engine.version)) is None, path


def test_no_profile_renders_a_method_its_engine_version_refuses():
    """Each ready-made profile renders for its pinned engine version (or the default one) without a gate read
    in the engine's source or a refusal measured on the engine standing in the way."""
    from specops.backends.render import render_plan
    from specops.plugins import get_registry

    registry = get_registry()
    refused = {}
    for path in READY:
        loaded = _load(path, SPECOPS_API_KEY="k")
        if not loaded.profile.engine.version:  # probes the installed engine: only the method-none baseline
            assert loaded.profile.speculative.method.value == "none", path
            continue
        backend = registry.backend(loaded.profile.backend)
        plan = render_plan(loaded, registry, probe=False)
        problem = backend.method_problem(loaded.profile.speculative.method, plan.engine_version)
        if problem:
            refused[path.name] = problem
    assert refused == {}


def test_validate_profiles_directory_passes_without_any_environment():
    """`specops validate profiles/` is what CI runs: no secrets, no Prometheus address needed."""
    res = run("validate", str(PROFILES), env={"SPECOPS_API_KEY": None, "PROMETHEUS_URL": None, "HF_TOKEN": None})
    assert res.code == 0, res.stdout + res.stderr
    assert f"{len(READY)} valid, 0 invalid" in res.stderr


# ------------------------------------------------------------------------------------ GitOps example

GITOPS = PROFILES / "gitops"


def test_gitops_base_is_partial_and_skipped():
    base = GITOPS / "base" / "llama31-8b-chat.yaml"
    assert "name" not in yaml.safe_load(base.read_text(encoding="utf-8"))
    res = run("validate", "--format", "json", str(GITOPS))
    assert res.code == 0
    assert res.stdout.count('"ok": true') == 3  # overall + two overlays
    assert f'"{base.relative_to(ROOT)}"' in res.stdout or str(base) in res.stdout


def test_gitops_overlays_merge_onto_the_base():
    staging = _load(GITOPS / "staging" / "llama31-8b-chat.yaml").profile
    prod = _load(GITOPS / "prod" / "llama31-8b-chat.yaml", PROMETHEUS_URL="http://prom:9090").profile
    for p in (staging, prod):  # inherited from the base
        assert p.model.id == "meta-llama/Llama-3.1-8B-Instruct" and p.model.served_name == "chat"
        assert p.speculative.method.value == "eagle3" and p.speculative.num_speculative_tokens == 3
        assert p.fallback.min_acceptance == 0.6 and p.gpus.devices == [0]
    assert staging.fallback.window == 30 and prod.fallback.window == 300  # overridden per environment
    assert prod.model.revision and not staging.model.revision
    assert prod.monitor.source == "promql" and prod.monitor.prometheus_url == "http://prom:9090"
    assert prod.monitor.labels == {"job": "vllm-chat"}
    assert staging.monitor.source == "scrape"


def test_gitops_api_key_comes_from_the_environment():
    prod = GITOPS / "prod" / "llama31-8b-chat.yaml"
    assert _load(prod, SPECOPS_API_KEY="sk-from-vault").profile.server.api_key == "sk-from-vault"
    assert "${SPECOPS_API_KEY" in prod.read_text(encoding="utf-8")
    with_key = run("render", str(prod), env={"SPECOPS_API_KEY": "sk-from-vault"})
    without = run("render", str(prod), env={"SPECOPS_API_KEY": None})
    assert "VLLM_API_KEY=***" in with_key.stdout
    assert "sk-from-vault" not in with_key.stdout
    assert "VLLM_API_KEY" not in without.stdout


def test_gitops_error_in_the_base_points_at_the_base(tmp_path):
    """A mistake in a shared base is reported at the base's line, even when validating an overlay."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "svc.yaml").write_text(
        "backend: vllm\nmodel:\n  id: a/b\nspeculative:\n  methd: ngram\n", encoding="utf-8"
    )
    overlay = tmp_path / "prod.yaml"
    overlay.write_text("extends: base/svc.yaml\nname: svc-prod\n", encoding="utf-8")
    res = run("validate", str(overlay))
    assert res.code == 1
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error")]
    assert len(errors) == 1
    assert re.search(
        r"base/svc\.yaml:5:3: speculative\.methd: unknown field 'methd'; did you mean 'method'\?", errors[0]
    ), errors


def test_readme_lists_every_profile():
    readme = (PROFILES / "README.md").read_text(encoding="utf-8")
    for path in READY:
        assert f"]({path.relative_to(PROFILES)})" in readme, path
