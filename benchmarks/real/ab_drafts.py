"""Two drafts of one target benched in alternation, A B B A …, so a shared machine's drift falls on both alike.

One `specops bench` of a profile measures its draft against the target alone, round by round; two such benches an
hour apart drifted 17 % on 2 cores with nothing else running (the target alone ran 2.86–3.35 tok/s), more than
the difference a fine-tuned draft makes. Here each run is a whole `specops bench` (its own rounds, its own
baseline), the runs alternate A B B A (``--pairs`` of them), and what is compared is each run's speedup over the
baseline measured beside it and each neighbouring A–B pair's ratio of tokens/s with speculation:

    .venv/bin/python benchmarks/real/ab_drafts.py A.yaml B.yaml --work DIR -o SUMMARY.json \\
        -- -p PROMPTS -c 1 -n 6 --max-tokens 64 --rounds 3 --no-plots --no-probe

Every run's report stays in DIR (``run-<i>-<A|B>/``, bench's own folder); SUMMARY.json holds each run's figures and the medians.
A run already in DIR is read, not measured again: an interrupted comparison resumes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]


def order(pairs: int) -> list[str]:
    """A B B A A B B A …: each side as often first as second."""
    return [s for i in range(pairs) for s in (("A", "B") if i % 2 == 0 else ("B", "A"))]


def figures(report: dict) -> dict:
    """What a run measured, as bench's headline does (the median over its cells of each cell's median over
    rounds): speedup over its own baseline, tokens/s on each side; acceptance and mean acceptance length over
    the run; how many cells were flagged."""
    rows, o = report["speedup"], report["overall"]
    cells = {k: median(r[k] for r in rows) for k in ("spec_tokens_per_s", "base_tokens_per_s")}
    return {
        "speedup": o["speedup"],
        **cells,
        **{k: o.get(k) for k in ("acceptance", "mean_acceptance_length")},
        "flagged_cells": report.get("flagged_cells") or 0,
    }


def summarize(runs: list[dict]) -> dict:
    """Each side's medians over its runs, and each neighbouring pair's B/A ratio of tokens/s with speculation."""
    sides = {}
    for side in ("A", "B"):
        mine = [r for r in runs if r["side"] == side]
        sides[side] = {
            "profile": mine[0]["profile"],
            "runs": len(mine),
            **{k: median(r[k] for r in mine) for k in ("speedup", "spec_tokens_per_s", "acceptance")},
        }
    pairs = [runs[i : i + 2] for i in range(0, len(runs) - 1, 2)]
    ratios = [
        next(r for r in p if r["side"] == "B")["spec_tokens_per_s"]
        / next(r for r in p if r["side"] == "A")["spec_tokens_per_s"]
        for p in pairs
    ]
    return {
        "sides": sides,
        "b_over_a_spec_tokens_per_s": ratios,
        "b_over_a_median": median(ratios) if ratios else None,
        "b_over_a_speedup": sides["B"]["speedup"] / sides["A"]["speedup"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="profile A (e.g. the draft in service)")
    ap.add_argument("b", type=Path, help="profile B (e.g. the fine-tuned draft)")
    ap.add_argument("--work", type=Path, required=True, help="where each run's report goes (and is resumed from)")
    ap.add_argument("--pairs", type=int, default=2, help="A–B pairs, alternating which goes first (default 2)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the summary JSON")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: what each `specops bench` is given
    args.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, side in enumerate(order(args.pairs)):
        profile = args.a if side == "A" else args.b
        out = args.work / f"run-{i}-{side}"
        if not (out / "results.json").exists():
            cmd = [sys.executable, "-m", "specops.cli", "bench", str(profile), *extra, "--json", "-o", str(out)]
            print(f"ab_drafts: run {i} ({side}): {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
            if done.returncode != 0 or not (out / "results.json").exists():
                print(f"ab_drafts: run {i} failed (exit {done.returncode})", file=sys.stderr)
                return 1
        report = json.loads((out / "results.json").read_text(encoding="utf-8"))
        runs.append({"run": i, "side": side, "profile": str(profile), "report": out.name, **figures(report)})
    summary = {"order": order(args.pairs), "bench_args": extra, "runs": runs, **summarize(runs)}
    args.out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    json.dump({k: summary[k] for k in ("sides", "b_over_a_spec_tokens_per_s", "b_over_a_median")}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
