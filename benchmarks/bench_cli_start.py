"""Cold start of the control plane: ``specops render`` and ``specops validate``, one new process each run.

Compares two source trees side by side (e.g. a ``git worktree add /tmp/base <commit>`` copy of an older commit
and the current tree), each imported through ``PYTHONPATH`` with the tree as the working directory, with the same
interpreter. Reports medians of wall time and of CPU time (user+sys of the child): on a shared machine the CPU
time is the steadier of the two. Byte-code is written and used in both trees (a fresh worktree has none).

    .venv/bin/python benchmarks/bench_cli_start.py --tree base=/tmp/base --tree now=. --runs 15 --json out.json

``--json`` also writes every sample, the medians, each tree's commit (and whether it had uncommitted changes),
the machine and its load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _harness import commit_of

ROOT = Path(__file__).resolve().parent.parent
PROFILE = "examples/vllm-cpu-ngram.yaml"


def run_once(tree: Path, argv: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one cold ``python -m specops.cli ARGV`` in TREE."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    # Byte-code is written (the warm-up compiles every tree alike, as an install does): with
    # PYTHONDONTWRITEBYTECODE set, a fresh worktree would compile its sources in every run and lose for that alone.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "specops.cli", *argv],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: specops {' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-400:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (repeatable)")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--backend-version", default="0.32.0", help="render for this version (no engine probe)")
    parser.add_argument("--json", help="also write the samples and medians here")
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, _, path in (t.partition("=") for t in args.tree)]
    commands = {
        "render": ["render", args.profile, "--backend-version", args.backend_version],
        "validate": ["validate", args.profile],
    }
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    load_before = os.getloadavg()
    for _name, tree in trees:  # one warm-up each: byte-code compiled, files in the page cache
        for argv in commands.values():
            run_once(tree, argv)
    for _ in range(args.runs):  # interleaved, so a load change hits every tree alike
        for name, tree in trees:
            for command, argv in commands.items():
                samples.setdefault((name, command), []).append(run_once(tree, argv))
    load_after = os.getloadavg()
    print(f"{'tree':<8} {'command':<9} {'median wall s':>14} {'median cpu s':>13}  (runs={args.runs})")
    rows = []
    for (name, command), values in samples.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        print(f"{name:<8} {command:<9} {wall:>14.3f} {cpu:>13.3f}")
        rows.append(
            {
                "tree": name,
                "command": command,
                "median_wall_s": round(wall, 4),
                "median_cpu_s": round(cpu, 4),
                "samples_wall_cpu_s": [[round(w, 4), round(c, 4)] for w, c in values],
            }
        )
    if args.json:
        sys.path.insert(0, str(ROOT))
        from specops.perf.bench import machine

        report = {
            "machine": machine(),
            "args": vars(args),
            "trees": {name: {"path": str(tree), **commit_of(tree)} for name, tree in trees},
            "load_average": [load_before, load_after],
            "results": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
