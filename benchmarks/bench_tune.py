"""Does ``specops tune`` find the best k? Its choice vs an exhaustive sweep, on the layer-skip fixture
(specops.devenv.testmodels).

For each engine (vLLM-CPU, llama-server) one run does, on the same machine and the same fixture:

1. **tune**: the race of ``specops tune`` (``specops.perf.tune.Tuner``, defaults: min 3 / max 7 rounds, 5 % margin,
   pruning on) over the k grid within ``--budget``; it picks k_tune.
2. **exhaustive**: every k of the grid (and ``none``, for the speedup column) launched and measured with the
   same rounds (``--rounds``, no pruning, no budget).

Reported per engine: k_tune, the exhaustive best k*, and tokens/s of k_tune ÷ tokens/s of k* *as measured by
the exhaustive sweep* (both numbers from one measurement, so the ratio is not one noisy run against
another); the goal is ≥ 0.95. Also each sweep's wall time, and the exhaustive table (tokens/s, speedup over
``none``, acceptance, mean acceptance length per k). One greedy client, the built-in ``code`` prompts capped at
``--max-tokens`` with ``ignore_eos`` (fixed lengths), so tokens/s is decode speed.

    .venv/bin/python benchmarks/bench_tune.py                                  # both engines, 768x16
    .venv/bin/python benchmarks/bench_tune.py --engines llamacpp --ks 1,2,3,4,6,8 --budget 3m
    .venv/bin/python benchmarks/bench_tune.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specops.config.durations import parse_duration  # noqa: E402
from specops.config.profile import load_profile  # noqa: E402
from specops.methods import Method  # noqa: E402
from specops.perf.bench import machine  # noqa: E402
from specops.perf.tune import EngineDriver, Setting, TuneConfig, TuneOptions, Tuner, prepare  # noqa: E402
from specops.plugins import get_registry  # noqa: E402


def profile_yaml(engine: str, target: Path, draft: Path, k: int) -> str:
    spec = f"speculative:\n  method: draft_model\n  draft: {draft}\n  num_speculative_tokens: {k}\n"
    if engine == "vllm":
        return (
            f"name: tune-bench-vllm\nbackend: vllm\nmodel:\n  id: {target}\n  dtype: float32\n"
            f'  max_model_len: 1024\n{spec}server:\n  parallel: 1\n  env:\n    VLLM_CPU_KVCACHE_SPACE: "1"\n'
            "engine:\n  ready_timeout: 900\nsupervisor:\n  stop_timeout: 20\n"
        )
    return (
        f"name: tune-bench-llama\nbackend: llamacpp\nmodel:\n  id: {target}\n  max_model_len: 2048\n{spec}"
        "gpus:\n  devices: []\nserver:\n  parallel: 1\nsupervisor:\n  stop_timeout: 10\n"
    )


def say(msg: str) -> None:
    print(f"[bench_tune] {msg}", file=sys.stderr, flush=True)


def events(name: str):
    def on_event(kind, **kw):
        if kind == "done":
            r = kw["result"]
            med = r.median(1)
            say(
                f"{name}: {r.setting.label}: {r.status}"
                + (f" {med:.1f} tok/s ({r.rounds(1)} rounds)" if med else "")
                + (f" - {r.reason}" if r.reason and r.status != "measured" else "")
            )

    return on_event


async def bench_engine(
    engine: str, hidden: int, layers: int, ks: list[int], budget: float, rounds: int, max_tokens: int, workdir: Path
) -> dict:
    from specops.devenv.testmodels import ensure_layerskip

    kind = "hf" if engine == "vllm" else "gguf"
    say(f"{engine}: layer-skip fixture {kind} {hidden}x{layers}")
    paths = ensure_layerskip(kind, hidden, layers)
    registry = get_registry()
    f = workdir / f"{engine}.yaml"
    f.write_text(profile_yaml(engine, paths["target"], paths["draft"], 4))
    loaded = load_profile(f, registry=registry)
    cfg = TuneConfig(workload="code", max_tokens=max_tokens, budget_s=budget, k_values=ks, ignore_eos=True)
    plan = prepare(loaded, registry, cfg)
    extra = {"ignore_eos": True}

    def driver() -> EngineDriver:
        return EngineDriver(
            loaded,
            plan.resolved,
            registry,
            plan.engine,
            plan.prompts,
            extra_body=extra,
            log_path=workdir / f"{engine}-engine.log",
        )

    # 1. the race, as `specops tune` runs it
    t0 = time.monotonic()
    tuned = await Tuner(
        plan.settings,
        driver(),
        TuneOptions(budget_s=budget, levels=(1,)),
        current=plan.current,
        on_event=events(f"{engine} tune"),
    ).run()
    tune_s = time.monotonic() - t0
    k_tune = tuned.winner.setting.k
    say(f"{engine}: tune chose k={k_tune} in {tune_s:.0f}s")

    # 2. everything, same rounds each, no pruning
    every = [Setting(Method.NONE)] + [s for s in plan.settings]
    t0 = time.monotonic()
    full = await Tuner(
        every,
        driver(),
        TuneOptions(budget_s=10 * 3600, levels=(1,), min_rounds=rounds, max_rounds=rounds, prune=False),
        current=plan.current,
        on_event=events(f"{engine} exhaustive"),
    ).run()
    full_s = time.monotonic() - t0
    spec_rows = [r for r in full.results if r.setting.k is not None and r.median(1) is not None]
    best = max(spec_rows, key=lambda r: r.median(1))
    tune_row = next(r for r in spec_rows if r.setting.k == k_tune)
    base = full.result_for(Setting(Method.NONE))
    base_tps = base.median(1) if base else None
    table = []
    for r in sorted(spec_rows, key=lambda r: r.setting.k):
        lr = r.levels[1]
        table.append(
            {
                "k": r.setting.k,
                "tokens_per_s": round(r.median(1), 2),
                "speedup": round(r.median(1) / base_tps, 3) if base_tps else None,
                "acceptance": lr.acceptance,
                "mean_acceptance_length": lr.mean_acceptance_length,
                "rounds": [round(x, 2) for x in lr.samples],
            }
        )
    return {
        "engine": engine,
        "engine_version": plan.engine.version,
        "size": f"hidden {hidden}, {layers} layers",
        "ks": ks,
        "budget_s": budget,
        "max_tokens": max_tokens,
        "rounds_exhaustive": rounds,
        "k_tune": k_tune,
        "k_best": best.setting.k,
        "tune_tokens_per_s_in_exhaustive": round(tune_row.median(1), 2),
        "best_tokens_per_s": round(best.median(1), 2),
        "ratio": round(tune_row.median(1) / best.median(1), 4),
        "within_5_percent": tune_row.median(1) >= 0.95 * best.median(1),
        "tune_s": round(tune_s, 1),
        "exhaustive_s": round(full_s, 1),
        "tune_launches": sum(1 for r in tuned.results if r.launch_s is not None),
        "tune_pruned": [r.setting.k for r in tuned.results if r.status == "pruned"],
        "tune_skipped": [r.setting.k for r in tuned.results if r.status == "skipped"],
        "tune_table": tuned.to_dict()["results"],
        "baseline_tokens_per_s": round(base_tps, 2) if base_tps else None,
        "exhaustive": table,
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "| engine | size | k chosen by tune | best k (exhaustive) | tok/s at tune's k | best tok/s | ratio | "
        "tune time | exhaustive time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['size']} | {r['k_tune']} | {r['k_best']} | "
            f"{r['tune_tokens_per_s_in_exhaustive']:.1f} | {r['best_tokens_per_s']:.1f} | "
            f"**{r['ratio']:.3f}**{'' if r['within_5_percent'] else ' (over 5 %)'} | {r['tune_s']:.0f} s "
            f"({r['tune_launches']} launches) | {r['exhaustive_s']:.0f} s |"
        )
    for r in results:
        lines += [
            "",
            f"{r['engine']} ({r['size']}), exhaustive sweep, no speculation {r['baseline_tokens_per_s']} tok/s:",
            "",
            "| k | tok/s | speedup | acceptance | mean acceptance length |",
            "|---|---|---|---|---|",
        ]
        for row in r["exhaustive"]:
            mark = " ←tune" if row["k"] == r["k_tune"] else ""
            lines.append(
                f"| {row['k']}{mark} | {row['tokens_per_s']:.1f} | "
                f"{row['speedup']:.2f}x | {row['acceptance'] or 0:.2f} | "
                f"{row['mean_acceptance_length'] or 0:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="vllm,llamacpp")
    ap.add_argument("--size", default="768x16", help="layer-skip fixture HIDDENxLAYERS")
    ap.add_argument("--ks", default="1,2,3,4,6,8")
    ap.add_argument("--budget", default=None, help="tune's budget (default: 8m for vLLM, 2m for llama-server)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per k in the exhaustive sweep")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    hidden, layers = (int(x) for x in a.size.split("x"))
    ks = [int(x) for x in a.ks.split(",")]
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        for engine in [e.strip() for e in a.engines.split(",") if e.strip()]:
            budget = parse_duration(a.budget) if a.budget else (480.0 if engine == "vllm" else 120.0)
            out.append(asyncio.run(bench_engine(engine, hidden, layers, ks, budget, a.rounds, a.max_tokens, Path(tmp))))
    report = {"machine": machine(), "results": out}
    print(markdown(out))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
