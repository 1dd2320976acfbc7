"""Faults on a real llama-server whose draft is bad enough to fall back from (acceptance ≈ 0.5):
an idle engine, a metrics endpoint that stops answering, and an engine restart mid-window must never
cause a switch on their own."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support_load import one_client
from support_ports import free_port
from support_up import UpRun, write_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]
WINDOW = 3


@pytest.fixture(scope="module")
def models(tiny_gguf_models):
    return tiny_gguf_models


def noisy_profile(tmp_path, models, name, **proxy):
    return write_profile(
        tmp_path / f"{name}.yaml",
        {
            "name": name,
            "backend": "llamacpp",
            "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 1024},
            "speculative": {
                "method": "draft_model",
                "draft": str(models / "gguf-draft-noisy.gguf"),
                "num_speculative_tokens": 8,
            },
            "gpus": {"devices": []},
            "server": {"port": free_port(), "parallel": 2},
            "fallback": {
                "window": f"{WINDOW}s",
                "min_draft_tokens": 100,
                "consecutive_windows": 2,
                "chain": ["ngram", "none"],
            },
            "monitor": {"interval": "300ms", "timeout": "500ms"},
            "supervisor": {"stop_timeout": 10, "restart_backoff": 0.2},
            "proxy": proxy or {"enabled": True},
        },
    )


def test_idle_engine_decides_nothing(tmp_path, models):
    with UpRun(noisy_profile(tmp_path, models, "idle"), tmp_path / "state", "idle") as run:
        run.wait_ready(timeout=60)
        time.sleep(4 * WINDOW)
        st = run.state()
        assert st["acceptance"]["status"] == "no-data" and st["acceptance"]["acceptance"] is None
        assert st["method"] == "draft_model" and st["switches"] == 0
        assert not run.events("decision")
        assert run.stop() == 0


def test_metrics_endpoint_down_means_no_switch_then_recovery(tmp_path, models):
    # without the proxy, nothing but llama-server's own /metrics tells acceptance
    with UpRun(noisy_profile(tmp_path, models, "frozen", enabled=False), tmp_path / "state", "frozen") as run:
        st = run.wait_ready(timeout=60)
        pgid = st["engine_pid"]
        os.killpg(pgid, signal.SIGSTOP)  # the engine hangs: /metrics times out
        try:
            st = run.wait_for(
                lambda s: (s.get("acceptance") or {}).get("status") == "unavailable",
                20,
                "the watcher to notice the unreadable source",
            )
            time.sleep(3 * WINDOW)
            st = run.state()
            assert st["acceptance"]["status"] == "unavailable" and st["policy"]["source_down_since"] is not None
            assert st["method"] == "draft_model" and st["switches"] == 0
            assert "warning" in run.output() and "metrics" in run.output().lower()
        finally:
            os.killpg(pgid, signal.SIGCONT)
        st = run.wait_for(lambda s: (s.get("acceptance") or {}).get("status") in ("no-data", "ok"), 20, "recovery")
        assert st["policy"]["source_down_since"] is None
        assert not [d for d in run.events("decision") if d.get("action") == "switch"]
        assert run.stop() == 0


def test_engine_restart_mid_window_is_not_a_verdict(tmp_path, models):
    """Counters restart from zero with the engine: the window treats it as a reset, not as negative work,
    and a window that spans the restart never decides."""
    profile = noisy_profile(tmp_path, models, "reset")
    with UpRun(profile, tmp_path / "state", "reset") as run:
        st = run.wait_ready(timeout=60)
        with one_client(st["url"], max_tokens=32) as load:
            run.wait_for(lambda s: ((s.get("acceptance") or {}).get("draft_tokens") or 0) > 0, 30, "some drafts")
            os.killpg(st["engine_pid"], signal.SIGKILL)
            st = run.wait_for(lambda s: s.get("restarts") == 1 and s.get("state") == "ready", 30, "restart")
            st = run.wait_for(lambda s: s.get("method") == "ngram", 60, "the fallback, decided after the restart")
        assert load.lost == 0 and load.ok > 0, load.failures[:3]  # the proxy held the requests over the restart
        switch = [d for d in run.events("decision") if d.get("action") == "switch"][0]
        restarted = [e for e in run.events("ready")][1]["ts"]
        # the deciding window starts after the new engine was ready (its reader attaches then): a whole window
        # after it, and no reset inside; a low window counted before the crash may complete the streak (the same
        # method and draft, disjoint evidence), so the switch can come one window after the restart, not two
        assert switch["ts"] - restarted >= WINDOW - 0.5
        assert switch["numbers"]["acceptance"] < 0.6 and switch["window"]["resets"] == 0
        assert switch["numbers"]["streak"] == 2, switch["numbers"]
        assert run.stop() == 0
