"""The EAGLE-3 training loop of ``specops adapt train`` (vLLM), run in the engine's venv (torch): never imported by specops.

``python -m specops.adapt.eagle3_worker JOB.json`` (PYTHONPATH = specops' source, the vLLM venv's interpreter,
whose torch, transformers and safetensors it uses). It imports nothing of specops; the job file is written by
:mod:`specops.adapt.eagle3`, which also reads this worker's output back. Why each part is the way it is:

- Features: the Hugging Face target runs once over every example (no gradient), in its checkpoint's dtype
  (a bfloat16 target as vLLM serves it), and its outputs are kept for the whole run: the target is frozen, so
  running it again at each step would recompute the same tensors, and on a CPU that pass is most of a step
  (a 1.5B target against a one-layer head). Forward pre-hooks keep the residual stream *entering* each
  decoder layer in ``aux_layer_ids`` (id ``n`` = the last layer's output, the input of the final norm):
  exactly what vLLM 0.32's ``_maybe_add_hidden_state`` hands the drafter (``hidden_states + residual``),
  concatenated in layer order. The target's greedy token at each position is the label: a drafted token is
  accepted exactly when it is the target's greedy choice.
- The head is vLLM's ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``) written out in torch: ``fc`` over the aux
  states, one layer whose q/k/v read ``cat(input_layernorm(embed), hidden_norm(h))`` with the residual taken
  before ``hidden_norm`` (``norm_before_residual: false``), fused residual norms, final ``norm``, ``lm_head`` over
  the draft vocabulary. Step 0 at position t reads token t+1 and the target's features at t (vLLM shifts the
  input ids by one, positions unchanged); draft step k reads token t+1+k at position t+k and the previous
  step's pre-norm output, attending to step 0's keys up to t and its own earlier steps at t: the
  training-time test of EAGLE-3, ``ttt_steps`` deep, each step's loss weighted ``ttt_decay**k``.
- The vocabulary maps: the draft vocabulary is the ``draft_vocab`` target ids seen most often in the captured
  tokens and the target's greedy choices (ties by id, then the unseen ids in order), sorted; ``d2t[i]`` is
  the offset of draft id i (target = i + d2t[i]), ``t2d`` a bool mask over the target vocabulary: the
  speculators layout (its ``Eagle3Speculator`` checks ``t2d.sum() == draft_vocab_size``).
- The target's embeddings are shared (not written): vLLM gives the head the target's ``embed_tokens`` when
  the checkpoint has none. ``lm_head`` starts from the target's rows for the draft ids.

Every ``checkpoint_every`` steps the head, the optimizer and the data order go to ``checkpoint.pt`` (atomic);
a run that finds one for the same job resumes after its last step. Progress is one JSON object per line on
stdout (``{"step", "of", "loss", "eta_s"}``), the result goes to ``result.json`` and the head to ``head/``
(``config.json`` + ``model.safetensors``, written to a temporary folder first).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _say(**kw) -> None:
    print(json.dumps(kw), flush=True)


# ------------------------------------------------------------------------------------------- target


class Target:
    """The HF target with hooks that keep the aux hidden states vLLM passes to an EAGLE-3 head."""

    def __init__(self, path: str, aux_ids: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval().requires_grad_(False)
        inner = self.model.model
        self.layers = inner.layers
        self.aux_ids = sorted(set(aux_ids))
        self._kept: dict[int, torch.Tensor] = {}
        for i in self.aux_ids:
            module = self.layers[i] if i < len(self.layers) else inner.norm
            module.register_forward_pre_hook(self._keep(i))

    def _keep(self, i: int):
        def hook(_module, args):
            self._kept[i] = args[0]

        return hook

    @torch.no_grad()
    def regenerate(self, pairs: list, batch: int) -> list:
        """(prompt, answer) pairs with each answer replaced by the target's greedy continuation of its length."""
        out = []
        for s in range(0, len(pairs), batch):
            group = pairs[s : s + batch]
            seqs = [list(p) for p, _ in group]
            want = [len(a) for _, a in group]
            for i in range(max(want, default=0)):
                live = [r for r in range(len(group)) if i < want[r]]
                ids, attn = _pad([seqs[r] for r in live])
                logits = self.model(input_ids=ids, attention_mask=attn).logits
                last = attn.sum(1) - 1
                nxt = logits[torch.arange(len(live)), last].argmax(-1).tolist()
                for r, t in zip(live, nxt):
                    seqs[r].append(t)
            out.extend((p, seqs[r][len(p) :]) for r, (p, _) in enumerate(group))
        return out

    @torch.no_grad()
    def features(self, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux states concatenated in layer order: B, T, n_aux*H; the target's greedy token at each position)."""
        self._kept.clear()
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        return torch.cat([self._kept[i] for i in self.aux_ids], dim=-1), logits.argmax(-1)

    def examples(self, examples: list[list[int]], batch: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """(ids, aux states: T, n_aux*H in the target's dtype, greedy tokens: T) of every example, computed once."""
        out = []
        for s in range(0, len(examples), batch):
            group = examples[s : s + batch]
            feats, greedy = self.features(*_pad(group))
            out += [(seq, feats[r, : len(seq)].clone(), greedy[r, : len(seq)].clone()) for r, seq in enumerate(group)]
        return out


def encode_examples(job: dict, tokenizer, target: Target | None = None, key: str = "examples") -> list[list[int]]:
    """Token ids per example, at most ``seq``: the prompt as vLLM tokenizes a completion prompt, then the answer.

    With ``answers: target`` the answer is the target's own greedy continuation in token space, as long as the
    captured one: exactly the tokens a greedy request is served (decoded text does not always tokenize back
    to the tokens that made it, e.g. a byte-level token cut in the middle of a character), and what EAGLE
    training recipes do (they regenerate the answers with the target). ``answers: captured`` tokenizes the
    captured text. Cached in ``tokens.json`` for a resumed run."""
    cache = Path(job[key]).with_name(Path(job[key]).stem + ".tokens.json")
    if cache.exists():
        saved = json.loads(cache.read_text(encoding="utf-8"))
        if saved.get("job") == job["id"]:
            return saved["ids"]
    pairs = []
    with open(job[key], encoding="utf-8") as fh:
        for line in fh:
            ex = json.loads(line)
            prompt = tokenizer(ex["prompt"])["input_ids"][: job["seq"] - 1]
            answer = tokenizer(ex["output"], add_special_tokens=False)["input_ids"]
            pairs.append((prompt, answer[: job["seq"] - len(prompt)]))
    if job.get("answers", "target") == "target" and target is not None:
        pairs = target.regenerate(pairs, job["batch"])
    out = [p + a for p, a in pairs if len(p) + len(a) >= 3]  # step 0 needs a token after the next one
    cache.write_text(json.dumps({"job": job["id"], "ids": out}), encoding="utf-8")
    return out


def _pad(group: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids in group)
    ids = torch.zeros((len(group), T), dtype=torch.long)
    attn = torch.zeros((len(group), T), dtype=torch.long)
    for r, seq in enumerate(group):
        ids[r, : len(seq)] = torch.tensor(seq)
        attn[r, : len(seq)] = 1
    return ids, attn


def draft_vocab_size(counts: Counter, vocab: int, asked: int | None, coverage: float) -> int:
    """``asked`` when given; else the fewest ids (a multiple of 64, at most 32000: EAGLE-3's published size)
    that cover ``coverage`` of the captured occurrences; the whole vocabulary when that is not smaller."""
    if asked:
        return min(asked, vocab)
    total, need, n = sum(counts.values()), 0, 0
    for _, c in counts.most_common():
        if need >= coverage * total:
            break
        need += c
        n += 1
    n = min(32000, -(-max(n, 1) // 64) * 64)
    return vocab if n >= vocab else n


def vocab_maps(counts: Counter, vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft→target ids, d2t offsets, t2d mask): the most frequent ids (ties by id, then unseen ids), sorted."""
    seen = sorted(counts, key=lambda i: (-counts[i], i))[:draft_vocab]
    rest = [i for i in range(vocab) if i not in set(seen)][: draft_vocab - len(seen)]
    ids = torch.tensor(sorted(seen + rest), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(len(ids)), t2d


# ------------------------------------------------------------------------------------------- the head


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (Llama in vLLM and HF): halves rotate; x: B, T, heads, D; pos: T."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[None, :, None, :]
    sin = torch.cat((ang.sin(), ang.sin()), -1)[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Eagle3Head(torch.nn.Module):
    """vLLM's Eagle3LlamaForCausalLM (one layer), parameters named as the speculators checkpoint names them."""

    def __init__(self, cfg: dict, n_aux: int, target_hidden: int, draft_vocab: int):
        super().__init__()
        H, FF = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or H // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
        lin = torch.nn.Linear
        self.fc = lin(n_aux * target_hidden, H, bias=False)
        self.q_proj = lin(2 * H, self.heads * self.hd, bias=False)
        self.k_proj = lin(2 * H, self.kv * self.hd, bias=False)
        self.v_proj = lin(2 * H, self.kv * self.hd, bias=False)
        self.o_proj = lin(self.heads * self.hd, H, bias=False)
        self.gate_proj = lin(H, FF, bias=False)
        self.up_proj = lin(H, FF, bias=False)
        self.down_proj = lin(FF, H, bias=False)
        self.lm_head = lin(H, draft_vocab, bias=False)
        ones = lambda: torch.nn.Parameter(torch.ones(H))  # noqa: E731
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm = (
            ones(),
            ones(),
            ones(),
            ones(),
        )

    def _qkv(self, emb, h, pos):
        B, T, _ = emb.shape
        z = torch.cat((_rms(emb, self.input_layernorm, self.eps), _rms(h, self.hidden_norm, self.eps)), -1)
        q = _rope(self.q_proj(z).view(B, T, self.heads, self.hd), pos, self.theta)
        k = _rope(self.k_proj(z).view(B, T, self.kv, self.hd), pos, self.theta)
        v = self.v_proj(z).view(B, T, self.kv, self.hd)
        rep = self.heads // self.kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # B, heads, T, D

    def step(self, emb, h, k_step: int, cache: list):
        """One draft step over every position: (logits over the draft vocabulary, pre-norm output).

        ``cache`` holds (K, V) of the earlier steps: step 0's are attended causally, later steps' only at
        the same position (the chain of the same start position)."""
        B, T, _ = emb.shape
        q, k, v = self._qkv(emb, h, torch.arange(T) + k_step)
        scale = 1.0 / math.sqrt(self.hd)
        if not cache:
            mask = torch.full((T, T), float("-inf")).triu(1)
            att = (q @ k.transpose(-1, -2)) * scale + mask
            o = att.softmax(-1) @ v
        else:
            k0, v0 = cache[0]
            mask = torch.full((T, T), float("-inf")).triu(1)
            s0 = (q @ k0.transpose(-1, -2)) * scale + mask
            diag_k = [kk for kk, _ in cache[1:]] + [k]
            diag_v = [vv for _, vv in cache[1:]] + [v]
            sd = torch.stack([(q * kk).sum(-1) * scale for kk in diag_k], -1)  # B, heads, T, steps
            p = torch.cat((s0, sd), -1).softmax(-1)
            o = p[..., :T] @ v0 + (p[..., T:, None] * torch.stack(diag_v, -2)).sum(-2)
        cache.append((k, v))
        o = o.transpose(1, 2).reshape(B, T, -1)
        r = self.o_proj(o) + h
        x = _rms(r, self.post_attention_layernorm, self.eps)
        r = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + r
        return self.lm_head(_rms(r, self.norm, self.eps)), r

    def tensors(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
        """The checkpoint's tensors, named as vLLM's loader and speculators read them (layers.0.*)."""
        p = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        out = {"fc.weight": p["fc.weight"], "norm.weight": p["norm"], "lm_head.weight": p["lm_head.weight"]}
        for n in ("q", "k", "v", "o"):
            out[f"layers.0.self_attn.{n}_proj.weight"] = p[f"{n}_proj.weight"]
        for n in ("gate", "up", "down"):
            out[f"layers.0.mlp.{n}_proj.weight"] = p[f"{n}_proj.weight"]
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"layers.0.{n}.weight"] = p[n]
        if len(d2t) < len(t2d):  # a full draft vocabulary has no maps (vLLM then has no d2t to load)
            out["d2t"], out["t2d"] = d2t.contiguous(), t2d.contiguous()
        return out


# ------------------------------------------------------------------------------------------- training


def _loss(head, embed, group, d_of_t, job, stats=None) -> torch.Tensor:
    """The TTT loss of one batch of :meth:`Target.examples`: cross-entropy against the target's greedy token at
    each draft step."""
    ids, attn = _pad([seq for seq, _, _ in group])
    B, T = ids.shape
    feats = torch.zeros((B, T, group[0][1].shape[-1]))
    greedy = torch.zeros((B, T), dtype=torch.long)
    for r, (seq, f, g) in enumerate(group):
        feats[r, : len(seq)], greedy[r, : len(seq)] = f, g
    lengths = attn.sum(1)
    h = head.fc(feats)
    cache: list = []
    total, weights = torch.zeros(()), 0.0
    tpos = torch.arange(T)
    for k in range(job["ttt_steps"]):
        src = (tpos + 1 + k).clamp(max=T - 1)
        valid = (tpos[None, :] + 1 + k) <= (lengths[:, None] - 1)
        if not valid.any():
            break
        emb = embed(ids[:, src]).float()
        logits, h = head.step(emb, h, k, cache)
        label = d_of_t[greedy[:, src]]  # -1: the target's choice is outside the draft vocabulary
        label = torch.where(valid & (label >= 0), label, torch.full_like(label, -100))
        if (label != -100).any():
            step_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1), ignore_index=-100)
            total = total + job["ttt_decay"] ** k * step_loss
            weights += job["ttt_decay"] ** k
        if stats is not None:
            hit = (logits.argmax(-1) == label) & valid
            stats.setdefault(k, [0, 0])
            stats[k][0] += int(hit.sum())
            stats[k][1] += int(valid.sum())
    return total / max(weights, 1e-9)  # a weighted mean: comparable across ttt_steps


def _mean(head, embed, examples, d_of_t, job) -> tuple[float, list[float]]:
    """Mean loss and greedy agreement per draft step over ``examples`` (no gradient)."""
    stats: dict = {}
    total = 0.0
    with torch.no_grad():
        for s in range(0, len(examples), job["batch"]):
            g = examples[s : s + job["batch"]]
            total += float(_loss(head, embed, g, d_of_t, job, stats)) * len(g)
    return total / len(examples), [round(hit / max(1, n), 4) for _, (hit, n) in sorted(stats.items())]


def _write_head(folder: Path, config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file

    final = folder / "head"
    tmp = folder / "head.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(dict(sorted(tensors.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def run(job_path: Path) -> int:
    from transformers import AutoTokenizer

    os.umask(0o077)  # the checkpoint and the head hold what was learned from captured traffic
    job = json.loads(job_path.read_text(encoding="utf-8"))
    folder = job_path.parent
    torch.manual_seed(job["seed"])
    # the cores this process may run on (`taskset`), not the machine's: two threads on one core only contend for it
    torch.set_num_threads(max(1, int(job.get("threads") or len(os.sched_getaffinity(0)))))
    tokenizer = AutoTokenizer.from_pretrained(job["target"])
    target = Target(job["target"], job["aux_layer_ids"])
    examples = encode_examples(job, tokenizer, target)
    if not examples:
        _say(error="no example is long enough to learn from (3 tokens at least)")
        return 2
    t_features = time.monotonic()
    examples = target.examples(examples, job["batch"])
    heldout = encode_examples(job, tokenizer, target, "heldout") if job.get("heldout") else []
    heldout = target.examples(heldout, job["batch"])
    features_s = round(time.monotonic() - t_features, 1)
    embed = target.model.get_input_embeddings()
    config = job["config"]
    layer = config["transformer_layer_config"]
    vocab = layer["vocab_size"]
    counts: Counter = Counter()
    for seq, _, greedy in examples:
        counts.update(seq)
        counts.update(greedy.tolist())
    dv = draft_vocab_size(counts, vocab, job["draft_vocab"], job["coverage"])
    draft_ids, d2t, t2d = vocab_maps(counts, vocab, dv)
    d_of_t = torch.full((vocab,), -1, dtype=torch.long)
    d_of_t[draft_ids] = torch.arange(dv)
    head = Eagle3Head(layer, len(target.aux_ids), config["target_hidden_size"], dv)
    with torch.no_grad():
        for mod in head.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=0.02)
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[draft_ids])
    opt = torch.optim.AdamW(head.parameters(), lr=job["lr"], weight_decay=0.0)
    ckpt = folder / "checkpoint.pt"
    step, first, rng_state = 0, None, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state.get("job") == job["id"]:
            head.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step, first, rng_state = state["step"], state["first"], state["rng"]
            _say(resumed=step)
    if first is None:
        first = _mean(head, embed, examples, d_of_t, job)
        if heldout:
            first = (*first, _mean(head, embed, heldout, d_of_t, job)[1])
        _say(step=0, of=job["steps"], loss=round(first[0], 4))
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
            loss = _loss(head, embed, [examples[j] for j in order[s : s + job["batch"]]], d_of_t, job)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            losses.append(float(loss.detach()))
            per = (time.monotonic() - t0) / (step - at_start)
            if step % max(1, steps // 50) == 0 or step == steps:
                recent = sum(losses[-20:]) / len(losses[-20:])
                _say(step=step, of=steps, loss=round(recent, 4), eta_s=round(per * (steps - step), 1))
            if step % job["checkpoint_every"] == 0 or step == steps:
                state = {
                    "job": job["id"],
                    "model": head.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "first": first,
                    "rng": rng.bit_generator.state,
                }
                torch.save(state, folder / "checkpoint.pt.tmp")
                os.replace(folder / "checkpoint.pt.tmp", ckpt)
    last = _mean(head, embed, examples, d_of_t, job)
    if heldout:
        last = (*last, _mean(head, embed, heldout, d_of_t, job)[1])
    config = {**config, "draft_vocab_size": dv}
    path = _write_head(folder, config, head.tensors(d2t, t2d))
    result = {
        "steps": step,
        "examples": len(examples),
        "first_loss": first[0],
        "last_loss": last[0],
        "first_agreement": first[1],
        "last_agreement": last[1],
        "heldout_examples": len(heldout),
        "heldout_first_agreement": first[2] if len(first) > 2 else None,
        "heldout_last_agreement": last[2] if len(last) > 2 else None,
        "draft_vocab_size": dv,
        "draft_vocab_coverage": round(sum(counts[i] for i in draft_ids.tolist()) / max(1, sum(counts.values())), 4),
        "head": str(path),
        "seconds": round(time.monotonic() - t0, 1),
        "features_seconds": features_s,  # the target's one pass over the examples, before the steps
    }
    (folder / "result.json").write_text(json.dumps(result), encoding="utf-8")
    _say(done=True, **result)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
