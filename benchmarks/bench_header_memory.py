"""Header memory: what hostile connections that send many large header lines (and never finish them) cost
the proxy process, before the API key can be checked.

The proxy runs in its own process (as inside ``specops up``, on the loop ``specops up`` picks), with an API
key the attacker does not have and no engine (nothing is ever forwarded). ``--connections`` loopback
connections each send a request line, then ``--lines`` header lines of ``--line-bytes`` bytes (each line in
``--pieces`` writes, one line every ``--interval`` seconds per connection), and never the blank line that
ends the headers. The proxy's RSS (``/proc/PID/status`` VmRSS) is read before, sampled every 50 ms during
(the peak is reported), and read after every attacking connection is closed (at once and 3 s later). How
each connection ended is counted: the status the proxy answered (431, 400, 503...), closed without an
answer, or still open when it had sent everything.

    .venv/bin/python benchmarks/bench_header_memory.py                         # 200 connections, defaults
    .venv/bin/python benchmarks/bench_header_memory.py --line-bytes 60000 --baseline HEAD~1   # before/after

``--baseline REV`` first runs the same attack against ``specops/proxy`` as it was at git revision REV.
``--json PATH`` also writes each run's figures, the work tree's commit, the machine and its load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import write_report  # noqa: E402
from bench_proxy import _baseline_module, _proxy_class, _spawn, _stop  # noqa: E402

KEY_ENV = "SPECOPS_BENCH_PROXY_KEY"  # the proxy's API key reaches the serving process in its environment


def rss_mib(pid: int) -> float:
    """The resident set of a process, in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _serve(module_path: str | None, max_connections: int, header_timeout: float) -> None:
    import signal

    Proxy = _proxy_class(module_path)
    proxy = Proxy(
        "127.0.0.1",
        0,
        queue_size=256,
        queue_timeout=30,
        drain_timeout=10,
        api_key=os.environ[KEY_ENV],
        max_connections=max_connections,
        header_timeout=header_timeout,
    )
    await proxy.start()
    proxy.set_upstream("http://127.0.0.1:9")  # never reached: no request gets past the key
    print(f"LISTENING {proxy.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await proxy.stop()


async def _status(port: int, key: str) -> dict:
    import aiohttp

    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{port}/specops/status", headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        return (await r.json())["proxy"]


async def _attacker(port: int, args, ended: Counter) -> None:
    """One hostile connection: a request line, then header lines without end; records how it ended."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        ended["connect failed"] += 1
        return
    answer: list[str] = []

    async def read_answer():
        try:
            first = await reader.readline()
        except (ConnectionError, OSError):
            first = b""
        answer.append(first.split()[1].decode() if first.startswith(b"HTTP/") else "closed, no answer")

    reading = asyncio.ensure_future(read_answer())
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n")
        value = b"a" * args.line_bytes
        step = max(1, len(value) // args.pieces)
        for i in range(args.lines):
            if reading.done():
                break
            line = b"X-Pad-%d: " % i + value + b"\r\n"
            for at in range(0, len(line), step):
                writer.write(line[at : at + step])
                await writer.drain()
            await asyncio.sleep(args.interval)
        await asyncio.wait_for(asyncio.shield(reading), 0.5)
    except asyncio.TimeoutError:  # before OSError: TimeoutError is one since Python 3.11
        answer.append("still open")
    except (ConnectionError, OSError):
        pass
    finally:
        if not reading.done():
            reading.cancel()
        ended[answer[0] if answer else "closed, no answer"] += 1
        writer.close()


async def _attack(pid: int, port: int, key: str, args) -> dict:
    for _ in range(20):  # warm up: the ordinary allocations of a serving proxy belong in "before"
        await _status(port, key)
    await asyncio.sleep(0.5)
    before = rss_mib(pid)
    peak = before
    sampling = True

    async def sample():
        nonlocal peak
        while sampling:
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample())
    ended: Counter = Counter()
    t0 = time.monotonic()
    await asyncio.gather(*(_attacker(port, args, ended) for _ in range(args.connections)))
    attack_s = time.monotonic() - t0
    sampling = False
    await sampler
    peak = max(peak, rss_mib(pid))
    deadline = time.monotonic() + 30
    st = await _status(port, key)
    while st.get("connections", 0) > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        st = await _status(port, key)
    after = rss_mib(pid)
    await asyncio.sleep(3.0)
    after3 = rss_mib(pid)
    return {
        "before": before,
        "peak": peak,
        "after": after,
        "after3": after3,
        "ended": dict(ended),
        "attack_s": attack_s,
        "counted": {k: st.get(k) for k in ("rejected_header_size", "rejected_malformed", "rejected_buffer_full")},
    }


def _report(name: str, desc: str, args, r: dict) -> str:
    per = (r["peak"] - r["before"]) / max(1, args.connections) * 1024
    ends = ", ".join(f"{k}: {v}" for k, v in sorted(r["ended"].items()))
    return (
        f"{name} ({desc})\n"
        f"  RSS MiB: before {r['before']:.1f}, peak during {r['peak']:.1f} (+{r['peak'] - r['before']:.1f}; "
        f"{per:.0f} KiB per connection), after close {r['after']:.1f}, 3 s later {r['after3']:.1f} "
        f"(+{r['after3'] - r['before']:.1f} held)\n"
        f"  connections ended: {ends}; attack took {r['attack_s']:.1f}s; proxy counted "
        + ", ".join(f"{k} {v}" for k, v in r["counted"].items() if v is not None)
        + "\n"
    )


def _figures(args, r: dict) -> dict:
    """What the report prints, as numbers: the growth during the attack and what was still held after it."""
    return {
        **r,
        "peak_growth_mib": round(r["peak"] - r["before"], 1),
        "per_connection_kib": round((r["peak"] - r["before"]) / max(1, args.connections) * 1024),
        "held_3s_after_close_mib": round(r["after3"] - r["before"], 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="specops proxy: RSS under connections that send endless headers.")
    p.add_argument("--connections", type=int, default=200)
    p.add_argument("--lines", type=int, default=128, help="header lines each connection sends (never ending them)")
    p.add_argument("--line-bytes", type=int, default=8000, help="bytes of each header value")
    p.add_argument("--pieces", type=int, default=2, help="writes per header line")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between a connection's lines")
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--header-timeout", type=float, default=10.0)
    p.add_argument("--baseline", metavar="REV", help="first run specops/proxy as it was at git revision REV")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: the proxy process
    p.add_argument("--serve-module", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        from specops.proxy import run_event_loop

        run_event_loop(_serve(args.serve_module, args.max_connections, args.header_timeout))
        return 0

    key = secrets.token_urlsafe(16)
    os.environ[KEY_ENV] = key
    specs: list[tuple[str, str | None, str]] = []
    tmp = None
    if args.baseline:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True, text=True, check=True
        ).stdout.strip()
        tmp = tempfile.mkdtemp(prefix="proxy_baseline_")
        module, where = _baseline_module(rev, tmp)
        specs.append((f"base-{rev}", module, f"{where} at {rev}"))
    specs.append(("new", None, "specops/proxy of the work tree"))
    print(
        f"{args.connections} connections x {args.lines} header lines of {args.line_bytes} bytes "
        f"({args.pieces} writes each, one line every {args.interval:g}s), never finished; "
        f"max_connections {args.max_connections}, header_timeout {args.header_timeout:g}s\n",
        flush=True,
    )
    load_before = os.getloadavg()
    runs = []
    for name, module, desc in specs:
        argv_ = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve",
            "--max-connections",
            str(args.max_connections),
            "--header-timeout",
            str(args.header_timeout),
        ]
        if module:
            argv_ += ["--serve-module", module]
        proc, port = _spawn(argv_)
        try:
            r = asyncio.run(_attack(proc.pid, port, key, args))
        finally:
            _stop(proc)
        print(_report(name, desc, args, r), flush=True)
        runs.append({"name": name, "proxy": desc, **_figures(args, r)})
    if args.json:
        write_report(args.json, ROOT, load_before, args=vars(args), runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
