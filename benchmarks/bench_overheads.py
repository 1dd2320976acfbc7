"""specops' own overheads: CLI cold start, what it imports, and the watcher's CPU use.

1. **Cold start** of ``specops render`` and ``specops validate`` (goal: ≤ 0.3 s): each run is a new
   process; the median of ``--runs`` runs is reported next to a bare ``python -c pass`` measured
   alternately in the same run (the interpreter's own start-up, which specops cannot shave).
2. **Import-time breakdown** of ``specops render`` from ``python -X importtime``: self+children time per
   top-level package, and the check that no engine (torch, vllm, llama_cpp, transformers) and no HTTP /
   Prometheus client is imported for render/validate.
3. **Watcher CPU**: ``specops up`` on the tiny llama-server fixture, idle, at several
   ``monitor.interval`` values: CPU seconds of the specops process (supervisor + proxy + watcher; the
   engine is another process) per wall second, measured from /proc, next to the engine's own idle CPU;
   and the CPU cost of one watcher tick (scrape + parse + window), from the watcher's reader in-process.

    .venv/bin/python benchmarks/bench_overheads.py
    .venv/bin/python benchmarks/bench_overheads.py --runs 15 --idle 20 --intervals 0.5,1,5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PY = sys.executable
RENDER = ["render", str(ROOT / "profiles" / "llama31-8b-eagle3.yaml"), "--backend-version", "0.32.0"]
VALIDATE = ["validate", str(ROOT / "profiles")]
ENGINE_MODULES = ("torch", "vllm", "llama_cpp", "transformers")
HEAVY_MODULES = (
    "aiohttp",
    "prometheus_client",
    "prometheus_api_client",
    "huggingface_hub",
    "requests",
    "matplotlib",
    "numpy",
    "gguf",
)
CLK = os.sysconf("SC_CLK_TCK")


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=ROOT)
    return time.perf_counter() - t0


def cold_start(runs: int) -> dict:
    cmds = {
        "python -c pass": [PY, "-c", "pass"],
        "specops --version": [PY, "-m", "specops.cli", "--version"],
        "specops render": [PY, "-m", "specops.cli", *RENDER],
        "specops validate profiles/": [PY, "-m", "specops.cli", *VALIDATE],
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for argv in cmds.values():  # one unmeasured run each: page cache, .pyc files
        timed(argv)
    for i in range(runs):
        for k, argv in list(cmds.items()) if i % 2 == 0 else list(cmds.items())[::-1]:
            times[k].append(timed(argv))
    return {
        k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": len(v)}
        for k, v in times.items()
    }


def import_breakdown(top: int = 12) -> dict:
    """``-X importtime`` of ``specops render``: cumulative µs per top-level package and the slowest modules."""
    res = subprocess.run(
        [PY, "-X", "importtime", "-m", "specops.cli", *RENDER], capture_output=True, text=True, cwd=ROOT
    )
    rows = []
    for line in res.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)))
    by_pkg: dict[str, int] = {}
    for self_us, _cum, _depth, name in rows:
        pkg = name.split(".")[0]
        by_pkg[pkg] = by_pkg.get(pkg, 0) + self_us
    total = sum(by_pkg.values())
    by_self = sorted(rows, key=lambda r: -r[0])[:top]
    # which modules a render loads (no engine, no HTTP client)
    probe = (
        "import sys, runpy\nsys.argv = ['specops'] + " + repr(RENDER) + "\ntry:\n    runpy.run_module('specops.cli', "
        "run_name='__main__')\nexcept SystemExit:\n    pass\nimport json\nprint(json.dumps(sorted({m.split('.')[0] "
        "for m in sys.modules})), file=sys.stderr)\n"
    )
    loaded = set(
        json.loads(
            subprocess.run([PY, "-c", probe], capture_output=True, text=True, cwd=ROOT).stderr.strip().splitlines()[-1]
        )
    )
    return {
        "total_ms": total / 1000,
        "by_package_ms": dict(sorted(((k, v / 1000) for k, v in by_pkg.items()), key=lambda kv: -kv[1])[:top]),
        "slowest_modules_ms": [(name, self_us / 1000) for self_us, _c, _d, name in by_self],
        "engines_imported": sorted(loaded & set(ENGINE_MODULES)),
        "heavy_imported": sorted(loaded & set(HEAVY_MODULES)),
    }


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK  # utime + stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def watcher_cpu(intervals: list[float], idle: float) -> list[dict]:
    from specops.devenv.testmodels import ensure_tiny_models

    models = ensure_tiny_models(["gguf"])
    out = []
    with tempfile.TemporaryDirectory(prefix="specops-bench-overheads-") as tmp:
        for interval in intervals:
            name = f"overhead-{str(interval).replace('.', '-')}"
            prof = Path(tmp) / f"{name}.yaml"
            prof.write_text(
                f"name: {name}\nbackend: llamacpp\n"
                f"model:\n  id: {models['gguf-target.gguf']}\n  max_model_len: 512\n"
                f"speculative:\n  method: draft_model\n  draft: {models['gguf-draft-same.gguf']}\n"
                f"gpus:\n  devices: []\nserver:\n  port: {free_port()}\n"
                f"monitor:\n  interval: {interval}\nsupervisor:\n  stop_timeout: 10\n"
            )
            env = {**os.environ, "SPECOPS_STATE": str(Path(tmp) / "state")}
            proc = subprocess.Popen(
                [PY, "-m", "specops.cli", "up", str(prof), "--quiet-engine"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                state = Path(tmp) / "state" / name / "state.json"
                deadline = time.monotonic() + 60
                st = {}
                while time.monotonic() < deadline and st.get("state") != "ready":
                    time.sleep(0.2)
                    try:
                        st = json.loads(state.read_text())
                    except (FileNotFoundError, ValueError):
                        st = {}
                if st.get("state") != "ready":
                    raise RuntimeError("specops up did not become ready")
                time.sleep(2.0)  # let start-up work settle
                eng_pid = st["engine_pid"]
                c0, e0, t0 = cpu_seconds(proc.pid), cpu_seconds(eng_pid), time.monotonic()
                time.sleep(idle)
                c1, e1, t1 = cpu_seconds(proc.pid), cpu_seconds(eng_pid), time.monotonic()
                out.append(
                    {
                        "interval_s": interval,
                        "specops_cpu_pct": 100 * (c1 - c0) / (t1 - t0),
                        "engine_cpu_pct": 100 * (e1 - e0) / (t1 - t0),
                        "seconds": t1 - t0,
                    }
                )
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    return out


def tick_cost(ticks: int) -> dict:
    """CPU per watcher tick (scrape + parse + window) against a real llama-server, in this process."""
    import asyncio

    from specops.config.profile import load_profile
    from specops.devenv.testmodels import ensure_tiny_models
    from specops.perf.launch import launched
    from specops.perf.workload import Prompt, run_workload
    from specops.plugins import get_registry
    from specops.watch.watcher import AcceptanceReader

    models = ensure_tiny_models(["gguf"])
    registry = get_registry()
    with tempfile.TemporaryDirectory(prefix="specops-bench-tick-") as tmp:
        prof = Path(tmp) / "tick.yaml"
        prof.write_text(
            f"name: tick\nbackend: llamacpp\nmodel:\n  id: {models['gguf-target.gguf']}\n"
            f"speculative:\n  method: draft_model\n  draft: {models['gguf-draft-same.gguf']}\n"
            "gpus:\n  devices: []\n"
        )
        loaded = load_profile(prof, registry=registry)

        async def run() -> dict:
            async with launched(loaded, registry) as eng:
                await run_workload(
                    eng.base_url, eng.model_name, [Prompt("the quick brown fox", 32)], concurrency=1, requests=2
                )
                reader = AcceptanceReader("scrape", eng.backend, 60.0, 3.0)
                reader.attach(eng.metrics_url, eng.model_name)
                reader.read_blocking(time.monotonic())
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(ticks):
                    reader.read_blocking(time.monotonic())
                c1, w1 = time.process_time(), time.perf_counter()
                return {
                    "ticks": ticks,
                    "cpu_ms_per_tick": 1000 * (c1 - c0) / ticks,
                    "wall_ms_per_tick": 1000 * (w1 - w0) / ticks,
                }

        return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=11, help="cold starts per command (median)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measurement per interval")
    ap.add_argument("--intervals", default="0.5,1,5", help="monitor.interval values (seconds)")
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    from specops.perf.bench import machine

    m = machine()
    cold = cold_start(args.runs)
    imports = import_breakdown()
    tick = tick_cost(args.ticks)
    cpu = watcher_cpu([float(x) for x in args.intervals.split(",")], args.idle)
    print(f"specops overheads; machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}\n")
    print(f"Cold start (new process each run, median of {args.runs}, alternating order):\n")
    print("| command | median | min | max | minus `python -c pass` |\n|---|---|---|---|---|")
    base = cold["python -c pass"]["median_s"]
    for k, v in cold.items():
        print(
            f"| `{k}` | {v['median_s'] * 1000:.0f} ms | {v['min_s'] * 1000:.0f} ms | {v['max_s'] * 1000:.0f} ms | "
            f"{(v['median_s'] - base) * 1000:.0f} ms |"
        )
    print(f"\nImports of `specops render` (-X importtime, self time by package, total {imports['total_ms']:.0f} ms):\n")
    print("| package | ms |\n|---|---|")
    for k, v in imports["by_package_ms"].items():
        print(f"| {k} | {v:.1f} |")
    print(
        "\nslowest modules (self time): " + ", ".join(f"{n} {v:.1f} ms" for n, v in imports["slowest_modules_ms"][:8])
    )
    print(
        f"\nengines imported by render: {imports['engines_imported'] or 'none'}; "
        f"heavy modules imported: {imports['heavy_imported'] or 'none'}"
    )
    print(
        f"\nWatcher tick (scrape llama-server /metrics + parse + window), {tick['ticks']} ticks: "
        f"{tick['cpu_ms_per_tick']:.2f} ms CPU, {tick['wall_ms_per_tick']:.2f} ms wall per tick"
    )
    print(f"\nIdle `specops up` (tiny llama-server, draft_model), {args.idle:g} s per interval:\n")
    print("| monitor.interval | specops CPU (% of one core) | engine CPU | tick cost ÷ interval |\n|---|---|---|---|")
    for row in cpu:
        print(
            f"| {row['interval_s']:g} s | {row['specops_cpu_pct']:.2f} % | {row['engine_cpu_pct']:.2f} % | "
            f"{tick['cpu_ms_per_tick'] / (row['interval_s'] * 10):.2f} % |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": m, "cold_start": cold, "imports": imports, "tick": tick, "idle_cpu": cpu}, indent=2)
            + "\n"
        )


if __name__ == "__main__":
    main()
