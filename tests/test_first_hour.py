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
from support_engines import need_dev_engine

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


# ------------------------------------------------------------------------- engine discovery and `up`

DEV_VLLM = sorted(
    Path(os.environ.get("SPECOPS_CACHE", Path.home() / ".cache/specops")).glob("engines/vllm-*/bin/python")
)
NO_ENGINES_PATH = "/usr/bin:/bin"  # neither vllm nor llama-server lives there on a test machine


def _dev(pattern: str) -> Path:
    return need_dev_engine(pattern)


def _gpu_profile(tmp_path: Path, backend: str, extra: str = "") -> Path:
    model = "meta-llama/Llama-3.1-8B-Instruct" if backend == "vllm" else "/m/target.gguf"
    spec = "{method: ngram}" if backend == "vllm" else "{method: draft_model, draft: /m/draft.gguf}"
    path = tmp_path / f"gpu-{backend}.yaml"
    path.write_text(
        f"name: gpu-{backend}\nbackend: {backend}\nmodel: {{id: {model}}}\n"
        f"speculative: {spec}\ngpus: {{devices: [0]}}\n{extra}",
        encoding="utf-8",
    )
    return path


@pytest.mark.engines
@pytest.mark.parametrize(
    ("backend", "pattern", "setting"),
    [
        ("vllm", "vllm-*/bin/python", "engine.python"),
        ("llamacpp", "llama-server-*/bin/llama-server", "engine.executable"),
    ],
)
def test_a_gpu_profile_never_gets_the_cpu_development_engine_silently(tmp_path, backend, pattern, setting):
    dev = _dev(pattern)
    path = _gpu_profile(tmp_path, backend)
    res = run("render", path, "--format", "json", env={"PATH": NO_ENGINES_PATH})
    assert res.code == 1 and "Traceback" not in res.stderr
    err = res.stderr
    assert f"specops' CPU development engine {dev.parent.parent} not used: it serves CPU profiles only" in err
    assert f"gpus.devices [0]; to use it anyway, set {setting}: {dev}" in err
    assert "on PATH" in err and "--backend-version" in err
    # named explicitly, it is used: the user chose it
    key = "python" if backend == "vllm" else "executable"
    chosen = _gpu_profile(tmp_path, backend, f"engine: {{{key}: {dev}}}\n")
    ok = run("render", chosen, "--format", "json", env={"PATH": NO_ENGINES_PATH})
    assert ok.code == 0, ok.stderr
    assert json.loads(ok.stdout)["argv"][0] == str(dev)


@pytest.mark.engines
@pytest.mark.parametrize(
    ("profile", "pattern"),
    [
        ("examples/vllm-cpu-ngram.yaml", "vllm-*/bin/python"),
        ("examples/llamacpp-cpu-draft.yaml", "llama-server-*/bin/llama-server"),
    ],
)
def test_cpu_profiles_still_find_the_development_engine(profile, pattern, monkeypatch):
    dev = _dev(pattern)
    res = run("render", ROOT / profile, "--format", "json", env={"PATH": NO_ENGINES_PATH})
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["argv"][0] == str(dev)
    from specops.plugins import get_registry

    loaded = load_profile(ROOT / profile)
    monkeypatch.setenv("PATH", NO_ENGINES_PATH)
    info = get_registry().backend(loaded.profile.backend).engine_info(loaded.profile)
    assert info.source.startswith("specops' CPU development engine, probed ")  # `up` prints where it came from


def test_up_without_the_engine_says_what_it_looked_for_where_and_how_to_fix(tmp_path):
    (tmp_path / "model").mkdir()
    path = tmp_path / "pinned.yaml"
    path.write_text(
        f"name: no-engine\nbackend: vllm\nengine: {{version: 0.32.0}}\nmodel: {{id: {tmp_path / 'model'}}}\n"
        "speculative: {method: none}\nserver: {port: 18419}\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PATH": NO_ENGINES_PATH, "SPECOPS_STATE": str(tmp_path / "state")}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "specops"), "up", str(path), "--offline", "--quiet-engine"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: cannot start vllm: no program `vllm` in any folder of PATH ({NO_ENGINES_PATH})")
    assert "version is given (0.32.0), so specops did not search for the engine" in err
    assert "`pip install vllm`" in err and "engine.python" in err and "engine.executable" in err


# ------------------------------------------------------------------------------------ bench plots


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_bench_without_matplotlib_says_so_before_and_after_the_run(tmp_path, monkeypatch):
    """A real (tiny) bench on llama-server with matplotlib made unimportable: no PNG, and two warnings."""
    _dev("llama-server-*/bin/llama-server")
    from specops.devenv.testmodels import ensure_tiny_models

    models = ensure_tiny_models(["gguf"])
    profile = tmp_path / "b.yaml"
    profile.write_text(
        f"name: bench-noplots\nbackend: llamacpp\nmodel: {{id: {models['gguf-target.gguf']}, max_model_len: 512}}\n"
        f"speculative: {{method: draft_model, draft: {models['gguf-draft-same.gguf']}}}\n"
        "gpus: {devices: []}\nsupervisor: {stop_timeout: 10}\n",
        encoding="utf-8",
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "out"
    args = ("bench", profile, "-p", "code", "-c", "1", "-n", "1", "--warmup", "0", "--max-tokens", "8", "-o", out, "-q")
    res = run(*args)
    assert res.code == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: matplotlib is not installed")]
    assert len(warnings) == 2, res.stderr  # before the run (time to install it) and after (not lost in output)
    assert f"`{sys.executable} -m pip install 'specops[plots]'`" in warnings[0] and "--no-plots" in warnings[0]
    files = sorted(p.name for p in out.iterdir())
    assert "results.json" in files and "summary.md" in files and not [f for f in files if f.endswith(".png")]
    quiet = run(*args[:-3], "-o", tmp_path / "out2", "-q", "--no-plots")
    assert quiet.code == 0 and "matplotlib" not in quiet.stderr  # asked for no plots: nothing to warn about


# ------------------------------------------------------------------------------ scripts/setup output

SETUPTOOLS_NOISE = """  /tmp/pip-build-env-x/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!
          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
"""


def _fake_venv(root: Path, pip_exit: int) -> Path:
    """A venv stand-in: pip prints setuptools' editable-install warnings (a real install takes minutes and a
    package index); specops says which engines step it was asked for."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    noise = root / "noise.txt"
    noise.write_text(SETUPTOOLS_NOISE, encoding="utf-8")
    for name, body in (
        ("pip", f'cat "{noise}" >&2\necho "Successfully installed specops"\nexit {pip_exit}\n'),
        ("specops", 'echo "specops $*"\n'),
    ):
        script = venv / "bin" / name
        script.write_text("#!/bin/sh\n" + body, encoding="utf-8")
        script.chmod(0o755)
    return venv


@pytest.mark.parametrize("pip_exit", [0, 1])
def test_setup_keeps_pip_and_setuptools_output_in_its_log(tmp_path, pip_exit):
    venv, cache = _fake_venv(tmp_path, pip_exit), tmp_path / "cache"
    env = {**os.environ, "SPECOPS_VENV": str(venv), "SPECOPS_CACHE": str(cache)}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "setup"), "models"], capture_output=True, text=True, env=env, timeout=60
    )
    log = cache / "logs" / "pip-project.log"
    assert "Editable installation" in log.read_text(encoding="utf-8")  # the full output is kept
    console = (proc.stdout + proc.stderr).splitlines()
    assert console[0] == f"setup: project venv {venv} (pip log: {log})"
    if pip_exit == 0:
        assert proc.returncode == 0 and console[1:] == ["specops engines setup models"]
        assert not [line for line in console if "Editable" in line or "Successfully" in line]
    else:  # on failure the log's tail and its path, so the cause is one look away
        assert proc.returncode != 0 and "setup: failed:" in proc.stderr and f"setup: full log: {log}" in proc.stderr
        assert "specops engines" not in proc.stdout


def test_status_verdict_in_model_mode_names_the_predicted_speedup(tmp_path):
    out, row = _state_after(tmp_path, [_window(0.1, 20.0)], fallback=", mode: model, draft_cost_ratio: 0.5")
    assert _line(out, "verdict") == "verdict    predicted speedup below 1: 1 of 2 windows (falls back after 2)"
    assert row["last_verdict"]["predicted_speedup"] < 1


@pytest.mark.parametrize(
    ("backend", "setting", "expected"),
    [
        ("vllm", "python", "cannot run /nonexistent/bin/python to find vLLM (no such file): point engine.python"),
        ("llamacpp", "executable", "llama-server not found at /nonexistent/bin/python: fix engine.executable"),
    ],
)
def test_an_engine_setting_that_points_nowhere_says_which_setting_to_fix(tmp_path, backend, setting, expected):
    path = _gpu_profile(tmp_path, backend, f"engine: {{{setting}: /nonexistent/bin/python}}\n")
    res = run("render", path)
    assert res.code == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"error: {expected}")
