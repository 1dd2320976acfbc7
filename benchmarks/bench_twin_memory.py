"""Resident memory of a llama-server pair (the primary and a `none` twin on the same GGUF) against one engine.

Runs ``specops up`` twice on the same profile, once with ``routing.twins: [none]`` and once without, waits until
every engine is ready and has answered a few requests, then reads each engine's ``/proc/PID/smaps_rollup``: RSS
(what ``ps`` shows; shared file pages counted in each process), PSS (shared pages split between the processes that
map them: the fair share) and the anonymous part (each engine's own KV cache, slots, buffers). Both engines map the
same GGUF file, so its pages sit once in the page cache: the pair's PSS sum is what the twin really costs.

    .venv/bin/python benchmarks/bench_twin_memory.py                       # the tiny test GGUF models
    .venv/bin/python benchmarks/bench_twin_memory.py --target /m/model.gguf --draft /m/draft.gguf --ctx 4096
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            out[key.strip()] = int(parts[0])
    return out


def _run(profile: dict, tmp: Path, twins: bool, requests: int) -> list[dict]:
    name = "twinmem" + ("-pair" if twins else "-one")
    data = json.loads(json.dumps(profile))
    data["name"] = name
    data["server"]["port"] = _free_port()
    if twins:
        data["routing"] = {"twins": ["none"]}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(data))
    env = {**os.environ, "SPECOPS_STATE": str(tmp / "state")}
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specops.cli", "up", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        want = 2 if twins else 1
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "engines not ready within 300 s"
            try:
                st = json.loads((tmp / "state" / name / "state.json").read_text())
            except (FileNotFoundError, ValueError):
                st = {}
            engines = st.get("engines") or ([{"live": st.get("state") == "ready"}] if st else [])
            if st.get("state") == "ready" and len(engines) == want and all(e.get("live") for e in engines):
                break
            time.sleep(0.5)
        url = st["url"]
        for i in range(requests):
            for hdr in ("on", "off") if twins else ("",):
                body = json.dumps({"prompt": f"the quick brown fox {i}", "max_tokens": 32, "temperature": 0}).encode()
                headers = {"Content-Type": "application/json"}
                if hdr:
                    headers["X-Specops-Speculation"] = hdr
                req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
                urllib.request.urlopen(req, timeout=120).read()
        pids = [st["engine_pid"]] + [e["engine_pid"] for e in st.get("engines", [])[1:]]
        return [{"pid": pid, **_rollup(pid)} for pid in pids]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log.close()


def main(argv: list[str] | None = None) -> int:
    from specops.paths import tiny_models_dir

    models = tiny_models_dir()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models / "gguf-target.gguf"))
    ap.add_argument("--draft", default=str(models / "gguf-draft-same.gguf"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    profile = {
        "backend": "llamacpp",
        "model": {"id": args.target, "max_model_len": args.ctx},
        "speculative": {"method": "draft_model", "draft": args.draft, "num_speculative_tokens": 4},
        "gpus": {"devices": []},
        "server": {"port": 0, "parallel": 2},
        "fallback": {"chain": ["none"]},
    }
    with tempfile.TemporaryDirectory() as tmp:
        one = _run(profile, Path(tmp), False, args.requests)
        pair = _run(profile, Path(tmp), True, args.requests)
    rows = {"one engine": one, "primary + none twin": pair}
    print(f"target {args.target} ({os.path.getsize(args.target) / 2**20:.1f} MiB), ctx {args.ctx}")
    print(f"{'run':22} {'RSS MiB':>8} {'PSS MiB':>8} {'anon MiB':>9} {'file MiB':>9}")
    for label, procs in rows.items():
        rss = sum(p.get("Rss", 0) for p in procs) / 1024
        pss = sum(p.get("Pss", 0) for p in procs) / 1024
        anon = sum(p.get("Anonymous", 0) for p in procs) / 1024
        file_ = sum(p.get("Pss_File", 0) for p in procs) / 1024
        print(f"{label:22} {rss:8.1f} {pss:8.1f} {anon:9.1f} {file_:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
