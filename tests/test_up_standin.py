"""`specops up` as wired in production (specops.serve.up), on the stand-in engine: a threshold fallback under
traffic through the proxy, then `specops status` and `specops down` from outside, like an operator.

The stand-in (support_standin.py) renders support_upstream.py for every method; ngram "accepts" 0.2, so
the watcher decides a switch to `none` within a few windows of traffic."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from support_ports import free_port
from support_procs import stop_group
from support_up import SPECOPS, http_json, http_text, write_profile

HERE = Path(__file__).resolve().parent


def events(state_dir: Path, name: str, kind: str) -> list[dict]:
    try:
        lines = (state_dir / name / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]


def status(state_dir: Path, name: str) -> dict:
    out = subprocess.run(
        SPECOPS + ["status", name, "--json", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(state_dir: Path, name: str, predicate, timeout: float, what: str, proc=None, tick=None) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        try:
            st = json.loads((state_dir / name / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            st = {}
        if predicate(st):
            return st
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"specops up exited ({proc.returncode}) waiting for {what}")
        if tick is not None:
            tick(st)
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {st}")


def test_fallback_status_and_down_through_the_real_wiring(tmp_path):
    state_dir = tmp_path / "state"
    name = "standin"
    port = free_port()
    profile = write_profile(
        tmp_path / "standin.yaml",
        {
            "name": name,
            "backend": "llamacpp",
            "model": {"id": str(tmp_path / "target.gguf")},
            "speculative": {"method": "ngram"},
            "gpus": {"devices": []},
            "server": {"port": port},
            "fallback": {
                "chain": ["none"],
                "window": 1,
                "min_draft_tokens": 20,
                "consecutive_windows": 2,
                "cooldown": 0,
            },
            "monitor": {"interval": 0.1, "timeout": 1},
            "supervisor": {"state_dir": str(state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
            "proxy": {"enabled": True},
        },
    )
    (tmp_path / "target.gguf").write_bytes(b"GGUF")  # the stand-in reads no weights; the launch check wants a file
    log = open(tmp_path / "up.log", "w")
    entry = tmp_path / "bin" / "specops"  # `specops up PROFILE`'s command line, which `specops down` checks
    entry.parent.mkdir()
    entry.symlink_to(HERE / "support_standin.py")
    proc = subprocess.Popen(
        [sys.executable, str(entry), "up", str(profile)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        st = wait_for(state_dir, name, lambda s: s.get("state") == "ready", 30, "ready", proc)
        assert st["method"] == "ngram" and st["switches"] == 0 and st["last_decision"] is None
        row = status(state_dir, name)
        assert row["running"] is True and row["state"] == "ready" and row["policy"]["method"] == "ngram"
        assert row["live"]["proxy"]["url"] == f"http://127.0.0.1:{port}"

        def traffic(_st):
            http_json(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x", "max_tokens": 20}, timeout=10)

        st = wait_for(
            state_dir,
            name,
            lambda s: s.get("method") == "none" and s.get("state") == "ready",
            60,
            "the fallback to none",
            proc,
            tick=traffic,
        )
        assert st["switches"] == 1 and st["last_decision"]["rule"] == "threshold"
        assert st["last_decision"]["from"] == "ngram" and st["last_decision"]["to"] == "none"
        [decision] = [d for d in events(state_dir, name, "decision") if d["action"] == "switch"]
        assert decision["rule"] == "threshold" and decision["numbers"]["acceptance"] < 0.6
        assert decision["window"]["status"] == "ok" and decision["numbers"]["streak"] == 2
        assert events(state_dir, name, "switch") and events(state_dir, name, "switch-complete")
        metrics = http_text(f"http://127.0.0.1:{port}/specops/metrics")
        assert 'specops_fallbacks_total{from_method="ngram",reason="threshold",to_method="none"} 1.0' in metrics
        assert 'specops_active_method{method="none"} 1.0' in metrics
        assert http_json(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x", "max_tokens": 4})[0] == 200

        down = subprocess.run(
            SPECOPS + ["down", name, "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60
        )
        assert down.returncode == 0 and f"{name}: stopped" in down.stdout, down.stdout + down.stderr
        assert proc.wait(10) == 0
        row = status(state_dir, name)
        assert row["state"] == "stopped" and row["running"] is False and row["switches"] == 1
        assert events(state_dir, name, "down")[-1]["exit_code"] == 0
        again = subprocess.run(
            SPECOPS + ["down", name, "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=30
        )
        assert again.returncode == 0 and "not running" in again.stdout
    finally:
        stop_group(proc, timeout=15)  # `specops down` stopped it when the test got that far; else SIGTERM here
        log.close()
        log.close()
