"""What the benchmarks share: `specops up` as a subprocess, stopped like `specops down`; the commit a run measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: The prompts the phased benchmarks cycle through (short, mixed: prose, code, function words).
PROMPTS = [
    "The quick brown fox jumps over the lazy dog and",
    "Once upon a time in a land far away",
    "def hello world return print self import",
    "It is the and of to in that for on with as",
]


def commit_of(tree: Path) -> dict:
    """The tree's commit and whether it had uncommitted changes: what a run's figures were measured on."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=False).stdout

    return {"commit": git("rev-parse", "HEAD").strip() or None, "uncommitted": bool(git("status", "--porcelain"))}


def write_report(path: str | Path, tree: Path, load_before: tuple[float, float, float], **figures) -> None:
    """A benchmark's ``--json`` file: the machine, the work tree's commit (:func:`commit_of`), the load average
    before and after the run, and its figures."""
    from specops.perf.bench import machine

    report = {
        "machine": machine(),
        "work_tree": commit_of(tree),
        "load_average": [load_before, os.getloadavg()],
        **figures,
    }
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


class Up:
    """``specops up PROFILE`` as a subprocess, stopped with SIGTERM like ``specops down``."""

    def __init__(self, profile: Path, state: Path, name: str):
        self.profile, self.state, self.name = profile, state, name
        state.mkdir(parents=True, exist_ok=True)
        self.log = open(state / f"{name}.up.log", "w")
        env = {**os.environ, "SPECOPS_STATE": str(state)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specops.cli", "up", str(profile), "--quiet-engine"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def st(self) -> dict:
        try:
            return json.loads((self.state / self.name / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def events(self) -> list[dict]:
        try:
            return [json.loads(x) for x in (self.state / self.name / "events.jsonl").read_text().splitlines() if x]
        except FileNotFoundError:
            return []

    def wait_ready(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.st()
            if st.get("state") == "ready":
                return st
            if self.proc.poll() is not None:
                raise RuntimeError(f"specops up exited: {(self.state / f'{self.name}.up.log').read_text()[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError("specops up not ready in time")

    def wait_engines(self, count: int, timeout: float = 120) -> dict:
        """Ready, and ``count`` engines live behind the proxy (the primary and its twins): the state then."""
        deadline = time.monotonic() + timeout
        st = self.wait_ready(timeout)
        while count > 1 and not (len(st.get("engines", [])) == count and all(e["live"] for e in st["engines"])):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the twins did not come up: {st.get('engines')}")
            time.sleep(0.2)
            st = self.st()
        return st

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
