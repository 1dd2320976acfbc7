"""The fine-tuning loop of ``specops adapt train`` for vLLM's ``draft_model``, run in the engine's venv (torch,
transformers): never imported by specops.

``python -m specops.adapt.distill_worker JOB.json`` (PYTHONPATH = specops' source). The job file is written by
:mod:`specops.adapt.distill`, which also reads this worker's output back. Why each part is the way it is:

- Tokens: each example is the prompt as vLLM tokenizes a completion prompt (the target's tokenizer: the ids
  the engine serves and the draft drafts in), then the captured answer; the label at each answer position is
  the answer's next token, the target's greedy choice there. Only answer positions are trained: the draft
  never drafts a prompt token.
- The blocks below the trained ones are frozen: they run once over every example (no gradient, the
  checkpoint's dtype, one example at a time so no padding reaches them), and what enters the first trained
  block is kept with the arguments the model passed it (its rotary embeddings and mask), so each step runs
  only the trained blocks, the final norm and the output layer. The trained blocks and norm train in float32
  copies (AdamW on bfloat16 weights loses small updates) and are cast back to the checkpoint's dtype when
  written. The embeddings and output layer are not trained.
- The result is the whole draft, in the layout it was read from (``save_pretrained`` + the tokenizer and
  template files copied), written to a temporary folder and renamed to ``draft/``: a folder vLLM serves as
  ``speculative.draft``. Agreement (the share of answer positions where the draft's greedy token is the
  label) is reported on the training and held-out examples before and after.
- Early stopping: with held-out examples, their agreement is measured every ``eval_every`` steps (a tenth of
  the run by default) and the draft written is the one that agreed most, the draft as it came (step 0)
  included: a few hundred captured answers are memorized long before the run ends (measured on the real 0.5B:
  agreement 0.85 → 0.99 on what it trained on, 0.875 → 0.863 held out), and a draft that only agrees more on
  its own training data must not replace the one in service.

Every ``checkpoint_every`` steps the trained modules, the optimizer and the data order go to ``checkpoint.pt``
(atomic); a run that finds one for the same job resumes after its last step. Progress is one JSON object per
line on stdout (``{"step", "of", "loss", "eta_s"}``), the result goes to ``result.json``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

#: Files of a checkpoint folder that hold weights: written again by save_pretrained, never copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


def _say(**kw) -> None:
    print(json.dumps(kw), flush=True)


class _Stop(Exception):
    """Raised by the hook once the first trained block's input is kept: the rest of the pass is not needed."""


def encode(job: dict, tokenizer, key: str) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per example, at most ``seq`` tokens with at least one answer token."""
    out = []
    with open(job[key], encoding="utf-8") as fh:
        for line in fh:
            ex = json.loads(line)
            prompt = tokenizer(ex["prompt"])["input_ids"][: job["seq"] - 1]
            answer = tokenizer(ex["output"], add_special_tokens=False)["input_ids"][: job["seq"] - len(prompt)]
            if prompt and answer:
                out.append((prompt + answer, len(prompt)))
    return out


class Frozen:
    """The draft's frozen part: what enters block ``first`` for an example, with the arguments it is called with."""

    def __init__(self, model, first: int):
        self.model = model
        self.kept: dict = {}
        self.hook = model.model.layers[first].register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, _module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.kept = {
            "hidden": hidden.detach().clone(),
            "kw": {
                k: v
                for k, v in kwargs.items()
                if k in ("attention_mask", "position_embeddings", "position_ids") and v is not None
            },
        }
        raise _Stop

    @torch.no_grad()
    def run(self, ids: list[int]) -> dict:
        try:
            self.model(input_ids=torch.tensor([ids]), use_cache=False)
        except _Stop:
            pass
        return self.kept


class Trained(torch.nn.Module):
    """Float32 copies of the trained blocks and the final norm; the output layer is the draft's, frozen."""

    def __init__(self, model, first: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(copy.deepcopy(b).float() for b in model.model.layers[first:])
        self.norm = copy.deepcopy(model.model.norm).float()
        self.lm_head = model.get_output_embeddings()

    def logits(self, kept: dict, start: int, end: int) -> torch.Tensor:
        h = kept["hidden"].float()
        for block in self.blocks:
            h = block(h, **kept["kw"])
            h = h[0] if isinstance(h, tuple) else h
        h = self.norm(h)[0, start:end]
        return F.linear(h.to(self.lm_head.weight.dtype), self.lm_head.weight).float()


def _loss(trained: Trained, example) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy summed over the answer positions of one example, how many agree, how many positions."""
    ids, n_prompt, kept = example
    logits = trained.logits(kept, n_prompt - 1, len(ids) - 1)
    labels = torch.tensor(ids[n_prompt:])
    agree = int((logits.argmax(-1) == labels).sum())
    return F.cross_entropy(logits, labels, reduction="sum"), agree, len(labels)


@torch.no_grad()
def _mean(trained: Trained, examples: list) -> tuple[float, float]:
    total = agree = n = 0
    for ex in examples:
        loss, a, k = _loss(trained, ex)
        total, agree, n = total + float(loss), agree + a, n + k
    return total / max(1, n), agree / max(1, n)


def _trainable(trained: Trained) -> dict:
    """A copy of what training changes (not the frozen output layer)."""
    return {k: v.detach().clone() for k, v in trained.state_dict().items() if not k.startswith("lm_head")}


def _write_draft(folder: Path, model, trained: Trained, first: int, source: Path) -> Path:
    with torch.no_grad():
        for block, tuned in zip(model.model.layers[first:], trained.blocks):
            block.load_state_dict(tuned.state_dict())
        model.model.norm.load_state_dict(trained.norm.state_dict())
    final, tmp = folder / "draft", folder / "draft.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not (tmp / f.name).exists():
            shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def run(job_path: Path) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.umask(0o077)  # the checkpoint and the draft hold what was learned from captured traffic
    job = json.loads(job_path.read_text(encoding="utf-8"))
    folder = job_path.parent
    torch.manual_seed(job["seed"])
    torch.set_num_threads(max(1, int(job.get("threads") or len(os.sched_getaffinity(0)))))
    tokenizer = AutoTokenizer.from_pretrained(job["target"])
    model = AutoModelForCausalLM.from_pretrained(job["draft"], dtype="auto")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    first = model.config.num_hidden_layers - job["layers"]
    t_frozen = time.monotonic()
    frozen = Frozen(model, first)
    examples = [(ids, n, frozen.run(ids)) for ids, n in encode(job, tokenizer, "examples")]
    heldout = [(ids, n, frozen.run(ids)) for ids, n in encode(job, tokenizer, "heldout")] if job.get("heldout") else []
    frozen.hook.remove()  # before the trained copies are made: a deep copy would keep it
    frozen_s = round(time.monotonic() - t_frozen, 1)
    if not examples:
        _say(error="no captured example has both a prompt and an answer to learn from")
        return 2
    trained = Trained(model, first)
    params = [p for n, p in trained.named_parameters() if not n.startswith("lm_head")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=job["lr"], weight_decay=0.0)
    ckpt = folder / "checkpoint.pt"
    step, first_eval, rng_state, best = 0, None, None, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state.get("job") == job["id"]:
            trained.load_state_dict(state["model"], strict=False)
            opt.load_state_dict(state["opt"])
            step, first_eval, rng_state, best = state["step"], state["first"], state["rng"], state.get("best")
            _say(resumed=step)
    if first_eval is None:
        first_eval = (*_mean(trained, examples), _mean(trained, heldout)[1] if heldout else None)
        _say(step=0, of=job["steps"], loss=round(first_eval[0], 4))
    if best is None and heldout:  # the draft as it came: kept unless a step agrees more on held-out answers
        best = {"step": 0, "agreement": first_eval[2], "model": _trainable(trained)}
    every = max(1, int(job.get("eval_every") or 0) or job["steps"] // 10)
    rng = np.random.default_rng(job["seed"])
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    steps, t0, at_start = job["steps"], time.monotonic(), step
    losses: list[float] = []
    while step < steps:
        order = rng.permutation(len(examples))
        for s in range(0, len(order), job["batch"]):
            if step >= steps:
                break
            opt.zero_grad()
            group = [examples[j] for j in order[s : s + job["batch"]]]
            positions = sum(len(ids) - n for ids, n, _ in group)
            total = 0.0
            for ex in group:  # one example at a time: no padding, gradients summed
                loss, _, _ = _loss(trained, ex)
                (loss / positions).backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(total / positions)
            per = (time.monotonic() - t0) / (step - at_start)
            if step % max(1, steps // 50) == 0 or step == steps:
                recent = sum(losses[-20:]) / len(losses[-20:])
                _say(step=step, of=steps, loss=round(recent, 4), eta_s=round(per * (steps - step), 1))
            if best is not None and (step % every == 0 or step == steps):
                agreement = _mean(trained, heldout)[1]
                _say(step=step, of=steps, heldout_agreement=round(agreement, 4))
                if agreement > best["agreement"]:
                    best = {"step": step, "agreement": agreement, "model": _trainable(trained)}
            if step % job["checkpoint_every"] == 0 or step == steps:
                state = {"job": job["id"], "model": _trainable(trained), "opt": opt.state_dict(), "step": step,
                         "first": first_eval, "rng": rng.bit_generator.state, "best": best}  # fmt: skip
                torch.save(state, folder / "checkpoint.pt.tmp")
                os.replace(folder / "checkpoint.pt.tmp", ckpt)
    last = (*_mean(trained, examples), _mean(trained, heldout)[1] if heldout else None)
    if best is not None:  # the written draft is the one that agreed most on the held-out answers
        trained.load_state_dict(best["model"], strict=False)
    path = _write_draft(folder, model, trained, first, Path(job["draft"]))
    result = {
        "steps": step,
        "examples": len(examples),
        "trained_blocks": job["layers"],
        "first_loss": first_eval[0],
        "last_loss": last[0],
        "first_agreement": first_eval[1],
        "last_agreement": last[1],
        "heldout_examples": len(heldout),
        "heldout_first_agreement": first_eval[2],
        "heldout_last_agreement": last[2],
        # the step whose draft was written (0: no step agreed more on the held-out answers than the draft as it
        # came), and its held-out agreement; None without held-out examples (the last step is written)
        "best_step": best["step"] if best else None,
        "heldout_best_agreement": best["agreement"] if best else None,
        "draft": str(path),
        "seconds": round(time.monotonic() - t0, 1),
        "frozen_seconds": frozen_s,  # the frozen blocks' one pass over the examples, before the steps
    }
    (folder / "result.json").write_text(json.dumps(result), encoding="utf-8")
    _say(done=True, **result)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
