"""What ``capture:`` (:mod:`specops.proxy.capture`) costs a client request on the proxy's path.

Three proxies in this process in front of the same protocol stand-in (``tests/support_upstream.py``), taking
turns round by round: no capture (``off``); capture at the default ``sample: 0.1`` (``0.1``); capture of every
request (``1.0``, the worst case: every answer copied, parsed and written on a later loop turn). Half the
requests stream (SSE, copied chunk by chunk when kept). Reports per-request medians and p99 from the client, and
the cost of one tap()+offer()+write outside a loop. The spot-check sampler's numbers
(``bench_spot_sampler.py``) are the reference.

    .venv/bin/python benchmarks/bench_capture.py [--rounds 21] [--requests 100] [--json out.json]

``--json PATH`` also writes the figures, the work tree's commit, the machine and its load average.
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
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import write_report  # noqa: E402
from support_upstream import Upstream, running_proxy  # noqa: E402 - tests/ is put on sys.path above

from specops.proxy.capture import Capture, CaptureFiles, CaptureSettings  # noqa: E402

PLAIN = json.dumps({"model": "m", "prompt": "def fibonacci(n):" * 8, "max_tokens": 16}).encode()
STREAM = json.dumps({"model": "m", "prompt": "def fibonacci(n):" * 8, "max_tokens": 16, "stream": True}).encode()
ANSWER = json.dumps({"choices": [{"text": " t" * 16, "finish_reason": "length"}]}).encode()


def _capture(folder: Path, sample: float) -> Capture:
    files = CaptureFiles(folder, max_bytes=1 << 30, max_file_bytes=16 << 20, max_age=86400)
    return Capture(files, CaptureSettings(sample, 256 * 1024, frozenset()))


def direct_cost(folder: Path, n: int = 20000) -> tuple[float, float]:
    """Seconds per request outside a loop: not sampled (one random draw), and kept (parse + JSON line written)."""
    skip, keep = _capture(folder / "skip", 1e-12), _capture(folder / "keep", 1.0)

    def once(cap):
        tap = cap.tap("POST", "/v1/completions", PLAIN, None)
        if tap is not None:
            cap.offer(tap, 200, ANSWER)

    return timeit.timeit(lambda: once(skip), number=n) / n, timeit.timeit(lambda: once(keep), number=n) / n


async def latencies(url: str, folder: Path, rounds: int, per: int) -> dict[str, list[float]]:
    import aiohttp

    lat: dict[str, list[float]] = {"off": [], "0.1": [], "1.0": []}
    async with running_proxy(url) as off, running_proxy(url) as tenth, running_proxy(url) as every:
        tenth.capture, every.capture = _capture(folder / "tenth", 0.1), _capture(folder / "every", 1.0)
        order = [("off", off), ("0.1", tenth), ("1.0", every)]
        async with aiohttp.ClientSession() as s:
            for r in range(rounds):
                for name, proxy in order[r % 3 :] + order[: r % 3]:
                    for i in range(per):
                        t = time.perf_counter()
                        async with s.post(
                            proxy.url + "/v1/completions",
                            data=STREAM if i % 2 else PLAIN,
                            headers={"Content-Type": "application/json"},
                        ) as resp:
                            await resp.read()
                        lat[name].append(time.perf_counter() - t)
        kept = every.capture.snapshot()["kept"]
    print(f"kept by the 1.0 proxy: {kept} of {rounds * per}")
    return lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--requests", type=int, default=100, help="sequential requests per proxy per round")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = p.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        skip, keep = direct_cost(Path(tmp))
        print(f"per request, no loop: not sampled {skip * 1e6:.2f} us; kept (parse + write) {keep * 1e6:.2f} us")
        with Upstream.start("bench") as eng:
            lat = asyncio.run(latencies(eng.url, Path(tmp), args.rounds, args.requests))
    rows = {}
    for name, v in lat.items():
        v.sort()
        rows[name] = {"p50_ms": statistics.median(v) * 1e3, "p99_ms": v[int(len(v) * 0.99)] * 1e3, "n": len(v)}
        print(f"{name:4}  p50 {rows[name]['p50_ms']:.3f} ms  p99 {rows[name]['p99_ms']:.3f} ms  n={len(v)}")
    if args.json:
        write_report(
            args.json,
            ROOT,
            load_before,
            args=vars(args),
            direct_us={"not_sampled": skip * 1e6, "kept": keep * 1e6},
            latency=rows,
        )


if __name__ == "__main__":
    main()
