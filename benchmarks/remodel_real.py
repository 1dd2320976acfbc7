"""The model column of a committed ``specops bench`` JSON, recomputed with a verification-cost record probed since
(``specops bench PROFILE --probe-verify --json``): the cells are the measurements and stay as they are; only the
prediction beside each changes, so the model's error is read against the same measured speedups.

    .venv/bin/python benchmarks/remodel_real.py BENCH.json PROBE.json -o NEW.json

Prints each cell's measured speedup, the prediction before and after, and the after's error. The draft cost c is
the probed one (0 for prompt lookup, whose lookup is inside the timed steps; a draft model's step over the
target's) unless ``--draft-cost`` gives it; the bench's own recorded c (the old default 0.05) is dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specops.perf.bench_report import summarize

#: The keys summarize computes from the cells (everything else in a report is what the bench measured with).
COMPUTED = ("model_basis", "speedup", "by_concurrency", "by_set", "overall", "flagged_cells", "errors")


def remodel(report: dict, record: dict, draft_cost: float | None = None) -> dict:
    """``report`` summarized again with ``record`` as its verification cost and ``draft_cost`` as c (None:
    measured)."""
    meta = {k: v for k, v in report.items() if k not in COMPUTED and k != "cells"}
    meta["settings"] = {**meta.get("settings", {}), "draft_cost_ratio": draft_cost}
    meta["verify_cost"] = {**record, "probed": False}
    meta["remodelled_from"] = {"model_basis": report.get("model_basis"), "verify_cost": _when(report)}
    return summarize(report["cells"], meta)


def _when(report: dict) -> str | None:
    vc = report.get("verify_cost") or {}
    return vc.get("date") or vc.get("error")


def table(old: dict, new: dict) -> str:
    lines = ["set          c   measured   model before   model after   error after"]
    for a, b in zip(old["speedup"], new["speedup"]):
        m, p = b["speedup"], b["model_speedup"]
        err = f"{(p / m - 1) * 100:+.0f} %" if m and p else "–"
        before = f"{a['model_speedup']:.2f}x" if a.get("model_speedup") else "–"
        after = f"{p:.2f}x" if p else "–"
        lines.append(f"{b['set']:<12} {b['concurrency']:>1}   {m:7.2f}x   {before:>12}   {after:>11}   {err:>11}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, help="a specops bench --json results file")
    ap.add_argument("probe", type=Path, help="a specops bench --probe-verify --json record")
    ap.add_argument("-o", "--out", type=Path, required=True, help="where the recomputed report goes")
    ap.add_argument("--draft-cost", type=float, help="c instead of the probed one")
    args = ap.parse_args(argv)
    try:
        old = json.loads(args.bench.read_text(encoding="utf-8"))
        record = json.loads(args.probe.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"remodel_real: {exc}", file=sys.stderr)
        return 2
    new = remodel(old, record, args.draft_cost)
    args.out.write_text(json.dumps(new, indent=2) + "\n", encoding="utf-8")
    sys.stdout.write(table(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
