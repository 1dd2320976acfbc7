"""Speculation per request on mixed traffic: a twin deployment that routes each request class against the static ones.

Two request classes whose acceptance differs, sent at the same time by concurrent clients: the built-in ``code``
set (greedy: the layer-skip draft agrees, speculation pays) and the ``creative`` set (temperature 1.3: the draft is
rarely accepted, speculation costs). Each class names itself in the request's ``model`` field (llama-server ignores
it), which is the twin deployment's class key. Three deployments, all run by ``specops up`` and up at once:

- **static-spec**: the draft (``fallback.enabled: false``);
- **static-none**: no speculation;
- **twin**: the draft as the primary and a warm ``none`` twin (``routing.twins: [none]``), measured two ways:
  - **learned**: requests carry only their class; the router sends each class where its own acceptance window
    (each response's ``timings``) says speculation pays (``routing.classes.key: model``);
  - **oracle**: the client's ``X-Specops-Speculation`` header sends ``code`` on and ``creative`` off: the per-class
    ceiling learned routing aims at.

First the twin deployment learns: mixed traffic until both classes have a verdict, counting the requests each class
took (the class table's own count when its verdict appeared in the state file). Then rounds: each mode in turn gets
the same mixed load for ``--slot`` seconds (the order rotates per round), so drift and other load on a shared
machine hit all alike. Every ``specops up`` and the engines it starts are pinned to the same CPU set (``--cpus``):
a twin pair then shares the cores one static engine has, instead of running its two engines on two cores.

Reported per class and for the whole mix: tokens/s (the class's output tokens ÷ the slot's wall time), medians over
rounds with their spread, each mode against the best static configuration, learned against the oracle.

    .venv/bin/python benchmarks/bench_routing.py
    .venv/bin/python benchmarks/bench_routing.py --rounds 8 --slot 20 --tokens 48 --json results.json
    .venv/bin/python benchmarks/bench_routing.py --engine vllm --cpus "" --rounds 2 --slot 30 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _harness import Up  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

from specops.perf.bench import machine  # noqa: E402
from specops.perf.workload import Prompt, load_prompts, run_workload  # noqa: E402
from specops.run.start import free_port  # noqa: E402

CLASSES = ("code", "creative")
DEPLOYMENTS = ("static-spec", "static-none", "twin")
#: What is measured, and on which deployment.
MODES = {"static-spec": "static-spec", "static-none": "static-none", "learned": "twin", "oracle": "twin"}
#: The oracle's header per class: where each class is known to pay.
ORACLE = {"code": "on", "creative": "off"}
HEADER = "X-Specops-Speculation"
#: vLLM checks ``model`` against its served name: there the class is a header (``routing.classes.key: header``).
CLASS_HEADER = "X-Bench-Class"


def profile_yaml(kind: str, paths: dict, port: int, args) -> str:
    spec = (
        "speculative:\n  method: none\n"
        if kind == "static-none"
        else f"speculative:\n  method: draft_model\n  draft: {paths['draft']}\n  num_speculative_tokens: {args.k}\n"
    )
    key = "key: model" if args.engine == "llamacpp" else f"key: header\n    header: {CLASS_HEADER}"
    if kind == "twin":
        rest = (
            f"fallback:\n  chain: [none]\n  mode: {args.policy}\n  draft_cost_ratio: {args.draft_cost_ratio}\n"
            f"routing:\n  twins: [none]\n  classes:\n    {key}\n    min_draft_tokens: {args.min_draft_tokens}\n"
            f"    explore: {args.explore}\n    window: {args.class_window}\n    learn: {args.learn}\n"
        )
    else:
        rest = "fallback:\n  enabled: false\n"
    if args.engine == "vllm":
        return (
            f"name: routing-{kind}\nbackend: vllm\nmodel:\n  id: {paths['target']}\n  dtype: float32\n"
            f"  max_model_len: 1024\n{spec}server:\n  port: {port}\n  parallel: {args.parallel}\n  env:\n"
            "    VLLM_CPU_KVCACHE_SPACE: '1'\n    VLLM_USE_AOT_COMPILE: '0'\n"
            # every deployment's threads unbound, as specops renders a twin pair's (fair: not one core each)
            "    VLLM_CPU_OMP_THREADS_BIND: nobind\n"
            + "".join(f"    {k}: '{v}'\n" for k, v in args.env)
            + rest
            + "monitor:\n  interval: 1s\nengine:\n  ready_timeout: 900\nsupervisor:\n  stop_timeout: 20\n"
        )
    return (
        f"name: routing-{kind}\nbackend: llamacpp\nmodel:\n  id: {paths['target']}\n  max_model_len: 4096\n{spec}"
        f"gpus:\n  devices: []\nserver:\n  port: {port}\n  parallel: {args.parallel}\n"
        f'  extra_args: ["-t", "{args.llama_threads}"]\n'
        + rest
        + "monitor:\n  interval: 500ms\nsupervisor:\n  stop_timeout: 10\n"
    )


def class_prompts(args) -> dict[str, list[Prompt]]:
    """The built-in sets, each with its own temperature, ``--tokens`` output tokens per request."""
    return {c: [Prompt(p.text, args.tokens, p.temperature, c) for p in load_prompts(c)] for c in CLASSES}


async def mixed(
    url: str, mode: str, prompts: dict, seconds: float, clients: int, vllm_model: str | None = None
) -> dict:
    """``clients`` closed-loop clients per class for ``seconds``; the oracle's clients send the class's header.
    On vLLM (``vllm_model``: its served name) requests are not streamed: vLLM's per-request counters are read from
    whole answers only."""
    import aiohttp

    async def one_class(name: str):
        headers = {HEADER: ORACLE[name]} if mode == "oracle" else {}
        if vllm_model:
            headers[CLASS_HEADER] = name
        connector = aiohttp.TCPConnector(limit=clients + 2, force_close=True)
        async with aiohttp.ClientSession(connector=connector, headers=headers, trust_env=False) as session:
            return await run_workload(
                url,
                vllm_model or name,  # llama-server: the class key (routing.classes.key: model)
                prompts[name],
                concurrency=clients,
                duration=seconds,
                stream=vllm_model is None,
                extra_body={"ignore_eos": True},
                session=session,
            )

    results = await asyncio.gather(*(one_class(c) for c in CLASSES))
    every = [r for res in results for r in res.requests]
    wall = max(r.end for r in every) - min(r.start for r in every) if every else seconds
    out: dict = {"wall_s": wall, "classes": {}}
    for name, res in zip(CLASSES, results):
        ok = res.ok
        drafted = [r for r in ok if (r.draft_tokens or 0) > 0]
        d = sum(r.draft_tokens or 0 for r in ok)
        a = sum(r.accepted or 0 for r in ok)
        out["classes"][name] = {
            "tokens": res.output_tokens,
            "requests": len(res.requests),
            "errors": len(res.errors),
            "first_error": next((r.error for r in res.errors), None),
            "tokens_per_s": res.output_tokens / wall if wall else 0.0,
            "served_speculating": len(drafted),
            "acceptance": a / d if d else None,
            "tpot_ms_median": None if res.tpot_median is None else res.tpot_median * 1000,
        }
    out["tokens"] = sum(c["tokens"] for c in out["classes"].values())
    out["tokens_per_s"] = out["tokens"] / wall if wall else 0.0
    out["errors"] = sum(c["errors"] for c in out["classes"].values())
    return out


def learn(up: Up, url: str, prompts: dict, args, say) -> dict:
    """Mixed traffic on the twin until every class has a verdict; per class, the requests it took (the router's own
    count in the class table when the verdict first showed in the state file) and the seconds."""
    seen: dict[str, dict] = {}
    stop = threading.Event()
    t0 = time.monotonic()

    def poll() -> None:
        while not stop.is_set():
            for row in up.st().get("routing", {}).get("classes", []):
                if row["class"] in CLASSES and row["speculate"] is not None and row["class"] not in seen:
                    seen[row["class"]] = {
                        "requests": row["requests"],
                        "seconds": round(time.monotonic() - t0, 1),
                        "speculate": row["speculate"],
                        "acceptance": row["acceptance"],
                        "reason": row["reason"],
                    }
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        deadline = time.monotonic() + args.learn_timeout
        while len(seen) < len(CLASSES) and time.monotonic() < deadline:
            asyncio.run(mixed(url, "learned", prompts, 2.0, args.clients, args.vllm_model))
        time.sleep(1.5)  # the last decision interval
    finally:
        stop.set()
        poller.join()
    for c in CLASSES:
        say(f"  learned {c}: {seen.get(c, 'no verdict')}")
    return seen


def run(paths: dict, work: Path, args, say) -> dict:
    prompts = class_prompts(args)
    ups: dict[str, Up] = {}
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
    try:
        for kind in DEPLOYMENTS:
            prof = work / f"{kind}.yaml"
            prof.write_text(profile_yaml(kind, paths, free_port(), args))
            ups[kind] = Up(prof, work, f"routing-{kind}")
            if cpus:  # before it starts its engines: they inherit it
                os.sched_setaffinity(ups[kind].proc.pid, cpus)
        urls = {}
        for kind, up in ups.items():
            st = up.wait_engines(2 if kind == "twin" else 1, timeout=180 if args.engine == "llamacpp" else 900)
            urls[kind] = st["url"]
            say(f"{kind}: ready on {st['url']}")
        for kind, url in urls.items():  # warm-up: every engine once
            for mode in ("oracle",) if kind == "twin" else (kind,):
                asyncio.run(mixed(url, mode, prompts, 1.0, 1, args.vllm_model))
        learned = learn(ups["twin"], urls["twin"], prompts, args, say)
        modes = list(MODES)
        rounds: list[dict] = []
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
            res = {}
            for mode in order:
                res[mode] = asyncio.run(
                    mixed(urls[MODES[mode]], mode, prompts, args.slot, args.clients, args.vllm_model)
                )
            rounds.append(res)
            say(
                f"round {rnd + 1}/{args.rounds}: "
                + ", ".join(
                    f"{m} {res[m]['tokens_per_s']:.1f} ("
                    + "/".join(f"{res[m]['classes'][c]['tokens_per_s']:.1f}" for c in CLASSES)
                    + ")"
                    for m in modes
                )
            )
        final = ups["twin"].st().get("routing", {})
        route_events = [e for e in ups["twin"].events() if e["event"] == "route"]
        return {"learned": learned, "rounds": rounds, "twin_routing": final, "route_events": route_events}
    finally:
        for up in ups.values():
            up.stop()


def summarise(rounds: list[dict]) -> dict:
    """Medians and spread (min, max) over rounds, per mode, per class and for the whole mix."""

    def stat(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out: dict = {}
    for mode in MODES:
        out[mode] = {
            "mix": stat([r[mode]["tokens_per_s"] for r in rounds]),
            **{c: stat([r[mode]["classes"][c]["tokens_per_s"] for r in rounds]) for c in CLASSES},
            "errors": sum(r[mode]["errors"] for r in rounds),
        }
    ratios: dict = {}
    for part in (*CLASSES, "mix"):
        per_round_best = [max(r["static-spec"], r["static-none"]) for r in _series(rounds, part)]
        best_mode = max(("static-spec", "static-none"), key=lambda m: out[m][part]["median"])
        ratios[part] = {"best_static": best_mode}
        for mode in ("learned", "oracle"):
            # the ratio of medians, and the spread of the same-round ratios
            same_round = [s[mode] / b for s, b in zip(_series(rounds, part), per_round_best) if b]
            ratios[part][mode] = {
                "vs_best_static": out[mode][part]["median"] / out[best_mode][part]["median"],
                "same_round": stat(same_round),
            }
        lo = [s["learned"] / s["oracle"] for s in _series(rounds, part) if s["oracle"]]
        ratios[part]["learned_vs_oracle"] = {
            "of_medians": out["learned"][part]["median"] / out["oracle"][part]["median"],
            "same_round": stat(lo),
        }
    return {"modes": out, "ratios": ratios}


def _series(rounds: list[dict], part: str) -> list[dict[str, float]]:
    """Per round: each mode's tokens/s for ``part`` (a class, or ``mix``)."""
    if part == "mix":
        return [{m: r[m]["tokens_per_s"] for m in MODES} for r in rounds]
    return [{m: r[m]["classes"][part]["tokens_per_s"] for m in MODES} for r in rounds]


def report(res: dict, summary: dict, args, m: dict, load: tuple) -> None:
    print(
        f"Routing per request, {args.engine}, layer-skip {args.hidden}x{args.layers}, draft_model k={args.k}; "
        f"machine: {m['cpu']}, {m['cores']} cores, every deployment pinned to CPU(s) {args.cpus or 'any'}; "
        f"llama-server -t {args.llama_threads} (llamacpp), {args.parallel} slots per engine; {args.clients} client(s) per class "
        f"(code greedy, creative temperature 1.3), {args.tokens} tokens/request (ignore_eos); "
        f"{args.slot:g} s per mode per round, {args.rounds} rounds, order rotating; twin policy {args.policy} "
        f"(classes: min_draft_tokens {args.min_draft_tokens}, explore {args.explore}, learn {args.learn}); "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after\n"
    )
    print("Requests each class took to learn (the router's count when its verdict appeared):\n")
    for c in CLASSES:
        v = res["learned"].get(c)
        print(
            f"- {c}: "
            + (
                f"{v['requests']} requests, {v['seconds']} s → speculate {v['speculate']} ({v['reason']})"
                if v
                else "no verdict within --learn-timeout"
            )
        )
    s, r = summary["modes"], summary["ratios"]
    f = lambda d: f"{d['median']:.1f} ({d['min']:.1f}–{d['max']:.1f})"  # noqa: E731
    print("\nTokens/s, median (min–max) over rounds:\n")
    print(
        "| | static spec | static none | learned | oracle | learned ÷ best static | oracle ÷ best static "
        "| learned ÷ oracle |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for part in (*CLASSES, "mix"):
        q = r[part]
        print(
            f"| {part if part != 'mix' else 'whole mix'} | {f(s['static-spec'][part])} | {f(s['static-none'][part])} | "
            f"{f(s['learned'][part])} | {f(s['oracle'][part])} | **{q['learned']['vs_best_static']:.2f}** "
            f"({q['learned']['same_round']['min']:.2f}–{q['learned']['same_round']['max']:.2f}) | "
            f"{q['oracle']['vs_best_static']:.2f} | {q['learned_vs_oracle']['of_medians']:.2f} |"
        )
    errors = ", ".join(f"{mode} {s[mode]['errors']}" for mode in MODES)
    print(f"\nerrors: {errors}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slot", type=float, default=30.0, help="seconds of mixed traffic per mode per round")
    ap.add_argument("--clients", type=int, default=2, help="closed-loop clients per class")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=4, help="slots per engine")
    ap.add_argument("--llama-threads", type=int, default=1)
    ap.add_argument("--cpus", default="0", help="CPU set for every deployment (comma list; empty: unpinned)")
    ap.add_argument("--policy", default="threshold", choices=("threshold", "model"), help="the twin's fallback.mode")
    ap.add_argument("--draft-cost-ratio", type=float, default=0.06)
    ap.add_argument("--min-draft-tokens", type=int, default=100, help="routing.classes.min_draft_tokens")
    ap.add_argument("--explore", type=float, default=0.05, help="routing.classes.explore")
    ap.add_argument("--class-window", default="60s", help="routing.classes.window")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        type=lambda v: tuple(v.split("=", 1)),
        metavar="KEY=VALUE",
        help="vllm: server.env of every deployment, beside VLLM_CPU_OMP_THREADS_BIND=nobind (repeatable)",
    )
    ap.add_argument("--learn", default="together", choices=("together", "one_at_a_time"), help="routing.classes.learn")
    ap.add_argument("--learn-timeout", type=float, default=120.0)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--engine",
        choices=("llamacpp", "vllm"),
        default="llamacpp",
        help="vllm: the layer-skip fixture on vLLM-CPU; requests not streamed (its per-request counters come in whole "
        "answers), the class in a header",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    args.engine_kind = "hf" if args.engine == "vllm" else "gguf"
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    from specops.devenv.testmodels import ensure_layerskip

    paths = {k: str(v) for k, v in ensure_layerskip(args.engine_kind, args.hidden, args.layers).items()}
    args.vllm_model = paths["target"] if args.engine == "vllm" else None
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specops-bench-routing-") as tmp:
        res = run(paths, Path(tmp), args, say)
    after = os.getloadavg()
    summary = summarise(res["rounds"])
    m = machine()
    report(res, summary, args, m, (before[0], after[0]))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": m, "args": vars(args), "load_average": [before, after], **res, "summary": summary},
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
