"""`fallback.mode: goodput` on a real llama-server: a load step past the surface's crossover switches the
deployment to `none`, and the load falling switches it back. The surface is given (the crossover's measurement
belongs to benchmarks/bench_goodput.py); the concurrency is the proxy's requests in flight and waiting."""

from __future__ import annotations

import json

import pytest
from support_load import Load
from support_ports import free_port
from support_up import UpRun, write_profile

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


def test_a_load_step_switches_to_none_and_back(tmp_path, tiny_gguf_models):
    surface = tmp_path / "goodput.tune.json"
    surface.write_text(json.dumps({"surface": SURFACE}))
    profile = write_profile(
        tmp_path / "goodput.yaml",
        {
            "name": "llama-goodput",
            "backend": "llamacpp",
            "model": {"id": str(tiny_gguf_models / "gguf-target.gguf"), "max_model_len": 2048},
            "speculative": {
                "method": "draft_model",
                "draft": str(tiny_gguf_models / "gguf-draft-same.gguf"),
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
        # four clients sending long greedy completions back to back: every request counted, a lost one fails
        with Load(st["url"], clients=4, max_tokens=96, stream=False, request_timeout=60) as load:
            run.wait_for(lambda s: s.get("method") == "none" and s.get("state") == "ready", 30, "the switch to none")
        assert load.lost == 0 and load.ok > 0, load.failures[:3]
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
