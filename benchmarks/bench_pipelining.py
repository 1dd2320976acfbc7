"""Pipelined requests that are never read: what they cost a bystander and the proxy's memory.

``--connections`` loopback connections each write ``--mbytes`` MB of pipelined ``GET /health`` (served
without the API key, which the proxy has and the attacker does not) and never read an answer. Meanwhile a
bystander on a connection of its own asks ``GET /health`` once every 0.2 s; its slowest wait is reported.
The proxy's RSS (``/proc/PID/status`` VmRSS) is read before, sampled during (the peak is reported) and read
3 s after every attacking connection is closed. The proxy runs in its own process on the loop ``specops up``
picks, in front of the stand-in engine (``tests/support_upstream.py``).

    .venv/bin/python benchmarks/bench_pipelining.py --connections 50 --json out.json
    .venv/bin/python benchmarks/bench_pipelining.py --baseline HEAD~1     # the proxy at HEAD~1 first, same attack
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_header_memory import rss_mib  # noqa: E402
from bench_proxy import _baseline_module, _proxy_class, _spawn, _stop  # noqa: E402

KEY_ENV = "SPECOPS_BENCH_PROXY_KEY"  # the proxy's API key reaches the serving process in its environment
REQUEST = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def _serve(upstream: str, module_path: str | None, http: str | None) -> None:
    import signal

    Proxy = _proxy_class(module_path)
    extra = {"http": http} if http else {}
    proxy = Proxy(
        "127.0.0.1", 0, queue_size=256, queue_timeout=30, drain_timeout=10, api_key=os.environ[KEY_ENV], **extra
    )
    await proxy.start()
    proxy.set_upstream(upstream)
    print(f"LISTENING {proxy.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await proxy.stop()


async def _health(port: int, timeout: float = 60.0) -> tuple[float, int]:
    """One bystander ``GET /health`` on a new connection: (seconds to the status line, status; 0: none)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            line = await asyncio.wait_for(reader.readline(), timeout)
        finally:
            writer.close()
        return time.perf_counter() - t0, int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    except (asyncio.TimeoutError, OSError, ValueError, IndexError):
        return time.perf_counter() - t0, 0


async def _attack(port: int, pid: int, connections: int, mbytes: float) -> dict:
    payload = REQUEST * int(mbytes * 1e6 // len(REQUEST))
    before = rss_mib(pid)
    peak = before
    waits: list[float] = []
    statuses: list[int] = []
    writers = []
    stop = asyncio.Event()

    async def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.05)

    async def bystander():
        while not stop.is_set():
            secs, status = await _health(port)
            waits.append(secs)
            statuses.append(status)
            await asyncio.sleep(0.2)

    tasks = [asyncio.ensure_future(sample()), asyncio.ensure_future(bystander())]
    t0 = time.monotonic()
    for _ in range(connections):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)  # never drained, never read: the client's transport holds what the proxy refuses
        writers.append(writer)
    await asyncio.sleep(5.0)  # the proxy works through what it read while the bystander asks
    stop.set()
    await asyncio.gather(*tasks)
    during = rss_mib(pid)
    for w in writers:
        w.transport.abort()
    await asyncio.sleep(3.0)
    after = rss_mib(pid)
    return {
        "connections": connections,
        "mbytes_each": mbytes,
        "requests_each": len(payload) // len(REQUEST),
        "bystander_max_wait_s": max(waits),
        "bystander_median_wait_s": sorted(waits)[len(waits) // 2],
        "bystander_asks": len(waits),
        "bystander_not_200": sum(1 for s in statuses if s != 200),
        "rss_before_mib": before,
        "rss_peak_mib": peak,
        "rss_at_5s_mib": during,
        "rss_3s_after_close_mib": after,
        "grew_peak_mib": peak - before,
        "kept_after_close_mib": after - before,
        "seconds": time.monotonic() - t0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="pipelined requests never read: bystander wait and proxy memory")
    p.add_argument("--connections", type=int, nargs="+", default=[50])
    p.add_argument("--mbytes", type=float, default=1.0, help="MB of pipelined GETs each connection writes")
    p.add_argument("--http", nargs="+", default=[None], help="proxy.http layer(s) of the proxy (where it has one)")
    p.add_argument("--baseline", metavar="REV", help="also run specops/proxy as it was at git revision REV, first")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--serve-module", help=argparse.SUPPRESS)
    p.add_argument("--serve-http", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        from specops.proxy import run_event_loop

        run_event_loop(_serve(args.serve, args.serve_module, args.serve_http))
        return 0

    tmp = tempfile.mkdtemp(prefix="bench_pipelining_")
    trees: list[tuple[str, str | None]] = []
    if args.baseline:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True, text=True, check=True
        ).stdout.strip()
        trees.append((f"base-{rev}", _baseline_module(rev, tmp)[0]))
    trees.append(("now", None))
    engine, eport = _spawn(
        [
            sys.executable,
            str(ROOT / "tests" / "support_upstream.py"),
            "--port",
            "0",
            "--name",
            "E",
            "--token-delay",
            "0",
        ]
    )
    env = {**os.environ, KEY_ENV: secrets.token_hex(16)}
    rows = []
    try:
        for (tree, module), http, n in ((t, h, n) for t in trees for h in args.http for n in args.connections):
            argv = [sys.executable, str(Path(__file__).resolve()), "--serve", f"http://127.0.0.1:{eport}"]
            argv += ["--serve-module", module] if module else []
            argv += ["--serve-http", http] if http else []
            os.environ[KEY_ENV] = env[KEY_ENV]
            proxy, port = _spawn(argv)
            try:
                row = {"proxy": tree, "http": http, **asyncio.run(_attack(port, proxy.pid, n, args.mbytes))}
            finally:
                _stop(proxy)
            rows.append(row)
            print(
                f"{tree:>12} {http or '-':>8} N={n:<4} bystander max {row['bystander_max_wait_s']:.3f}s "
                f"(median {row['bystander_median_wait_s']:.3f}s, {row['bystander_asks']} asks, "
                f"{row['bystander_not_200']} not 200)  RSS {row['rss_before_mib']:.0f} MiB, peak +"
                f"{row['grew_peak_mib']:.1f}, kept after close +{row['kept_after_close_mib']:.1f}",
                flush=True,
            )
    finally:
        _stop(engine)
    print(f"cpus={os.cpu_count()}, 1-min load average {os.getloadavg()[0]:.2f}")
    if args.json:
        doc = {"args": {k: v for k, v in vars(args).items() if not k.startswith("serve")}, "rows": rows}
        doc["loadavg_1m"] = os.getloadavg()[0]
        git = ["git", "-C", str(ROOT)]
        doc["tree"] = {  # what "now" measured: the commit, and whether specops/proxy had changes beyond it
            "commit": subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "proxy_changes": bool(
                subprocess.run([*git, "status", "--porcelain", "specops/proxy"], capture_output=True, text=True).stdout
            ),
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
