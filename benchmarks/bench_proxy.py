"""Proxy overhead: specops' front proxy vs direct to the same engine, alternating in one run.

Latency: non-streamed ``/v1/completions`` (engine with zero per-token delay by default), per-request wall
time from the client, at each concurrency; reports p50/p99 direct and via the proxy and the added ms.
Throughput: streamed completions (a token stream), tokens received per second across all clients, at each
concurrency; reports the ratio proxy/direct. Direct and proxy runs alternate round by round so drift on a
shared machine hits both alike; the numbers are pooled over rounds.

The proxy runs in its own process (as it does inside ``specops up``), the client in this one, the engine
in a third: by default ``tests/support_upstream.py`` (an OpenAI-compatible stand-in). Give ``--engine-url``
to measure against a real engine instead (vLLM / llama-server), with ``--model`` for its served name.

    .venv/bin/python benchmarks/bench_proxy.py                       # stand-in engine, defaults
    .venv/bin/python benchmarks/bench_proxy.py --engine-url http://127.0.0.1:8001 --model tiny \\
        --max-tokens 16 --stream-tokens 64 --token-delay 0
    .venv/bin/python benchmarks/bench_proxy.py --json out.json      # also write the results as JSON
    .venv/bin/python benchmarks/bench_proxy.py --baseline HEAD~1 --loops asyncio uvloop   # before/after
    .venv/bin/python benchmarks/bench_proxy.py --bare aiohttp uvicorn      # bare pass-through HTTP layers beside it

``--baseline REV`` runs a second proxy process from ``specops/proxy`` as it was at git revision REV (on
asyncio's loop, as before), and ``--loops`` runs the current proxy once per event loop given; every proxy
takes its turn in the same alternating rounds as the direct runs, so before and after are measured side by
side under the same load. ``--bare`` adds bare pass-through proxies, the
HTTP layer alone with none of specops' checks, queue or routing (a lower bound of what a proxy on that layer
costs): ``aiohttp`` (aiohttp's server) and ``uvicorn`` (an ASGI app on uvicorn with httptools and uvloop), both
forwarding through one pooled aiohttp ``ClientSession``, so they differ only in the server side. uvicorn is no
dependency of specops: install it where the bench can import it (``pip install --target DIR uvicorn`` and
``PYTHONPATH=DIR``). Each row reports the pooled p50/p99 and the median over rounds of each round's added p50
(robust to drift between rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------------------ proxy process


def _proxy_class(module_path: str | None):
    if not module_path:
        from specops.proxy import Proxy

        return Proxy
    import importlib.util

    package = [os.path.dirname(module_path)] if os.path.basename(module_path) == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(
        "specops_proxy_baseline", module_path, submodule_search_locations=package
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod.Proxy


def _baseline_module(rev: str, into: str) -> tuple[str, str]:
    """The proxy as it was at ``rev``, written under ``into``: (the file to load, what it is). Before the
    proxy became a package it was one file, ``specops/proxy.py``; since then the package's modules import
    each other relatively, so the copy loads as a package of its own."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    listed = git("ls-tree", "-r", "--name-only", rev, "specops/proxy/").splitlines()
    names = [n for n in listed if n.endswith(".py")]
    if not names:
        path = os.path.join(into, "proxy_baseline.py")
        Path(path).write_text(git("show", f"{rev}:specops/proxy.py"))
        return path, "specops/proxy.py"
    package = Path(into, "specops_proxy_baseline")
    package.mkdir()
    for name in names:
        (package / name.rpartition("/")[2]).write_text(git("show", f"{rev}:{name}"))
    return str(package / "__init__.py"), "specops/proxy/"


async def _serve_proxy(upstream: str, module_path: str | None = None) -> None:
    import signal

    Proxy = _proxy_class(module_path)
    proxy = Proxy("127.0.0.1", 0, queue_size=256, queue_timeout=30, drain_timeout=10)
    await proxy.start()
    proxy.set_upstream(upstream)
    print(f"LISTENING {proxy.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await proxy.stop()


#: not forwarded by the bare proxies (hop-by-hop, or set by the server that answers)
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "proxy-connection"})


async def _serve_bare(kind: str, upstream: str) -> None:
    """A bare pass-through proxy on ``kind``'s server (``aiohttp`` or ``uvicorn``), aiohttp's pooled client
    to the engine: method, target, headers less hop-by-hop, body; the answer streamed back as it comes."""
    import signal
    import socket

    import aiohttp

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.setblocking(False)
    if kind == "aiohttp":
        from aiohttp import web

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            async with session.request(request.method, upstream + request.raw_path, data=body, headers=headers) as r:
                resp = web.StreamResponse(status=r.status)
                resp.headers.update({k: v for k, v in r.headers.items() if k.lower() not in _HOP})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        runner = web.ServerRunner(web.Server(handle, access_log=None), handle_signals=False)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        print(f"LISTENING {sock.getsockname()[1]}", flush=True)
        await stop.wait()
        await runner.cleanup()
    else:
        import uvicorn

        async def app(scope, receive, send):
            body, more = b"", True
            while more:
                msg = await receive()
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
            target = scope["raw_path"].decode("latin-1") + (
                "?" + scope["query_string"].decode("latin-1") if scope["query_string"] else ""
            )
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            headers = {k: v for k, v in headers if k.lower() not in _HOP}
            async with session.request(scope["method"], upstream + target, data=body, headers=headers) as r:
                out = [
                    (k.encode("latin-1"), v.encode("latin-1")) for k, v in r.headers.items() if k.lower() not in _HOP
                ]
                await send({"type": "http.response.start", "status": r.status, "headers": out})
                async for chunk in r.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        config = uvicorn.Config(
            app,
            http="httptools",
            loop="none",
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=30,
        )
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # uvicorn < 0.29; later ones read capture_signals
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        print(f"LISTENING {sock.getsockname()[1]}", flush=True)
        await asyncio.wait([task, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await task
    await session.close()


def _spawn(argv: list[str], timeout: float = 20.0) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("LISTENING"):
            return proc, int(line.split()[1])
    proc.kill()
    raise RuntimeError(f"{argv[:3]} did not start")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _cpu_seconds(pid: int | None) -> float | None:
    """User+system CPU time of a process (Linux /proc), to report the proxy's own cost per request."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------------------------ client side


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


async def _latency_round(
    session, url: str, body: bytes, concurrency: int, per_client: int, service_ms: float = 0.0, seed: int = 0
) -> list[float]:
    """Per-request latencies of ``concurrency`` clients sending ``per_client`` requests back to back.

    ``service_ms`` (stand-in only): each request asks the stand-in to take a service time drawn uniformly
    from [0.5, 1.5] x service_ms, from a seeded sequence that is the same for direct and proxy rounds, so
    clients do not stay in lockstep (real requests differ in length).
    """
    out: list[float] = []

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        headers = {"Content-Type": "application/json"}
        for _ in range(per_client):
            if service_ms:
                headers = {
                    "Content-Type": "application/json",
                    "X-Test-First-Delay": str(service_ms * rng.uniform(0.5, 1.5) / 1e3),
                }
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")
            out.append(time.perf_counter() - t0)

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return out


async def _stream_round(session, url: str, body: bytes, concurrency: int, per_client: int) -> tuple[int, float]:
    """Returns (token chunks received, wall seconds) for ``concurrency`` clients streaming.

    Streams ask for ``Connection: close`` in both modes: llama-server drops the connection after a stream
    without saying so, and a reused one would fail the next request (the proxy does the same upstream).
    """
    headers = {"Content-Type": "application/json", "Connection": "close"}
    tokens = 0

    async def client():
        nonlocal tokens
        for _ in range(per_client):
            async with session.post(url, data=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")
                done = False
                async for line in r.content:
                    if line.startswith(b"data: "):
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif b'"finish_reason":null' in line or b'"finish_reason": null' in line:
                            tokens += 1
                if not done:
                    raise RuntimeError("stream ended without [DONE]")

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


def _median(values: list[float]) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


async def _bench(args, engine_url: str, proxies: dict[str, tuple[str, int | None]], stream_extra: dict) -> dict:
    """``proxies``: name -> (url, pid). Every proxy and the direct path take turns in each round."""
    import aiohttp

    targets = {"direct": engine_url, **{name: url for name, (url, _) in proxies.items()}}
    names = list(targets)
    lat_body = json.dumps(
        {"model": args.model, "prompt": "hello world", "max_tokens": args.max_tokens, "temperature": 0}
    ).encode()
    stream_body = json.dumps(
        {
            "model": args.model,
            "prompt": "hello world",
            "max_tokens": args.stream_tokens,
            "temperature": 0,
            "stream": True,
            **stream_extra,
        }
    ).encode()
    results: dict = {"latency": [], "throughput": []}
    conn = aiohttp.TCPConnector(limit=0)

    def order(rnd: int) -> list[str]:  # rotate who goes first, so drift hits all alike
        k = rnd % len(names)
        out = names[k:] + names[:k]
        return out if rnd % 2 == 0 else out[::-1]

    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for base in targets.values():  # warm every path (connections, caches)
            await _latency_round(session, base + "/v1/completions", lat_body, 4, 10)
        for service_ms, c in itertools.product(args.service_ms, args.concurrency):
            # the stand-in's service time per request (X-Test-First-Delay); a real engine has its own
            service = 0.0 if args.engine_url else service_ms
            lat: dict[str, list[float]] = {n: [] for n in names}
            round_p50: dict[str, list[float]] = {n: [] for n in names}
            round_p99: dict[str, list[float]] = {n: [] for n in names}
            cpu0 = {n: _cpu_seconds(pid) for n, (_, pid) in proxies.items()}
            results.setdefault("loadavg_1m_at_blocks", []).append(os.getloadavg()[0])
            n_req = args.requests if not service_ms else args.requests // 4
            per_client = max(8 if service_ms else 1, n_req // c)
            for rnd in range(args.rounds):
                for name in order(rnd):
                    got = await _latency_round(
                        session, targets[name] + "/v1/completions", lat_body, c, per_client, service, seed=rnd
                    )
                    lat[name] += got
                    round_p50[name].append(_pct(got, 0.5))
                    round_p99[name].append(_pct(got, 0.99))
            cpu1 = {n: _cpu_seconds(pid) for n, (_, pid) in proxies.items()}
            d50, d99 = _pct(lat["direct"], 0.5), _pct(lat["direct"], 0.99)
            for name in proxies:
                p50, p99 = _pct(lat[name], 0.5), _pct(lat[name], 0.99)
                deltas = [a - b for a, b in zip(round_p50[name], round_p50["direct"])]
                deltas99 = [a - b for a, b in zip(round_p99[name], round_p99["direct"])]
                results["latency"].append(
                    {
                        "proxy": name,
                        "clients": c,
                        "service_ms": service_ms,
                        "n": len(lat[name]),
                        "direct_p50_ms": d50 * 1e3,
                        "direct_p99_ms": d99 * 1e3,
                        "proxy_p50_ms": p50 * 1e3,
                        "proxy_p99_ms": p99 * 1e3,
                        "added_p50_ms": (p50 - d50) * 1e3,
                        "added_p99_ms": (p99 - d99) * 1e3,
                        "median_round_added_p50_ms": _median(deltas) * 1e3,
                        "median_round_added_p99_ms": _median(deltas99) * 1e3,
                        # the spread of the per-round added latency: its 25th and 75th percentiles over rounds
                        "round_added_p50_iqr_ms": [_pct(deltas, 0.25) * 1e3, _pct(deltas, 0.75) * 1e3],
                        "round_added_p99_iqr_ms": [_pct(deltas99, 0.25) * 1e3, _pct(deltas99, 0.75) * 1e3],
                        "proxy_cpu_us_per_request": None
                        if cpu0[name] is None or cpu1[name] is None
                        else (cpu1[name] - cpu0[name]) / len(lat[name]) * 1e6,
                    }
                )
        for c in args.concurrency:
            tok = {n: [0, 0.0] for n in names}
            cpu0 = {n: _cpu_seconds(pid) for n, (_, pid) in proxies.items()}
            results.setdefault("loadavg_1m_at_blocks", []).append(os.getloadavg()[0])
            per_client = max(2, args.stream_requests // c)
            for rnd in range(args.stream_rounds):
                for name in order(rnd):
                    n, secs = await _stream_round(
                        session, targets[name] + "/v1/completions", stream_body, c, per_client
                    )
                    tok[name][0] += n
                    tok[name][1] += secs
            cpu1 = {n: _cpu_seconds(pid) for n, (_, pid) in proxies.items()}
            dt = tok["direct"][0] / tok["direct"][1]
            for name in proxies:
                pt = tok[name][0] / tok[name][1]
                results["throughput"].append(
                    {
                        "proxy": name,
                        "clients": c,
                        "direct_tok_s": dt,
                        "proxy_tok_s": pt,
                        "ratio": pt / dt,
                        "tokens": tok[name][0],
                        "proxy_cpu_us_per_token": None
                        if cpu0[name] is None or cpu1[name] is None
                        else (cpu1[name] - cpu0[name]) / tok[name][0] * 1e6,
                    }
                )
    return results


#: the figures :func:`_summary` gives as [median, min, max] over runs
_SUMMED = {
    "latency": (
        "direct_p50_ms",
        "added_p50_ms",
        "median_round_added_p50_ms",
        "added_p99_ms",
        "median_round_added_p99_ms",
        "proxy_cpu_us_per_request",
    ),
    "throughput": ("direct_tok_s", "ratio", "proxy_cpu_us_per_token"),
}


def _summary(runs: list[dict]) -> dict:
    """Per proxy and concurrency (and service time): each figure of :data:`_SUMMED` as [median, min, max]
    over the runs."""
    out: dict = {}
    for kind, figures in _SUMMED.items():
        rows: dict[tuple, list[dict]] = {}
        for res in runs:
            for r in res[kind]:
                rows.setdefault((r["proxy"], r["clients"], r.get("service_ms")), []).append(r)
        out[kind] = []
        for (proxy, clients, service_ms), rs in rows.items():
            row: dict = {"proxy": proxy, "clients": clients}
            if service_ms is not None:
                row["service_ms"] = service_ms
            for f in figures:
                vals = [r[f] for r in rs if r[f] is not None]
                row[f] = [_median(vals), min(vals), max(vals)] if vals else None
            out[kind].append(row)
    return out


def _us(v) -> str:
    return "n/a" if v is None else f"{v:.0f} us"


def _report(args, res: dict, engine: str, proxies: dict[str, str]) -> str:
    w = max(5, *(len(n) for n in proxies))
    lines = (
        [f"engine: {engine}"]
        + [f"proxy {n}: {desc}" for n, desc in proxies.items()]
        + [
            f"latency: non-streamed, max_tokens={args.max_tokens}, "
            f"{args.rounds} alternating rounds of ~{args.requests} requests per path "
            f"(1/4 of that with a service time)",
            f"{'proxy':<{w}} {'clients':>7} {'service':>7} {'direct p50':>10} {'proxy p50':>10} {'added p50':>10} "
            f"{'med. round':>10} {'direct p99':>10} {'proxy p99':>10} {'added p99':>10} {'med. round':>10} "
            f"{'proxy CPU/req':>13}   (times in ms; med. round: the median over rounds of each round's added "
            f"latency, [25th-75th percentile over rounds])",
        ]
    )
    for r in res["latency"]:
        lines.append(
            f"{r['proxy']:<{w}} {r['clients']:>7} {r['service_ms']:>7g} {r['direct_p50_ms']:10.3f} "
            f"{r['proxy_p50_ms']:10.3f} {r['added_p50_ms']:10.3f} {r['median_round_added_p50_ms']:10.3f} "
            f"{r['direct_p99_ms']:10.3f} {r['proxy_p99_ms']:10.3f} {r['added_p99_ms']:10.3f} "
            f"{r['median_round_added_p99_ms']:10.3f} {_us(r['proxy_cpu_us_per_request']):>13}"
            f"   [{r['round_added_p50_iqr_ms'][0]:.3f} .. {r['round_added_p50_iqr_ms'][1]:.3f}] p50"
            f"  [{r['round_added_p99_iqr_ms'][0]:.3f} .. {r['round_added_p99_iqr_ms'][1]:.3f}] p99"
        )
    lines += [
        f"throughput: streamed, {args.stream_tokens} tokens per request, token delay "
        f"{args.token_delay * 1e3:g} ms (stand-in engine only), {args.stream_rounds} alternating rounds",
        f"{'proxy':<{w}} {'clients':>7} {'direct tok/s':>13} {'proxy tok/s':>12} {'ratio':>7} {'proxy CPU/token':>15}",
    ]
    for r in res["throughput"]:
        lines.append(
            f"{r['proxy']:<{w}} {r['clients']:>7} {r['direct_tok_s']:13.1f} {r['proxy_tok_s']:12.1f} "
            f"{r['ratio']:7.3f} {_us(r['proxy_cpu_us_per_token']):>15}"
        )
    return "\n".join(lines)


def _default_loop() -> str:
    """The loop `specops up` runs the proxy on."""
    from specops.proxy import loop_factory

    return "asyncio" if loop_factory() is None else "uvloop"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="specops proxy overhead: proxy vs direct, alternating.")
    p.add_argument("--engine-url", help="measure against this running engine (default: start the stand-in)")
    p.add_argument("--model", default="tiny-test-model", help="model name sent in requests")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=20, help="alternating direct/proxy latency rounds")
    p.add_argument("--requests", type=int, default=120, help="latency requests per round per path")
    p.add_argument("--stream-rounds", type=int, default=6, help="alternating direct/proxy streaming rounds")
    p.add_argument(
        "--service-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="stand-in engine: fixed time per latency request, one run each (0: answer at once)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per latency request")
    p.add_argument(
        "--stream-requests", type=int, default=4, help="streamed requests per round per path (at least 2 per client)"
    )
    p.add_argument("--stream-tokens", type=int, default=128, help="tokens per streamed request")
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.005,
        help="stand-in engine: seconds per streamed token (latency runs use 0)",
    )
    p.add_argument(
        "--loops",
        nargs="+",
        choices=("asyncio", "uvloop"),
        default=None,
        help="event loop(s) to run the current proxy on, one proxy process each (default: the one `specops up` uses)",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also run specops/proxy (a package, or proxy.py before it was one) from git "
        "revision REV (asyncio loop), side by side",
    )
    p.add_argument(
        "--bare",
        nargs="+",
        choices=("aiohttp", "uvicorn"),
        default=[],
        help="also run bare pass-through proxies on these servers (uvloop, aiohttp's client to the engine)",
    )
    p.add_argument("--runs", type=int, default=1, help="repeat the whole measurement; the JSON adds a summary")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--serve-proxy", help=argparse.SUPPRESS)  # internal: run the proxy process
    p.add_argument("--serve-module", help=argparse.SUPPRESS)  # internal: the proxy module file to run
    p.add_argument("--serve-loop", default="asyncio", help=argparse.SUPPRESS)
    p.add_argument("--serve-bare", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_proxy and args.serve_bare:
        import uvloop

        uvloop.run(_serve_bare(args.serve_bare, args.serve_proxy))
        return 0
    if args.serve_proxy:
        if args.serve_loop == "uvloop":
            import uvloop

            uvloop.run(_serve_proxy(args.serve_proxy, args.serve_module))
        else:
            asyncio.run(_serve_proxy(args.serve_proxy, args.serve_module))
        return 0

    procs = []
    tmp = None
    try:
        if args.engine_url:
            engine_url = args.engine_url.rstrip("/")
            engine_desc = engine_url
        else:
            # the stand-in takes a per-request token delay, so one process serves both runs:
            # zero for latency, --token-delay for streams (sent in the body, ignored by real engines)
            proc, port = _spawn(
                [
                    sys.executable,
                    str(ROOT / "tests" / "support_upstream.py"),
                    "--port",
                    "0",
                    "--name",
                    "bench",
                    "--token-delay",
                    "0",
                ]
            )
            procs.append(proc)
            engine_url = f"http://127.0.0.1:{port}"
            engine_desc = "tests/support_upstream.py (stand-in, separate process)"
        specs: list[tuple[str, str | None, str, str | None, str]] = []  # name, module file, loop, bare, description
        if args.baseline:
            import tempfile

            rev = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            tmp = tempfile.mkdtemp(prefix="proxy_baseline_")
            module, where = _baseline_module(rev, tmp)
            specs.append((f"base-{rev}", module, "asyncio", None, f"{where} at {rev}, asyncio loop"))
        here = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            or "?"
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "specops/proxy"], capture_output=True, text=True
        ).stdout.strip()
        for loop_name in args.loops or [_default_loop()]:
            specs.append(
                (
                    f"new-{loop_name}",
                    None,
                    loop_name,
                    None,
                    f"specops/proxy of the work tree ({here}{'+changes' if dirty else ''}), {loop_name} loop",
                )
            )
        for kind in args.bare:
            server = "aiohttp's server" if kind == "aiohttp" else "uvicorn (httptools, ASGI)"
            specs.append((f"bare-{kind}", None, "uvloop", kind, f"bare pass-through: {server}, aiohttp client, uvloop"))
        proxies: dict[str, tuple[str, int | None]] = {}
        for name, module, loop_name, bare, _ in specs:
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--serve-proxy",
                engine_url,
                "--serve-loop",
                loop_name,
            ]
            if module:
                argv += ["--serve-module", module]
            if bare:
                argv += ["--serve-bare", bare]
            proc, pport = _spawn(argv)
            procs.append(proc)
            proxies[name] = (f"http://127.0.0.1:{pport}", proc.pid)
        # the stand-in reads a per-request token delay from the body (a real engine ignores no such field,
        # so it is only sent to the stand-in)
        stream_extra = {} if args.engine_url else {"x_token_delay": args.token_delay}
        runs = []
        for run in range(args.runs):
            t0 = time.monotonic()
            load0 = os.getloadavg()[0]
            res = asyncio.run(_bench(args, engine_url, proxies, stream_extra))
            res["loadavg_1m"] = [load0, os.getloadavg()[0]]
            res["utc"] = [
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() - (time.monotonic() - t0))),
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            ]
            runs.append(res)
            if args.runs > 1:
                print(f"--- run {run + 1} of {args.runs}")
            print(_report(args, res, engine_desc, {name: desc for name, _, _, _, desc in specs}))
            print(
                f"total {time.monotonic() - t0:.1f}s, cpus={os.cpu_count()}, python {sys.version.split()[0]}, "
                f"1-min load average before/after {res['loadavg_1m'][0]:.2f}/{res['loadavg_1m'][1]:.2f}, "
                f"at each block {' '.join(f'{v:.1f}' for v in res['loadavg_1m_at_blocks'])}",
                flush=True,
            )
        summary = _summary(runs)
        if args.runs > 1:
            print(f"--- median (min..max) of {args.runs} runs")
            for row in summary["latency"] + summary["throughput"]:
                print(
                    "  ".join(
                        f"{k} {v}" if not isinstance(v, list) else f"{k} {v[0]:.3g} ({v[1]:.3g}..{v[2]:.3g})"
                        for k, v in row.items()
                    )
                )
        if args.json:
            doc = {"args": {k: v for k, v in vars(args).items() if not k.startswith("serve_")}}
            doc["proxies"] = {name: desc for name, _, _, _, desc in specs}
            doc.update({"results": runs[0]} if args.runs == 1 else {"runs": runs, "summary": summary})
            Path(args.json).write_text(json.dumps(doc, indent=1))
    finally:
        for proc in reversed(procs):
            _stop(proc)
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
