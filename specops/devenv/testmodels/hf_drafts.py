"""The draft checkpoints of ``hf_models.py drafts``: one per draft format vLLM loads, for the tiny target.

Part of the standalone HF generator script: ``hf_models.py`` imports it from its own folder (the script's
folder is first on sys.path), under the vLLM venv's python. It must not import specops. Each format has
its own seed, so the output is deterministic and one format's bytes do not depend on another's.
"""

from __future__ import annotations

import json
import os

#: Draft formats written by ``drafts`` (directory name → what it is); see the usage in hf_models.py.
DRAFT_DIRS = (
    "hf-eagle1",
    "hf-eagle3",
    "hf-eagle3-speculators",
    "hf-medusa",
    "hf-medusa-fd",
    "hf-mlp-speculator",
    "hf-mimo-mtp",
    "hf-dflash",
)
#: EAGLE-3 (original layout): the draft vocabulary is the last 256 target ids (d2t offsets, t2d mask).
EAGLE3_DRAFT_VOCAB = 256
#: Medusa heads = drafted tokens (vLLM sets num_heads from num_speculative_tokens).
MEDUSA_HEADS = 3


class _Rand:
    """Deterministic random tensors for one format (its own seed)."""

    def __init__(self, seed):
        import torch

        self.torch = torch
        self.gen = torch.Generator().manual_seed(seed)

    def w(self, *shape, std=0.05):
        return (self.torch.randn(*shape, generator=self.gen) * std).contiguous()

    def ones(self, *shape):
        return self.torch.ones(*shape)

    def zeros(self, *shape):
        return self.torch.zeros(*shape)


def _write_checkpoint(out_dir, config, tensors, filename="model.safetensors", tokenizer_from=None):
    import shutil

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        os.path.join(out_dir, filename),
        metadata={"format": "pt"},
    )
    if tokenizer_from:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(tokenizer_from, name), os.path.join(out_dir, name))
    return {"tensors": len(tensors), "params": int(sum(t.numel() for t in tensors.values()))}


def _llama_layer(r, prefix, hidden, ffn, qkv_in=None, input_norm=True):
    """One Llama decoder layer's tensors (q/k/v take ``qkv_in`` features: 2×hidden for EAGLE-3)."""
    qkv_in = qkv_in or hidden
    t = {f"{prefix}self_attn.{n}_proj.weight": r.w(hidden, qkv_in) for n in "qkv"}
    t[f"{prefix}self_attn.o_proj.weight"] = r.w(hidden, hidden)
    t[f"{prefix}post_attention_layernorm.weight"] = r.ones(hidden)
    t[f"{prefix}mlp.gate_proj.weight"] = r.w(ffn, hidden)
    t[f"{prefix}mlp.up_proj.weight"] = r.w(ffn, hidden)
    t[f"{prefix}mlp.down_proj.weight"] = r.w(hidden, ffn)
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = r.ones(hidden)
    return t


class _Target:
    """The tiny target every draft is made for: its shapes, read from its config.json."""

    def __init__(self, target_dir):
        with open(os.path.join(target_dir, "config.json")) as fh:
            tcfg = json.load(fh)
        self.dir = target_dir
        self.cfg = tcfg
        self.H, self.FF, self.V = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
        self.heads, self.kv, self.hd = (
            tcfg["num_attention_heads"],
            tcfg["num_key_value_heads"],
            tcfg.get("head_dim") or self.H // tcfg["num_attention_heads"],
        )
        self.n_layers = n_layers = tcfg["num_hidden_layers"]
        self.abs = os.path.abspath(target_dir)
        # Aux ids: i is the hidden state entering layer i (0 = embeddings, n = final pre-norm output). vLLM's
        # default (2, n//2, n-3) gives (2, 1, -1) for 2 layers: -1 never matches, so set all three explicitly.
        self.aux_ids = [0, 1, 2] if n_layers == 2 else [2, n_layers // 2, n_layers - 3]
        # Full Llama fields (hidden_act too): the speculators converter builds the draft's Llama config from
        # transformer_layer_config alone, and vLLM 0.32 fails at model init without hidden_act (measured).
        self.llama_fields = {
            "hidden_act": "silu",
            "hidden_size": self.H,
            "intermediate_size": self.FF,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv,
            "head_dim": self.hd,
            "vocab_size": self.V,
            "max_position_embeddings": tcfg["max_position_embeddings"],
            "rms_norm_eps": tcfg["rms_norm_eps"],
            "rope_parameters": tcfg.get("rope_parameters") or {"rope_theta": 10000.0, "rope_type": "default"},
            "bos_token_id": tcfg["bos_token_id"],
            "eos_token_id": tcfg["eos_token_id"],
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


def make_drafts(out, target_dir):
    """Every draft format for the tiny target in ``target_dir`` (see :data:`DRAFT_DIRS`)."""
    tg = _Target(target_dir)
    summary = {"target": tg.abs, "aux_hidden_state_layer_ids": tg.aux_ids, "models": {}}
    for name in DRAFT_DIRS:
        summary["models"][name] = _WRITERS[name](os.path.join(out, name), tg)
    return summary


def _eagle1(out_dir, tg):
    # EAGLE-1 (vllm/model_executor/models/llama_eagle.py): fc(cat(embeds, hidden)) + N layers, layer 0 without
    # input_layernorm, no final norm, no lm_head (the target's is shared), embed_tokens optional (shared).
    H, FF = tg.H, tg.FF
    r = _Rand(101)
    t = {"fc.weight": r.w(H, 2 * H)}
    t.update(_llama_layer(r, "layers.0.", H, FF, input_norm=False))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, **tg.llama_fields}
    return {"method": "eagle", "seed": 101, **_write_checkpoint(out_dir, cfg, t)}


def _eagle3(out_dir, tg):
    # EAGLE-3, original layout (llama_eagle3.py): midlayer.* (mapped to layers.0.), q/k/v take
    # cat(input_layernorm(embeds), hidden_norm(h)), fc over 3 aux states, own norm + lm_head over the draft
    # vocabulary, d2t offsets (target = i + d2t[i]) and t2d mask (ignored by vLLM).
    import torch

    H, FF, V = tg.H, tg.FF, tg.V
    r = _Rand(102)
    dv = EAGLE3_DRAFT_VOCAB
    t = {
        "fc.weight": r.w(H, 3 * H),
        "norm.weight": r.ones(H),
        "lm_head.weight": r.w(dv, H),
        "midlayer.hidden_norm.weight": r.ones(H),
    }
    t.update(_llama_layer(r, "midlayer.", H, FF, qkv_in=2 * H))
    first = V - dv
    t["d2t"] = torch.full((dv,), first, dtype=torch.int64)
    t["t2d"] = torch.arange(V) >= first
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": dv,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": tg.aux_ids,
        **tg.llama_fields,
    }
    return {"method": "eagle3", "seed": 102, "draft_vocab_size": dv, **_write_checkpoint(out_dir, cfg, t)}


def _eagle3_speculators(out_dir, tg):
    # EAGLE-3, speculators layout (transformers_utils/configs/speculators): no top-level model_type, a
    # transformer_layer_config, the verifier's path; layers.0.* names; norm_before_residual explicit.
    H, FF, V = tg.H, tg.FF, tg.V
    r = _Rand(103)
    t = {
        "fc.weight": r.w(H, 3 * H),
        "norm.weight": r.ones(H),
        "lm_head.weight": r.w(V, H),
        "layers.0.hidden_norm.weight": r.ones(H),
    }
    t.update(_llama_layer(r, "layers.0.", H, FF, qkv_in=2 * H))
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": V,
        "norm_before_residual": False,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": tg.aux_ids,
        "transformer_layer_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            **tg.llama_fields,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": tg.abs, "architectures": tg.cfg["architectures"]},
        },
        "speculators_version": "0.3.0",
    }
    return {"method": "eagle3", "seed": 103, "draft_vocab_size": V, **_write_checkpoint(out_dir, cfg, t)}


def _medusa(out_dir, tg):
    # Medusa, vLLM's layout (models/medusa.py): per head x + SiLU(Linear(x)), then lm_heads.h.
    H, V = tg.H, tg.V
    r = _Rand(104)
    t = {}
    for h in range(MEDUSA_HEADS):
        t[f"blocks.{h}.layers.0.weight"] = r.w(H, H)
        t[f"lm_heads.{h}.weight"] = r.w(V, H)
    cfg = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": MEDUSA_HEADS,
        "num_hidden_layers": 1,
        "truncated_vocab_size": V,
    }
    return {"method": "medusa", "seed": 104, "heads": MEDUSA_HEADS, **_write_checkpoint(out_dir, cfg, t)}


def _medusa_fd(out_dir, tg):
    # Medusa, FasterDecoding's original layout: config without model_type (medusa_num_heads/_layers,
    # base_model_name_or_path), ResBlock linears with a bias named "{h}.{l}.linear", heads "{h}.{N}".
    # hidden_size is added because vLLM defaults it to 4096 (the 7B Vicuna heads FasterDecoding shipped);
    # medusa_fc_bias is NOT set, as in the originals (vLLM then drops the biases without a word).
    H, V = tg.H, tg.V
    r = _Rand(105)
    t = {}
    for h in range(MEDUSA_HEADS):
        t[f"{h}.0.linear.weight"] = r.w(H, H)
        t[f"{h}.0.linear.bias"] = r.w(H)
        t[f"{h}.1.weight"] = r.w(V, H)
    cfg = {
        "medusa_num_heads": MEDUSA_HEADS,
        "medusa_num_layers": 1,
        "base_model_name_or_path": tg.abs,
        "hidden_size": H,
    }
    return {
        "method": "medusa",
        "seed": 105,
        "heads": MEDUSA_HEADS,
        **_write_checkpoint(out_dir, cfg, t, filename="medusa_lm_head.safetensors"),
    }


def _mlp_speculator(out_dir, tg):
    # MLP speculator (IBM / FMS layout, models/mlp_speculator.py).
    H, V = tg.H, tg.V
    r = _Rand(106)
    n_predict = 3
    t = {}
    for i in range(n_predict):
        t[f"emb.{i}.weight"] = r.w(V, H)
        t[f"proj.{i}.weight"] = r.w(H, H)
        t[f"head.{i}.weight"] = r.w(V, H)
        t[f"ln.{i}.weight"] = r.ones(H)
        t[f"ln.{i}.bias"] = r.zeros(H)
    cfg = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": V,
        "emb_dim": H,
        "inner_dim": H,
        "n_predict": n_predict,
        "top_k_tokens_per_head": [1] * n_predict,
        "n_candidates": 1,
        "tie_weights": False,
        "scale_input": False,
    }
    return {"method": "mlp_speculator", "seed": 106, **_write_checkpoint(out_dir, cfg, t)}


def _mimo_mtp(out_dir, tg):
    # A tiny MiMo target (models/mimo.py: Qwen2 blocks, q/k/v with bias) carrying one MTP layer
    # (models/mimo_mtp.py: model.mtp_layers.0.*; input_proj over cat(prev_hidden, embeds)).
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    H, FF, V, tcfg = tg.H, tg.FF, tg.V, tg.cfg
    torch.manual_seed(107)
    qcfg = Qwen2Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=tg.n_layers,
        num_attention_heads=tg.heads,
        num_key_value_heads=tg.kv,
        max_position_embeddings=tcfg["max_position_embeddings"],
        rms_norm_eps=tcfg["rms_norm_eps"],
        bos_token_id=tcfg["bos_token_id"],
        eos_token_id=tcfg["eos_token_id"],
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    mimo = Qwen2ForCausalLM(qcfg).eval()
    t = {k: v.detach().clone() for k, v in mimo.state_dict().items()}
    r = _Rand(108)
    m = "model.mtp_layers.0."
    t.update(
        {
            m + "token_layernorm.weight": r.ones(H),
            m + "hidden_layernorm.weight": r.ones(H),
            m + "input_proj.weight": r.w(H, 2 * H),
            m + "final_layernorm.weight": r.ones(H),
        }
    )
    t.update(_llama_layer(r, m, H, FF))
    for n in "qkv":
        t[f"{m}self_attn.{n}_proj.bias"] = r.zeros(H)
    cfg = qcfg.to_dict()
    for drop in ("head_dim", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "layer_types"):
        cfg.pop(drop, None)
    cfg.update(
        {
            "architectures": ["MiMoForCausalLM"],
            "model_type": "qwen2",
            "num_nextn_predict_layers": 1,
            "use_sliding_window": False,
            "torch_dtype": "float32",
        }
    )
    return {
        "method": "mtp",
        "seed": 107,
        "mtp_layers": 1,
        **_write_checkpoint(out_dir, cfg, t, tokenizer_from=tg.dir),
    }


def _dflash(out_dir, tg):
    # DFlash (models/qwen3_dflash.py): fc over the outputs of target layers 0 and 1 (target_layer_ids are
    # aux ids − 1), hidden_norm, one qwen3 layer (q_norm/k_norm) attending non-causally, own final norm.
    H, FF = tg.H, tg.FF
    r = _Rand(109)
    t = {
        "fc.weight": r.w(H, 2 * H),
        "hidden_norm.weight": r.ones(H),
        "norm.weight": r.ones(H),
        "layers.0.self_attn.q_norm.weight": r.ones(tg.hd),
        "layers.0.self_attn.k_norm.weight": r.ones(tg.hd),
    }
    t.update(_llama_layer(r, "layers.0.", H, FF))
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 1,
        "block_size": 4,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0, 1]},
        **tg.llama_fields,
    }
    return {"method": "dflash", "seed": 109, **_write_checkpoint(out_dir, cfg, t)}


#: The writer of each format in :data:`DRAFT_DIRS`.
_WRITERS = {
    "hf-eagle1": _eagle1,
    "hf-eagle3": _eagle3,
    "hf-eagle3-speculators": _eagle3_speculators,
    "hf-medusa": _medusa,
    "hf-medusa-fd": _medusa_fd,
    "hf-mlp-speculator": _mlp_speculator,
    "hf-mimo-mtp": _mimo_mtp,
    "hf-dflash": _dflash,
}
