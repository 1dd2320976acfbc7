"""What every set-up step shares: its marker file, its lock, its log, and what it reports.

A step writes a marker file (JSON: what was installed, when, how long it took) as its very last act, so a
missing or unreadable marker means "not done"; concurrent set-ups wait on the step's lock, then find it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specops import __version__
from specops.errors import SpecopsError
from specops.paths import cache_dir

MARKER = ".specops-ready"
LOG_TAIL_LINES = 25

Progress = Callable[[str], None]


class SetupError(SpecopsError):
    """A set-up step failed: a one-line message, plus the log file and its last lines for the operator."""

    def __init__(self, message: str, log: Path | None = None, tail: Iterable[str] = ()):
        super().__init__(message)
        self.log = log
        self.tail = list(tail)


@dataclass
class StepResult:
    """What one set-up step did. ``status``: ``installed`` (work was done), ``adopted`` (found a correct
    install without a marker: verified it and wrote the marker) or ``cached`` (marker valid: nothing done)."""

    step: str
    status: str
    seconds: float
    path: Path
    detail: dict = field(default_factory=dict)
    log: Path | None = None

    @property
    def did_work(self) -> bool:
        return self.status != "cached"

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "path": str(self.path),
            "log": str(self.log) if self.log else None,
            "detail": self.detail,
        }


def logs_dir() -> Path:
    return cache_dir() / "logs"


def dir_size(path: Path) -> int:
    """Bytes used by the files under ``path`` (links not followed)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += st.st_size
    return total


# -------------------------------------------------------------------------------------------- markers


def read_marker(directory: Path, name: str = MARKER) -> dict | None:
    """The marker's JSON, or None when it is missing or unreadable (both mean: not set up)."""
    try:
        data = json.loads((Path(directory) / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(directory: Path, data: dict, name: str = MARKER) -> Path:
    """Write the marker atomically (a reader sees the old file or the whole new one, never a part)."""
    directory = Path(directory)
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    payload = {"specops": __version__, "created": _now(), **data}
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if needed): concurrent set-ups wait, then find the marker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------- running a subprocess


class StepLog:
    """One log file per step (``logs/engines-<step>.log``), appended per run, with each command's output."""

    def __init__(self, step: str, progress: Progress | None):
        self.step = step
        self.path = logs_dir() / f"engines-{step}.log"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress = progress or (lambda msg: None)
        with open(self.path, "a") as fh:
            fh.write(f"\n===== {_now()} specops {__version__}: setup {step} =====\n")
        self.start_offset = self.path.stat().st_size
        self.t0 = time.monotonic()

    def note(self, msg: str) -> None:
        with open(self.path, "a") as fh:
            fh.write(f"# {msg}\n")
        self.progress(f"{self.step}: {msg}")

    def tail(self, n: int = LOG_TAIL_LINES) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.start_offset)
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return []
        return text.rstrip("\n").splitlines()[-n:]

    def pip_download(self, dest: Path, requirements: list[str], what: str, *options: str, **kw) -> None:
        """``pip download --no-deps`` of ``requirements`` into ``dest`` with this interpreter's pip (nothing is
        installed: set-up steps use the files), ``options`` before them (e.g. ``--no-binary :all:``)."""
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", *options]
        self.run([*cmd, "-d", str(dest), *requirements], what, **kw)

    def fail(self, message: str) -> SetupError:
        with open(self.path, "a") as fh:
            fh.write(f"# FAILED: {message}\n")
        return SetupError(f"{self.step}: {message} (log: {self.path})", self.path, self.tail())

    def run(
        self,
        cmd: list[str],
        what: str,
        *,
        cwd: Path | None = None,
        env: dict | None = None,
        heartbeat: float = 30.0,
        timeout: float | None = None,
    ) -> None:
        """Run ``cmd`` with its output going to the log; raise SetupError on failure.

        Every ``heartbeat`` seconds the last progress-looking line (``[ 42%] ...``) is reported, so an
        8-minute build does not look hung.
        """
        self.note(f"{what}: {' '.join(cmd)}")
        t0 = time.monotonic()
        with open(self.path, "ab") as out:
            try:
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env
                )
            except FileNotFoundError:
                raise self.fail(f"{cmd[0]} not found: install it first") from None
            except PermissionError:
                raise self.fail(f"{cmd[0]} is not executable") from None
            next_beat = t0 + heartbeat
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=1.0)
                        break
                    except subprocess.TimeoutExpired:
                        now = time.monotonic()
                        if timeout is not None and now - t0 > timeout:
                            proc.kill()
                            proc.wait()
                            raise self.fail(f"{what} did not finish within {timeout:.0f} s") from None
                        if now >= next_beat:
                            next_beat = now + heartbeat
                            self.progress(f"{self.step}: {what}: still running ({now - t0:.0f} s){self._last_mark()}")
            except BaseException:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                raise
        secs = time.monotonic() - t0
        with open(self.path, "a") as fh:
            fh.write(f"# exit {rc} after {secs:.1f} s\n")
        if rc != 0:
            raise self.fail(f"{what} failed (exit {rc})")
        self.progress(f"{self.step}: {what}: done in {secs:.1f} s")

    def _last_mark(self) -> str:
        for line in reversed(self.tail(40)):
            m = re.match(r"\s*\[\s*(\d+)%\]", line)
            if m:
                return f", {m.group(1)}%"
        return ""
