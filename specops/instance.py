"""A running instance's footprint on disk: state file, event log and engine log, under one folder.

``specops up`` writes ``<state_dir>/<name>/state.json`` (atomically, on every change) and appends to
``events.jsonl``; ``specops status`` / ``down`` read them to reach the instance without a server of
their own. A state file whose pid is gone is reported as stale, never trusted.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecopsError
from .paths import state_dir


@dataclass(frozen=True)
class InstancePaths:
    root: Path

    @classmethod
    def for_profile(cls, name: str, setting: str | None = None) -> "InstancePaths":
        return cls(state_dir(setting) / name)

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def engine_log(self) -> Path:
        return self.root / "engine.log"

    @property
    def lock(self) -> Path:
        return self.root / "up.pid"


def proc_state(pid: int | str) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid`` from /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # the fields after the command name (which may contain spaces) start after the last ')'
    rest = stat[stat.rfind(")") + 2:].split()
    return (rest[0], int(rest[2])) if len(rest) > 2 else None


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    st = proc_state(pid)
    return st is None or st[0] != "Z"  # a zombie is not alive (no /proc entry: trust kill(0))


def write_state(paths: InstancePaths, state: dict) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    tmp = paths.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, paths.state)


def read_state(paths: InstancePaths) -> dict | None:
    try:
        return json.loads(paths.state.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SpecopsError(f"cannot read {paths.state}: {exc}") from None


def acquire(paths: InstancePaths) -> None:
    """Refuse a second ``up`` of the same profile name while the first one lives."""
    paths.root.mkdir(parents=True, exist_ok=True)
    try:
        other = int(paths.lock.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        other = 0
    if other and other != os.getpid() and pid_alive(other):
        raise SpecopsError(f"{paths.root.name} is already up (specops pid {other}); "
                           f"`specops down {paths.root.name}` first")
    paths.lock.write_text(f"{os.getpid()}\n")


def release(paths: InstancePaths) -> None:
    try:
        if int(paths.lock.read_text().strip() or 0) == os.getpid():
            paths.lock.unlink()
    except (FileNotFoundError, ValueError):
        pass


class EventLog:
    """JSON lines, one per event, flushed at once so a crash loses nothing that was decided."""

    def __init__(self, path: Path | None, keep: int = 200):
        self.path = path
        self.recent: list[dict] = []
        self.keep = keep
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        self.recent.append(record)
        del self.recent[: -self.keep]
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record


def find_instances(setting: str | None = None) -> list[InstancePaths]:
    root = state_dir(setting)
    if not root.is_dir():
        return []
    return [InstancePaths(p) for p in sorted(root.iterdir()) if (p / "state.json").is_file()]
