"""Pure parts of the resolver: method / target detection, name matching, the catalog, GGUF picks, memory."""

from __future__ import annotations

import sys

import pytest
from fakehub import DEEPSEEK_V3, EAGLE3_LLAMA31_8B, EAGLE_LLAMA31_8B, LLAMA31_8B, MEDUSA_VICUNA_7B, speculators_eagle3

from specops.config.profile import Profile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.resolve.catalog import load_catalog, parse_catalog
from specops.resolve.detect import (
    declared_targets,
    detect_method,
    facts_from_config,
    name_info,
    names_match,
    same_family_smaller,
    same_model,
)
from specops.resolve.ggufinfo import pick_file, quant_of
from specops.resolve.memory import GIB, Weights, estimate, from_files, from_safetensors

# ------------------------------------------------------------------------------------------ detection


@pytest.mark.parametrize(
    "config,repo,method,evidence",
    [
        (speculators_eagle3("meta-llama/Llama-3.1-8B-Instruct"), "x/y", Method.EAGLE3, "speculators_model_type"),
        (EAGLE3_LLAMA31_8B, "x/y", Method.EAGLE3, "LlamaForCausalLMEagle3"),
        (
            {"architectures": ["LlamaForCausalLM"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}},
            "x/y",
            Method.EAGLE3,
            "eagle_config",
        ),
        (MEDUSA_VICUNA_7B, "x/y", Method.MEDUSA, "medusa_num_heads"),
        (
            {
                "architectures": ["MLPSpeculatorPreTrainedModel"],
                "model_type": "mlp_speculator",
                "emb_dim": 4096,
                "n_predict": 4,
                "vocab_size": 128256,
            },
            "x/y",
            Method.MLP_SPECULATOR,
            "mlp_speculator",
        ),
        # DFlash drafters are Qwen3-shaped models (model_type qwen3) marked by their architecture / dflash_config
        (
            {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dflash_config": {"mask_token_id": 0}},
            "x/y",
            Method.DFLASH,
            "DFlashDraftModel",
        ),
        ({"model_type": "qwen3", "dflash_config": {"target_layer_ids": [1, 9]}}, "x/y", Method.DFLASH, "dflash_config"),
        ({"architectures": ["DSparkDraftModel"], "model_type": "deepseek_v4"}, "x/y", Method.DSPARK, "DSpark"),
        ({}, "z-lab/Qwen3-8B-DFlash-b16", Method.DFLASH, "name: dflash"),
        (EAGLE_LLAMA31_8B, "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", Method.EAGLE, "name"),  # EAGLE-1: no marker
        (EAGLE_LLAMA31_8B, "someone/llama-head", None, "no method marker"),
        (LLAMA31_8B, "meta-llama/Llama-3.1-8B-Instruct", None, "no method marker"),
    ],
)
def test_detect_method(config, repo, method, evidence):
    got, why = detect_method(config, repo)
    assert got is method
    assert evidence in why


def test_config_beats_name():
    """A repo named eagle whose config is a Medusa head is Medusa."""
    assert detect_method(MEDUSA_VICUNA_7B, "x/eagle-vicuna")[0] is Method.MEDUSA


def test_facts_from_speculators_config_are_read_from_the_nested_layer_config():
    f = facts_from_config(speculators_eagle3("t", hidden=5120, vocab=151936, context=40960, aux=[2, 20, 37]))
    assert (f.vocab, f.hidden, f.context, f.draft_vocab, f.aux_layer_ids) == (151936, 5120, 40960, 32000, (2, 20, 37))


def test_facts_eagle3_and_mtp():
    e = facts_from_config(EAGLE3_LLAMA31_8B)
    assert (e.vocab, e.draft_vocab, e.hidden, e.layers, e.context) == (128256, 32000, 4096, 1, 2048)
    d = facts_from_config(DEEPSEEK_V3)
    assert d.mtp_layers == 1 and d.layers == 61
    assert facts_from_config(LLAMA31_8B).mtp_layers is None
    assert facts_from_config({"text_config": {"vocab_size": 7, "hidden_size": 8}}).vocab == 7


def test_declared_targets_order_verifier_then_card():
    cfg = speculators_eagle3("meta-llama/Llama-3.1-8B-Instruct")
    decl = declared_targets(cfg, {"base_model": ["RedHatAI/other-draft"]})
    assert [(d.target, d.source) for d in decl] == [
        ("meta-llama/Llama-3.1-8B-Instruct", "speculators verifier"),
        ("RedHatAI/other-draft", "card base_model"),
    ]
    assert declared_targets(MEDUSA_VICUNA_7B, None)[0].source == "medusa base_model_name_or_path"
    assert declared_targets(LLAMA31_8B, None) == []


def test_names():
    assert names_match("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert not names_match("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-70B")
    assert not names_match("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B")
    assert names_match("mistralai/Mixtral-8x7B-Instruct-v0.1", "yuhuili/EAGLE-mixtral-instruct-8x7B")
    assert name_info("Qwen/Qwen3-30B-A3B").size_b == 30
    assert same_family_smaller("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-3B-Instruct")
    assert not same_family_smaller("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-3B-Instruct")  # > 1/4
    assert not same_family_smaller("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B")  # base vs instruct
    assert same_family_smaller("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B")
    assert same_model(
        "meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/llama-3.1-8b-instruct", load_catalog().aliases
    )
    assert same_model("/models/Llama-3.1-8B-Instruct/", "meta-llama/Llama-3.1-8B-Instruct")
    assert not same_model("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")


# ------------------------------------------------------------------------------------------ catalog


def test_catalog_has_the_published_pairs():
    cat = load_catalog()
    assert len(cat.entries) >= 30
    methods = {e.method for e in cat.entries}
    assert methods == {
        Method.EAGLE,
        Method.EAGLE3,
        Method.MEDUSA,
        Method.MLP_SPECULATOR,
        Method.DRAFT_MODEL,
        Method.MTP,
    }
    eagle3_authors = {e.draft.split("/")[0] for e in cat.entries if e.method is Method.EAGLE3}
    assert {"yuhuili", "RedHatAI", "lmsys", "AngelSlim", "Tengyunw", "nvidia"} <= eagle3_authors
    assert all(e.source.startswith("https://") for e in cat.entries)
    assert any(e.backends == ("llamacpp",) and e.files for e in cat.entries)
    pairs = {(e.target, e.draft) for e in cat.entries}
    assert ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct") in pairs
    assert ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B") in pairs
    assert len(pairs) == len(cat.entries)  # no duplicates
    # the known caveats are recorded
    eagle3 = cat.pair("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert eagle3.context == 2048 and any("2048" in c for c in eagle3.caveats)
    qwen = cat.pair("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")
    assert any("151936" in c and "152064" in c for c in qwen.caveats)
    assert cat.facts("Qwen/Qwen2.5-7B-Instruct").vocab == 152064
    assert cat.facts("Qwen/Qwen2.5-0.5B-Instruct-GGUF").vocab == 151936  # GGUF repo: facts of what it converts
    assert cat.facts("deepseek-ai/DeepSeek-V3").mtp == 1


def test_catalog_aliases_and_extension(tmp_path, monkeypatch):
    extra = tmp_path / "mine.yaml"
    extra.write_text(
        "entries:\n  - {target: acme/Chat-70B, draft: acme/Chat-70B-eagle3, method: eagle3, "
        "backends: [vllm], source: 'https://acme.example/drafts'}\n"
    )
    monkeypatch.setenv("SPECOPS_CATALOG", str(extra))
    cat = load_catalog()
    assert cat.for_target("acme/chat-70b")[0].draft == "acme/Chat-70B-eagle3"
    assert cat.for_target("meta-llama/Meta-Llama-3.1-8B-Instruct")  # alias of the renamed repo


@pytest.mark.parametrize(
    "text,msg",
    [
        ("entries:\n  - {target: a/b, draft: c/d, method: warp, source: s}\n", "unknown method 'warp'"),
        ("entries:\n  - {target: a/b, draft: c/d, method: eagle}\n", "lacks source"),
        ("entries:\n  - {target: a/b, draft: c/d, method: mtp, source: s}\n", "draft: self"),
        ("entries:\n  - {target: a/b, draft: c/d, method: eagle, source: s, colour: red}\n", "unknown catalog keys"),
    ],
)
def test_bad_catalog_entries_are_reported(text, msg):
    with pytest.raises(SpecopsError, match=msg):
        parse_catalog(text, "x.yaml")


# ------------------------------------------------------------------------------------------ GGUF files


def test_pick_gguf_file():
    files = [
        "README.md",
        "qwen2.5-0.5b-instruct-q4_k_m.gguf",
        "qwen2.5-0.5b-instruct-q8_0.gguf",
        "qwen2.5-0.5b-instruct-fp16-00001-of-00002.gguf",
        "qwen2.5-0.5b-instruct-fp16-00002-of-00002.gguf",
    ]
    assert pick_file(files, None) == ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M as requested")
    assert pick_file(files, "q8_0")[0] == "qwen2.5-0.5b-instruct-q8_0.gguf"
    f, why = pick_file(["Qwen3-0.6B-Q8_0.gguf"], "Q4_K_M")
    assert f == "Qwen3-0.6B-Q8_0.gguf" and "nearest available is Q8_0" in why
    assert pick_file(["model.safetensors"], None) == (None, "the repo has no .gguf file")
    assert quant_of("Llama-3.2-1B-Instruct-IQ4_XS.gguf") == "IQ4_XS"


# ------------------------------------------------------------------------------------------ memory


def _profile(**gpus):
    return Profile.model_validate(
        {
            "name": "m",
            "backend": "vllm",
            "model": {"id": "a/b"},
            "gpus": gpus,
            "speculative": {"method": "draft_model", "draft": "c/d"},
        }
    )


def test_memory_from_safetensors_metadata_and_files():
    w = from_safetensors({"parameters": {"BF16": 8_030_261_248}, "total": 8_030_261_248})
    assert w.bytes == 16_060_522_496 and w.source == "safetensors metadata"
    assert from_safetensors({"parameters": {"F8_E4M3": 10, "F32": 1}, "total": 11}).bytes == 14
    files = from_files({"model-1.safetensors": 10, "model-2.safetensors": 20, "pytorch_model.bin": 99, "a.json": 5})
    assert files.bytes == 30  # safetensors preferred over the duplicate .bin


def test_memory_per_gpu_share_and_budget():
    target, draft = Weights(80 * GIB, "x"), Weights(2 * GIB, "y")
    e = estimate(_profile(tensor_parallel_size=4, memory_gb=24), target, draft)
    assert e.per_gpu_gib == pytest.approx(22.0) and not e.over_budget  # 80/4 + whole draft on one GPU
    e = estimate(_profile(tensor_parallel_size=4, memory_gb=21), target, draft)
    assert e.over_budget
    p = Profile.model_validate(
        {
            "name": "m",
            "backend": "vllm",
            "model": {"id": "a/b"},
            "gpus": {"tensor_parallel_size": 4},
            "speculative": {"method": "draft_model", "draft": "c/d", "draft_tensor_parallel_size": 4},
        }
    )
    assert estimate(p, target, draft).per_gpu_gib == pytest.approx(20.5)


def test_importing_the_resolver_does_not_import_the_hub_client():
    import subprocess

    code = (
        "import sys, specops.resolve, specops.commands.resolve; "
        "print(sorted(m for m in ('huggingface_hub', 'gguf', 'numpy', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
