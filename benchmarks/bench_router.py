"""The router's cost per request: :meth:`specops.proxy.router.Router.route` on realistic requests, in-process.

Routing runs on every request of a profile with twins, so it must stay far below the proxy's own overhead (goal:
at most 0.2 ms p50, JSON peek included). Cases: no routing configured beyond twins (the header only), route rules
that need the body (``model`` and a system-prompt pattern: the JSON is parsed), learned classes keyed by a
hash of the system prompt, and model aliases (a request that names none: its ``model`` is read; one that names one:
its body is written again with the served name). Each case times ``--n`` calls one by one (perf_counter_ns) and reports p50/p99 in µs,
median over ``--rounds`` rounds.

    .venv/bin/python benchmarks/bench_router.py
    .venv/bin/python benchmarks/bench_router.py --n 20000 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import commit_of  # noqa: E402
from multidict import CIMultiDict  # noqa: E402

from specops.config.routing import Routing  # noqa: E402
from specops.perf.bench import machine  # noqa: E402
from specops.proxy.router import EngineInfo, Router  # noqa: E402

ENGINES = [EngineInfo(0, "ngram", True), EngineInfo(1, "none", False)]
LIVE = (True, True)
SYSTEM = "You are a careful assistant. " * 20  # ~600 characters of system prompt
SERVED = "tiny"  # the model name the engines serve (an alias is written over with it)


def _body(i: int, model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "max_tokens": 64,
            "temperature": 0.0,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Write function number {i} in Python. " * 30},  # ~1 KiB prompt
            ],
        }
    ).encode()


ALIASES = {"twins": ["none"], "aliases": {"tiny-fast": "on", "tiny-exact": "off"}}
#: case -> (the routing section, the ``model`` the requests name)
CASES = {
    "header only": ({"twins": ["none"]}, SERVED),
    "rules (model, system regex)": (
        {
            "twins": ["none"],
            "rules": [
                {"match": {"model": "creative"}, "speculation": "off"},
                {"match": {"system": "(?i)write a poem"}, "speculation": "off"},
            ],
        },
        SERVED,
    ),
    "classes by system hash": ({"twins": ["none"], "classes": {"key": "system", "max_classes": 64}}, SERVED),
    "aliases, none named": (ALIASES, SERVED),
    "aliases, one named": (ALIASES, "tiny-fast"),
}


def _time(router: Router, bodies: list[bytes], headers: list[CIMultiDict]) -> list[float]:
    out = []
    perf = time.perf_counter_ns
    for body, hdr in zip(bodies, headers):
        t0 = perf()
        router.route("/v1/chat/completions", hdr, body, LIVE, 0.0)
        out.append((perf() - t0) / 1000.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="calls per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    headers = [CIMultiDict({"Content-Type": "application/json", "Authorization": "Bearer x"}) for _ in range(args.n)]
    results = {}
    load_before = os.getloadavg()
    print(f"{'case':32} {'p50 µs':>8} {'p99 µs':>8}  (median of {args.rounds} rounds × {args.n} calls)")
    for name, (section, model) in CASES.items():
        bodies = [_body(i, model) for i in range(args.n)]
        p50s, p99s = [], []
        for _ in range(args.rounds):
            router = Router(Routing.model_validate(section), ENGINES)
            router.served = SERVED
            times = sorted(_time(router, bodies, headers))
            p50s.append(times[len(times) // 2])
            p99s.append(times[int(len(times) * 0.99)])
        results[name] = {"p50_us": round(statistics.median(p50s), 2), "p99_us": round(statistics.median(p99s), 2)}
        print(f"{name:32} {results[name]['p50_us']:8.2f} {results[name]['p99_us']:8.2f}")
    if args.json:
        report = {
            "machine": machine(),
            "tree": commit_of(ROOT),
            "load_average": [load_before, os.getloadavg()],
            "n": args.n,
            "rounds": args.rounds,
            "cases": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
