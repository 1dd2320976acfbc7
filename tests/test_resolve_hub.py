"""The resolver with the real huggingface_hub client against a local fake Hub (tests/fakehub.py).

Every test starts its own Hub on 127.0.0.1 with an empty HF cache; nothing reaches the internet.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest
from fakehub import (
    DEEPSEEK_V3,
    EAGLE3_LLAMA31_8B,
    LLAMA31_8B,
    MEDUSA_VICUNA_7B,
    MISTRAL_7B_V03,
    QWEN25_05B,
    QWEN25_7B,  # noqa: F401
    QWEN_TOKENIZER,
    TEST_TOKEN,
    VICUNA_7B,
    fake_hub,  # noqa: F401  (a pytest fixture)
    seed_llama31,
    speculators_eagle3,
)

from specops.config.profile import Profile, load_profile
from specops.errors import ProfileError
from specops.methods import Method
from specops.resolve import resolve, resolve_profile, synthetic_profile
from specops.resolve.hub import Hub

pytestmark = pytest.mark.timeout(120)


def write_profile(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def by_draft(res, draft):
    return next(c for c in res.candidates if c.draft == draft)


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


GRANITE = {
    "architectures": ["GraniteForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "max_position_embeddings": 131072,
    "model_type": "granite",
    "vocab_size": 49159,
    "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------------------------------ discovery


def test_eagle3_head_found_by_base_model_tag(fake_hub):
    fake_hub.add_model(
        "mistralai/Mistral-7B-Instruct-v0.3",
        {"config.json": MISTRAL_7B_V03},
        safetensors={"parameters": {"BF16": 7_248_023_552}, "total": 7_248_023_552},
    )
    head = {**EAGLE3_LLAMA31_8B, "vocab_size": 32768, "draft_vocab_size": 16384, "max_position_embeddings": 32768}
    fake_hub.add_model(
        "acme/spec-head-e3",
        {"config.json": head, "model.safetensors": 400_000_000},
        card_data={"base_model": "mistralai/Mistral-7B-Instruct-v0.3"},
        downloads=1200,
    )
    # a fine-tune with the same base_model tag is not a draft
    fake_hub.add_model(
        "acme/Mistral-7B-Instruct-v0.3-finetune",
        {"config.json": MISTRAL_7B_V03},
        card_data={"base_model": "mistralai/Mistral-7B-Instruct-v0.3"},
        downloads=99_000,
    )

    res = resolve(synthetic_profile("mistralai/Mistral-7B-Instruct-v0.3"))

    assert res.choice is not None and res.choice.draft == "acme/spec-head-e3"
    assert res.choice.method is Method.EAGLE3 and res.choice.verdict == "ok"
    assert "base_model tag" in res.choice.signals
    assert res.profile.speculative.method is Method.EAGLE3
    assert res.profile.speculative.draft == "acme/spec-head-e3"
    assert res.profile.speculative.draft_revision == fake_hub.repos["acme/spec-head-e3"].sha
    assert all(c.draft != "acme/Mistral-7B-Instruct-v0.3-finetune" for c in res.candidates)
    assert [c.method for c in res.candidates][-1] is Method.NGRAM  # n-gram is always the last resort
    assert any("filter=base_model%3Amistralai%2FMistral-7B-Instruct-v0.3" in p for p in fake_hub.paths_requested("GET"))
    assert fake_hub.weight_downloads == []
    assert not any(p.endswith((".safetensors", ".bin")) for p in fake_hub.paths_requested("GET"))


def test_speculators_verifier_wins_over_a_wrong_card_base_model(fake_hub):
    target = "ibm-granite/granite-3.3-8b-instruct"
    other = "ibm-granite/granite-3.3-2b-instruct"
    fake_hub.add_model(target, {"config.json": GRANITE})
    # right head, wrong card: the card names another model; found by name, its verifier names the target
    fake_hub.add_model(
        "org-a/granite-3.3-8b-instruct-speculator.eagle3",
        {"config.json": speculators_eagle3(target, vocab=49159, verifier_arch="GraniteForCausalLM")},
        card_data={"base_model": other},
        downloads=100,
    )
    # wrong head, right card: tagged with the target, but trained for the 2B model
    fake_hub.add_model(
        "org-b/granite-eagle3-head",
        {"config.json": speculators_eagle3(other, hidden=2048, vocab=49159)},
        card_data={"base_model": target},
        downloads=5000,
    )

    res = resolve(synthetic_profile(target, method="eagle3"))

    right = by_draft(res, "org-a/granite-3.3-8b-instruct-speculator.eagle3")
    wrong = by_draft(res, "org-b/granite-eagle3-head")
    assert res.choice is right
    assert "speculators verifier" in right.signals
    assert any(f.check == "identity" and f.severity == "info" and other in f.message for f in right.findings)
    assert wrong.verdict == "refused"
    assert any(
        f.check == "identity" and f.severity == "error" and f"trained for {other}" in f.message for f in wrong.findings
    )
    assert res.candidates.index(right) < res.candidates.index(wrong)  # re-ranked once the verifier was read


def test_medusa_head_and_its_vllm_version_window(fake_hub, tmp_path):
    fake_hub.add_model("lmsys/vicuna-7b-v1.3", {"config.json": VICUNA_7B})
    fake_hub.add_model(
        "FasterDecoding/medusa-vicuna-7b-v1.3", {"config.json": MEDUSA_VICUNA_7B, "medusa_lm_head.pt": 1_400_000_000}
    )
    vllm_layout = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 4096}
    vllm_layout |= {"vocab_size": 32000, "num_heads": 5, "num_hidden_layers": 1}
    fake_hub.add_model("abhigoyal/vllm-medusa-vicuna-7b-v1.3", {"config.json": vllm_layout, "model.safetensors": 10})
    text = (
        "name: medusa\nbackend: vllm\nengine: {version: '%s'}\nmodel: {id: lmsys/vicuna-7b-v1.3}\n"
        "speculative: {method: medusa, draft: auto}\n"
    )
    ok = resolve_profile(load_profile(write_profile(tmp_path, text % "0.32.0")), use_lock=False)
    # the head in vLLM's layout is chosen; FasterDecoding's original-layout head is not offered as loading
    assert ok.profile.speculative.draft == "abhigoyal/vllm-medusa-vicuna-7b-v1.3"
    assert "catalog" in ok.choice.signals and ok.choice.verdict == "ok"
    original = by_draft(ok, "FasterDecoding/medusa-vicuna-7b-v1.3")
    assert original.verdict == "warning"
    assert any("no engine specops renders for loads this draft as published" in f.message for f in original.findings)
    assert {"catalog", "medusa base_model_name_or_path"} <= set(original.signals)

    with pytest.raises(ProfileError) as exc:
        resolve_profile(load_profile(write_profile(tmp_path, text % "0.33.0", "q.yaml")), use_lock=False)
    assert "vLLM 0.33.0 cannot run method medusa: 0.33.0 dropped it" in str(exc.value)


def _seed_qwen(hub):
    hub.add_model(
        "Qwen/Qwen2.5-7B-Instruct",
        {"config.json": QWEN25_7B, "tokenizer.json": QWEN_TOKENIZER, "model-00001-of-00004.safetensors": 3_945_441_440},
    )
    hub.add_model(
        "Qwen/Qwen2.5-0.5B-Instruct",
        {"config.json": QWEN25_05B, "tokenizer.json": QWEN_TOKENIZER, "model.safetensors": 988_097_824},
    )
    hub.add_model(
        "Qwen/Qwen2.5-7B-Instruct-GGUF",
        {
            "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf": 3_993_201_344,
            "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf": 689_872_288,
            "qwen2.5-7b-instruct-q8_0-00001-of-00003.gguf": 3_988_000_000,
        },
        card_data={"base_model": "Qwen/Qwen2.5-7B-Instruct"},
        gguf={"total": 7_615_616_512, "architecture": "qwen2", "context_length": 32768},
    )
    hub.add_model(
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        {"qwen2.5-0.5b-instruct-q4_k_m.gguf": 491_400_064, "qwen2.5-0.5b-instruct-q8_0.gguf": 675_710_816},
        card_data={"base_model": "Qwen/Qwen2.5-0.5B-Instruct"},
        gguf={"total": 494_032_768, "architecture": "qwen2", "context_length": 32768},
    )


def test_qwen25_vocab_mismatch_is_refused_where_vllm_cannot_map_vocabularies(fake_hub, tmp_path):
    _seed_qwen(fake_hub)
    text = (
        "name: q\nbackend: vllm\nengine: {version: '%s'}\nmodel: {id: Qwen/Qwen2.5-7B-Instruct}\n"
        "speculative:\n  method: draft_model\n  draft: Qwen/Qwen2.5-0.5B-Instruct\n"
    )
    path = write_profile(tmp_path, text % "0.24.0")
    with pytest.raises(ProfileError) as exc:
        resolve_profile(load_profile(path), use_lock=False)
    problem = exc.value.problems[0]
    assert "vocab_size 151936 != target's 152064" in problem.message and "(0.24.0)" in problem.message
    assert (problem.field, problem.location.line) == ("speculative.draft", 7)  # located at the draft line


@pytest.mark.parametrize("pin", ["engine: {version: '0.32.0'}\n", ""])
def test_qwen25_vocab_mismatch_runs_with_use_heterogeneous_vocab_where_vllm_has_it(fake_hub, tmp_path, pin):
    """vLLM 0.25+ maps a draft model's tokens to the target's: the pair launches with the option set."""
    from specops.resolve.prelaunch import resolve_for_launch

    _seed_qwen(fake_hub)
    path = write_profile(
        tmp_path,
        "name: q\nbackend: vllm\n" + pin + "model: {id: Qwen/Qwen2.5-7B-Instruct}\n"
        "speculative:\n  method: draft_model\n  draft: Qwen/Qwen2.5-0.5B-Instruct\n",
    )
    loaded = load_profile(path)
    res = resolve_profile(loaded, use_lock=False)
    assert not res.errors
    assert any(f.check == "vocab-mapped" and "use_heterogeneous_vocab: true" in f.message for f in res.findings)
    said: list[str] = []
    launch, refused = resolve_for_launch(loaded, offline=False, say=said.append)
    assert refused is None
    assert launch.profile.speculative.options == {"use_heterogeneous_vocab": True}
    assert loaded.profile.speculative.options == {}  # the profile itself is unchanged


def test_qwen25_vocab_mismatch_is_allowed_for_llamacpp(fake_hub, tmp_path):
    _seed_qwen(fake_hub)
    path = write_profile(
        tmp_path,
        "name: q\nbackend: llamacpp\nmodel: {id: Qwen/Qwen2.5-7B-Instruct-GGUF}\n"
        "speculative: {method: draft_model, draft: Qwen/Qwen2.5-0.5B-Instruct-GGUF}\n",
    )
    res = resolve_profile(load_profile(path), use_lock=False)
    spec = res.profile.speculative
    assert spec.draft_file == "qwen2.5-0.5b-instruct-q4_k_m.gguf"  # default Q4_K_M
    assert res.target.gguf_file == "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf"
    assert res.memory.target.bytes == 3_993_201_344 + 689_872_288  # both split parts
    assert any(f.check == "vocab" and "differ by 128" in f.message for f in res.findings)
    assert not res.errors
    assert res.memory is not None and res.memory.draft.bytes == 491_400_064  # from paths-info, not downloaded
    assert fake_hub.weight_downloads == []


def test_llamacpp_auto_picks_the_catalog_gguf_pair_and_the_requested_quant(fake_hub):
    _seed_qwen(fake_hub)
    res = resolve(synthetic_profile("Qwen/Qwen2.5-7B-Instruct-GGUF", backend="llamacpp", quant="Q8_0"))
    assert res.choice.method is Method.DRAFT_MODEL
    assert res.profile.speculative.draft == "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
    assert res.profile.speculative.draft_file == "qwen2.5-0.5b-instruct-q8_0.gguf"
    assert "catalog" in res.choice.signals


def _write_gguf(path: Path, n_vocab: int, *, bos: int = 1, eos: int = 2, swap: int | None = None) -> Path:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, n_vocab)]
    if swap is not None:
        tokens[swap] = "different"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "draft_kwargs,ok,message",
    [
        ({"n_vocab": 400}, True, "same token text"),
        ({"n_vocab": 400 + 128}, True, "same token text"),
        ({"n_vocab": 400 + 129}, False, "129 apart; llama.cpp allows at most 128"),
        ({"n_vocab": 400, "eos": 3}, False, "BOS/EOS differ"),
        ({"n_vocab": 400, "swap": 7}, False, "token 7 differs"),
    ],
)
def test_local_gguf_vocab_rules_of_llamacpp(fake_hub, tmp_path, draft_kwargs, ok, message):
    target = _write_gguf(tmp_path / "target.gguf", 400)
    draft = _write_gguf(tmp_path / "draft.gguf", **draft_kwargs)
    p = Profile.model_validate(
        {
            "name": "g",
            "backend": "llamacpp",
            "model": {"id": str(target)},
            "speculative": {"method": "draft_model", "draft": str(draft)},
        }
    )
    res = resolve(p)
    vocab = [f for f in res.findings if f.check == "vocab"]
    assert any(message in f.message for f in vocab), vocab
    assert (res.choice is not None) is ok
    assert fake_hub.requests == []  # local files: no Hub


def test_eagle_head_trained_at_2048_warned_when_serving_8192(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    text = (
        "name: e\nbackend: vllm\nmodel:\n  id: meta-llama/Llama-3.1-8B-Instruct\n  max_model_len: %d\n"
        "speculative: {method: eagle3, draft: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B}\n"
    )
    res = resolve_profile(load_profile(write_profile(tmp_path, text % 8192)), use_lock=False)
    warn = [f for f in res.findings if f.check == "context"]
    assert len(warn) == 1 and warn[0].severity == "warning"
    assert "draft context 2048 < served context 8192" in warn[0].message
    assert warn[0].path == ("model", "max_model_len")
    assert res.choice.verdict == "warning"
    short = resolve_profile(load_profile(write_profile(tmp_path, text % 2048, "s.yaml")), use_lock=False)
    assert not [f for f in short.findings if f.check == "context"] and short.choice.verdict == "ok"


def test_mtp_refused_on_a_target_without_mtp_layers(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    fake_hub.add_model("deepseek-ai/DeepSeek-V3", {"config.json": DEEPSEEK_V3})
    path = write_profile(
        tmp_path, "name: m\nbackend: vllm\nmodel: {id: meta-llama/Llama-3.1-8B-Instruct}\nspeculative: {method: mtp}\n"
    )
    with pytest.raises(ProfileError) as exc:
        resolve_profile(load_profile(path), use_lock=False)
    assert "has no MTP layers" in str(exc.value) and exc.value.problems[0].field == "speculative.method"

    res = resolve(synthetic_profile("deepseek-ai/DeepSeek-V3", method="mtp"))
    assert res.choice.method is Method.MTP and res.profile.speculative.draft is None
    auto = resolve(synthetic_profile("deepseek-ai/DeepSeek-V3"))
    assert auto.choice.method is Method.MTP  # no EAGLE head published: MTP comes next
    assert {"catalog", "target config"} <= set(auto.choice.signals)


# ------------------------------------------------------------------------------------------ checks


def test_head_checks_hidden_aux_layers_and_method_mismatch(fake_hub):
    seed_llama31(fake_hub)
    t = "meta-llama/Llama-3.1-8B-Instruct"
    fake_hub.add_model("x/aux-too-deep", {"config.json": speculators_eagle3(t, aux=[2, 16, 32])})
    fake_hub.add_model("x/wrong-hidden", {"config.json": speculators_eagle3(t, hidden=5120)})

    def run(method, draft):
        return resolve(
            Profile.model_validate(
                {"name": "c", "backend": "vllm", "model": {"id": t}, "speculative": {"method": method, "draft": draft}}
            )
        )

    aux = run("eagle3", "x/aux-too-deep")
    assert any(f.check == "aux_layers" and "include 32, but the target has 32 layers" in f.message for f in aux.errors)
    hidden = run("eagle3", "x/wrong-hidden")
    assert any(f.check == "hidden" and "5120 != target hidden_size 4096" in f.message for f in hidden.errors)
    as_eagle = run("eagle", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert any("set method: eagle3" in f.message for f in as_eagle.errors)
    full = run("eagle", "meta-llama/Llama-3.2-1B-Instruct")
    assert any("looks like a complete model (16 layers" in f.message for f in full.errors)
    eagle1 = run("eagle", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B")
    assert eagle1.choice is not None and not eagle1.errors
    old = resolve(
        Profile.model_validate(
            {
                "name": "c",
                "backend": "vllm",
                "engine": {"version": "0.8.4"},
                "model": {"id": t},
                "speculative": {"method": "eagle3", "draft": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            }
        )
    )
    assert any("needs vLLM >= 0.8.5" in f.message for f in old.errors)


def test_tokenizer_identity_and_memory_budget(fake_hub):
    seed_llama31(fake_hub)
    fake_hub.add_model(
        "acme/Llama-3.2-1B-Instruct-retok",
        {
            "config.json": {**LLAMA31_8B, "hidden_size": 2048, "num_hidden_layers": 16},
            "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}',
            "model.safetensors": 2_400_000_000,
        },
    )
    p = Profile.model_validate(
        {
            "name": "t",
            "backend": "vllm",
            "model": {"id": "meta-llama/Llama-3.1-8B-Instruct"},
            "gpus": {"memory_gb": 16},
            "speculative": {"method": "draft_model", "draft": "acme/Llama-3.2-1B-Instruct-retok"},
        }
    )
    res = resolve(p)
    tok = [f for f in res.findings if f.check == "tokenizer"]
    assert tok and tok[0].severity == "warning" and "tokenizer differs" in tok[0].message
    mem = [f for f in res.findings if f.check == "memory"]
    assert mem[0].severity == "warning" and "over the gpus.memory_gb budget" in mem[0].message
    assert res.memory.target.source == "safetensors metadata" and res.memory.draft.source == "file sizes"
    same = resolve(
        p.model_copy(
            update={"speculative": p.speculative.model_copy(update={"draft": "meta-llama/Llama-3.2-1B-Instruct"})}
        )
    )
    assert any(f.check == "tokenizer" and f.severity == "info" and "identical" in f.message for f in same.findings)


def test_ranking_prefers_method_then_trust_then_downloads(fake_hub):
    fake_hub.add_model("mistralai/Mistral-7B-Instruct-v0.3", {"config.json": MISTRAL_7B_V03})
    head = {**EAGLE3_LLAMA31_8B, "vocab_size": 32768, "draft_vocab_size": 16384, "max_position_embeddings": 32768}
    for name, dl in (("a/head-low", 10), ("b/head-high", 5000)):
        fake_hub.add_model(
            name, {"config.json": head}, card_data={"base_model": "mistralai/Mistral-7B-Instruct-v0.3"}, downloads=dl
        )
    fake_hub.add_model("c/EAGLE3-Mistral-7B-Instruct-v0.3", {"config.json": head}, downloads=90_000)  # name only
    res = resolve(synthetic_profile("mistralai/Mistral-7B-Instruct-v0.3", method="eagle3"))
    order = [c.draft for c in res.candidates if c.method is Method.EAGLE3]
    assert order == ["b/head-high", "a/head-low", "c/EAGLE3-Mistral-7B-Instruct-v0.3"]
    assert "5.0k downloads" in res.candidates[0].why() and res.candidates[2].signals == ["name"]


# ------------------------------------------------------------------------------------------ Hub failures


def test_hub_down_falls_back_to_the_catalog_with_a_note(monkeypatch, fake_hub):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    res = resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct", max_model_len=2048))
    assert time.monotonic() - t0 < 10
    assert any("is unreachable" in n and "catalog" in n for n in res.notes), res.notes
    assert res.choice is not None and "catalog" in res.choice.signals
    assert res.choice.method in (Method.EAGLE3, Method.EAGLE)
    assert any(f.check == "hub" and "not verified against the Hub" in f.message for f in res.choice.findings)


def test_rate_limit_is_one_line_and_falls_back(fake_hub):
    fake_hub.rate_limited = True
    t0 = time.monotonic()
    res = resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct"))
    assert time.monotonic() - t0 < 10
    assert any("rate-limited by the Hub" in n and "retry in 55 s" in n for n in res.notes), res.notes
    assert res.choice is not None and "catalog" in res.choice.signals
    assert len(fake_hub.requests) <= 3  # the breaker stops asking after the first 429


def test_repo_not_found(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = write_profile(
        tmp_path,
        "name: n\nbackend: vllm\nmodel: {id: meta-llama/Llama-3.1-8B-Instruct}\n"
        "speculative: {method: eagle3, draft: nobody/missing-eagle3}\n",
    )
    with pytest.raises(ProfileError) as exc:
        resolve_profile(load_profile(path), use_lock=False)
    assert "nobody/missing-eagle3 not found on the Hub" in str(exc.value)
    res = resolve(synthetic_profile("nobody/missing-target"))
    assert res.choice is None and res.errors[0].path == ("model", "id")
    assert "nobody/missing-target not found on the Hub" in res.errors[0].message


def test_gated_repo_needs_a_token(fake_hub, monkeypatch):
    seed_llama31(fake_hub)
    fake_hub.repos["meta-llama/Llama-3.2-1B-Instruct"].gated = "manual"
    p = Profile.model_validate(
        {
            "name": "g",
            "backend": "vllm",
            "model": {"id": "meta-llama/Llama-3.1-8B-Instruct"},
            "speculative": {"method": "draft_model", "draft": "meta-llama/Llama-3.2-1B-Instruct"},
        }
    )
    res = resolve(p)
    assert res.choice is None
    msg = res.errors[0].message
    assert "meta-llama/Llama-3.2-1B-Instruct is gated" in msg and "HF_TOKEN" in msg
    monkeypatch.setenv("HF_TOKEN", TEST_TOKEN)
    ok = resolve(p)
    assert ok.choice is not None and not ok.errors
    assert all(TEST_TOKEN not in f.message for f in res.findings + ok.findings)


def test_offline_uses_the_cache_then_the_catalog(fake_hub, monkeypatch, tmp_path):
    seed_llama31(fake_hub)
    online = resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct", max_model_len=2048))
    n = len(fake_hub.requests)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct", max_model_len=2048))
    assert len(fake_hub.requests) == n  # not a single request
    assert any(note.startswith("offline") for note in cached.notes)
    assert cached.target.revision == online.target.revision  # commit from the cache's refs/main
    assert cached.target.facts.vocab == 128256 and cached.target.facts_source == "config.json"
    # both published EAGLE-3 heads pass; offline there are no download counts to break the tie, so the
    # pick may differ from the online one (a lock pins it) — but it comes checked from the cache
    assert online.choice.method is cached.choice.method is Method.EAGLE3
    assert cached.choice.draft in {c.draft for c in online.candidates if c.verdict == "ok"}
    assert cached.choice.verdict == "ok" and cached.choice.view.facts_source == "config.json"
    assert cached.profile.speculative.draft_revision == fake_hub.repos[cached.choice.draft].sha

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))  # offline, nothing cached
    bare = resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct"))
    assert bare.target.facts_source == "catalog" and bare.target.facts.vocab == 128256
    assert bare.choice is not None and "catalog" in bare.choice.signals
    unknown = resolve(
        Profile.model_validate(
            {
                "name": "u",
                "backend": "vllm",
                "model": {"id": "meta-llama/Llama-3.1-8B-Instruct"},
                "speculative": {"method": "eagle3", "draft": "someone/unknown-eagle3"},
            }
        )
    )
    msg = next(f.message for f in unknown.findings if f.check == "hub")
    assert msg.startswith("offline: someone/unknown-eagle3 is not in the lock, the HF cache or the catalog")
    assert len(fake_hub.requests) == n


def test_progress_reports_config_downloads(fake_hub):
    seed_llama31(fake_hub)
    said = []
    hub = Hub(progress=said.append)
    resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct", method="draft_model"), hub=hub)
    assert "downloading meta-llama/Llama-3.1-8B-Instruct/config.json" in said
    assert "downloading meta-llama/Llama-3.2-1B-Instruct/config.json" in said


def test_a_hub_that_does_not_answer_is_cut_off_by_the_deadline(fake_hub, monkeypatch):
    seed_llama31(fake_hub)
    fake_hub.latency = 4.0
    monkeypatch.setenv("SPECOPS_HUB_TIMEOUT", "0.5")  # deadline per call: 2 × 0.5 + 1 = 2 s
    t0 = time.monotonic()
    res = resolve(synthetic_profile("meta-llama/Llama-3.1-8B-Instruct"))
    assert time.monotonic() - t0 < 3.5
    # the per-request read timeout or the per-call deadline, whichever fires first
    assert any("did not answer in time" in n and "SPECOPS_HUB_TIMEOUT" in n for n in res.notes), res.notes
    assert res.choice is not None and "catalog" in res.choice.signals


# ------------------------------------------------------------------------------------------ capabilities


def _register(monkeypatch, backend):
    from specops.plugins import get_registry

    monkeypatch.setitem(get_registry().backends, backend.name, backend)


def test_the_resolver_reads_backend_capabilities_not_names(fake_hub, monkeypatch):
    """A third-party backend with llama.cpp's capabilities is resolved like llama.cpp; one with the defaults
    like an engine that serves Hugging Face repos and needs equal vocabularies."""
    from specops.backends.base import Backend

    class GgufEngine(Backend):
        name, display_name = "ggufish", "GGUFish"
        methods = frozenset({Method.DRAFT_MODEL, Method.NONE})
        model_format, draft_vocab_tolerance, parallel_layout = "gguf", 128, False

    class PlainEngine(Backend):
        name = "plain"
        methods = frozenset({Method.DRAFT_MODEL, Method.NONE})

    _register(monkeypatch, GgufEngine())
    _register(monkeypatch, PlainEngine())
    _seed_qwen(fake_hub)
    gguf = resolve(
        Profile.model_validate(
            {
                "name": "g",
                "backend": "ggufish",
                "model": {"id": "Qwen/Qwen2.5-7B-Instruct-GGUF"},
                "speculative": {"method": "draft_model", "draft": "Qwen/Qwen2.5-0.5B-Instruct-GGUF"},
            }
        )
    )
    assert not gguf.errors
    assert gguf.profile.speculative.draft_file == "qwen2.5-0.5b-instruct-q4_k_m.gguf"
    assert any(f.check == "vocab" and "differ by 128: GGUFish accepts up to 128" in f.message for f in gguf.findings)
    assert "device(s)" in gguf.memory.layout  # not parallel_layout
    plain = resolve(
        Profile.model_validate(
            {
                "name": "p",
                "backend": "plain",
                "model": {"id": "Qwen/Qwen2.5-7B-Instruct"},
                "speculative": {"method": "draft_model", "draft": "Qwen/Qwen2.5-0.5B-Instruct"},
            }
        )
    )
    assert any(
        f.check == "vocab"
        and f.severity == "error"
        and "vocab_size 151936 != target's 152064: plain needs equal vocabularies" in f.message
        for f in plain.findings
    ), plain.findings
    assert plain.profile.speculative.draft_file is None


def test_pinned_versions_are_checked_by_the_backend(monkeypatch):
    from specops.backends.base import Backend
    from specops.resolve.check import backend_findings

    class Pinned(Backend):
        name = "pinned"
        methods = frozenset({Method.EAGLE3, Method.NONE})

        def method_version_problem(self, method, version):
            return f"{method} needs pinned >= 2 (profile pins {version})" if version == "1" else None

    p = Profile.model_validate(
        {
            "name": "v",
            "backend": "pinned",
            "model": {"id": "a/b"},
            "engine": {"version": "1"},
            "speculative": {"method": "eagle3", "draft": "c/d"},
        }
    )
    assert [f.message for f in backend_findings(Method.EAGLE3, p, Pinned())] == [
        "eagle3 needs pinned >= 2 (profile pins 1)"
    ]

    class Ungated(Backend):
        methods = Pinned.methods

    assert backend_findings(Method.EAGLE3, p, Ungated()) == []  # the default knows no gates
