"""Two drafts of one target compared request by request: both engines up, each prompt sent to one and then the other.

`ab_drafts.py` alternates whole benches, 16 minutes apart; on 2 cores with nothing else running the target alone
drifted 17 % between benches, more than a fine-tuned draft's gain. Here both profiles' engines are up at once (one
serving while the other idles), every held-out prompt goes to A and to B seconds apart at one client, greedy, the
order alternating from prompt to prompt and round to round, and what is compared is each pair of requests: the same
prompt, the same answer (greedy speculation is lossless, so both produce the same tokens), the same minute.

    SPECOPS_PROFILE_ROOT=benchmarks/real .venv/bin/python benchmarks/real/ab_interleaved.py A.yaml B.yaml \\
        -p PROMPTS --rounds 1 --max-tokens 64 --swap -o OUT.json

What is left is the launch: on 2 cores one profile's engine served the same 12 requests at 4.06 to 4.72 tok/s over
four launches, while the other's, up beside it each time, stayed within 4.30 to 4.41 (the committed runs of
benchmarks/RESULTS.md). ``--swap`` runs the comparison twice, launching A first and then B first, and the summary's
``b_over_a`` is the geometric mean of the two launches' medians: a launch-order effect cancels, a launch's own luck
halves in weight.

OUT.json holds every request (tokens, seconds, drafted and accepted tokens from the engine's counters read before
and after it) and the summary: each side's tokens/s (its tokens over its seconds) and acceptance; each pair's B/A
ratio of tokens/s, their median, a bootstrap 90 % interval of that median, and how many pairs B won. It is
rewritten after every round, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path
from statistics import median

from specops.adapt.promote import heldout_prompts
from specops.config.profile import load_profile
from specops.perf.launch import launched
from specops.perf.workload import Prompt, run_workload
from specops.plugins import get_registry


def order(round_index: int, prompt_index: int) -> tuple[str, str]:
    """Which side goes first: alternating along the prompts, and shifted by one each round."""
    return ("A", "B") if (round_index + prompt_index) % 2 == 0 else ("B", "A")


async def one(eng, prompt: Prompt) -> dict:
    """One request at one client, with the engine's draft counters read before and after it."""
    before = await eng.settled_counters()
    res = await run_workload(eng.base_url, eng.model_name, [prompt], concurrency=1, api_key=eng.api_key)
    stats = await eng.acceptance_since(before)
    req = res.requests[0]
    return {
        "ok": req.ok and req.output_tokens > 0,
        "error": req.error,
        "tokens": req.output_tokens,
        "seconds": req.latency,
        "ttft": req.ttft,
        "drafted": stats.draft_tokens,
        "accepted": stats.accepted,
        "drafts": stats.drafts,
        "acceptance": stats.acceptance,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def rate(request: dict) -> float:
    """One request's tokens per second."""
    return request["tokens"] / request["seconds"]


def summarize(rows: list[dict], seed: int = 39) -> dict:
    """Each side's totals, and the pairs' B/A ratios of tokens/s (median, bootstrap 90 % interval, B's wins)."""
    sides = {}
    for side in ("A", "B"):
        mine = [r[side] for r in rows if r[side]["ok"]]
        drafted = sum(r["drafted"] or 0 for r in mine)
        accepted = sum(r["accepted"] or 0 for r in mine)
        drafts = sum(r["drafts"] or 0 for r in mine)
        sides[side] = {
            "requests": len(mine),
            "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine) if mine else None,
            "median_request_tokens_per_s": median(map(rate, mine)) if mine else None,
            "acceptance": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "drafted": drafted,
            "accepted": accepted,
            "median_ttft_s": median(r["ttft"] for r in mine if r["ttft"] is not None) if mine else None,
        }
    pairs = [r for r in rows if r["A"]["ok"] and r["B"]["ok"]]
    ratios = [rate(r["B"]) / rate(r["A"]) for r in pairs]
    out = {
        "sides": sides,
        "pairs": len(ratios),
        "same_tokens": sum(r["A"]["tokens"] == r["B"]["tokens"] for r in pairs),
    }
    if ratios:
        rng = random.Random(seed)
        boot = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        out |= {
            "b_over_a_median": median(ratios),
            "b_over_a_interval_90": [boot[100], boot[1899]],
            "b_wins": sum(x > 1 for x in ratios),
            "b_over_a_totals": sides["B"]["tokens_per_s"] / sides["A"]["tokens_per_s"],
        }
    return out


async def compare(args) -> dict:
    registry = get_registry()
    loaded = {side: load_profile(p) for side, p in (("A", args.a), ("B", args.b))}
    prompts = heldout_prompts(args.prompts, args.max_tokens, args.limit)
    report = {"a": str(args.a), "b": str(args.b), "prompts": str(args.prompts), "rounds": args.rounds, "halves": []}
    for launch in (("A", "B"), ("B", "A"))[: 2 if args.swap else 1]:
        half = {"launched_first": launch[0], "rows": []}
        report["halves"].append(half)
        async with launched(loaded[launch[0]], registry) as first, launched(loaded[launch[1]], registry) as second:
            engines = {launch[0]: first, launch[1]: second}
            for eng in engines.values():  # warm-up, not counted
                await run_workload(eng.base_url, eng.model_name, prompts[:2], concurrency=1, api_key=eng.api_key)
            for r in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    row = {"round": r, "prompt": i, "first": order(r, i)[0]}
                    for side in order(r, i):
                        row[side] = await one(engines[side], prompt)
                    half["rows"].append(row)
                    print(f"{launch[0]} launched first, round {r} prompt {i}: {said(row)}", file=sys.stderr, flush=True)
                half["summary"] = summarize(half["rows"])
                report["summary"] = combined(report["halves"])
                args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def said(row: dict) -> str:
    a, b = row["A"], row["B"]
    if a["ok"] and b["ok"]:
        return f"B/A {rate(b) / rate(a):.3f}"
    return f"failed: A {a['error']}, B {b['error']}"


def combined(halves: list[dict]) -> dict:
    """Both launch orders: every request's totals, and B/A as the geometric mean of each order's median."""
    out = summarize([row for h in halves for row in h["rows"]])
    medians = [h["summary"].get("b_over_a_median") for h in halves if "summary" in h]
    if medians and None not in medians:
        out["b_over_a_per_launch_order"] = {h["launched_first"] + " first": m for h, m in zip(halves, medians)}
        out["b_over_a"] = math.prod(medians) ** (1 / len(medians))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="profile A (e.g. the draft in service)")
    ap.add_argument("b", type=Path, help="profile B (e.g. the fine-tuned draft)")
    ap.add_argument("-p", "--prompts", type=Path, required=True, help="JSON Lines of prompts (bench's format)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts (default 3)")
    ap.add_argument("--limit", type=int, default=1_000_000, help="the first N prompts only")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--swap", action="store_true", help="measure again with B's engine launched first")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the JSON written after every round")
    args = ap.parse_args(argv)
    report = asyncio.run(compare(args))
    json.dump(report["summary"], sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
