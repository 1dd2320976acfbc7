"""How long a llama.cpp RPC group takes to serve again after one of its workers dies.

The group is the LeaderWorkerSet `specops k8s render` writes for a tiny GGUF profile with
``deploy.multi_node: {nodes: 3}``, run on loopback from its rendered pod commands
(specops.devenv.matrix_group). Each round, under a trickle of requests through the leader's proxy, one
``rpc-server`` worker is killed (SIGKILL) and started again at once, as the kubelet restarts a container;
the time is from the kill to the first completion answered 200 after the leader's specops restarted its
llama-server (the engine loses its layers on that worker, exits, and is restarted against the group).
Also reported: the group's time to ready (pods started → the leader's specops ready), and what the
clients saw (requests in flight on the dying engine end as explicit stream errors, none silently).

    .venv/bin/python benchmarks/bench_multinode_recovery.py --rounds 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support_load import Load  # noqa: E402

from specops.devenv import engines  # noqa: E402
from specops.devenv.matrix_group import LocalGroup, render_objects  # noqa: E402
from specops.devenv.testmodels import ensure_tiny_models  # noqa: E402
from specops.paths import tiny_models_dir  # noqa: E402
from specops.run.start import free_port  # noqa: E402


def completion_ok(url: str) -> bool:
    body = json.dumps({"prompt": "the quick", "max_tokens": 8}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (loopback)
            return resp.status == 200
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    ensure_tiny_models(["gguf"])
    models = tiny_models_dir()
    with tempfile.TemporaryDirectory(prefix="specops-bench-mn-") as tmp:
        profile = Path(tmp) / "rpc.yaml"
        profile.write_text(
            yaml.safe_dump(
                {
                    "name": "bench-rpc",
                    "backend": "llamacpp",
                    "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 1024},
                    "speculative": {
                        "method": "draft_model",
                        "draft": str(models / "gguf-draft-same.gguf"),
                        "num_speculative_tokens": 4,
                    },
                    "gpus": {"gpu_layers": "all"},
                    "server": {"port": free_port(), "parallel": 2},
                    "fallback": {"enabled": False},
                    "supervisor": {"stop_timeout": 10},
                    "deploy": {"multi_node": {"nodes": 3, "rpc_port": free_port()}, "monitor": "none"},
                }
            )
        )
        group = LocalGroup(
            render_objects(profile),
            Path(tmp) / "group",
            path_dirs=[Path(sys.executable).parent, engines.llama_server_bin().parent],
        )
        t0 = time.monotonic()
        group.start_all()
        recoveries, outcomes = [], []
        try:
            group.wait_for(lambda s: s.get("state") == "ready", 120, "ready")
            ready_s = time.monotonic() - t0
            for i in range(a.rounds):
                victim = group.workers[i % len(group.workers)]
                restarts = int(group.state().get("restarts") or 0)
                with Load(group.url(), clients=2, max_tokens=32, request_timeout=60, max_seconds=120) as load:
                    load.wait_for_answers(2, timeout=60)
                    killed = time.monotonic()
                    group.kill(victim, signal.SIGKILL)
                    victim.proc.wait(timeout=10)
                    group.start(victim)
                    recovered = None
                    while time.monotonic() - killed < 120:
                        st = group.state()
                        if int(st.get("restarts") or 0) > restarts and st.get("state") == "ready":
                            if completion_ok(group.url()):
                                recovered = time.monotonic() - killed
                                break
                        elif time.monotonic() - killed > 30 and completion_ok(group.url()):
                            break  # the engine never exited: it served through the worker's restart
                        time.sleep(0.1)
                    recoveries.append(recovered)
                    time.sleep(1.0)
                outcomes.append(dict(load.counts))
                what = f"served again after {recovered:.2f} s" if recovered else "no engine restart (served through)"
                print(f"round {i + 1}: {what}; clients {dict(load.counts)}")
        finally:
            group.stop(timeout=30)
    result = {
        "ready_s": round(ready_s, 2),
        "recovery_s": {
            "median": round(statistics.median([r for r in recoveries if r]), 2) if any(recoveries) else None,
            "each": [round(r, 2) if r else None for r in recoveries],
        },
        "clients": outcomes,
    }
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
