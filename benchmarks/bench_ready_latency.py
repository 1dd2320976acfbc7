#!/usr/bin/env python3
"""How long `specops up` adds between the engine answering /health and reporting "ready".

For each run: start `specops up` on a CPU demo profile, read the engine's internal URL from the state
file as soon as it is written, poll that /health every 5 ms from here, and compare the moment it first
answers 200 with the `ready` event specops writes. Also reports the engine's time to ready.

    .venv/bin/python benchmarks/bench_ready_latency.py                 # llama-server, 10 runs
    .venv/bin/python benchmarks/bench_ready_latency.py --engine vllm --runs 2
    .venv/bin/python benchmarks/bench_ready_latency.py --json out.json   # also write every run and the medians

``--json PATH`` also writes the work tree's commit, the machine and its load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _harness import write_report

ROOT = Path(__file__).resolve().parent.parent
PROFILES = {
    "llamacpp": ROOT / "examples" / "llamacpp-cpu-draft.yaml",
    "vllm": ROOT / "examples" / "vllm-cpu-ngram.yaml",
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(engine: str, workdir: Path) -> dict:
    profile = workdir / "p.yaml"
    profile.write_text(
        f"extends: {PROFILES[engine]}\nname: bench-ready\nserver: {{port: {free_port()}}}\n"
        f"supervisor: {{state_dir: {workdir / 'state'}}}\n"
    )
    state = workdir / "state" / "bench-ready"
    if state.exists():
        for f in state.iterdir():
            f.unlink()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specops.cli", "up", str(profile), "--quiet-engine"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    t_start = time.time()
    try:
        engine_url = None
        while engine_url is None:
            try:
                engine_url = json.loads((state / "state.json").read_text()).get("engine_url")
            except (OSError, ValueError):
                pass
            if proc.poll() is not None:
                raise RuntimeError("specops up exited")
            time.sleep(0.002)
        t_engine = None
        while t_engine is None:
            try:
                with urllib.request.urlopen(engine_url + "/health", timeout=1) as r:
                    if r.status == 200:
                        t_engine = time.time()
            except OSError:
                time.sleep(0.005)
        t_ready = None
        while t_ready is None:
            try:
                for line in (state / "events.jsonl").read_text().splitlines():
                    e = json.loads(line)
                    if e["event"] == "ready":
                        t_ready = e["ts"]
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        return {"engine_ready_s": t_engine - t_start, "added_s": t_ready - t_engine}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=sorted(PROFILES), default="llamacpp")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", metavar="PATH", help="also write every run and the medians here")
    a = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            r = one_run(a.engine, Path(tmp))
            rows.append(r)
            print(
                f"run {i + 1}: engine ready after {r['engine_ready_s']:.3f}s, specops reported it "
                f"{r['added_s'] * 1000:+.0f} ms later",
                flush=True,
            )
    added = [r["added_s"] for r in rows]
    print(
        f"\n{a.engine}: median engine time to ready {statistics.median(r['engine_ready_s'] for r in rows):.2f}s; "
        f"specops adds median {statistics.median(added) * 1000:.0f} ms, max {max(added) * 1000:.0f} ms "
        f"(health polls start at 20 ms and back off to 250 ms; goal: <= poll interval + 500 ms) over {len(rows)} runs"
    )
    if a.json:
        write_report(
            a.json,
            ROOT,
            load_before,
            args=vars(a),
            runs=rows,
            median_engine_ready_s=statistics.median(r["engine_ready_s"] for r in rows),
            median_added_ms=statistics.median(added) * 1000,
            max_added_ms=max(added) * 1000,
        )
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
