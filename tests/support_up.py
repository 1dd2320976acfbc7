"""Run `specops up` for real, as a subprocess, and look at it from outside like an operator would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from support_policy import require_engines_marker
from support_ports import free_port
from support_procs import stop_group

from specops.run.process import group_members

SPECOPS = [sys.executable, "-m", "specops.cli"]


def write_profile(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict | str]:
    """One request: (status, the JSON body or the raw text). A refused or reset connection and a timeout
    raise (the test fails there); load that must count every outcome is tests/support_load.py's."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def standin_up(tmp_path: Path, profile: Path, script: str) -> subprocess.Popen:
    """``specops up PROFILE`` run through a stand-in entry point (``script``, a file beside this one, named
    ``specops`` so its engines are what it launches), leading its own process group; output in ``up.log``."""
    entry = tmp_path / "bin" / "specops"
    entry.parent.mkdir()
    entry.symlink_to(Path(__file__).resolve().parent / script)
    with open(tmp_path / "up.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(entry), "up", str(profile)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_groups(pgids) -> None:
    """SIGKILL every process left in these process groups (engines lead groups of their own, so a supervisor
    killed or stopped before them can leave them running, holding a port and a core)."""
    for pgid in pgids:
        for pid in group_members(pgid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class UpProcess:
    """A `specops up` run as a subprocess leading its own process group, with its state folder: read from outside
    (``state``, ``events``), waited on, SIGKILLed whole or stopped as `specops down` does, its engines ended after
    it either way. A subclass says how it starts (``argv``, ``env``) and where its output goes (``log_path``)."""

    #: ``wait``'s default timeout and poll interval, and how long ``stop`` waits after SIGTERM
    wait_timeout, poll_s, stop_timeout = 30.0, 0.05, 30.0
    #: what ``wait`` raises when the run exits or the time is up
    failure: type[Exception] = AssertionError

    def __init__(self, name: str, state_dir: Path, env: dict):
        self.name, self.state_dir, self.env = name, state_dir, env
        self.proc: subprocess.Popen | None = None
        self.engines: set[int] = set()  # the engine process groups seen in its state, killed after it
        self.starts = 0

    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def start(self) -> UpProcess:
        self.starts += 1
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def output(self) -> str:
        return self.log_path.read_text()[-3000:]

    def state(self) -> dict:
        try:
            st = json.loads((self.state_dir / self.name / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        for pid in [st.get("engine_pid")] + [e.get("engine_pid") for e in st.get("engines", [])]:
            if pid:
                self.engines.add(pid)
        return st

    def wait(self, pred, what: str, timeout: float | None = None, tick=None) -> dict:
        """The first state ``pred`` accepts, calling ``tick`` (e.g. a request that feeds it) between looks."""
        deadline = time.monotonic() + (self.wait_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            st = self.state()
            if st and pred(st):
                return st
            if self.proc.poll() is not None:
                raise self.failure(f"{self.name}: specops up exited waiting for {what}:\n{self.output()}")
            if tick is not None:
                tick()
            time.sleep(self.poll_s)
        raise self.failure(f"{self.name}: timed out waiting for {what}: {self.state()}")

    def events(self, kind: str) -> list[dict]:
        lines = (self.state_dir / self.name / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]

    def kill(self) -> None:
        """SIGKILL the whole `specops up` (its engines, in groups of their own, are killed after it)."""
        self.state()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        kill_groups(self.engines)

    def stop(self) -> int | None:
        """SIGTERM (as `specops down` does), then whatever is left in its group and its engines killed; → its exit
        code (None when it did not exit within ``stop_timeout`` or never started)."""
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        stop_group(self.proc, timeout=5)
        kill_groups(self.engines)
        return rc


class UpRun:
    """`specops up PROFILE` on a real engine, in the background (the test is marked ``engines``); always stopped
    (and checked for orphans) on exit."""

    def __init__(self, profile: Path, state_dir: Path, name: str, env: dict | None = None):
        self.profile = profile
        self.state_dir = state_dir
        self.name = name
        self.env = {**os.environ, "SPECOPS_STATE": str(state_dir), **(env or {})}
        self.log_path = state_dir / f"{name}.up.log"
        self.proc: subprocess.Popen | None = None
        self.engine_groups: set[int] = set()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> UpRun:
        require_engines_marker(f"starts `specops up {self.profile.name}` on a real engine")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            SPECOPS + ["up", str(self.profile)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        return self

    def __enter__(self) -> UpRun:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.stop(check=False)
        if self.proc:
            stop_group(self.proc, 5)  # whatever specops up left in its own group
        kill_groups(self.engine_groups)  # never leave an engine behind, even when a test failed
        self._log.close()

    def stop(self, timeout: float = 90.0, check: bool = True) -> int:
        """SIGTERM specops (as `specops down` does) and wait; returns its exit code."""
        assert self.proc
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait(timeout=10)
            if check:
                raise AssertionError(f"specops up did not stop within {timeout}s\n{self.output()}") from None
        return rc

    # -------------------------------------------------------------- observation
    @property
    def root(self) -> Path:
        return self.state_dir / self.name

    def state(self) -> dict:
        try:
            st = json.loads((self.root / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        if st.get("engine_pid"):
            self.engine_groups.add(st["engine_pid"])
        return st

    def events(self, kind: str | None = None) -> list[dict]:
        try:
            lines = (self.root / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        evs = [json.loads(line) for line in lines if line.strip()]
        return [e for e in evs if kind is None or e["event"] == kind]

    def output(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except FileNotFoundError:
            return ""

    def wait_line(self, needle: str, timeout: float = 30.0) -> str:
        """The first line of the whole log holding ``needle`` (:meth:`output` keeps only its tail, which an
        engine's own lines can push a line out of), waited for: the state file can say ready before the line."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = self.log_path.read_text()
            except FileNotFoundError:
                text = ""
            found = next((line for line in text.splitlines() if needle in line), None)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no line with {needle!r} in the log after {timeout}s\n{self.output()}")
            time.sleep(0.2)

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if predicate(st):
                return st
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(
                    f"specops up exited ({self.proc.returncode}) while waiting for {what}\n{self.output()}"
                )
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; state={self.state()}\n{self.output()}")

    def wait_ready(self, timeout: float = 240.0, method: str | None = None) -> dict:
        return self.wait_for(
            lambda st: st.get("state") == "ready" and (method is None or st.get("method") == method),
            timeout,
            f"ready{' with ' + method if method else ''}",
        )

    def status_json(self) -> dict:
        out = subprocess.run(
            SPECOPS + ["status", self.name, "--json"], capture_output=True, text=True, env=self.env, timeout=30
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


def llama_profile(
    tmp_path,
    models,
    name,
    *,
    method="draft_model",
    draft="gguf-draft-same.gguf",
    target="gguf-target.gguf",
    chain=None,
    **extra,
):
    """A llama-server profile on the tiny GGUF models in ``models`` (CPU, 2 slots of 256 tokens); ``extra``
    sections replace the defaults."""
    spec = {"method": method}
    if method == "draft_model":
        spec["draft"] = draft if os.path.isabs(draft) else str(models / draft)
        spec["num_speculative_tokens"] = 4
    data = {
        "name": name,
        "backend": "llamacpp",
        "model": {"id": str(models / target), "max_model_len": 512},
        "speculative": spec,
        "gpus": {"devices": []},
        "server": {"port": free_port(), "parallel": 2},
        "supervisor": {"restart_backoff": 0.2, "stop_timeout": 10},
        "engine": {"ready_timeout": 60},
        **extra,
    }
    if chain is not None:
        data["fallback"] = {"chain": chain}
    return write_profile(tmp_path / f"{name}.yaml", data)
