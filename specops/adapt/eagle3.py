"""``specops adapt train`` for vLLM: an EAGLE-3 head trained on the target's own hidden states, in the
``speculators`` checkpoint layout that ``vllm serve`` loads as a Hub head (``config.json`` with
``speculators_config`` + ``model.safetensors``).

The profile's target must be a local Hugging Face checkpoint (a folder with ``config.json``) of an architecture
whose vLLM model hands an EAGLE-3 head its hidden states (``SupportsEagle3``): Llama or Qwen2. The head itself
is a Llama layer for either (vLLM maps it to ``Eagle3LlamaForCausalLM`` whatever the target): Qwen2's biases
on q/k/v stay in the target, and a tied output layer is read as the embeddings. The
training runs in a subprocess with torch and transformers (the vLLM venv's interpreter, or ``--python``):
:mod:`specops.adapt.eagle3_worker`, which runs the target on the captured prompts and answers, builds the
draft vocabulary (d2t/t2d) from the captured tokens and trains the head with a training-time test. This module
plans, checks the target's config (a located error, never a traceback), estimates memory, writes the job and
reads progress back; it never imports torch.

Held-out examples (one in ten, by prompt) are never trained on: they go to ``heldout.jsonl`` for
``specops adapt promote``, as for llama.cpp drafts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specops.adapt.train import TrainOptions, TrainOutcome, prepare_run, run_job, split_examples
from specops.errors import SpecopsError

#: The ``speculators`` release whose Eagle3SpeculatorConfig fields the written config follows.
SPECULATORS_VERSION = "0.9.0"
#: Architectures the head's layer is written for (vLLM maps model_type llama → Eagle3LlamaForCausalLM).
LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)
#: Target model types whose vLLM 0.32 model implements SupportsEagle3 and whose config the head is built from.
TARGET_MODEL_TYPES = ("llama", "qwen2")


@dataclass
class Eagle3Options:
    """What only an EAGLE-3 run needs beyond :class:`~specops.adapt.train.TrainOptions`."""

    draft_vocab: int | None = None  # None: the fewest ids covering ``coverage`` of the captured tokens
    coverage: float = 0.995
    ttt_steps: int = 3  # draft steps unrolled in training (EAGLE-3's training-time test)
    ttt_decay: float = 0.8
    speculative_tokens: int = 3  # written into speculators_config.proposal_methods
    answers: str = "target"  # target: the target's greedy continuation of each prompt; captured: the captured text
    intermediate_size: int | None = None  # the head's MLP width; None: the target's


def read_target_config(target: Path) -> dict:
    """The target's config.json, checked for what the head is built from; SpecopsError naming file and field."""
    path = target / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecopsError(
            f"{path}: cannot read the target's config ({exc.strerror or exc}): "
            "`specops adapt train` needs the target as a local Hugging Face folder"
        ) from None
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise SpecopsError(
            f"{path}:{getattr(exc, 'lineno', 1)}:{getattr(exc, 'colno', 1)}: not JSON ({getattr(exc, 'msg', exc)})"
        ) from None
    if not isinstance(cfg, dict):
        raise SpecopsError(f"{path}: not a JSON object")
    if cfg.get("model_type") not in TARGET_MODEL_TYPES:
        raise SpecopsError(
            f"{path}: field `model_type` is {cfg.get('model_type')!r}: the EAGLE-3 head is trained for "
            f"{' and '.join(TARGET_MODEL_TYPES)} targets (vLLM hands their hidden states to a head)"
        )
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
    ):
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecopsError(f"{path}: field `{name}` is missing or not a positive integer")
    return cfg


def default_aux_layers(n_layers: int) -> list[int]:
    """vLLM's default (2, n//2, n-3) where all three are distinct layers; else (0, n//2, n), as the fixtures do.

    Id i is the residual stream entering layer i; id n is the last layer's output."""
    ids = [2, n_layers // 2, n_layers - 3]
    if n_layers >= 6 and len(set(ids)) == 3:
        return ids
    return sorted({0, n_layers // 2, n_layers})


def aux_layers_of(draft: str | None) -> list[int] | None:
    """The aux layer ids of the head in service when it is a local EAGLE-3 head that names them."""
    if not draft:
        return None
    try:
        cfg = json.loads((Path(draft) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(cfg, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    return None


def speculators_config(target: Path, tcfg: dict, aux: list[int], e3: Eagle3Options) -> dict:
    """The head's config.json without ``draft_vocab_size`` (the worker sets it once the vocabulary is counted).

    Fields as speculators' Eagle3SpeculatorConfig writes them; vLLM 0.32 reads ``speculators_model_type``,
    ``transformer_layer_config``, ``speculators_config.proposal_methods[0].speculative_tokens`` and
    ``verifier.name_or_path``. The layer config carries the full Llama fields (vLLM fails at init without
    ``hidden_act``)."""
    H = tcfg["hidden_size"]
    layer = {
        "architectures": list(LLAMA_ARCHITECTURES),
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_act": tcfg.get("hidden_act", "silu"),
        "hidden_size": H,
        "intermediate_size": e3.intermediate_size or tcfg["intermediate_size"],
        "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg.get("num_key_value_heads", tcfg["num_attention_heads"]),
        "head_dim": tcfg.get("head_dim") or H // tcfg["num_attention_heads"],
        "vocab_size": tcfg["vocab_size"],
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_parameters": tcfg.get("rope_parameters")
        or {"rope_theta": tcfg.get("rope_theta", 10000.0), "rope_type": "default"},
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "norm_before_residual": False,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": aux,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": e3.speculative_tokens}],
            "verifier": {"name_or_path": str(target), "architectures": tcfg.get("architectures") or []},
        },
        "speculators_version": SPECULATORS_VERSION,
    }


def memory_estimate(tcfg: dict, n_aux: int, opts: TrainOptions, e3: Eagle3Options, tokens: int = 0) -> int:
    """Bytes at most: the target (in its checkpoint's dtype, as the worker loads it; no gradient), the head with gradients and two AdamW moments, the
    activations of one batch (one target layer's and its logits: the target runs without gradient, so its
    layers' activations do not outlive the layer; every unrolled draft step's), and the aux states of the
    ``tokens`` tokens of all examples, which the worker keeps for the whole run."""
    H, FF, L, V = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["num_hidden_layers"], tcfg["vocab_size"]
    heads = tcfg["num_attention_heads"]
    target = 2 * V * H + L * (4 * H * H + 3 * H * FF + 2 * H)
    dv = min(e3.draft_vocab or 32000, V)
    head_ff = e3.intermediate_size or FF
    head = n_aux * H * H + 2 * H * 3 * H + H * H + 3 * H * head_ff + dv * H + 4 * H
    B, T = opts.batch, opts.seq
    acts = B * T * (8 * H + 2 * FF + heads * T + V + e3.ttt_steps * (16 * H + 3 * head_ff + 2 * heads * T + 2 * dv))
    weight = 2 if (tcfg.get("dtype") or tcfg.get("torch_dtype")) in ("bfloat16", "float16") else 4
    kept = tokens * (weight * n_aux * H + 8)
    return weight * target + 4 * (4 * head + 2 * acts) + kept + (512 << 20)  # + the interpreter, torch, transformers


def train_vllm_eagle3(
    prof,
    capture: Path,
    out: Path,
    opts: TrainOptions,
    *,
    python: Path,
    on_progress: Callable[[dict], None] = lambda d: None,
    e3: Eagle3Options | None = None,
) -> TrainOutcome:
    """Train an EAGLE-3 head for the vLLM profile ``prof`` into ``out/head`` (resuming a run of the same job)."""

    e3 = e3 or Eagle3Options(speculative_tokens=prof.speculative.num_speculative_tokens or 3)
    target = Path(prof.model.id)
    if not target.is_dir():
        raise SpecopsError(
            f"model.id {prof.model.id!r} is not a local folder: `specops adapt train` runs the target on the "
            "captured text, so it needs the target's Hugging Face checkpoint on disk (download it and name the folder)"
        )
    target = target.resolve()
    tcfg = read_target_config(target)
    aux = aux_layers_of(prof.speculative.draft) or default_aux_layers(tcfg["num_hidden_layers"])
    bad = [i for i in aux if not 0 <= i <= tcfg["num_hidden_layers"]]
    if bad:
        raise SpecopsError(
            f"{prof.speculative.draft}/config.json: field `eagle_aux_hidden_state_layer_ids` names {bad}, "
            f"outside the target's 0..{tcfg['num_hidden_layers']}"
        )
    train, held = split_examples(capture, opts.only_class)
    # at most seq tokens an example; a token is at least a character of its text
    tokens = sum(min(opts.seq, len(e["prompt"]) + len(e["output"])) for e in train + held)
    need = memory_estimate(tcfg, len(aux), opts, e3, tokens)
    out, examples_text = prepare_run(out, train, held, need, opts)
    job = {
        "kind": "eagle3",
        "target": str(target),
        "examples": str(out / "examples.jsonl"),
        "heldout": str(out / "heldout.jsonl") if held else None,
        "aux_layer_ids": aux,
        "config": speculators_config(target, tcfg, aux, e3),
        "draft_vocab": e3.draft_vocab,
        "coverage": e3.coverage,
        "answers": e3.answers,
        "ttt_steps": e3.ttt_steps,
        "ttt_decay": e3.ttt_decay,
        **opts.loop(),
    }
    info = {"target": str(target), "train_examples": len(train), "heldout_examples": len(held), "memory_estimate": need}
    result = run_job(python, out, job, examples_text, target, info, "specops.adapt.eagle3_worker", on_progress)
    return TrainOutcome(
        Path(result["head"]), out, result, len(train), len(held), "a new head (lm_head from the target's)", need
    )
