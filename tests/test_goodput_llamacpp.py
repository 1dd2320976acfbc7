"""`fallback.mode: goodput` on a real llama-server: a load step past the surface's crossover switches the
deployment to `none`, and the load falling switches it back. The surface is given (the crossover's measurement
belongs to benchmarks/bench_goodput.py); the concurrency is the proxy's requests in flight and waiting."""

from __future__ import annotations

import json
import threading

import pytest
from support_up import UpRun, free_port, http_json, write_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(120)]

# spec 100 + 20t vs none 50 + 150t (t = log2(c) / 2): the crossover is at t = 5/13, c = 2^(10/13) ≈ 1.7
SURFACE = {
    "date": "test",
    "points": [
        {"method": "none", "k": 0, "concurrency": 1, "tokens_per_s": 50},
        {"method": "none", "k": 0, "concurrency": 4, "tokens_per_s": 200},
        {"method": "draft_model", "k": 4, "concurrency": 1, "tokens_per_s": 100},
        {"method": "draft_model", "k": 4, "concurrency": 4, "tokens_per_s": 120},
    ],
}


class Clients:
    """``n`` clients sending long greedy completions back to back until stopped."""

    def __init__(self, url: str, n: int):
        self.url, self.n = url, n
        self.ok = self.failed = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        while not self._stop.is_set():
            status, body = http_json(
                self.url + "/v1/completions",
                {"prompt": "the quick brown fox jumps over", "max_tokens": 96, "temperature": 0},
                timeout=60,
            )
            if status == 200:
                self.ok += 1
            else:
                self.failed += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def test_a_load_step_switches_to_none_and_back(tmp_path, tiny_models):
    surface = tmp_path / "goodput.tune.json"
    surface.write_text(json.dumps({"surface": SURFACE}))
    profile = write_profile(
        tmp_path / "goodput.yaml",
        {
            "name": "llama-goodput",
            "backend": "llamacpp",
            "model": {"id": str(tiny_models / "gguf-target.gguf"), "max_model_len": 2048},
            "speculative": {
                "method": "draft_model",
                "draft": str(tiny_models / "gguf-draft-same.gguf"),
                "num_speculative_tokens": 4,
            },
            "gpus": {"devices": []},
            "server": {"port": free_port(), "parallel": 4},
            "fallback": {
                "mode": "goodput",
                "window": "3s",
                "chain": ["none"],
                "goodput": {
                    "surface": surface.name,  # relative: read from the profile's folder, not the cwd
                    "sustain": "1500ms",
                    "min_dwell": "3s",
                    "regime": "1m",
                    "switch_cost": "1s",
                },
            },
            "monitor": {"interval": "500ms"},
            "supervisor": {"stop_timeout": 10},
        },
    )
    with UpRun(profile, tmp_path / "state", "llama-goodput") as run:
        st = run.wait_ready(timeout=60)
        assert st["method"] == "draft_model"
        with Clients(st["url"], 4) as clients:
            run.wait_for(lambda s: s.get("method") == "none" and s.get("state") == "ready", 30, "the switch to none")
        assert clients.failed == 0 and clients.ok > 0
        down = [d for d in run.events("decision") if d.get("action") == "switch"][0]
        assert (down["from"], down["to"], down["rule"]) == ("draft_model", "none", "goodput")
        n = down["numbers"]
        assert n["concurrency"] > 1.7 and n["concurrency_source"] == "proxy in flight + waiting"
        assert n["predicted"]["none"] > n["predicted"]["draft_model k=4"]
        assert n["sustained_s"] >= 1.5 and n["gain_tokens"] > n["cost_tokens"]
        # the load is gone: back to speculation once the dwell and the sustain time have passed
        st = run.wait_for(lambda s: s.get("method") == "draft_model" and s.get("state") == "ready", 30, "the way back")
        up = [d for d in run.events("decision") if d.get("action") == "switch"][1]
        assert (up["from"], up["to"], up["rule"]) == ("none", "draft_model", "goodput")
        assert up["numbers"]["concurrency"] < 1.7
        assert up["ts"] - run.events("switch-complete")[0]["ts"] >= 3.0 - 0.5  # min_dwell
        timeline = [(e["rule"], e.get("to")) for e in run.events("goodput")]
        assert ("goodput-sustain", None) in timeline
        g = run.status_json()
        assert "last_goodput" in json.dumps(g)
        assert run.stop() == 0
