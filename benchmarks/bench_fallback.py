"""Fallback protection: a workload whose acceptance collapses mid-run, managed vs static deployments.

Phase A sends greedy requests (the draft is right: speculation pays); phase B switches the same client to
temperature 1.5 (the draft is rarely accepted: speculation costs more than it gains). Three deployments,
each run by ``specops up`` behind its proxy and all up at once, get the identical phased workload: within a
phase one client sends a request to each in turn (rotating who goes first), so the three are measured at
the same moments and drift on a shared machine hits them alike:

- **managed**: draft_model with fallback on (chain ``[none]``), short windows so it can react in a phase;
- **static speculation**: the same draft with ``fallback.enabled: false``;
- **static none**: no speculation.

Reported per phase: tokens/s of each, the managed deployment against the best static configuration for
that phase and against static speculation, plus when the managed one switched. Engine: llama-server on
the layer-skip fixture (specops.devenv.testmodels, hidden 768, 16 layers), where greedy speculation gives ~2.5x and
high-temperature speculation ~0.75x on this machine.

    .venv/bin/python benchmarks/bench_fallback.py
    .venv/bin/python benchmarks/bench_fallback.py --phase-a 30 --phase-b 60 --rounds 2 --json out.json
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

from _harness import PROMPTS, Up  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

from specops.perf.bench import machine  # noqa: E402
from specops.perf.workload import Prompt, run_workload  # noqa: E402
from specops.run.start import free_port  # noqa: E402

CONFIGS = ("managed", "static-spec", "static-none")


def profile_yaml(
    config: str, target: Path, draft: Path, port: int, k: int, window: str, threads: int | None = None
) -> str:
    spec = (
        "speculative:\n  method: none\n"
        if config == "static-none"
        else (f"speculative:\n  method: draft_model\n  draft: {draft}\n  num_speculative_tokens: {k}\n")
    )
    fallback = (
        "fallback:\n  enabled: false\n"
        if config != "managed"
        else f"fallback:\n  window: {window}\n  min_draft_tokens: 50\n  consecutive_windows: 2\n"
        "  cooldown: 10m\n  chain: [none]\n"
    )
    return (
        f"name: fallback-{config}\nbackend: llamacpp\nmodel:\n  id: {target}\n  max_model_len: 1024\n{spec}"
        f"gpus:\n  devices: []\nserver:\n  port: {port}\n  parallel: 2\n"
        + (f'  extra_args: ["-t", "{threads}"]\n' if threads else "")
        + f"{fallback}"
        "monitor:\n  interval: 500ms\nsupervisor:\n  stop_timeout: 10\n"
    )


async def one(url: str, prompt: Prompt) -> tuple[int, float, bool]:
    res = await run_workload(url, "x", [prompt], concurrency=1, requests=1, extra_body={"ignore_eos": True})
    r = res.requests[0]
    return r.output_tokens if r.ok else 0, r.latency, r.ok


async def interleaved(urls: dict[str, str], durations: list[tuple[str, float, float]], tokens: int, say) -> dict:
    """Each phase: until its time is up, one request to each deployment in turn (rotating who goes first).

    A deployment's tokens/s in a phase is its tokens over the time it spent answering (Σ latency), so the
    three are measured under the same conditions at the same moments; the managed one switches in the
    background while the others answer (a request that arrives mid-switch waits in its proxy and the wait
    counts against it).
    """
    out: dict = {name: {} for name in urls}
    names = list(urls)
    i = 0
    for phase, seconds, temp in durations:
        acc = {n: {"tokens": 0, "busy_s": 0.0, "requests": 0, "errors": 0} for n in names}
        start = time.time()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            order = names[i % len(names) :] + names[: i % len(names)]
            prompt = Prompt(PROMPTS[i % len(PROMPTS)], tokens, temp, phase)
            for n in order:
                got, latency, ok = await one(urls[n], prompt)
                a = acc[n]
                a["tokens"] += got
                a["busy_s"] += latency
                a["requests"] += 1
                a["errors"] += 0 if ok else 1
            i += 1
        for n in names:
            a = acc[n]
            a["tokens_per_s"] = a["tokens"] / a["busy_s"] if a["busy_s"] else 0.0
            a["start"] = start
            out[n][phase] = a
        say("  " + phase + ": " + ", ".join(f"{n} {acc[n]['tokens_per_s']:.1f} tok/s" for n in names))
    return out


def run_round(paths: dict, work: Path, args, say) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    ups = {}
    try:
        for config in CONFIGS:
            port = free_port()
            prof = work / f"{config}.yaml"
            prof.write_text(
                profile_yaml(
                    config, paths["target"], paths["draft"], port, args.k, args.window, args.llama_threads or None
                )
            )
            ups[config] = Up(prof, work, f"fallback-{config}")
        urls = {}
        for config, up in ups.items():
            st = up.wait_ready()
            urls[config] = st["url"]
            asyncio.run(one(st["url"], Prompt(PROMPTS[0], 8, 0.0, "warm-up")))
            say(f"{config}: ready on {st['url']} with {st['method']}")
        res = asyncio.run(
            interleaved(
                urls, [("A greedy", args.phase_a, 0.0), ("B temperature 1.5", args.phase_b, 1.5)], args.tokens, say
            )
        )
        b_start = res["managed"]["B temperature 1.5"]["start"]
        res["managed"]["switch_after_s"] = [
            round(e["ts"] - b_start, 1) for e in ups["managed"].events() if e["event"] == "switch"
        ]
        res["managed"]["final_method"] = ups["managed"].st().get("method")
        return res
    finally:
        for up in ups.values():
            up.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-a", type=float, default=30.0, help="seconds of greedy traffic")
    ap.add_argument("--phase-b", type=float, default=60.0, help="seconds of temperature-1.5 traffic")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--window", default="5s", help="the managed profile's fallback.window")
    ap.add_argument("--rounds", type=int, default=1, help="repeat all three, rotating the order; medians")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--llama-threads",
        type=int,
        default=1,
        help="llama-server -t (default 1: other load on a shared machine then slows all three alike; "
        "0 = the engine's default)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    from specops.devenv.testmodels import ensure_layerskip

    paths = ensure_layerskip("gguf", args.hidden, args.layers)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specops-bench-fallback-") as tmp:
        for rnd in range(args.rounds):
            say(f"round {rnd + 1}/{args.rounds}: starting the three deployments")
            res = run_round(paths, Path(tmp) / f"r{rnd}", args, say)
            for c in CONFIGS:
                runs[c].append(res[c])
    load_after = os.getloadavg()
    phase_names = ("A greedy", "B temperature 1.5")
    med = {c: {p: statistics.median(r[p]["tokens_per_s"] for r in runs[c]) for p in phase_names} for c in CONFIGS}
    total = {}
    for c in CONFIGS:
        total[c] = statistics.median(
            sum(r[p]["tokens"] for p in phase_names) / sum(r[p]["busy_s"] for p in phase_names) for r in runs[c]
        )
    m = machine()
    print(
        f"Fallback protection, llama-server, layer-skip {args.hidden}x{args.layers}, draft_model k={args.k}; "
        f"machine: {m['cpu']}, {m['cores']} cores; llama-server threads {args.llama_threads or 'default'}; "
        f"1 client, {args.tokens} tokens/request; "
        f"phase A {args.phase_a:g}s greedy, phase B {args.phase_b:g}s temperature 1.5; "
        f"managed window {args.window} × 2; requests round-robin over the three deployments (all up at once); "
        f"medians of {args.rounds} round(s); load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n"
    )
    print(
        "| phase | managed tok/s | static spec tok/s | static none tok/s | managed ÷ best static | "
        "managed ÷ static spec |"
    )
    print("|---|---|---|---|---|---|")
    for p in phase_names:
        best = max(med["static-spec"][p], med["static-none"][p])
        print(
            f"| {p} | {med['managed'][p]:.1f} | {med['static-spec'][p]:.1f} | {med['static-none'][p]:.1f} | "
            f"**{med['managed'][p] / best:.2f}** | {med['managed'][p] / med['static-spec'][p]:.2f} |"
        )
    best_total = max(total["static-spec"], total["static-none"])
    print(
        f"| whole run | {total['managed']:.1f} | {total['static-spec']:.1f} | {total['static-none']:.1f} | "
        f"**{total['managed'] / best_total:.2f}** | {total['managed'] / total['static-spec']:.2f} |"
    )
    print(
        f"\nmanaged switched {', '.join(str(r['switch_after_s']) for r in runs['managed'])} s after phase B "
        f"began; final method {[r['final_method'] for r in runs['managed']]}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": m, "args": vars(args), "runs": runs, "medians": med, "whole_run": total},
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
