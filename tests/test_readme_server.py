"""The documentation's "Run it on your server" (docs/server.md; the README's short version quotes its commands):
the commands of its code blocks, run as written on a CPU profile copied
to `my-model.yaml` (the install, sudo, systemctl and journalctl lines excepted, each by name; `specops up`
until it serves a request, then Ctrl-C), and the unit it writes started the way systemd starts it
(ExecStart's argv, the EnvironmentFile's variables) and stopped the way systemd stops it (SIGTERM to
specops alone) within its TimeoutStopSec."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, unavailable
from support_engines import need_llama_server

from specops.run.process import group_members

PAGE = ROOT / "docs" / "server.md"
README = ROOT / "README.md"
SPECOPS = Path(sys.executable).parent / "specops"
SECRET = "sk-readme-0123456789"  # the API key the test's "environment file" holds

#: lines of the section that need root, pipx, a package index or a running systemd; the test runs the rest
NOT_RUN = {
    "pipx": "installs specops (a package index)",
    "python3": "creates a venv to install specops into (a package index)",
    "~/.venvs/specops/bin/pip": "installs specops (a package index)",
    "sudo": "root: installs the unit and the secrets file, drives systemd",
    "journalctl": "needs a running systemd",
}


def section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index("<!-- server:start -->"), text.index("<!-- server:end -->")
    return text[start:end]


def commands() -> list[list[str]]:
    """Every command of the section's ```bash blocks: comments dropped, `a && b` split."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section(), re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(words[:cut])
                words = words[cut + 1 :]
    return out


def test_the_readmes_server_commands_are_the_pages_tested_ones():
    """The README's "init → up on your server" block runs here through the page: each of its lines is one of the
    page's, so a command edited in one place and not the other fails."""
    text = README.read_text(encoding="utf-8")
    start, end = text.index("<!-- server-short:start -->"), text.index("<!-- server-short:end -->")
    page_lines = {" ".join(words) for words in commands()}
    readme_lines = [
        " ".join(shlex.split(line, comments=True))
        for block in re.findall(r"```bash\n(.*?)```", text[start:end], re.S)
        for line in block.splitlines()
    ]
    assert len([line for line in readme_lines if line.startswith("specops ")]) >= 4
    missing = [line for line in readme_lines if line and line not in page_lines]
    assert not missing, f"README commands not in docs/server.md (not tested): {missing}"


def test_the_section_has_the_steps():
    cmds = commands()
    specops = [c[1] for c in cmds if c[0] == "specops"]
    assert specops == ["resolve", "lock", "validate", "render", "up", "systemd", "doctor"]
    assert {"promtool", "systemd-analyze"} <= {c[0] for c in cmds}
    for c in cmds:
        assert c[0] in NOT_RUN or c[0] in ("specops", "promtool", "systemd-analyze"), f"unknown command {c}"
    text = section()
    for needed in ("engine.python", "engine.executable", "PATH", "EnvironmentFile", "ExecReload"):
        assert needed in text, needed


@pytest.fixture
def my_model(tmp_path, tiny_gguf_models, monkeypatch) -> Path:
    """examples/llamacpp-cpu-draft.yaml as the reader's own profile: named my-model, its key as ${API_KEY},
    on a free port."""
    from support_ports import free_port

    need_llama_server()
    data = yaml.safe_load((ROOT / "examples" / "llamacpp-cpu-draft.yaml").read_text(encoding="utf-8"))
    data["name"] = "my-model"
    data["server"].update(port=free_port(), api_key="${API_KEY}")
    (tmp_path / "my-model.yaml").write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    (tmp_path / "contrib").symlink_to(ROOT / "contrib")  # the commands name contrib/… from a checkout
    monkeypatch.setenv("SPECOPS_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the CPU profile's models are local files
    monkeypatch.setenv("API_KEY", SECRET)
    return tmp_path


def run_here(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    tool = {"specops": str(SPECOPS)}.get(words[0], words[0])
    exe = tool if os.path.isabs(tool) else shutil.which(tool)
    if exe is None:
        unavailable(f"{tool} is not installed")
    return subprocess.run([exe, *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.engines
def test_the_sections_commands_run_as_written(my_model):
    ran = []
    for words in commands():
        if words[0] in NOT_RUN:
            continue
        if words[0] == "specops" and words[1] == "up":  # serves until Ctrl-C: until it answered, here
            argv = [str(SPECOPS), *words[1:]]
            took = serve_then_stop(argv, my_model, dict(os.environ), signal.SIGINT, stop_within=60)
            print(f"{shlex.join(words)}: served, stopped {took:.1f}s after Ctrl-C")
            ran.append(words[:2])
            continue
        res = run_here(words, my_model)
        out = res.stdout + res.stderr
        assert res.returncode == 0, f"{shlex.join(words)}:\n{out}"
        assert "Traceback" not in out
        assert SECRET not in out, shlex.join(words)
        ran.append(words[:2])
    assert ["specops", "resolve"] in ran and ["promtool", "test"] in ran and ["systemd-analyze", "verify"] in ran
    assert ["specops", "up"] in ran
    assert ["specops", "doctor"] in ran  # exit 0: nothing blocks `specops up` for this profile
    # what each step left behind
    lock = json.loads((my_model / "my-model.lock.json").read_text(encoding="utf-8"))
    assert "gguf-draft-same.gguf" in json.dumps(lock)
    unit = (my_model / "specops-my-model.service").read_text(encoding="utf-8")
    assert SECRET not in unit
    assert "User=llm\n" in unit and "EnvironmentFile=/etc/specops/my-model.env\n" in unit
    assert "The profile reads: API_KEY" in unit


def exec_start(unit: str) -> list[str]:
    line = next(v for v in unit.splitlines() if v.startswith("ExecStart="))
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line.partition("=")[2])]


def serve_then_stop(
    argv: list[str], folder: Path, env: dict, stop: signal.Signals, stop_within: float, cwd: Path | None = None
) -> float:
    """Run ``specops up`` (``argv``, in ``cwd``, else the reader's ``folder``; leading its own process group)
    until it is ready (60 s) and answers a completion with the key, then send ``stop`` to specops alone
    (Ctrl-C, or systemd's SIGTERM under KillMode=mixed): it exits 0 within ``stop_within`` seconds, its
    engine's whole group gone with it. Returns the seconds the stop took; the secret is never in the output."""
    log_path = folder / "up.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        argv, cwd=cwd or folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    state_file = Path(env["SPECOPS_STATE"]) / "my-model" / "state.json"
    engine_group = None
    try:
        deadline = time.monotonic() + 60
        state: dict = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                state = json.loads(state_file.read_text())
            except (FileNotFoundError, ValueError):
                state = {}
            if state.get("state") == "ready":
                break
            time.sleep(0.2)
        assert state.get("state") == "ready", (
            f"{shlex.join(argv)} (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}"
        )
        engine_group = state["engine_pid"]
        req = urllib.request.Request(
            state["url"] + "/v1/completions",
            data=json.dumps({"prompt": "hello", "max_tokens": 8}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        status = run_here(["specops", "status", "my-model"], folder)
        assert status.returncode == 0 and "my-model" in status.stdout, status.stdout + status.stderr
        t0 = time.monotonic()
        proc.send_signal(stop)  # to the main process only
        rc = proc.wait(timeout=stop_within)
        took = time.monotonic() - t0
        assert rc == 0, log_path.read_text()[-3000:]
        assert not group_members(engine_group)  # the engine's whole group is gone, not left behind
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if engine_group is not None:
            for pid in group_members(engine_group):
                os.kill(pid, signal.SIGKILL)
        log.close()
    assert SECRET not in log_path.read_text()
    return took


@pytest.mark.engines
def test_the_unit_starts_serves_and_stops_within_its_timeout(my_model):
    """ExecStart's argv with only the variables the EnvironmentFile would hold, then systemd's stop:
    SIGTERM to specops alone (KillMode=mixed). specops stops the engine itself, exits 0 (no restart under
    Restart=on-failure) well within TimeoutStopSec, and leaves no engine process behind."""
    res = run_here(["specops", "systemd", "my-model.yaml", "--run-as", "llm", "-o", "unit.service"], my_model)
    assert res.returncode == 0, res.stderr
    unit = (my_model / "unit.service").read_text(encoding="utf-8")
    argv = exec_start(unit)
    assert argv[1:] == ["up", str(my_model / "my-model.yaml")]
    timeout_stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    env["API_KEY"] = SECRET  # what /etc/specops/my-model.env holds
    took = serve_then_stop(argv, my_model, env, signal.SIGTERM, stop_within=timeout_stop, cwd=Path("/"))
    assert took < timeout_stop
