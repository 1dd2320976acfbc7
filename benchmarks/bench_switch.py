"""A method switch under 16 clients: a route change to a warm twin against a restart, side by side.

Two deployments of the same llama-server profile (the tiny GGUF target with the noisy draft: acceptance ~0.5-0.65,
held to ``fallback.min_acceptance: 0.9``, so the decider is certain to leave speculation after two windows):

- **twin**: ``routing.twins: [none]``: the switch to ``none`` is a route change (no hold, no drain, no restart);
- **restart**: no twin: the switch holds new requests, drains, stops the engine and starts it without the draft.

Each runs alone (the order alternates per round) under 16 closed-loop clients, half of them streaming, from ready
until ``--tail`` seconds after its switch completed. Every request is recorded (start, end, ok, streamed);
the switch's moments come from the instance's own events: the ``decision`` to switch, then the ``route`` event
(twin) or ``switch-complete`` (restart, with its drain/stop/start seconds).

Reported per deployment (medians over rounds): requests lost (failed or cut), the switch time in milliseconds
(decision → route, or decision → switch complete), p50/p99 latency of the steady state before the switch and of
the requests in flight at any moment of the switch (started before it ended, finished after it began), their
ratio, and the longest time no streamed token reached any client.

    .venv/bin/python benchmarks/bench_switch.py
    .venv/bin/python benchmarks/bench_switch.py --rounds 3 --json benchmarks/results-llamacpp-switch.json
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _harness import PROMPTS, Up  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

from specops.perf.bench import machine  # noqa: E402
from specops.perf.stats import percentile  # noqa: E402
from specops.perf.workload import sse_payloads  # noqa: E402
from specops.run.start import free_port  # noqa: E402

KINDS = ("twin", "restart")


def profile_yaml(kind: str, models: Path, port: int, args) -> str:
    twins = "routing:\n  twins: [none]\n" if kind == "twin" else ""
    return (
        f"name: switch-{kind}\nbackend: llamacpp\nmodel:\n  id: {models / 'gguf-target.gguf'}\n  max_model_len: 2048\n"
        f"speculative:\n  method: draft_model\n  draft: {models / 'gguf-draft-noisy.gguf'}\n"
        f"  num_speculative_tokens: 4\ngpus:\n  devices: []\nserver:\n  port: {port}\n  parallel: {args.parallel}\n"
        f'  extra_args: ["-t", "{args.llama_threads}"]\n'
        "fallback:\n  window: 4s\n  min_acceptance: 0.9\n  min_draft_tokens: 100\n  consecutive_windows: 2\n"
        "  chain: [none]\n"
        + twins
        + "monitor:\n  interval: 500ms\nsupervisor:\n  restart_backoff: 0.2\n  stop_timeout: 10\n"
        "engine:\n  ready_timeout: 60\n"
    )


@dataclass
class Req:
    client: int
    stream: bool
    start: float  # wall seconds (the events' clock)
    end: float = 0.0
    ok: bool = False
    drafted: int | None = None
    error: str | None = None


class Clients:
    """``n`` closed-loop clients (even-numbered ones stream), greedy completions, every request recorded."""

    def __init__(self, url: str, n: int, tokens: int):
        self.url, self.n, self.tokens = url.rstrip("/") + "/v1/completions", n, tokens
        self.requests: list[Req] = []
        self.token_times: list[float] = []  # when each streamed chunk with text arrived (wall seconds)
        self.running = True

    async def run(self) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.n + 2, force_close=True)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.n)))

    async def _client(self, session, i: int) -> None:
        import aiohttp

        k = 0
        while self.running:
            stream = i % 2 == 0
            body = {
                "model": "x",
                "prompt": PROMPTS[(i + k) % len(PROMPTS)],
                "max_tokens": self.tokens,
                "temperature": 0,
                "stream": stream,
            }
            k += 1
            r = Req(i, stream, time.time())
            self.requests.append(r)
            try:
                async with session.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
                    if resp.status != 200:
                        r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    elif stream:
                        await self._read_stream(resp, r)
                    else:
                        data = await resp.json(content_type=None)
                        r.drafted = (data.get("timings") or {}).get("draft_n")
                        r.ok = bool(data.get("choices"))
            except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError) as exc:
                r.error = f"{type(exc).__name__}: {exc}"[:200]
            r.end = time.time()

    async def _read_stream(self, resp, r: Req) -> None:
        async for payload in sse_payloads(resp.content):
            if payload == b"[DONE]":
                r.ok = True
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                r.error = f"stream error: {str(chunk['error'])[:200]}"
                return
            if any(c.get("text") for c in chunk.get("choices") or ()):
                self.token_times.append(time.time())
            if isinstance(chunk.get("timings"), dict):
                r.drafted = chunk["timings"].get("draft_n")
        r.error = "stream ended before [DONE]"


def switch_moments(kind: str, events: list[dict]) -> dict | None:
    """The decision to switch and when the switch was done (twin: the ``route`` event; restart: ``switch-complete``)."""
    decision = next((e for e in events if e["event"] == "decision" and e.get("action") == "switch"), None)
    if kind == "twin":
        done = next((e for e in events if e["event"] == "route" and e.get("scope") == "default"), None)
    else:
        done = next((e for e in events if e["event"] == "switch-complete"), None)
    if decision is None or done is None:
        return None
    out = {"decision_ts": decision["ts"], "done_ts": done["ts"], "switch_ms": (done["ts"] - decision["ts"]) * 1000}
    if kind == "restart":
        out["timing"] = {k: done.get(k) for k in ("drain_s", "stop_s", "start_to_ready_s", "total_s")}
    else:
        out["reason"] = done.get("reason")
    return out


def one_run(kind: str, models: Path, work: Path, args, say) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    prof = work / f"{kind}.yaml"
    prof.write_text(profile_yaml(kind, models, free_port(), args))
    up = Up(prof, work, f"switch-{kind}")
    if args.cpus:  # before it starts its engines: they inherit it
        os.sched_setaffinity(up.proc.pid, {int(c) for c in args.cpus.split(",")})
    try:
        st = up.wait_ready(timeout=120)
        deadline = time.monotonic() + 120
        while kind == "twin" and not (len(st.get("engines", [])) == 2 and all(e["live"] for e in st["engines"])):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the twin did not come up: {st.get('engines')}")
            time.sleep(0.2)
            st = up.st()
        clients = Clients(st["url"], args.clients, args.tokens)

        async def drive() -> dict | None:
            task = asyncio.ensure_future(clients.run())
            moments, stop_at = None, time.monotonic() + args.timeout
            while time.monotonic() < stop_at:
                await asyncio.sleep(0.25)
                if moments is None:
                    moments = switch_moments(kind, up.events())
                    if moments is not None:
                        stop_at = min(stop_at, time.monotonic() + args.tail)
            clients.running = False
            await task
            return moments

        moments = asyncio.run(drive())
    finally:
        up.stop()
    return analyse(kind, clients, moments, args.steady, say)


def analyse(kind: str, clients: Clients, moments: dict | None, steady_s: float, say) -> dict:
    reqs = clients.requests
    lost = [r for r in reqs if not r.ok]
    out: dict = {"requests": len(reqs), "lost": len(lost), "lost_examples": [r.error for r in lost[:3]]}
    if moments is None:
        say(f"  {kind}: no switch seen")
        return {**out, "switch": None}
    t0, t1 = moments["decision_ts"], moments["done_ts"]
    ok = [r for r in reqs if r.ok]
    first = min(r.start for r in reqs)
    # steady state: what finished in the --steady seconds before the decision, past the first 2 s (engine warm)
    steady = [r.end - r.start for r in ok if r.start >= first + 2.0 and t0 - steady_s <= r.end < t0]
    during = [r.end - r.start for r in ok if r.start <= t1 and r.end >= t0]
    after = [r.end - r.start for r in ok if r.start > t1]
    gaps = _gaps([t for t in clients.token_times])
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    out.update(
        switch=moments,
        steady={"n": len(steady), "p50_ms": ms(percentile(steady, 50)), "p99_ms": ms(percentile(steady, 99))},
        during={"n": len(during), "p50_ms": ms(percentile(during, 50)), "p99_ms": ms(percentile(during, 99))},
        after={"n": len(after), "p50_ms": ms(percentile(after, 50)), "p99_ms": ms(percentile(after, 99))},
        longest_token_gap_ms=ms(max((g for t, g in gaps if t0 - 1 <= t <= t1 + 1), default=None)),
        steady_token_gap_ms=ms(max((g for t, g in gaps if t < t0 - 1), default=None)),
        after_drafted=sum(1 for r in ok if r.start > t1 and (r.drafted or 0) > 0),
    )
    # every request, seconds from the decision (start, latency), for the raw JSON
    out["timeline"] = [[round(r.start - t0, 3), round(r.end - r.start, 3), r.ok, r.stream, r.drafted] for r in reqs]
    p99s, p99d = out["steady"]["p99_ms"], out["during"]["p99_ms"]
    out["p99_during_vs_steady"] = p99d / p99s if p99s and p99d else None
    say(
        f"  {kind}: switch {moments['switch_ms']:.1f} ms, lost {len(lost)} of {len(reqs)}, p99 steady {p99s} ms, "
        f"during {p99d} ms ({out['p99_during_vs_steady'] or 0:.2f}x), token gap {out['longest_token_gap_ms']} ms"
    )
    return out


def _gaps(times: list[float]) -> list[tuple[float, float]]:
    """(when, how long) of each gap between consecutive streamed tokens, over all streaming clients."""
    ts = sorted(times)
    return [(b, b - a) for a, b in zip(ts, ts[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--parallel", type=int, default=4, help="slots per engine")
    ap.add_argument("--llama-threads", type=int, default=1, help="llama-server -t")
    ap.add_argument("--cpus", default="0", help="CPU set for each deployment (comma list; empty: unpinned)")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds before the decision that are the steady state")
    ap.add_argument("--tail", type=float, default=10.0, help="seconds of load after the switch")
    ap.add_argument("--timeout", type=float, default=180.0, help="give up on a switch after this long")
    ap.add_argument("--json")
    args = ap.parse_args()
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    from specops.devenv.testmodels import ensure_tiny_models
    from specops.paths import tiny_models_dir

    ensure_tiny_models(["gguf"])
    models = tiny_models_dir()
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specops-bench-switch-") as tmp:
        for rnd in range(args.rounds):
            for kind in KINDS if rnd % 2 == 0 else KINDS[::-1]:
                say(f"round {rnd + 1}/{args.rounds}: {kind}")
                runs[kind].append(one_run(kind, models, Path(tmp) / f"r{rnd}-{kind}", args, say))
    after = os.getloadavg()
    m = machine()
    print(
        f"A switch under {args.clients} clients (half streaming), llama-server, tiny GGUF target + noisy draft k=4 "
        f"(min_acceptance 0.9: certain to switch), {args.parallel} slots, -t {args.llama_threads}, pinned to CPU(s) "
        f"{args.cpus or 'any'}, {args.tokens} tokens/request; steady state: the {args.steady:g} s before the decision; "
        f"machine: "
        f"{m['cpu']}, {m['cores']} cores; {args.rounds} rounds, order alternating; load average {before[0]:.1f} "
        f"before, {after[0]:.1f} after\n"
    )
    print(
        "| | lost | switch ms | p50 / p99 steady ms | p50 / p99 during ms | p99 during ÷ steady | "
        "longest token gap at the switch ms (steady) |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in KINDS:
        rs = [r for r in runs[kind] if r.get("switch")]
        if not rs:
            print(f"| {kind} | {sum(r['lost'] for r in runs[kind])} | no switch | | | | |")
            continue
        med = lambda f, rs=rs: statistics.median(f(r) for r in rs)  # noqa: E731
        spread = lambda f, rs=rs: f"{min(f(r) for r in rs):.2f}–{max(f(r) for r in rs):.2f}"  # noqa: E731
        print(
            f"| {kind} | {sum(r['lost'] for r in runs[kind])} of {sum(r['requests'] for r in runs[kind])} | "
            f"{med(lambda r: r['switch']['switch_ms']):.1f} | "
            f"{med(lambda r: r['steady']['p50_ms']):.0f} / {med(lambda r: r['steady']['p99_ms']):.0f} | "
            f"{med(lambda r: r['during']['p50_ms']):.0f} / {med(lambda r: r['during']['p99_ms']):.0f} | "
            f"**{med(lambda r: r['p99_during_vs_steady']):.2f}** ({spread(lambda r: r['p99_during_vs_steady'])}) | "
            f"{med(lambda r: r['longest_token_gap_ms'] or 0):.0f} ({med(lambda r: r['steady_token_gap_ms'] or 0):.0f}) |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": m, "args": vars(args), "load_average": [before, after], "runs": runs}, indent=2)
            + "\n"
        )


if __name__ == "__main__":
    main()
