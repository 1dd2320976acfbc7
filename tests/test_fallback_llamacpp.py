"""Watch-and-fallback on a real llama-server: a noisy draft (acceptance ≈ 0.5) is left for n-gram, a
same-weights draft (≈ 0.97) is kept, over the same traffic. Decisions show in the event log, the state
file and specops' own /metrics."""

from __future__ import annotations

import time

import pytest
from support_load import one_client
from support_ports import free_port
from support_up import UpRun, http_json, http_text, write_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def models(tiny_gguf_models):
    return tiny_gguf_models


def profile_for(tmp_path, models, name, draft):
    return write_profile(
        tmp_path / f"{name}.yaml",
        {
            "name": name,
            "backend": "llamacpp",
            "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 1024},
            "speculative": {"method": "draft_model", "draft": str(models / draft), "num_speculative_tokens": 8},
            "gpus": {"devices": []},
            "server": {"port": free_port(), "parallel": 2},
            "fallback": {
                "window": "4s",
                "min_draft_tokens": 100,
                "consecutive_windows": 2,
                "cooldown": "1m",
                "chain": ["ngram", "none"],
            },
            "monitor": {"interval": "500ms"},
            "supervisor": {"stop_timeout": 10},
        },
    )


def test_noisy_draft_falls_back_to_ngram_and_keeps_serving(tmp_path, models):
    profile = profile_for(tmp_path, models, "llama-noisy", "gguf-draft-noisy.gguf")
    with UpRun(profile, tmp_path / "state", "llama-noisy") as run:
        st = run.wait_ready(timeout=120)
        with one_client(st["url"]) as load:
            st = run.wait_for(
                lambda s: s.get("method") == "ngram" and s.get("state") == "ready", 90, "fallback to ngram"
            )
            time.sleep(1.0)
        assert load.lost == 0 and load.counts["stream_error"] == 0, load.failures[:3]
        assert load.ok > 0
        switch = [d for d in run.events("decision") if d.get("action") == "switch"][0]
        assert switch["from"] == "draft_model" and switch["to"] == "ngram" and switch["rule"] == "threshold"
        assert switch["numbers"]["acceptance"] < 0.6 and switch["numbers"]["draft_tokens"] >= 100
        assert switch["window"]["status"] == "ok"
        # hysteresis: two low windows, each starting after the engine was ready, must precede the decision
        # (no upper bound: how soon the windows fill depends on the machine's load; wait_for bounds it)
        ready = run.events("ready")[0]["ts"]
        assert switch["ts"] - ready >= 2 * 4 - 0.5, switch["ts"] - ready
        assert switch["numbers"]["streak"] == 2
        assert st["last_decision"]["to"] == "ngram"
        complete = run.events("switch-complete")
        assert complete and complete[0]["start_to_ready_s"] > 0
        metrics = http_text(st["url"] + "/specops/metrics")
        assert 'specops_fallbacks_total{from_method="draft_model",reason="threshold",to_method="ngram"} 1.0' in metrics
        assert 'specops_active_method{method="ngram"} 1.0' in metrics
        status, body = http_json(
            st["url"] + "/v1/completions", {"prompt": "the quick", "max_tokens": 8, "temperature": 0}
        )
        assert status == 200
        assert run.stop() == 0


def test_same_weights_draft_is_kept_over_the_same_traffic(tmp_path, models):
    profile = profile_for(tmp_path, models, "llama-good", "gguf-draft-same.gguf")
    with UpRun(profile, tmp_path / "state", "llama-good") as run:
        st = run.wait_ready(timeout=120)
        with one_client(st["url"]) as load:
            st = run.wait_for(
                lambda s: (
                    (s.get("acceptance") or {}).get("status") == "ok"
                    and ((s.get("acceptance") or {}).get("draft_tokens") or 0) >= 100
                ),
                60,
                "a full window",
            )
            time.sleep(10)  # more than two windows of evidence
            st = run.wait_for(lambda s: (s.get("acceptance") or {}).get("status") == "ok", 30, "a window with data")
        assert load.lost == 0 and load.counts["stream_error"] == 0, load.failures[:3]
        assert load.ok > 0
        assert st["method"] == "draft_model" and st["switches"] == 0
        assert st["acceptance"]["acceptance"] > 0.9
        assert not [d for d in run.events("decision") if d.get("action") == "switch"]
        assert run.stop() == 0
