"""Watch-and-fallback on a real llama-server: a noisy draft (acceptance ≈ 0.5) is left for n-gram, a
same-weights draft (≈ 0.97) is kept, over the same traffic. Decisions show in the event log, the state
file and specops' own /metrics."""

from __future__ import annotations

import threading
import time

import pytest
from support_up import UpRun, free_port, http_json, http_text, write_profile

pytestmark = pytest.mark.engines

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "def hello world return print self",
    "it is the and of to in that for on with",
    "lazy dog and quick fox over the hill",
]


@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


class Traffic:
    """Greedy completions from one background client until stopped; counts failures."""

    def __init__(self, url: str, max_tokens: int = 64, timeout: float = 300):
        # a request may wait in the proxy's queue for a whole engine switch (a vLLM start is ~1 min)
        self.url, self.max_tokens, self.timeout = url, max_tokens, timeout
        self.ok = self.failed = 0
        self.errors: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                status, body = http_json(
                    self.url + "/v1/completions",
                    {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": self.max_tokens, "temperature": 0},
                    timeout=self.timeout,
                )
            except OSError as exc:  # refused, reset, timed out: all count as a lost request
                status, body = None, repr(exc)
            if status == 200 and body["choices"][0]["text"] is not None:
                self.ok += 1
            else:
                self.failed += 1
                self.errors.append((status, body))
            i += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=90)


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
        with Traffic(st["url"]) as traffic:
            st = run.wait_for(
                lambda s: s.get("method") == "ngram" and s.get("state") == "ready", 90, "fallback to ngram"
            )
            time.sleep(1.0)
        assert traffic.failed == 0, traffic.errors[:3]
        assert traffic.ok > 0
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
        with Traffic(st["url"]) as traffic:
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
        assert traffic.failed == 0
        assert st["method"] == "draft_model" and st["switches"] == 0
        assert st["acceptance"]["acceptance"] > 0.9
        assert not [d for d in run.events("decision") if d.get("action") == "switch"]
        assert run.stop() == 0
