"""Pools on loopback: a speculating deployment whose `none` step is another, plain deployment (a remote twin).

Two `specops up` of the demo profile (examples/llamacpp-cpu-gemma.yaml: the real Gemma 3 270M on llama-server),
each in a pod namespace of its own as the multi-node tests run their pods (specops.devenv.matrix_group): its own
loopback address (the speculating pod 127.0.0.1, the plain pod 127.0.0.2) and its own /etc/hosts (``unshare -rm``
and specops.devenv.podns), so the speculating pod reaches the plain one by a name, as a Service is reached:

- **spec**: the demo profile (ngram), `routing.twins: [{url: http://gemma-plain:PORT, api_key_env: ...}]`, classes
  keyed on `X-Task`, the alias `gemma-exact: off`;
- **plain**: the demo profile with `speculative.method: none`, an API key of its own.

Phases: (1) the classes (`extraction`, greedy; `creative`, temperature 1.3) learned across the hop; (2) each class's
tokens/s (all tokens over the batch's wall time) at 1 client and at 16 (twice the requests), routed by its class,
against each static deployment (the speculating one asked `on`, the plain one directly); (3) the hop's added latency: the same short requests to the plain deployment directly and
through the speculating one (`X-Specops-Speculation: off`), p50/p99 at 1 and 16 clients; (4) the plain pod killed
(SIGKILL) under 16 clients sending the alias, then started again: what the clients saw, what the speculating
deployment served meanwhile, how long until it routed to the plain one again.

    flock /tmp/brief/bench.lock .venv/bin/python benchmarks/bench_pools.py --min-acceptance 0.6 \\
        --json benchmarks/results-pools-loopback.json

``--min-acceptance 0.6`` is the schema's default threshold (the published rule of thumb); the demo profile's 0.5
keeps creative text, whose acceptance with ngram sits near 0.5, on the speculating engine, so no class would be
learned onto the remote twin.

Each engine runs with one thread (two engines on the machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import write_report  # noqa: E402
from support_load import Load  # noqa: E402
from support_up import SPECOPS, UpProcess, write_profile  # noqa: E402

from specops.run.start import free_port  # noqa: E402

DEMO = ROOT / "examples" / "llamacpp-cpu-gemma.yaml"
PROMPTS = ROOT / "specops" / "data" / "prompts"
PLAIN_HOST, PLAIN_IP = "gemma-plain", "127.0.0.2"
KEY_VAR, KEY = "BENCH_PLAIN_KEY", "bench-plain-key"
HOP_TOKENS = 8


def prompts(name: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


class PodUp(UpProcess):
    """One `specops up` in a pod namespace of its own (its /etc/hosts bound over the machine's)."""

    wait_timeout, poll_s, stop_timeout = 300.0, 0.2, 60.0  # the real Gemma on a shared machine
    failure = RuntimeError

    def __init__(self, work: Path, name: str, profile: dict, hosts: Path):
        self.work = work / name
        self.work.mkdir(parents=True)
        env = {**os.environ, "SPECOPS_STATE": str(self.work / "state"), KEY_VAR: KEY, "PYTHONUNBUFFERED": "1"}
        super().__init__(name, self.work / "state", env)
        self.profile = write_profile(self.work / f"{name}.yaml", profile)
        self.hosts = hosts

    def argv(self) -> list[str]:
        pod = ["unshare", "-rm", sys.executable, "-m", "specops.devenv.podns", str(self.hosts), "--"]
        return [*pod, *SPECOPS, "up", str(self.profile), "--quiet-engine"]

    @property
    def log_path(self) -> Path:
        return self.work / f"up-{self.starts}.log"  # one per start: the restarted pod's own


def profiles(spec_port: int, plain_port: int, min_acceptance: float | None = None) -> tuple[dict, dict]:
    demo = yaml.safe_load(DEMO.read_text())
    demo["server"]["extra_args"] = [*demo["server"]["extra_args"], "-t", "1"]
    demo["proxy"] = {"enabled": True}
    demo["monitor"] = {"interval": "1s"}
    plain = json.loads(json.dumps(demo))
    plain.update(name="gemma-plain", speculative={"method": "none"})
    plain["server"].update(host=PLAIN_IP, port=plain_port, api_key=f"${{{KEY_VAR}}}")
    plain["fallback"] = {"enabled": False, "chain": []}
    spec = json.loads(json.dumps(demo))
    spec["name"] = "gemma-spec"
    spec["server"].update(host="127.0.0.1", port=spec_port)
    spec["fallback"] = {**demo["fallback"], "enabled": False}  # the classes decide; no whole-deployment switch
    if min_acceptance is not None:  # the classes' threshold (the demo's 0.5 keeps creative text, at ~0.5, on)
        spec["fallback"]["min_acceptance"] = min_acceptance
    spec["routing"] = {
        "twins": [{"url": f"http://{PLAIN_HOST}:{plain_port}", "api_key_env": KEY_VAR, "method": "none"}],
        "classes": {"key": "header", "header": "X-Task", "min_draft_tokens": 60, "window": "5m", "explore": 0},
        "aliases": {"gemma-exact": "off"},
    }
    return spec, plain


async def one(session, url: str, body: dict, headers: dict) -> tuple[float, int]:
    """One completion: (seconds, tokens generated)."""
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        doc = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {str(doc)[:300]}")
    tokens = (doc.get("timings") or {}).get("predicted_n") or (doc.get("usage") or {}).get("completion_tokens", 0)
    return time.perf_counter() - t0, int(tokens)


async def run_clients(url: str, bodies: list[dict], headers: dict, clients: int) -> list[tuple[float, int]]:
    """``bodies`` sent by ``clients`` concurrent clients (each takes the next body); every result, in order done."""
    queue = list(bodies)
    out: list[tuple[float, int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def client():
            while queue:
                out.append(await one(s, url, queue.pop(0), headers))

        await asyncio.gather(*(client() for _ in range(clients)))
    return out


def throughput(url: str, bodies: list[dict], headers: dict, clients: int) -> float:
    """Tokens/s that ``clients`` concurrent clients get together: all tokens over the wall time of the batch (at one
    client, one client's rate; at 16, the deployment's)."""
    t0 = time.perf_counter()
    results = asyncio.run(run_clients(url, bodies, headers, clients))
    return round(sum(n for _, n in results) / (time.perf_counter() - t0), 2)


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48, help="per request in the tokens/s phase")
    ap.add_argument("--rounds", type=int, default=2, help="passes over each class's 8 prompts per deployment")
    ap.add_argument("--hop-requests", type=int, default=32, help="requests per path and client count (hop phase)")
    ap.add_argument("--min-acceptance", type=float, help="the classes' threshold (default: the demo profile's)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    load_before = os.getloadavg()
    figures: dict = {"profile": str(DEMO.relative_to(ROOT)), "threads_per_engine": 1}
    with tempfile.TemporaryDirectory(prefix="specops-bench-pools-") as tmp:
        work = Path(tmp)
        hosts = work / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 gemma-spec\n{PLAIN_IP} {PLAIN_HOST}\n")
        spec_port, plain_port = free_port(), free_port()
        spec_doc, plain_doc = profiles(spec_port, plain_port, a.min_acceptance)
        figures["min_acceptance"] = spec_doc["fallback"]["min_acceptance"]
        plain = PodUp(work, "gemma-plain", plain_doc, hosts).start()
        spec = PodUp(work, "gemma-spec", spec_doc, hosts).start()
        spec_url, plain_url = f"http://127.0.0.1:{spec_port}", f"http://{PLAIN_IP}:{plain_port}"
        plain_auth = {"Authorization": f"Bearer {KEY}"}
        try:
            plain.wait(lambda s: s.get("state") == "ready", "ready")
            remote = lambda s: next((e for e in s.get("engines", []) if e.get("remote")), {})  # noqa: E731
            spec.wait(lambda s: s.get("state") == "ready" and remote(s).get("live"), "ready, the remote twin live")
            print("both deployments ready", flush=True)

            # (1) the classes learned across the hop
            t0 = time.monotonic()
            sent = {"extraction": 0, "creative": 0}

            def verdicts(st):
                rows = {r["class"]: r for r in st.get("routing", {}).get("classes", [])}
                return {k: rows.get(k, {}).get("speculate") for k in sent}

            while time.monotonic() - t0 < 420 and None in verdicts(spec.state()).values():
                for cls in [c for c, v in verdicts(spec.state()).items() if v is None]:
                    ps = prompts(cls)
                    body = {**ps[sent[cls] % len(ps)], "max_tokens": a.max_tokens}
                    asyncio.run(run_clients(spec_url, [body], {"X-Task": cls}, 1))
                    sent[cls] += 1
            st = spec.state()
            rows = {r["class"]: r for r in st["routing"]["classes"]}
            figures["learning"] = {
                cls: {
                    "verdict": {True: "speculate", False: "no speculation", None: "undecided"}[rows[cls]["speculate"]],
                    "requests_sent": sent[cls],
                    "acceptance": rows[cls]["acceptance"],
                }
                for cls in sent
            }
            figures["learning_seconds"] = round(time.monotonic() - t0, 1)
            print("learning:", figures["learning"], flush=True)

            # (2) tokens/s per class at 1 and 16 clients: routed by class, static speculation, the plain deployment
            for clients in (1, 16):
                per_class = {}
                for cls in sent:
                    bodies = [{**p, "max_tokens": a.max_tokens} for p in prompts(cls)] * a.rounds
                    row = {}
                    for label, url, headers in (
                        ("routed", spec_url, {"X-Task": cls}),
                        ("static_speculation", spec_url, {"X-Specops-Speculation": "on"}),
                        ("static_plain", plain_url, plain_auth),
                    ):
                        row[label] = throughput(url, bodies * (2 if clients > 1 else 1), headers, clients)
                    row["routed_vs_best_static"] = round(
                        row["routed"] / max(row["static_speculation"], row["static_plain"]), 3
                    )
                    per_class[cls] = row
                    print(f"{cls} at {clients}:", row, flush=True)
                figures[f"tokens_per_s_{clients}_clients"] = per_class

            # (3) the hop's added latency: the same short request, directly and through the speculating proxy
            hop = {}
            short = {"prompt": "The quick brown fox", "max_tokens": HOP_TOKENS, "temperature": 0}
            for clients in (1, 16):
                row = {}
                for label, url, headers in (
                    ("direct", plain_url, plain_auth),
                    ("through_the_hop", spec_url, {"X-Specops-Speculation": "off"}),
                ):
                    lat = [t for t, _ in asyncio.run(run_clients(url, [short] * a.hop_requests, headers, clients))]
                    row[label] = {"p50_ms": round(pct(lat, 0.5) * 1000, 1), "p99_ms": round(pct(lat, 0.99) * 1000, 1)}
                row["added_p50_ms"] = round(row["through_the_hop"]["p50_ms"] - row["direct"]["p50_ms"], 1)
                row["added_p99_ms"] = round(row["through_the_hop"]["p99_ms"] - row["direct"]["p99_ms"], 1)
                hop[f"{clients}_clients"] = row
                print(f"hop at {clients}:", row, flush=True)
            figures["hop_latency"] = hop
            figures["health_check"] = {
                k: remote(spec.state())["remote"][k] for k in ("health_rtt_ms", "health_rtt_max_ms")
            }

            # (4) the plain pod killed under 16 clients sending the alias `gemma-exact` (off: the plain deployment)
            def routed_by_engine() -> dict:
                return {e["engine"]: e["routed"] for e in spec.state().get("engines", [])}

            load = Load(spec_url, clients=16, max_tokens=16, model="gemma-exact", stream="half", request_timeout=300)
            with load:
                load.wait_for_answers(32, timeout=300)
                before = routed_by_engine()
                t_kill = time.monotonic()
                plain.kill()
                spec.wait(lambda s: not remote(s).get("live"), "the remote twin out of the routes", 30)
                out_after = round(time.monotonic() - t_kill, 2)
                load.wait_for_answers(32, timeout=300)
                during = routed_by_engine()
                plain.start()
                plain.wait(lambda s: s.get("state") == "ready", "ready again")
                t_back = time.monotonic()
                spec.wait(lambda s: remote(s).get("live"), "the remote twin routed again", 60)
                back_after = round(time.monotonic() - t_back, 2)
                load.wait_for_answers(32, timeout=300)
                after = routed_by_engine()
            figures["plain_killed_under_16_clients"] = {
                "outcomes": load.snapshot(),
                "lost": load.lost,
                "stream_errors": load.counts.get("stream_error", 0),
                "out_of_the_routes_s_after_the_kill": out_after,
                "served_by_the_speculating_engine_while_down": during.get(0, 0) - before.get(0, 0),
                "served_by_the_plain_deployment_before_the_kill": before.get(1, 0),
                "routed_again_s_after_plain_ready": back_after,
                "served_by_the_plain_deployment_after_it_came_back": after.get(1, 0) - during.get(1, 0),
                "remote": remote(spec.state()).get("remote"),
            }
            print("kill:", figures["plain_killed_under_16_clients"], flush=True)
        finally:
            spec.stop()
            plain.stop()
    if a.json:
        write_report(a.json, ROOT, load_before, **figures)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
