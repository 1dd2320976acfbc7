"""The training loop of ``specops adapt train``, run in the engine's venv (torch): never imported by specops.

``python -m specops.adapt.train_worker JOB.json`` (PYTHONPATH = specops' source, the interpreter of the vLLM
venv, whose torch and tokenizers it uses). It imports nothing of specops, so the control plane's modules stay
free of torch and this one free of specops' dependencies. The job file (written by :mod:`specops.adapt.train`)
names everything:

- ``kind: llama-draft``: a llama-architecture draft (the current draft's weights, or the target's first
  layers) trained on the captured prompts and the target's answers: cross-entropy against the target's greedy
  choice at every position of that text (``teacher``: the target run here on it; the draft's proposals are
  accepted exactly when they are the target's greedy tokens), or, without a teacher, against the answer's
  next token. Its forward is llama.cpp's for the
  ``llama`` architecture (RMSNorm, rotary embedding on adjacent pairs, SwiGLU), so the weights it writes mean
  the same thing in llama-server.
- ``vocab``: the target's SPM vocabulary (pieces and scores) from its GGUF; the text is tokenized with it.

Every ``checkpoint_every`` steps the parameters, the optimizer and the data order go to ``checkpoint.pt`` (written
atomically); a run that finds one for the same job resumes after its last step. Progress goes to stdout as one
JSON object per line (``{"step": ..., "of": ..., "loss": ...}``), the result to ``result.json`` and the
weights to ``draft.npz`` in the job's folder.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _say(**kw) -> None:
    print(json.dumps(kw), flush=True)


# ------------------------------------------------------------------------------------------- tokenizing


def spm_tokenizer(vocab: dict):
    """A tokenizer over the GGUF's SPM pieces (byte fallback; control and byte pieces only when nothing else fits)."""
    from tokenizers import Tokenizer, models, normalizers

    pieces = []
    for piece, score, kind in zip(vocab["tokens"], vocab["scores"], vocab["types"]):
        normal = kind in (1, 4)  # NORMAL, USER_DEFINED
        pieces.append((piece, float(score) if normal else -1e9))
    tok = Tokenizer(models.Unigram(pieces, unk_id=vocab.get("unk", 0), byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    return tok


class SpmMerges:
    """llama.cpp's SPM tokenization of a prompt (``llm_tokenizer_spm``): characters merged pairwise, the
    highest-scoring merge whose result is a piece first (the leftmost on a tie), bytes for what stays unknown.

    This is how the engine reads a prompt, and it can differ from the best segmentation: a piece that no chain
    of merges reaches (a whole word in a vocabulary not built by merging) is never used for a prompt, though
    the model may emit it. Training on another segmentation of the prompt trains on contexts the engine never
    sees."""

    def __init__(self, vocab: dict):
        self.ids = {}
        for i, piece in enumerate(vocab["tokens"]):
            self.ids.setdefault(piece, i)
        self.scores = [float(x) for x in vocab["scores"]]
        self.unk = vocab.get("unk", 0)

    def encode(self, text: str) -> list[int]:
        import heapq

        sym = list(text)
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        heap: list = []

        def push(left: int) -> None:
            right = nxt[left] if left >= 0 else -1
            if left < 0 or right < 0:
                return
            merged = sym[left] + sym[right]
            tid = self.ids.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-self.scores[tid], left, merged))

        for i in range(len(sym) - 1):
            push(i)
        while heap:
            _score, left, merged = heapq.heappop(heap)
            right = nxt[left]
            if right < 0 or not sym[left] or sym[left] + sym[right] != merged:
                continue  # one side changed since this pair was seen
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left])
            push(left)
        out: list[int] = []
        i = 0 if sym else -1
        while i >= 0:
            piece = sym[i]
            tid = self.ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.encode("utf-8"):
                    out.append(self.ids.get(f"<0x{b:02X}>", self.unk))
            i = nxt[i]
        return out


def encode_examples(job: dict, tok) -> list[tuple[list[int], int]]:
    """(token ids, where the answer starts) per example: BOS, the prompt as llama.cpp tokenizes it (a space
    prefix, then :class:`SpmMerges`), and the answer in its best segmentation (``tok``: the pieces a model
    emits; re-merging its text could split a piece the target produced whole)."""
    out = []
    bos, seq = job["vocab"].get("bos"), job["seq"]
    merges = SpmMerges(job["vocab"])
    prefix = " " if job["vocab"].get("space_prefix", True) else ""
    with open(job["examples"], encoding="utf-8") as fh:
        for line in fh:
            ex = json.loads(line)
            prompt = merges.encode((prefix + ex["prompt"]).replace(" ", "\u2581"))
            # up to the first U+FFFD: past it the text was cut from bytes that are not UTF-8 (a model emitting
            # byte tokens), its tokens are lost, and re-tokenizing would invent a context the engine never saw
            answer = tok.encode(ex["output"].split("\ufffd", 1)[0]).ids
            if not answer:
                continue
            ids = ([bos] if bos is not None else []) + prompt
            start = len(ids)
            ids = (ids + answer)[: seq + 1]
            if len(ids) - start >= 1 and start < len(ids):
                out.append((ids, start))
    return out


# ------------------------------------------------------------------------------------------- the model


class LlamaDraft(torch.nn.Module):
    """llama.cpp's ``llama`` graph, parameters named as in GGUF."""

    def __init__(self, tensors: dict, dims: dict):
        super().__init__()
        self.dims = dims
        self.names = sorted(tensors)
        self.params = torch.nn.ParameterDict(
            {
                k.replace(".", "__"): torch.nn.Parameter(torch.from_numpy(np.array(v, dtype=np.float32)))
                for k, v in tensors.items()
            }
        )

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.dims["eps"]) * w

    def _rope(self, x):  # x: B, T, H, D; adjacent pairs rotate (llama.cpp rope type NORM)
        B, T, H, D = x.shape
        inv = self.dims["rope_base"] ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]  # T, D/2
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        d = self.dims
        B, T = ids.shape
        H, Hkv = d["heads"], d["heads_kv"]
        x = F.embedding(ids, self.p("token_embd.weight"))
        mask = torch.full((T, T), float("-inf")).triu(1)
        for i in range(d["layers"]):
            b = f"blk.{i}."
            h = self._rms(x, self.p(b + "attn_norm.weight"))
            q = (h @ self.p(b + "attn_q.weight").T).view(B, T, H, -1)
            k = (h @ self.p(b + "attn_k.weight").T).view(B, T, Hkv, -1)
            v = (h @ self.p(b + "attn_v.weight").T).view(B, T, Hkv, -1)
            q, k = self._rope(q), self._rope(k)
            if Hkv != H:
                k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
            att = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
            o = (att.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(B, T, -1)
            x = x + o @ self.p(b + "attn_output.weight").T
            h = self._rms(x, self.p(b + "ffn_norm.weight"))
            g = F.silu(h @ self.p(b + "ffn_gate.weight").T) * (h @ self.p(b + "ffn_up.weight").T)
            x = x + g @ self.p(b + "ffn_down.weight").T
        x = self._rms(x, self.p("output_norm.weight"))
        head = self.p("output.weight") if "output__weight" in self.params else self.p("token_embd.weight")
        return x @ head.T

    def tensors(self) -> dict:
        return {k: self.p(k).detach().numpy().astype(np.float32) for k in self.names}


# ------------------------------------------------------------------------------------------- training


def _batches(examples, batch: int, rng: np.random.Generator):
    order = rng.permutation(len(examples))
    for s in range(0, len(order), batch):
        yield [examples[j] for j in order[s : s + batch]]


def _inputs(group) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next tokens) of a group of examples, padded; padding is -100 in the targets."""
    T = max(len(ids) for ids, _ in group) - 1
    inp = torch.zeros((len(group), T), dtype=torch.long)
    tgt = torch.full((len(group), T), -100, dtype=torch.long)
    for r, (ids, _start) in enumerate(group):
        t = torch.tensor(ids, dtype=torch.long)
        inp[r, : len(ids) - 1] = t[:-1]
        tgt[r, : len(ids) - 1] = t[1:]
    return inp, tgt


def teacher_labels(teacher, examples, batch: int) -> tuple[list[list[int]], int, int]:
    """The target's greedy choice after every prefix of every example, computed once (the teacher is frozen,
    so every epoch would compute the same), and how many of the captured answer's tokens it reproduces
    (agreeing, compared): the check that this forward and this tokenization are the engine's."""
    labels, agree, seen = [], 0, 0
    with torch.no_grad():
        for s in range(0, len(examples), batch):
            group = examples[s : s + batch]
            inp, tgt = _inputs(group)
            greedy = teacher(inp).argmax(-1)
            for r, (ids, start) in enumerate(group):
                g = greedy[r, : len(ids) - 1]
                labels.append(g.tolist())
                ans = slice(max(0, start - 1), len(ids) - 1)
                agree += int((g[ans] == tgt[r, ans]).sum())
                seen += len(ids) - start
    return labels, agree, seen


def _loss(model, group, labels=None) -> torch.Tensor:
    """Cross-entropy of the draft against the target's greedy choice at every position of the captured text
    (``labels``: :func:`teacher_labels`), else against the captured answer's next token."""
    inp, tgt = _inputs([(ids, start) for ids, start, _ in group])
    for r, (ids, start, lab) in enumerate(group):
        if labels is None or lab is None:
            tgt[r, : max(0, start - 1)] = -100  # only the answer's tokens are learned
        else:
            tgt[r, : len(ids) - 1] = torch.tensor(lab, dtype=torch.long)
    logits = model(inp)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)


def _mean_loss(model, examples, batch: int, labels) -> float:
    with torch.no_grad():
        groups = [examples[s : s + batch] for s in range(0, len(examples), batch)]
        return sum(float(_loss(model, g, labels)) * len(g) for g in groups) / len(examples)


def run(job_path: Path) -> int:
    job = json.loads(job_path.read_text(encoding="utf-8"))
    folder = job_path.parent
    torch.manual_seed(job["seed"])
    # the cores this process may run on (`taskset`), not the machine's: two threads on one core only contend for it
    torch.set_num_threads(max(1, int(job.get("threads") or len(os.sched_getaffinity(0)))))
    tok = spm_tokenizer(job["vocab"])
    examples = encode_examples(job, tok)
    if not examples:
        _say(error="no example has an answer to learn from")
        return 2
    init = np.load(job["init"])
    model = LlamaDraft({k: init[k] for k in init.files}, job["dims"])
    labels, agreement = None, None
    if job.get("teacher"):
        tt = np.load(job["teacher"])
        teacher = LlamaDraft({k: tt[k] for k in tt.files}, job["teacher_dims"]).requires_grad_(False)
        t0 = time.monotonic()
        found, agree, seen = teacher_labels(teacher, examples, job["batch"])
        labels = True
        examples = [(ids, start, lab) for (ids, start), lab in zip(examples, found)]
        agreement = round(agree / max(1, seen), 4)
        _say(teacher_s=round(time.monotonic() - t0, 1), teacher_agreement=agreement)
        del teacher, tt
        if agreement < float(job.get("min_agreement") or 0):
            _say(
                error=f"the target reproduces only {agreement:.0%} of the captured answers' tokens on the "
                "re-tokenized text (--min-agreement "
                f"{job['min_agreement']}): the capture is not this target's greedy output as this tokenizer "
                "reads it (another model, sampled answers, or a vocabulary specops does not tokenize as the "
                "engine does), and a draft trained on it would learn contexts the engine never sees"
            )
            return 2
    else:
        examples = [(ids, start, None) for ids, start in examples]
    opt = torch.optim.AdamW(model.parameters(), lr=job["lr"], weight_decay=0.0)
    ckpt = folder / "checkpoint.pt"
    step, first_loss, rng_state = 0, None, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state.get("job") == job["id"]:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step, first_loss, rng_state = state["step"], state["first_loss"], state["rng"]
            _say(resumed=step)
    if first_loss is None:
        first_loss = _mean_loss(model, examples, job["batch"], labels)
        _say(step=0, of=job["steps"], loss=round(first_loss, 4))
    rng = np.random.default_rng(job["seed"])
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    steps, t0, done_at_start = job["steps"], time.monotonic(), step
    losses: list[float] = []
    while step < steps:
        for group in _batches(examples, job["batch"], rng):
            if step >= steps:
                break
            loss = _loss(model, group, labels)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            losses.append(loss.item())
            per = (time.monotonic() - t0) / (step - done_at_start)
            if step % max(1, steps // 50) == 0 or step == steps:
                recent = sum(losses[-20:]) / len(losses[-20:])
                _say(step=step, of=steps, loss=round(recent, 4), eta_s=round(per * (steps - step), 1))
            if step % job["checkpoint_every"] == 0 or step == steps:
                state = {
                    "job": job["id"],
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "first_loss": first_loss,
                    "rng": rng.bit_generator.state,
                }
                tmp = folder / "checkpoint.pt.tmp"
                torch.save(state, tmp)
                os.replace(tmp, ckpt)
    final = _mean_loss(model, examples, job["batch"], labels)
    np.savez(folder / "draft.npz", **model.tensors())
    result = {
        "steps": step,
        "examples": len(examples),
        "first_loss": first_loss,
        "last_loss": final,
        "seconds": round(time.monotonic() - t0, 1),
        # the share of the captured answers' tokens the target, run here on that text, chooses itself: near 1
        # when the text round-trips through the tokenizer (an answer cut into invalid UTF-8 does not)
        "teacher_agreement": agreement,
    }
    (folder / "result.json").write_text(json.dumps(result), encoding="utf-8")
    _say(done=True, **result)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
