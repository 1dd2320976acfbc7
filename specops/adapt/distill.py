"""``specops adapt train`` for vLLM's ``draft_model``: the draft model in service, fine-tuned on the target's own
captured answers, in the Hugging Face layout vLLM loads it from.

A small model of the target's family (Qwen2.5-Coder-0.5B for the 1.5B) already agrees with its target most of
the time; what it gets wrong on a deployment's traffic is where the two models' training differed. Trained on
the target's greedy answers to that traffic (sequence-level distillation: a drafted token is accepted exactly
when it is the target's greedy choice, and the captured answer is that choice, token by token), it agrees more
often on traffic like it, at the same cost per draft step — unlike a new head, whose acceptance starts at zero.

Only the draft's last ``--layers`` blocks and its final norm are trained: the blocks below are run once over
every example (their output kept for the whole run, as an EAGLE-3 run keeps the target's hidden states), so a
step costs those blocks and the output layer, not the whole draft; the embeddings and output layer stay as they
are. The run is :mod:`specops.adapt.distill_worker` in the vLLM venv's interpreter (torch, transformers); this
module checks the two checkpoints (a located error, never a traceback), estimates memory, writes the job and
reads progress back; it never imports torch. Held-out examples (one in ten, by prompt) are never trained on:
they go to ``heldout.jsonl`` for ``specops adapt promote``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from specops.adapt.train import TrainOptions, TrainOutcome, prepare_run, run_job, split_examples
from specops.errors import SpecopsError

#: config.json fields the fine-tuning reads; a checkpoint without them is not a decoder transformers builds.
_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _config(folder: Path, what: str) -> dict:
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecopsError(
            f"{what} {str(folder)!r} is not a local Hugging Face checkpoint (no config.json): `specops adapt train` "
            "fine-tunes the draft on disk, so download it and name the folder"
        ) from None
    except (OSError, ValueError) as exc:
        raise SpecopsError(f"{path}: not a readable JSON config: {exc}") from None
    if not isinstance(cfg, dict):
        raise SpecopsError(f"{path}: not a JSON object")
    for name in _FIELDS:
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SpecopsError(f"{path}: field `{name}` must be a positive integer (found {value!r})")
    return cfg


def check_pair(target: Path, draft: Path, layers: int) -> tuple[dict, dict]:
    """Both checkpoints' configs, checked: one vocabulary (vLLM verifies the draft's ids as the target's), and
    no more trained blocks than the draft has."""
    tcfg, dcfg = _config(target, "model.id"), _config(draft, "speculative.draft")
    if tcfg["vocab_size"] != dcfg["vocab_size"]:
        raise SpecopsError(
            f"{draft / 'config.json'}: field `vocab_size` is {dcfg['vocab_size']}, the target's is "
            f"{tcfg['vocab_size']}: a draft model must share its target's vocabulary"
        )
    if layers > dcfg["num_hidden_layers"]:
        raise SpecopsError(
            f"--layers {layers}: the draft {str(draft)!r} has {dcfg['num_hidden_layers']} blocks (field "
            "`num_hidden_layers`); train at most that many"
        )
    return tcfg, dcfg


def memory_estimate(dcfg: dict, opts: TrainOptions, tokens: int = 0) -> int:
    """Bytes at most: the draft in its checkpoint's dtype, the trained blocks in float32 with gradients and two
    AdamW moments, one example's activations through them and its logits (the worker runs a batch one example
    at a time, summing gradients), and the hidden states of the ``tokens`` tokens of all examples at the first
    trained block, kept for the whole run."""
    H, FF, L, V = dcfg["hidden_size"], dcfg["intermediate_size"], dcfg["num_hidden_layers"], dcfg["vocab_size"]
    heads = dcfg["num_attention_heads"]
    block = 4 * H * H + 3 * H * FF + 2 * H
    weight = 2 if (dcfg.get("dtype") or dcfg.get("torch_dtype")) in ("bfloat16", "float16") else 4
    draft = weight * (2 * V * H + L * block)
    trained = 4 * 4 * opts.layers * block
    T = opts.seq
    acts = 4 * T * (opts.layers * (12 * H + 3 * FF + 2 * heads * T) + 3 * V)
    kept = tokens * (weight * H + 8)
    return draft + trained + acts + kept + (512 << 20)  # + the interpreter, torch, transformers


def train_vllm_draft(
    prof,
    capture: Path,
    out: Path,
    opts: TrainOptions,
    *,
    python: Path,
    on_progress: Callable[[dict], None] = lambda d: None,
) -> TrainOutcome:
    """Fine-tune the vLLM profile ``prof``'s draft model into ``out/draft`` (resuming a run of the same job)."""
    if not prof.speculative.draft:
        raise SpecopsError("speculative.draft is not set: method draft_model fine-tunes the draft in service")
    target, draft = Path(prof.model.id), Path(prof.speculative.draft)
    if not target.is_dir():
        raise SpecopsError(
            f"model.id {prof.model.id!r} is not a local folder: the fine-tuning tokenizes the captured text with the "
            "target's tokenizer (the ids vLLM serves), so it needs the target's checkpoint on disk"
        )
    target, draft = target.resolve(), draft.resolve()
    _, dcfg = check_pair(target, draft, opts.layers)
    train, held = split_examples(capture, opts.only_class)
    tokens = sum(min(opts.seq, len(e["prompt"]) + len(e["output"])) for e in train + held)
    need = memory_estimate(dcfg, opts, tokens)
    out, examples_text = prepare_run(out, train, held, need, opts)
    job = {
        "kind": "draft_model",
        "target": str(target),
        "draft": str(draft),
        "examples": str(out / "examples.jsonl"),
        "heldout": str(out / "heldout.jsonl") if held else None,
        "answers": "captured",
        "layers": opts.layers,
        **opts.loop(),
    }
    info = {"target": str(target), "train_examples": len(train), "heldout_examples": len(held), "memory_estimate": need}
    result = run_job(python, out, job, examples_text, draft, info, "specops.adapt.distill_worker", on_progress)
    init = f"the draft in service ({draft.name}), its last {opts.layers} blocks trained"
    return TrainOutcome(Path(result["draft"]), out, result, len(train), len(held), init, need)
