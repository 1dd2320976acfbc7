"""What the live spot-check sampler (``certify.spot_check``, :mod:`specops.proxy.sample`) costs a client request.

Three proxies in this process in front of the same protocol stand-in (``tests/support_upstream.py``), taking
turns round by round: no sampler (``off``); a sampler that is always full (``full``, the steady state in
``specops up``: it keeps at most ``2 × sample`` requests between checks and drops the rest with two
comparisons); and a sampler that is never full (``on``, the worst case: every greedy answer is byte-checked,
copied and JSON-parsed on a later loop turn). Reports per-request p50/p99 from the client and the cost of one
``offer()`` call.

    .venv/bin/python benchmarks/bench_spot_sampler.py [--rounds 21] [--requests 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from support_upstream import Upstream, running_proxy  # noqa: E402 - tests/ is put on sys.path above

from specops.proxy.sample import LiveSampler  # noqa: E402

BODY = json.dumps({"model": "m", "prompt": "def fibonacci(n):" * 8, "max_tokens": 16, "temperature": 0}).encode()
ANSWER = json.dumps({"choices": [{"text": " t" * 16, "finish_reason": "length"}]}).encode()


def offer_cost(n: int = 20000) -> tuple[float, float]:
    """Seconds per offer(): to a full sampler, and kept (outside a loop, so the parse runs inside the call)."""
    full = LiveSampler(max_entries=1)
    full.offer("POST", "/v1/completions", {}, BODY, 200, ANSWER)
    roomy = LiveSampler(max_entries=10**9, max_entry_bytes=1 << 20, max_bytes=1 << 40)
    t_full = timeit.timeit(lambda: full.offer("POST", "/v1/completions", {}, BODY, 200, ANSWER), number=n) / n
    t_kept = timeit.timeit(lambda: roomy.offer("POST", "/v1/completions", {}, BODY, 200, ANSWER), number=n) / n
    return t_full, t_kept


async def latencies(url: str, rounds: int, per: int) -> dict[str, list[float]]:
    import aiohttp

    lat: dict[str, list[float]] = {"off": [], "full": [], "on": []}
    roomy = LiveSampler(max_entries=10**9, max_entry_bytes=1 << 20, max_bytes=1 << 40)
    async with (
        running_proxy(url) as off,
        running_proxy(url, sampler=LiveSampler(max_entries=4)) as full,
        running_proxy(url, sampler=roomy) as on,
    ):
        order = [("off", off), ("full", full), ("on", on)]
        async with aiohttp.ClientSession() as s:
            for r in range(rounds):
                for name, proxy in order[r % 3 :] + order[: r % 3]:
                    for _ in range(per):
                        t = time.perf_counter()
                        async with s.post(
                            proxy.url + "/v1/completions", data=BODY, headers={"Content-Type": "application/json"}
                        ) as resp:
                            await resp.read()
                        lat[name].append(time.perf_counter() - t)
                roomy.take(10**9)
    return lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--requests", type=int, default=100, help="sequential requests per proxy per round")
    args = p.parse_args()
    t_full, t_kept = offer_cost()
    print(
        f"offer(): to a full sampler {t_full * 1e6:.2f} us; kept (byte checks, copy, JSON parse) {t_kept * 1e6:.2f} us"
    )
    with Upstream.start("bench") as eng:
        lat = asyncio.run(latencies(eng.url, args.rounds, args.requests))
    for name, v in lat.items():
        v.sort()
        print(
            f"{name:4}  p50 {statistics.median(v) * 1e3:.3f} ms  p99 {v[int(len(v) * 0.99)] * 1e3:.3f} ms  n={len(v)}"
        )


if __name__ == "__main__":
    main()
