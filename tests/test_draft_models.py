"""The generated draft-format checkpoints (one per format the engines load): contents, markers, determinism.

GGUF tests run in a temporary $SPECOPS_CACHE with gguf + numpy only. The HF set needs torch from the vLLM
venv (marked ``engines``: skipped without it, a failure in CI). What the engines *do* with these files is
the support matrix (tests/test_matrix_engines.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from conftest import unavailable
from support_engines import mtimes, sha256_tree

from specops.devenv import engines
from specops.devenv import testmodels as fixtures

REAL_VLLM_READY = engines.vllm_ready()
REAL_VLLM_PYTHON = engines.vllm_python()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECOPS_CACHE", str(root))
    return root


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields[key]
    if len(f.data) == 1 and f.types[0] != gguf.GGUFValueType.ARRAY:
        return f.parts[f.data[0]][0].item()
    return [f.parts[i][0].item() for i in f.data]


@pytest.mark.timeout(120)
def test_gguf_eagle3_head(cache):
    paths = fixtures.ensure_draft_models(kinds=("gguf",))
    assert list(paths) == list(fixtures.DRAFT_GGUF)
    head = paths["gguf-eagle3.gguf"]
    reader = gguf.GGUFReader(str(head))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert arch == "eagle3"
    assert _field(reader, "eagle3.target_layers") == [0, 1, 2]  # exactly 3, all valid for a 2-layer target
    assert _field(reader, "eagle3.target_hidden_size") == 64
    assert _field(reader, "eagle3.block_count") == 1
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}  # ggml ne order
    assert shapes["fc.weight"] == (192, 64)  # 3 aux states × 64 → 64
    assert shapes["blk.0.attn_q.weight"] == (128, 64)  # cat(embeds, fused hidden) → q
    assert "blk.0.attn_norm_2.weight" in shapes and "d2t" not in shapes  # same vocabulary: no d2t
    # the target's vocabulary, token for token (llama.cpp compares them)
    target = gguf.GGUFReader(str(fixtures.model_path("gguf-target.gguf")))
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == len(target.fields["tokenizer.ggml.tokens"].data)
    marker = cache / "models" / "v1" / ".drafts-gguf.ready"
    before = mtimes([marker, head])
    assert fixtures.ensure_draft_models(kinds=("gguf",)) == paths and mtimes([marker, head]) == before
    assert fixtures.status()["models-drafts-gguf"]["ready"] is True


def test_draft_names_resolve():
    assert set(fixtures.DRAFT_MODELS).isdisjoint(fixtures.TINY_MODELS)
    with pytest.raises(Exception, match="hf-eagle3-speculators"):
        fixtures.model_path("no-such-model", ensure=False)


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_hf_draft_formats(cache):
    if not REAL_VLLM_READY:
        unavailable("vLLM CPU venv not set up: run `specops engines setup vllm`")
    paths = fixtures.ensure_draft_models(kinds=("hf",), python=REAL_VLLM_PYTHON)
    assert list(paths) == list(fixtures.DRAFT_HF)

    def names(d: Path) -> set[str]:
        """Tensor names from the safetensors headers (8-byte length, then JSON; no safetensors package here)."""
        out = set()
        for f in d.glob("*.safetensors"):
            raw = f.read_bytes()
            header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
            out |= set(header) - {"__metadata__"}
        return out

    cfg = {k: json.loads((v / "config.json").read_text()) for k, v in paths.items()}
    t = {k: names(v) for k, v in paths.items()}
    # EAGLE-1: no final norm, no lm_head, layer 0 without input_layernorm (vLLM's loader would refuse them)
    assert (
        "fc.weight" in t["hf-eagle1"]
        and not {"lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"} & t["hf-eagle1"]
    )
    # EAGLE-3 original: midlayer.* names, d2t for a smaller draft vocabulary; speculators: no model_type
    assert "midlayer.hidden_norm.weight" in t["hf-eagle3"] and "d2t" in t["hf-eagle3"]
    assert (
        cfg["hf-eagle3"]["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["hf-eagle3"]["draft_vocab_size"] == 256
    )
    spec = cfg["hf-eagle3-speculators"]
    assert "model_type" not in spec and spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(cache / "models" / "v1" / "hf-target")
    assert "layers.0.hidden_norm.weight" in t["hf-eagle3-speculators"]
    # Medusa: vLLM's names vs FasterDecoding's, in its own file name
    assert cfg["hf-medusa"]["model_type"] == "medusa" and "blocks.0.layers.0.weight" in t["hf-medusa"]
    assert "model_type" not in cfg["hf-medusa-fd"] and (paths["hf-medusa-fd"] / "medusa_lm_head.safetensors").is_file()
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight"} <= t["hf-medusa-fd"]
    assert cfg["hf-mlp-speculator"]["model_type"] == "mlp_speculator"
    mimo = cfg["hf-mimo-mtp"]
    assert mimo["architectures"] == ["MiMoForCausalLM"] and mimo["num_nextn_predict_layers"] == 1
    assert "model.mtp_layers.0.input_proj.weight" in t["hf-mimo-mtp"] and "lm_head.weight" in t["hf-mimo-mtp"]
    assert (paths["hf-mimo-mtp"] / "tokenizer.json").read_bytes() == (
        cache / "models" / "v1" / "hf-target" / "tokenizer.json"
    ).read_bytes()
    assert cfg["hf-dflash"]["architectures"] == ["DFlashDraftModel"] and "hidden_norm.weight" in t["hf-dflash"]
    # cached, and the same bytes when made again
    first = {k: sha256_tree(v) for k, v in paths.items()}
    before = mtimes(paths.values())
    assert (
        fixtures.ensure_draft_models(kinds=("hf",), python=REAL_VLLM_PYTHON) == paths
        and mtimes(paths.values()) == before
    )
    fixtures.ensure_draft_models(kinds=("hf",), python=REAL_VLLM_PYTHON, force=True)
    assert {k: sha256_tree(v) for k, v in paths.items()} == first


def _gguf_with_nextn(dst: Path, n: int) -> Path:
    """A header-only llama GGUF whose metadata declares ``n`` MTP (nextn) layers."""
    writer = gguf.GGUFWriter(str(dst), arch="llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_context_length(512)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    writer.add_uint32("llama.nextn_predict_layers", n)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.timeout(120)
def test_mtp_on_a_local_gguf_follows_its_nextn_metadata(cache, tmp_path):
    """llama-server refuses `--spec-type draft-mtp` on a GGUF without `<arch>.nextn_predict_layers` (the
    support matrix saw it exit with "model doesn't contain MTP layers" on the tiny target): resolve refuses
    the same file before launch, and accepts one whose metadata declares MTP layers."""
    from specops.config.profile import load_profile
    from specops.errors import ProfileError
    from specops.resolve import resolve_profile

    plain = fixtures.model_path("gguf-target.gguf")
    with_mtp = _gguf_with_nextn(tmp_path / "mtp.gguf", 1)
    body = "name: m\nbackend: llamacpp\nengine: {version: current}\nmodel: {id: '%s'}\nspeculative: {method: mtp}\n"
    path = tmp_path / "p.yaml"

    path.write_text(body % plain, encoding="utf-8")
    with pytest.raises(ProfileError) as exc:
        resolve_profile(load_profile(path, env={}), use_lock=False)
    assert "has no MTP layers (its GGUF metadata has no <arch>.nextn_predict_layers)" in str(exc.value)

    path.write_text(body % with_mtp, encoding="utf-8")
    res = resolve_profile(load_profile(path, env={}), use_lock=False)
    assert any(f.check == "mtp" and "1 MTP layer" in f.message for f in res.findings)
    assert not res.errors
