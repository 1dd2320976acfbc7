"""The drift scenario of `specops adapt` on llama-server (CPU): a draft trained on traffic A serves traffic B.

    .venv/bin/python benchmarks/bench_adapt_drift.py --work /tmp/adapt-drift --json benchmarks/results-llamacpp-adapt-drift.json

1. A target whose greedy answers are learnable but not given away: a layer-skip-style llama GGUF (random
   weights, generated here) whose deeper layers are *not* zero but scaled by ``--alpha``, and whose output
   head is its embeddings shifted along a random cycle per token family (``--tie``): its first layer alone
   continues a token with the next one in its family's cycle (word prompts get word answers, letter prompts
   letter answers), and the deeper layers change that choice depending on the context. The first layer
   alone (the "layer-skip" draft) agrees with the target only part of the time.
2. Traffic A (function words) is captured through a real `specops up` with `capture:` on; `specops adapt
   train` makes draft_A (from the target's first layer, the default init).
3. Traffic B (single letters) is served with draft_A (acceptance falls), captured the same way,
   and `specops adapt train` makes draft_B; `specops adapt promote` (lossless check, then acceptance against
   draft_A on B's held-out capture) writes it into the profile.
4. On held-out prompts of each distribution (never captured), each draft serves at one client, greedy:
   acceptance, mean acceptance length, tokens/s, with the target alone (speculation off) for tokens/s.

Every stage's result is kept in ``--work`` and reused when the script runs again (``--fresh`` starts over),
so an interrupted run resumes. The engine and the training share the machine: run it alone.

A drift the draft genuinely lacks (``--first 0 --alpha 0 --init scratch``): with every layer's outputs at zero
the target's greedy answer is the current token's successor in its family's cycle, whatever the context, so A's
answers never reach B's letters. The layer-skip draft is then exact (the upper reference), and drafts trained
from random weights (``specops adapt train --init scratch``, the small distilled draft's case) learn only the
cycle of the traffic they saw: draft_A knows A's words, not B's letters. (With the first layer left on, its
attention sends some word prompts' answers into the letters' cycle, and a draft trained on A learns B too.)

    .venv/bin/python benchmarks/bench_adapt_drift.py --work /tmp/adapt-drift-scratch --first 0 --alpha 0 \\
        --layers 16 --init scratch --lr 3e-3 --steps 60 --json benchmarks/results-llamacpp-adapt-drift-scratch.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _adapt import measure_runs, stage, work_folder  # noqa: E402
from _harness import Up  # noqa: E402

#: Traffic A: function words; traffic B: single letters (each one token of the shared vocabulary).
A_WORDS = "the and of to in is it that for on with as was at by this be from or are".split()
B_LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def prompts_of(kind: str, n: int, seed: int, a_words: list[str] | None = None) -> list[str]:
    rng = random.Random(f"{kind}-{seed}")
    pool = (a_words or A_WORDS) if kind == "A" else B_LETTERS
    return [" ".join(rng.choice(pool) for _ in range(rng.randint(4, 9))) for _ in range(n)]


# ------------------------------------------------------------------------------------------- the models


def make_models(
    folder: Path, hidden: int, layers: int, ffn: int, heads: int, alpha: float, tie: float, first: float = 1.0
) -> dict:
    """target.gguf, layerskip.gguf (its first layer) and random.gguf (one random layer) in ``folder``."""
    from specops.adapt.train import scratch_tensors
    from specops.devenv.testmodels.gguf_models import Dims, build_vocab, write_gguf

    done = folder / "models.json"
    want = {"hidden": hidden, "layers": layers, "ffn": ffn, "heads": heads, "alpha": alpha, "tie": tie}
    want |= {"first": first} if first != 1.0 else {}
    if done.exists() and json.loads(done.read_text()) == want:
        return want
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab()
    n_vocab = len(vocab[0])
    rng = np.random.default_rng(4321)

    def w(*shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    E, FF = hidden, ffn
    emb = w(n_vocab, E, std=1.0)
    # the head scores token j by how like the embedding of its predecessor the last state is: the first layer
    # alone continues a token with its successor in a random cycle of its own family (A's words, B's letters)
    succ = np.arange(n_vocab)
    index = {tok: i for i, tok in enumerate(vocab[0])}
    families = [[index["\u2581" + x] for x in A_WORDS], [index["\u2581" + x] for x in B_LETTERS]]
    rest = sorted(set(range(n_vocab)) - {i for f in families for i in f})
    for fam in [*families, rest]:
        order = rng.permutation(fam)
        succ[order] = np.roll(order, -1)
    pred = np.empty_like(succ)
    pred[succ] = np.arange(n_vocab)
    head = tie * emb[pred] / np.sqrt(E) + w(n_vocab, E, std=0.1)
    head[rest] *= 0.2  # byte and other pieces seldom win: the answers stay text (a capture keeps text)
    t = {
        "token_embd.weight": emb,
        "output_norm.weight": np.ones(E, np.float32),
        "output.weight": head.astype(np.float32),
    }
    for i in range(layers):
        p, scale = f"blk.{i}.", first if i == 0 else alpha
        t[p + "attn_norm.weight"] = np.ones(E, np.float32)
        t[p + "ffn_norm.weight"] = np.ones(E, np.float32)
        for name in ("attn_q", "attn_k", "attn_v"):
            t[p + name + ".weight"] = w(E, E, std=1 / np.sqrt(E))
        t[p + "attn_output.weight"] = w(E, E, std=scale / np.sqrt(E))
        t[p + "ffn_gate.weight"] = w(FF, E, std=1 / np.sqrt(E))
        t[p + "ffn_up.weight"] = w(FF, E, std=1 / np.sqrt(E))
        t[p + "ffn_down.weight"] = w(E, FF, std=scale / np.sqrt(FF))
    write_gguf(folder / "target.gguf", t, Dims(hidden=E, layers=layers, heads=heads, ffn=FF), "drift-target", vocab)
    first = {k: v for k, v in t.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    one = Dims(hidden=E, layers=1, heads=heads, ffn=FF)
    write_gguf(folder / "layerskip.gguf", first, one, "drift-layerskip", vocab)
    dims = {"hidden": E, "ffn": FF, "heads": heads, "heads_kv": heads}
    write_gguf(folder / "random.gguf", scratch_tensors(dims, n_vocab, 1, 7), one, "drift-random", vocab)
    done.write_text(json.dumps(want))
    return want


def write_profile(path: Path, target: Path, draft: Path, capture: Path, port: int) -> None:
    path.write_text(
        "\n".join(
            [
                "name: adapt-drift",
                "backend: llamacpp",
                "model:",
                f"  id: {target}",
                "  max_model_len: 1024",
                "speculative:",
                "  method: draft_model",
                f"  draft: {draft}",
                "  num_speculative_tokens: 4",
                "gpus:",
                "  devices: []",
                "server:",
                "  host: 127.0.0.1",
                f"  port: {port}",
                "  parallel: 1",
                '  extra_args: ["-t", "1", "-td", "1"]',
                "capture:",
                "  enabled: true",
                f"  path: {capture}",
                "  sample: 1.0",
                "fallback:",
                "  enabled: false",
            ]
        )
        + "\n",
        encoding="utf-8",
    )


# ------------------------------------------------------------------------------------------- the stages


def capture(profile: Path, state: Path, prompts: list[str], max_tokens: int) -> dict:
    """The prompts through a real `specops up` (its proxy keeps them: `capture:`); the acceptance it saw."""
    import urllib.request

    from specops.config.profile import load_profile

    port = load_profile(profile).profile.server.port
    up = Up(profile, state, "adapt-drift")
    t0 = time.monotonic()
    try:
        up.wait_ready(timeout=300)
        for text in prompts:
            body = json.dumps({"prompt": text, "max_tokens": max_tokens, "temperature": 0}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                json.loads(r.read())
        time.sleep(0.5)  # the capture is written on a later loop turn
    finally:
        up.stop()
    return {"requests": len(prompts), "seconds": round(time.monotonic() - t0, 1)}


def train(profile: Path, folder: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "specops.cli", "adapt", "train", str(profile), "--from", str(folder)]
    cmd += ["--out", str(out), "--steps", str(args.steps), "--lr", str(args.lr), "--batch", "8", "--json"]
    cmd += ["--init", args.init]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"adapt train failed: {res.stderr[-2000:]}")
    return {"wall_seconds": round(time.monotonic() - t0, 1), **json.loads(res.stdout)}


def promote(profile: Path, draft: Path, args) -> dict:
    cmd = [sys.executable, "-m", "specops.cli", "adapt", "promote", str(profile), str(draft), "--json"]
    cmd += ["--max-tokens", str(args.tokens), "--limit", str(args.eval)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    try:
        return {"exit": res.returncode, **json.loads(res.stdout)}
    except ValueError:
        return {"exit": res.returncode, "error": res.stderr[-2000:]}


def evaluate(profile: Path, drafts: dict[str, Path], sets: dict[str, list[str]], tokens: int, runs: int) -> dict:
    """Each draft on each held-out set, and the target alone, on the real engine: one launch each, a warm-up,
    then the prompts ``runs`` times at one client (tokens/s median; acceptance over all runs)."""
    from specops.config.profile import load_profile
    from specops.perf.workload import Prompt

    loaded = load_profile(profile)
    out: dict = {}
    for set_name, texts in sets.items():
        prompts = [Prompt(t, max_tokens=tokens, temperature=0.0, set=set_name) for t in texts]
        row = {}
        for name, path in {"target alone": None, **drafts}.items():
            row[name] = asyncio.run(measure_runs(loaded, None if path is None else str(path), prompts, runs))
            print(f"  {set_name} {name}: {row[name]}", flush=True)
        out[set_name] = row
    return out


def overlap(cap_a: Path, cap_b: Path) -> dict:
    """How many of B's captured answer words A's captured answers show (0: draft_A never saw B's continuations)."""

    def words(folder: Path) -> set[str]:
        lines = (json.loads(x) for f in sorted(folder.glob("*.jsonl")) for x in f.read_text().splitlines() if x)
        return {w for rec in lines for w in rec.get("output", "").split()}

    a, b = words(cap_a), words(cap_b)
    return {"A_answer_words": len(a), "B_answer_words": len(b), "B_words_in_A": len(a & b)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/specops-adapt-drift"))
    ap.add_argument("--json", type=Path, help="Write the results here too.")
    ap.add_argument("--fresh", action="store_true", help="Forget the stages of an earlier run.")
    ap.add_argument("--capture", type=int, default=80, help="Prompts captured per distribution.")
    ap.add_argument("--eval", type=int, default=12, help="Held-out prompts measured per distribution.")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of every request.")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1.0, help="Scale of the deeper layers' outputs (0: layer-skip).")
    ap.add_argument("--tie", type=float, default=1.0, help="How much the output head is the embedding.")
    ap.add_argument(
        "--first",
        type=float,
        default=1.0,
        help="Scale of the first layer's outputs (0 with --alpha 0: the next token is the current one's successor "
        "in its family's cycle, whatever the context, so a family's answers never leave its cycle).",
    )
    ap.add_argument(
        "--init",
        choices=["auto", "target", "scratch"],
        default="auto",
        help="Where `specops adapt train` starts draft_A and draft_B (scratch: random weights, knowing no cycle).",
    )
    ap.add_argument(
        "--a-words",
        type=lambda text: text.split(),
        help="The words A's prompts are drawn from (default: all of A's family). llama.cpp splits some of them "
        "into pieces that start with one of B's letters, so A's traffic then reaches B's cycle.",
    )
    ap.add_argument("--runs", type=int, default=3, help="Runs over the held-out prompts per launch (tok/s median).")
    args = ap.parse_args(argv)
    from specops.run.start import free_port

    work = work_folder(args.work, args.fresh)
    models = work / "models"
    spec = make_models(models, args.hidden, args.layers, args.ffn, args.heads, args.alpha, args.tie, args.first)
    target = models / "target.gguf"
    seen = set()
    sets = {}
    for kind, seed in (("A", 1), ("B", 2)):
        cap = [p for p in prompts_of(kind, args.capture, seed, args.a_words) if not (p in seen or seen.add(p))]
        held = [p for p in prompts_of(kind, args.eval * 3, seed + 100, args.a_words) if p not in seen][: args.eval]
        sets[kind] = (cap, held)
    port = free_port()
    profile = work / "profile.yaml"
    results: dict = {"models": spec, "args": {k: str(v) for k, v in vars(args).items()}}

    write_profile(profile, target, models / "random.gguf", work / "capA", port)
    results["capture_A"] = stage(work, "capture-A", lambda: capture(profile, work / "state", sets["A"][0], args.tokens))
    results["train_A"] = stage(work, "train-A", lambda: train(profile, work / "capA", work / "trainA", args))
    draft_a = work / "trainA" / "draft.gguf"

    write_profile(profile, target, draft_a, work / "capB", port)
    results["capture_B"] = stage(work, "capture-B", lambda: capture(profile, work / "state", sets["B"][0], args.tokens))
    results["overlap"] = overlap(work / "capA", work / "capB")
    results["train_B"] = stage(work, "train-B", lambda: train(profile, work / "capB", work / "trainB", args))
    draft_b = work / "trainB" / "draft.gguf"
    results["promote_B"] = stage(work, "promote-B", lambda: promote(profile, draft_b, args))

    drafts = {
        "random": models / "random.gguf",
        "layer-skip": models / "layerskip.gguf",
        "draft_A": draft_a,
        "draft_B": draft_b,
    }
    held = {f"held-out {k}": v[1] for k, v in sets.items()}
    results["evaluate"] = stage(work, "evaluate", lambda: evaluate(profile, drafts, held, args.tokens, args.runs))
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
