"""An answer survives its engine: the speculating llama-server SIGKILLed under load (issue 40 item 3).

`specops up` of the demo profile (examples/llamacpp-cpu-gemma.yaml: the real Gemma 3 270M on llama-server, ngram)
with ``routing: {twins: [none]}`` (a warm engine without speculation beside it), each engine on one thread. 16
closed-loop clients (half streaming, greedy completions, tests/support_load.py) run for ``--before`` seconds, the
speculating engine is SIGKILLed (the whole process group), and the clients go on for ``--after`` seconds while its
supervisor restarts it. Every request's outcome is counted the way a client sees it: ``ok`` (a JSON answer, or a
stream ending in ``[DONE]``), ``stream_error`` (a stream ended by an explicit error event) or lost (``malformed``
includes a stream that just stops: a silent cut). The proxy's own counters say how many streams it continued on
the twin (or the restarted engine) from the text already sent, and why any was not.

    flock /tmp/brief/bench.lock .venv/bin/python benchmarks/bench_engine_kill.py \\
        --json benchmarks/results-llamacpp-engine-kill.json

``--remote`` runs the same with the `none` step a remote twin: a second `specops up` (the demo profile, method
none) in a pod namespace of its own, as benchmarks/bench_pools.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import write_report  # noqa: E402
from bench_pools import PLAIN_HOST, PLAIN_IP, PodUp  # noqa: E402
from bench_pools import profiles as pool_profiles  # noqa: E402
from support_load import Load  # noqa: E402

from specops.proxy.server import COUNTERS  # noqa: E402
from specops.run.process import group_members  # noqa: E402
from specops.run.start import free_port  # noqa: E402

DEMO = ROOT / "examples" / "llamacpp-cpu-gemma.yaml"
MODELS = Path.home() / ".cache" / "specops" / "models" / "real-v1"
#: The proxy's counters the report keeps: what happened to the requests (its rejections and timings are not it).
KEPT = tuple(c for c in COUNTERS if not c.startswith(("rejected_", "timings_", "reconnects", "client_")))


def local_profile(port: int) -> dict:
    demo = yaml.safe_load(DEMO.read_text())
    demo["name"] = "gemma-kill"
    demo["server"]["extra_args"] = [*demo["server"]["extra_args"], "-t", "1"]
    demo["server"]["port"] = port
    demo["fallback"] = {**demo["fallback"], "enabled": False}  # the kill, not a fallback, is measured
    demo["routing"] = {"twins": ["none"]}
    return demo


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/specops/status", timeout=10) as r:
        return json.loads(r.read())


def kill_group(pgid: int) -> list[int]:
    pids = group_members(pgid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64, help="per request (less 0-4 by client)")
    ap.add_argument("--before", type=float, default=20.0, help="seconds of load before the kill")
    ap.add_argument("--after", type=float, default=40.0, help="seconds of load after it")
    ap.add_argument("--remote", action="store_true", help="the none step a remote twin (another specops up)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    os.environ.setdefault("SPECOPS_REAL_MODELS", str(MODELS))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specops-bench-kill-") as tmp:
        work = Path(tmp)
        hosts = work / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 gemma-spec\n{PLAIN_IP} {PLAIN_HOST}\n")
        port = free_port()
        pods: list[PodUp] = []
        if a.remote:
            spec_doc, plain_doc = pool_profiles(port, free_port())
            spec_doc["routing"] = {k: v for k, v in spec_doc["routing"].items() if k == "twins"}
            pods.append(PodUp(work, "gemma-plain", plain_doc, hosts).start())
            pods.append(PodUp(work, "gemma-spec", spec_doc, hosts).start())
        else:
            pods.append(PodUp(work, "gemma-kill", local_profile(port), hosts).start())
        spec = pods[-1]
        url = f"http://127.0.0.1:{port}"
        try:
            for pod in pods:
                pod.wait(
                    lambda s: s.get("state") == "ready" and all(e.get("live") for e in s.get("engines", [])),
                    "ready, every engine live",
                )
            st = spec.wait(
                lambda s: len(s.get("engines", [])) == 2 and all(e.get("live") for e in s["engines"]), "two engines"
            )
            victim = st["engine_pid"]
            print(f"ready; the speculating engine is pid {victim}", flush=True)
            load = Load(url, clients=a.clients, max_tokens=a.max_tokens, stream="half", request_timeout=180)
            load.start()
            time.sleep(a.before)
            before = load.snapshot()
            in_flight = status(url)["proxy"]["in_flight"]
            killed = kill_group(victim)
            print(f"killed {killed} with {in_flight} requests in flight; {before}", flush=True)
            time.sleep(a.after)
            load.stop()
            doc = status(url)
            spec_state = spec.state()
        finally:
            for pod in reversed(pods):
                pod.stop()
        proxy = doc["proxy"]
        figures = {
            "profile": str(DEMO.relative_to(ROOT)),
            "twin": "remote (another specops up, method none)" if a.remote else "local (routing.twins: [none])",
            "threads_per_engine": 1,
            "clients": a.clients,
            "half_streaming": True,
            "max_tokens": a.max_tokens,
            "before_s": a.before,
            "after_s": a.after,
            "in_flight_at_kill": in_flight,
            "killed_pids": killed,
            "outcomes_before_kill": before,
            "outcomes": load.snapshot(),
            "cut_streams_silent": load.counts["malformed"],
            "stream_errors": load.stream_errors[:10],
            "failures": load.failures[:10],
            "proxy": {k: proxy.get(k) for k in KEPT},
            "engines": [
                {k: e.get(k) for k in ("engine", "method", "live", "routed", "remote")}
                for e in spec_state.get("engines", [])
            ],
            "restarted": spec_state.get("engine_pid") not in (None, victim),
        }
        print(load.report(), flush=True)
        print(json.dumps(figures["proxy"]), flush=True)
    if a.json:
        write_report(a.json, ROOT, load_before, **figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
