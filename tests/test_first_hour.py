"""The rough edges of a production user's first hour (issue 17), each pinned by a test:

- `specops status` shows the verdict against the threshold and the hysteresis count, not the window's
  data state ("ok") as if it were one;
- `specops up` without the engine says what it looked for, where, and how to fix it;
- specops' own CPU development engines serve CPU profiles only: a GPU profile never silently gets one;
- `specops bench` says when it cannot write plots and how to get them;
- `scripts/setup` keeps pip's output (setuptools' "Editable installation" warnings) in its log file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support_cli import ROOT, run

from specops.config.profile import load_profile
from specops.run.instance import EventLog, InstancePaths, write_state
from specops.watch.decide import FallbackDecider
from specops.watch.window import OK, WindowStats

W = 20.0


def _window(acceptance: float, end: float, tokens: float = 500) -> WindowStats:
    return WindowStats(
        OK,
        window_s=W,
        start=end - W,
        end=end,
        acceptance=acceptance,
        draft_tokens=tokens,
        accepted=acceptance * tokens,
        drafts=tokens / 4,
        mean_acceptance_length=1 + acceptance * 4,
        full=True,
        reason=f"{acceptance * tokens:g} accepted of {tokens:g} drafted",
    )


def _state_after(tmp_path: Path, windows: list[WindowStats], fallback: str = "") -> tuple[str, dict]:
    """Feed ``windows`` to the real decider of a profile, write the state file as `up` does, run status."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prof = tmp_path / "p.yaml"
    prof.write_text(
        "name: inst1\nbackend: llamacpp\nengine: {version: current}\nmodel: {id: /m/t.gguf}\n"
        "speculative: {method: draft_model, draft: /m/d.gguf}\ngpus: {devices: []}\n"
        f"fallback: {{min_acceptance: 0.6, window: 20s, consecutive_windows: 2, min_draft_tokens: 100{fallback}}}\n",
        encoding="utf-8",
    )
    profile = load_profile(prof, env={}).profile
    said: list[str] = []
    decider = FallbackDecider.from_profile(profile, events=EventLog(None), say=said.append, clock=lambda: 0.0)
    for w in windows:
        decider.observe(w, w.end or 0.0)
    state_dir = tmp_path / "state"
    paths = InstancePaths(state_dir / "inst1")
    write_state(
        paths,
        {
            "name": "inst1",
            "backend": "llamacpp",
            "url": "http://127.0.0.1:1",
            "proxy": False,
            "state": "ready",
            "method": "draft_model",
            "chain": ["draft_model", "ngram", "none"],
            "acceptance": windows[-1].to_dict() if windows else None,
            **decider.snapshot(),
        },
    )
    res = run("status", "inst1", "--state-dir", state_dir)
    assert res.code == 0, res.stderr
    return res.stdout, json.loads(run("status", "inst1", "--state-dir", state_dir, "--json").stdout)


def _line(out: str, key: str) -> str:
    return next(line.strip() for line in out.splitlines() if line.strip().startswith(key))


def test_status_shows_the_verdict_against_the_threshold_and_the_hysteresis_count(tmp_path):
    out, row = _state_after(tmp_path, [_window(0.368, 20.0)])
    acc = _line(out, "acceptance")
    assert acc.startswith("acceptance 0.368 over 20.0s") and "ok" not in acc  # "ok" was never a verdict
    assert _line(out, "verdict") == "verdict    below 0.6: 1 of 2 windows (falls back after 2)"
    assert row["policy"]["min_acceptance"] == 0.6 and row["policy"]["streak"] == 1
    assert row["last_verdict"]["low"] is True and row["last_verdict"]["acceptance"] == pytest.approx(0.368)


def test_status_verdict_after_a_good_window_and_before_any(tmp_path):
    out, _ = _state_after(tmp_path / "a", [_window(0.368, 20.0), _window(0.81, 40.0)])
    assert _line(out, "verdict") == "verdict    not below 0.6: 0 of 2 windows; last counted window: acceptance 0.810"
    # a window that is still filling gets no verdict, and status says why instead of "ok"
    filling = WindowStats(OK, window_s=W, start=0.0, end=5.0, acceptance=0.2, draft_tokens=300, accepted=60)
    out, _ = _state_after(tmp_path / "b", [filling])
    assert _line(out, "verdict") == (
        "verdict    no verdict yet (falls back after 2 windows below 0.6); latest window: the window is still filling"
    )
    few = _window(0.2, 20.0, tokens=50)
    out, _ = _state_after(tmp_path / "c", [few])
    assert "too few drafted tokens in the window (min_draft_tokens 100)" in _line(out, "verdict")


def test_status_verdict_when_fallback_is_off(tmp_path):
    out, _ = _state_after(tmp_path, [_window(0.1, 20.0)], fallback=", enabled: false")
    assert _line(out, "verdict") == "verdict    below 0.6: 1 of 2 windows (fallback disabled: watch only)"


def test_status_of_an_old_state_file_prints_no_verdict_line(tmp_path):
    paths = InstancePaths(tmp_path / "old")
    write_state(paths, {"name": "old", "state": "ready", "proxy": False, "policy": {"method": "ngram", "streak": 0}})
    res = run("status", "old", "--state-dir", tmp_path)
    assert res.code == 0 and "verdict" not in res.stdout and "Traceback" not in res.stderr
