"""Profile reload on a real llama-server under 16 clients: a valid edit (a ConfigMap-style symlink swap) restarts
the engine with the new flags, an invalid one (SIGHUP) is rejected with its location while the old config keeps
serving, and no client request is lost over the whole run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from support_load import Load
from support_ports import free_port
from support_up import SPECOPS, UpRun, http_text

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]

CLIENTS = 16
K_FLAGS = ("--draft-max", "--spec-draft-n-max")


def configmap(root: Path, version: str, data: dict) -> Path:
    """Write ``data`` the way kubelet updates a ConfigMap volume: a new ``..<version>`` folder, then an atomic
    swap of the ``..data`` symlink; ``p.yaml`` is a symlink through ``..data`` (the path specops was given)."""
    folder = root / f"..{version}"
    folder.mkdir()
    (folder / "p.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    tmp = root / "..data_tmp"
    os.symlink(folder.name, tmp)
    os.replace(tmp, root / "..data")
    link = root / "p.yaml"
    if not link.is_symlink():
        os.symlink("..data/p.yaml", link)
    return folder / "p.yaml"


def profile_data(models: Path, port: int, k: int) -> dict:
    return {
        "name": "reload-llama",
        "backend": "llamacpp",
        "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 2048},
        "speculative": {
            "method": "draft_model",
            "draft": str(models / "gguf-draft-same.gguf"),
            "num_speculative_tokens": k,
        },
        "gpus": {"devices": []},
        "server": {"port": port, "parallel": 8},
        "fallback": {"window": "3s", "min_draft_tokens": 100, "consecutive_windows": 2, "chain": ["ngram", "none"]},
        "monitor": {"interval": "300ms", "timeout": "1s"},
        "supervisor": {"stop_timeout": 10, "restart_backoff": 0.2},
        "engine": {"ready_timeout": 60},
        "proxy": {"queue_timeout": "2m", "drain_timeout": "30s"},
    }


def k_of(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg in K_FLAGS:
            return argv[i + 1]
    raise AssertionError(f"no draft-size flag in {argv}")


def wait_until(check, timeout: float, what: str, run: UpRun):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert run.proc.poll() is None, f"specops up exited while waiting for {what}\n{run.output()}"
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{run.output()}")


def test_valid_and_invalid_reload_under_load_lose_nothing(tmp_path, tiny_gguf_models):
    mount = tmp_path / "config"
    mount.mkdir()
    port = free_port()
    configmap(mount, "v1", profile_data(tiny_gguf_models, port, k=8))
    profile = mount / "p.yaml"
    url = f"http://127.0.0.1:{port}"
    with UpRun(profile, tmp_path / "state", "reload-llama") as run:
        run.wait_ready(timeout=120)
        first_pid = run.state()["engine_pid"]
        assert k_of(run.events("start")[0]["argv"]) == "8"
        load = Load(url, clients=CLIENTS, max_tokens=24, request_timeout=120, max_seconds=240).start()
        try:
            load.wait_for_answers(16, timeout=60)

            # (1) a valid edit, delivered like a ConfigMap update: the engine restarts with the new k
            configmap(mount, "v2", profile_data(tiny_gguf_models, port, k=3))
            reload_ev = wait_until(lambda: run.events("reload"), 30, "the reload event", run)[0]
            assert reload_ev["changes"] == ["speculative.num_speculative_tokens"]
            starts = wait_until(lambda: run.events("start")[1:], 60, "the engine's restart", run)
            assert k_of(starts[0]["argv"]) == "3"
            st = run.wait_for(
                lambda s: s.get("state") == "ready" and s.get("engine_pid") not in (None, first_pid),
                60,
                "the reloaded engine to be ready",
            )
            second_pid = st["engine_pid"]
            assert run.events("switch-complete"), "the reload did not go through the supervisor's switch"
            assert st["profile_reload"]["applied"] == 1
            load.wait_for_answers(16, timeout=60)

            # (2) an invalid edit, delivered with SIGHUP: rejected with its location, the old config keeps serving
            bad = profile_data(tiny_gguf_models, port, k=3)
            bad["speculative"]["num_speculative_tokens"] = -2
            written = configmap(mount, "v3", bad)
            run.proc.send_signal(signal.SIGHUP)
            rejected = wait_until(lambda: run.events("reload-rejected"), 30, "the rejection", run)[0]
            line = next(
                i for i, text in enumerate(written.read_text().splitlines(), 1) if "num_speculative_tokens" in text
            )
            assert f"{profile}:{line}:" in rejected["message"], rejected
            assert "speculative.num_speculative_tokens" in rejected["message"]
            st = wait_until(
                lambda: (s := run.state()).get("profile_reload", {}).get("rejected") and s, 10, "the state file", run
            )
            assert st["engine_pid"] == second_pid and st["state"] == "ready"
            shown = subprocess.run(
                SPECOPS + ["status", "reload-llama"], capture_output=True, text=True, env=run.env, timeout=30
            )
            assert "profile reload rejected, keeps running the old config" in shown.stdout, shown.stdout + shown.stderr
            assert f"{profile}:{line}:" in shown.stdout
            metrics = http_text(url + "/specops/metrics")
            assert "specops_profile_reload_failed 1.0" in metrics
            assert 'specops_profile_reload_total{result="rejected"} 1.0' in metrics
            assert 'specops_profile_reload_total{result="applied"} 1.0' in metrics
            load.wait_for_answers(16, timeout=60)  # still served, by the engine of the running config
            assert len(run.events("start")) == 2 and run.state()["engine_pid"] == second_pid
        finally:
            load.stop()
        print(f"\nreload under load: {load.report()}")
        assert load.lost == 0, load.report() + "\n" + "\n".join(load.failures[:8]) + "\n" + run.output()[-3000:]
        assert load.counts["stream_error"] == 0, load.stream_errors[:5]
        assert load.counts["ok"] > 0
        assert run.stop() == 0
