"""Speculation that follows the load: ``fallback.mode: goodput`` against static deployments on a phased workload.

1. **The surface**: ``specops tune --dry-run --json`` measures the deployment (the layer-skip fixture on
   llama-server or vLLM-CPU) at concurrency 1, 2, ``--high`` and ``--levels`` with speculation (k) and without
   (the baseline tune adds), and its record's ``surface`` gives the crossover concurrency. The script prints
   the measured curve.
2. **The phased workload**, the same for three deployments run by ``specops up`` one after the other (the order
   rotates per round; medians over rounds): greedy at concurrency 1, greedy at ``--high`` (past the crossover),
   greedy at 1 again, then temperature 1.5 at 1 (the draft is rarely accepted):

   - **managed**: ``fallback.mode: goodput`` with the measured surface (chain ``[none]``);
   - **twin** (``--configs``): the same policy with a warm ``none`` twin (``routing.twins: [none]``): a switch is a
     route change, and above the crossover load every request goes to the twin;
   - **static speculation**: the draft, ``fallback.enabled: false``;
   - **static none**: no speculation.

Reported per phase: tokens/s (output tokens ÷ the phase's wall time, clients closed-loop) of each, the managed
one against the best static configuration of that phase, the whole run, and the managed deployment's decisions
(time into the run, from → to, concurrency, predicted tokens/s).

    .venv/bin/python benchmarks/bench_goodput.py
    .venv/bin/python benchmarks/bench_goodput.py --phase 120 --together --json out.json
    .venv/bin/python benchmarks/bench_goodput.py --surface-only --high 16 --levels 8 --parallel 16 --draft-layers 6
    .venv/bin/python benchmarks/bench_goodput.py --engine vllm --surface vllm.surface.json --together
    .venv/bin/python benchmarks/bench_goodput.py --engine vllm --configs twin static-spec static-none --phase 120 \
        --env VLLM_CPU_OMP_THREADS_BIND=nobind
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _harness import PROMPTS, Up  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

from specops.perf.bench import machine  # noqa: E402
from specops.perf.workload import Prompt, run_workload  # noqa: E402
from specops.run.start import free_port  # noqa: E402

CONFIGS = ("managed", "twin", "static-spec", "static-none")
#: The configurations a policy runs (the others are static).
POLICIES = ("managed", "twin")
#: The model name requests carry (vLLM checks it against the served name; llama-server ignores it).
MODEL = {"name": "x"}


def profile_yaml(config: str, paths: dict, port: int, args, surface: Path | None, schedule=None) -> str:
    spec = (
        "speculative:\n  method: none\n"
        if config == "static-none"
        else f"speculative:\n  method: draft_model\n  draft: {paths['draft']}\n  num_speculative_tokens: {args.k}\n"
    )
    if config in POLICIES and schedule:  # vLLM: the engine follows load by itself, goodput handles the rest
        spec += f"  per_batch_size: {json.dumps(schedule)}\n"
    if config in POLICIES:
        fallback = (
            f"fallback:\n  mode: goodput\n  window: {args.window}\n  min_draft_tokens: 50\n  chain: [none]\n"
            f"  max_switches_per_hour: 60\n  goodput:\n    surface: {surface}\n    sustain: {args.sustain}\n"
            f"    min_dwell: {args.dwell}\n    regime: 1m\n"
        )
        if config == "twin":
            fallback += "routing:\n  twins: [none]\n"
    else:
        fallback = "fallback:\n  enabled: false\n"
    if args.engine == "vllm":
        return (
            f"name: goodput-{config}\nbackend: vllm\nmodel:\n  id: {paths['target']}\n  dtype: float32\n"
            f"  max_model_len: 1024\n{spec}server:\n  port: {port}\n  parallel: {args.parallel}\n  env:\n"
            f"    VLLM_CPU_KVCACHE_SPACE: '1'\n"
            # vLLM 0.32.0 cannot load its AOT compile cache and compiles again at every start; the older cache
            # loads (a start 53 s instead of 86-95 s here, the same tokens/s; bench_vllm_start.py): cheaper switches
            f"    VLLM_USE_AOT_COMPILE: '0'\n"
            + "".join(f"    {k}: '{v}'\n" for k, v in args.env)
            + fallback
            + "monitor:\n  interval: 1s\nengine:\n  ready_timeout: 900\nsupervisor:\n  stop_timeout: 20\n"
        )
    return (
        f"name: goodput-{config}\nbackend: llamacpp\nmodel:\n  id: {paths['target']}\n  max_model_len: 4096\n{spec}"
        f"gpus:\n  devices: []\nserver:\n  port: {port}\n  parallel: {args.parallel}\n"
        + (f'  extra_args: ["-t", "{args.llama_threads}"]\n' if args.llama_threads else "")
        + fallback
        + "monitor:\n  interval: 500ms\nsupervisor:\n  stop_timeout: 10\n"
    )


def measure_surface(paths: dict, work: Path, args, say) -> dict:
    """``specops tune --dry-run --json`` on the static-speculation profile: the record's surface."""
    prof = work / "surface.yaml"
    prof.write_text(profile_yaml("static-spec", paths, free_port(), args, None))
    prompts = work / "phase-prompts.jsonl"  # the phases' own greedy prompts
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": args.tokens}) + "\n" for p in PROMPTS))
    cmd = [
        sys.executable,
        "-m",
        "specops.cli",
        "tune",
        str(prof),
        "--workload",
        str(prompts),
        "--k",
        str(args.k),
        "-c",
        ",".join(str(c) for c in sorted({args.high, 2, 1, *args.levels}, reverse=True)),
        "--budget",
        args.surface_budget,
        "--max-tokens",
        str(args.tokens),
        "--ignore-eos",
        "--min-rounds",
        "3",
        "--rounds",
        "5",
        "--dry-run",
        "--json",
        "--no-plot",
        "-q",
    ]
    say("measuring the surface: " + " ".join(cmd[3:]))
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPECOPS_STATE": str(work)})
    if out.returncode:
        raise RuntimeError(f"specops tune failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)["record"]["surface"]


async def phase_load(url: str, concurrency: int, seconds: float, temperature: float, tokens: int) -> dict:
    prompts = [Prompt(p, tokens, temperature, "phase") for p in PROMPTS]
    res = await run_workload(
        url, MODEL["name"], prompts, concurrency=concurrency, duration=seconds, extra_body={"ignore_eos": True}
    )
    return {
        "tokens": res.output_tokens,
        "wall_s": res.wall_s,
        "tokens_per_s": res.output_tokens / res.wall_s if res.wall_s else 0.0,
        "requests": len(res.requests),
        "errors": len(res.errors),
    }


def warm_twin(url: str) -> None:
    """One request on the twin (the client's ``X-Specops-Speculation: off``), as the primary got its warm-up."""
    body = json.dumps({"model": MODEL["name"], "prompt": PROMPTS[0], "max_tokens": 8}).encode()
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "X-Specops-Speculation": "off"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def run_config(config: str, paths: dict, work: Path, args, surface: Path, phases, say) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    prof = work / f"{config}.yaml"
    prof.write_text(profile_yaml(config, paths, free_port(), args, surface, args.schedule))
    up = Up(prof, work, f"goodput-{config}")
    try:
        st = up.wait_engines(2 if config == "twin" else 1, timeout=900 if args.engine == "vllm" else 120)
        asyncio.run(phase_load(st["url"], 1, 1.0, 0.0, 8))  # warm-up
        if config == "twin":
            warm_twin(st["url"])
        t0 = time.time()
        out: dict = {"phases": {}}
        for name, conc, temp in phases:
            start = round(time.time() - t0, 1)
            out["phases"][name] = asyncio.run(phase_load(st["url"], conc, args.phase, temp, args.tokens))
            out["phases"][name]["start_s"] = start
        out["decisions"] = _decisions(up, t0)
        out["verdicts"] = _verdicts(up, t0)
        out["routes"] = _routes(up, t0)
        say(
            f"  {config}: "
            + ", ".join(f"{p} {v['tokens_per_s']:.1f}" for p, v in out["phases"].items())
            + (f"; switches at {[d['t'] for d in out['decisions']]}" if out["decisions"] else "")
        )
        return out
    finally:
        up.stop()


def _verdicts(up: Up, t0: float) -> list[str]:
    """Each change of the managed policy's verdict (the ``goodput`` events): time, rule, the best option."""
    return [
        f"{e['ts'] - t0:.1f}s {e.get('rule')} (best {e['numbers'].get('best')})"
        for e in up.events()
        if e["event"] == "goodput" and e["ts"] >= t0
    ]


def _routes(up: Up, t0: float) -> list[str]:
    """A twin deployment's route changes (``route`` events): time, scope, where to, why."""
    return [
        f"{e['ts'] - t0:.1f}s {e.get('scope')} "
        + (f"{e.get('from')} → {e.get('to')}" if "to" in e else f"speculate {e.get('speculate')}")
        + f": {e.get('reason')}"
        for e in up.events()
        if e["event"] == "route" and e["ts"] >= t0
    ]


def _decisions(up: Up, t0: float) -> list[dict]:
    """The managed deployment's switches: when (seconds into the run), why, the numbers it decided on, and how long
    the switch took (drain, stop, start to ready: the next ``switch-complete`` event; to a warm twin: the
    milliseconds to the ``route`` event that moved the default route)."""
    events = up.events()
    out = []
    for i, e in enumerate(events):
        if e["event"] != "decision" or e.get("action") != "switch":
            continue
        done = next(
            (
                x
                for x in events[i + 1 :]
                if x["event"] == "switch-complete" or (x["event"] == "route" and x.get("scope") == "default")
            ),
            {},
        )
        if done.get("event") == "route":
            took = {"route_ms": round((done["ts"] - e["ts"]) * 1000, 1)}
        else:
            took = {k: done.get(k) for k in ("drain_s", "stop_s", "start_to_ready_s", "total_s") if k in done}
        out.append(
            {
                "t": round(e["ts"] - t0, 1),
                "from": e.get("from"),
                "to": e.get("to"),
                "rule": e.get("rule"),
                "concurrency": round(e["numbers"].get("concurrency") or 0, 2),
                "predicted": e["numbers"].get("predicted"),
                "mean_acceptance_length": e["numbers"].get("mean_acceptance_length"),
                **{
                    k: e["numbers"].get(k)
                    for k in ("sustained_s", "switch_cost_s", "switch_cost_basis", "gain_tokens", "cost_tokens")
                },
                "switch": took,
            }
        )
    return out


def run_together(paths: dict, work: Path, args, surface: Path, phases, say) -> dict[str, dict]:
    """All the deployments up at once, each with its own clients, every phase on all three at the same time:
    drift and contention on the shared machine hit them alike (each llama-server runs one thread)."""
    work.mkdir(parents=True, exist_ok=True)
    ups = {}
    try:
        for config in args.configs:
            prof = work / f"{config}.yaml"
            prof.write_text(profile_yaml(config, paths, free_port(), args, surface, args.schedule))
            ups[config] = Up(prof, work, f"goodput-{config}")
        urls = {
            c: up.wait_engines(2 if c == "twin" else 1, timeout=900 if args.engine == "vllm" else 120)["url"]
            for c, up in ups.items()
        }
        for c, url in urls.items():
            asyncio.run(phase_load(url, 1, 1.0, 0.0, 8))  # warm-up
            if c == "twin":
                warm_twin(url)
        t0 = time.time()
        out: dict[str, dict] = {c: {"phases": {}} for c in args.configs}

        async def phase(conc: int, temp: float) -> list[dict]:
            return await asyncio.gather(
                *(phase_load(urls[c], conc, args.phase, temp, args.tokens) for c in args.configs)
            )

        for name, conc, temp in phases:
            start = round(time.time() - t0, 1)
            for c, res in zip(args.configs, asyncio.run(phase(conc, temp))):
                out[c]["phases"][name] = {**res, "start_s": start}
        for c in args.configs:
            out[c]["decisions"] = _decisions(ups[c], t0)
            out[c]["verdicts"] = _verdicts(ups[c], t0)
            out[c]["routes"] = _routes(ups[c], t0)
            say(f"  {c}: " + ", ".join(f"{p} {v['tokens_per_s']:.1f}" for p, v in out[c]["phases"].items()))
        for c in set(args.configs) & set(POLICIES):
            say(f"  {c} switched at {[d['t'] for d in out[c]['decisions']]}")
        return out
    finally:
        for up in ups.values():
            up.stop()


def print_surface(surface) -> None:
    from specops.watch.surface import option_label

    print("Measured surface (tokens/s; specops tune, medians of its rounds):\n")
    levels = surface.levels()
    print("| option | " + " | ".join(f"c={c}" for c in levels) + " | mean acc. length |")
    print("|---|" + "---|" * (len(levels) + 1))
    for meth, k in surface.options():
        row = [surface.tokens_per_s(meth, k, c) for c in levels]
        tau = surface.tau(meth, k)
        print(
            f"| {option_label(meth, k)} | "
            + " | ".join("-" if v is None else f"{v:.1f}" for v in row)
            + f" | {'' if tau is None else f'{tau:.2f}'} |"
        )
    cross = surface.crossovers()
    print(
        f"\ncrossover concurrency: {cross} (None: speculation wins at every measured level)\n"
        if cross
        else "\nno crossover known: the surface has no baseline (none); give tune a larger --surface-budget\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--phase",
        type=float,
        default=120.0,
        help="seconds per phase (at least twice the managed regime of 1m: a switch costs the window, the sustain, "
        "the drain of the requests in flight and a restart, ~5-10 s here, and must be paid back inside the phase)",
    )
    ap.add_argument("--high", type=int, default=4, help="the high concurrency of phase 2")
    ap.add_argument("--parallel", type=int, default=4, help="server.parallel of every deployment")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--window", default="3s")
    ap.add_argument("--sustain", default="2s")
    ap.add_argument("--dwell", default="5s")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--surface-budget", default="6m")
    ap.add_argument(
        "--levels",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="more concurrency levels for the surface besides 1, 2 and --high (comma-separated)",
    )
    ap.add_argument("--surface", help="a tune record with a surface to use instead of measuring one")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=1,
        help="a costlier draft: the layer-skip target with this many layers (the same function as the target, "
        "at draft-layers/layers of its cost; 1 = the fixture's one-layer draft)",
    )
    ap.add_argument("--surface-only", action="store_true", help="measure and print the surface, then stop")
    ap.add_argument(
        "--together",
        action="store_true",
        help="run the three deployments at the same time, each with its own clients (default: one after the "
        "other, the order rotating per round); not with --engine vllm on a small machine: three vLLM-CPU "
        "servers oversubscribe its cores and the scheduler, not the configuration, sets their shares",
    )
    ap.add_argument("--llama-threads", type=int, default=1)
    ap.add_argument(
        "--engine",
        choices=("llamacpp", "vllm"),
        default="llamacpp",
        help="vllm: the layer-skip fixture on vLLM-CPU; the managed deployment also runs the k per batch size "
        "rendered from the surface (speculative.per_batch_size), so load changes need no restart",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=["managed", "static-spec", "static-none"],
        help="the deployments to run (static-spec and static-none always: the ratios are against them)",
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        type=lambda v: tuple(v.split("=", 1)),
        metavar="KEY=VALUE",
        help="vllm: server.env of every deployment (e.g. VLLM_CPU_OMP_THREADS_BIND=nobind, which specops renders "
        "for twins: the static ones then bind alike)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    args.configs = list(dict.fromkeys([*args.configs, "static-spec", "static-none"]))
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    from specops.devenv.testmodels import ensure_layerskip
    from specops.watch.surface import Surface

    kind = "hf" if args.engine == "vllm" else "gguf"
    paths = {k: str(v) for k, v in ensure_layerskip(kind, args.hidden, args.layers).items()}
    if args.draft_layers > 1:  # layer 0 and the embeddings come first from one seed: the same function, costlier
        paths["draft"] = str(ensure_layerskip(kind, args.hidden, args.draft_layers)["target"])
    if args.engine == "vllm":
        MODEL["name"] = paths["target"]
    phases = [
        ("1 greedy c=1", 1, 0.0),
        (f"2 greedy c={args.high}", args.high, 0.0),
        ("3 greedy c=1", 1, 0.0),
        ("4 temperature 1.5 c=1", 1, 1.5),
    ]
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory(prefix="specops-bench-goodput-") as tmp:
        work = Path(tmp)
        record = work / "surface.tune.json"
        if args.surface:
            surface_d = json.loads(Path(args.surface).read_text())["surface"]
        else:
            surface_d = measure_surface(paths, work, args, say)
            if args.json:
                Path(args.json).with_suffix(".surface.json").write_text(json.dumps({"surface": surface_d}, indent=2))
        record.write_text(json.dumps({"surface": surface_d}))
        surface = Surface.from_dict(surface_d)
        args.schedule = None
        if args.engine == "vllm":
            from specops.methods import Method
            from specops.watch.surface import per_batch_schedule

            args.schedule = per_batch_schedule(surface, Method.DRAFT_MODEL, max_batch=args.parallel, ks=[args.k])
            say(f"managed: per_batch_size {args.schedule} (from the surface, k {args.k})")
        if args.surface_only:
            print_surface(surface)
            return
        for rnd in range(args.rounds):
            if args.together:
                say(f"round {rnd + 1}/{args.rounds}: the three deployments at once")
                for config, res in run_together(paths, work / f"r{rnd}", args, record, phases, say).items():
                    runs[config].append(res)
                continue
            n = rnd % len(args.configs)
            order = args.configs[n:] + args.configs[:n]
            say(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}")
            for config in order:
                runs[config].append(run_config(config, paths, work / f"r{rnd}", args, record, phases, say))
    load_after = os.getloadavg()
    names = [p[0] for p in phases]
    med = {c: {p: statistics.median(r["phases"][p]["tokens_per_s"] for r in runs[c]) for p in names} for c in runs}
    total = {
        c: statistics.median(
            sum(r["phases"][p]["tokens"] for p in names) / sum(r["phases"][p]["wall_s"] for p in names) for r in runs[c]
        )
        for c in runs
    }
    policies = [c for c in args.configs if c in POLICIES]
    m = machine()
    print(
        f"Goodput policy, {'vLLM-CPU' if args.engine == 'vllm' else 'llama-server'}, layer-skip {args.hidden}x{args.layers}, draft_model k={args.k}, "
        f"server.parallel {args.parallel}; machine: {m['cpu']}, {m['cores']} cores; "
        + (f"llama-server threads {args.llama_threads or 'default'}; " if args.engine == "llamacpp" else "")
        + (f"policy per_batch_size {args.schedule}; " if args.schedule else "")
        + f"{args.tokens} tokens/request (ignore_eos); phases of {args.phase:g}s; "
        f"policy: window {args.window}, sustain {args.sustain}, min_dwell {args.dwell}; draft: layer-skip target "
        f"with {args.draft_layers} layer(s); "
        + ("the deployments at once, " if args.together else "deployments one after the other, order rotating; ")
        + f"medians of {args.rounds} round(s); load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after\n"
    )
    print_surface(surface)
    cols = [*policies, "static-spec", "static-none"]
    print(
        "| phase | "
        + " | ".join(f"{c} tok/s" for c in cols)
        + " | "
        + " | ".join(f"{c} ÷ best static" for c in policies)
        + " |"
    )
    print("|---|" + "---|" * (len(cols) + len(policies)))
    rows = [(p, lambda c, p=p: med[c][p]) for p in names] + [("whole run", lambda c: total[c])]
    for label, value in rows:
        best = max(value("static-spec"), value("static-none"))
        print(
            f"| {label} | "
            + " | ".join(f"{value(c):.1f}" for c in cols)
            + " | "
            + " | ".join(f"**{value(c) / best:.2f}**" for c in policies)
            + " |"
        )
    for c in policies:
        print(
            f"\n{c} decisions (seconds into the run; phases start at "
            + ", ".join(f"{p} {runs[c][0]['phases'][p]['start_s']}" for p in names)
            + "):"
        )
        for i, r in enumerate(runs[c]):
            for d in r["decisions"]:
                print(
                    f"  round {i + 1}: t={d['t']}s {d['from']} → {d['to']} [{d['rule']}] concurrency "
                    f"{d['concurrency']}, mean acceptance length {d.get('mean_acceptance_length')}, predicted "
                    f"{d['predicted']}, sustained {d.get('sustained_s')}s, cost {d.get('switch_cost_s')}s "
                    f"({d.get('switch_cost_basis')}); switch took {d.get('switch') or '?'}"
                )
            for e in r.get("routes", []):
                print(f"  round {i + 1}: route {e}")
            print(f"  round {i + 1} verdicts: " + "; ".join(r.get("verdicts", [])))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": m, "args": vars(args), "surface": surface_d, "runs": runs, "medians": med, "whole": total},
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
