"""A running instance's footprint on disk: state file, event log and engine log, under one folder.

``specops up`` writes ``<state_dir>/<name>/state.json`` (atomically, on every change) and appends to
``events.jsonl``; ``specops status`` / ``down`` read them to reach the instance without a server of
their own. The folder is private (0700) and every file in it is created 0600. A state folder another
user owns, or that group or others may write, is refused (:func:`specops.paths.trust_problem`): whoever
can write a state file chooses what ``down`` signals.

Every state file is stamped with the writer's process identity (:mod:`specops.run.identity`), so a
state file whose process is gone or is now someone else is reported as stale and nothing is ever
signalled; the ``up.pid`` lock is in :mod:`specops.run.lock`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specops.errors import SpecopsError
from specops.paths import checked_state_dir, private_dir, trust_problem
from specops.run.identity import (
    identity_problem,
    self_identity,
    short_repr,
    valid_pid,
)

#: The largest state or lock file read; a bigger one is reported as unreadable, never loaded.
MAX_STATE_BYTES = 1 << 20
FILE_MODE = 0o600


class StateError(SpecopsError):
    """A state file that cannot be used as it is; the message is one line saying why."""


@dataclass(frozen=True)
class InstancePaths:
    root: Path

    @classmethod
    def for_profile(cls, name: str, setting: str | None = None) -> InstancePaths:
        return cls(checked_state_dir(setting) / name)

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

    def ensure(self) -> Path:
        """Create the instance folder (0700, and the state folder above it when missing); refuse a state
        folder above it that another user owns or group or others may write."""
        root = private_dir(self.root, tighten=True)
        problem = trust_problem(root.parent)
        if problem:
            raise SpecopsError(problem)
        return root


# --------------------------------------------------------------------------------------------- files


def open_private(path: Path, flags: int) -> int:
    """``os.open`` creating the file 0600; a file of ours left more open by an older specops is tightened."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 and st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode):
            os.fchmod(fd, FILE_MODE)
    except OSError:
        pass
    return fd


def open_log(path: Path, **kwargs):
    """A text file opened for appending, created 0600 (engine.log, events.jsonl)."""
    return os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", **kwargs)


def _read_bounded(path: Path) -> bytes:
    """The bytes of a regular file of at most MAX_STATE_BYTES (FileNotFoundError when absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(str(path)) from None
        if exc.errno == errno.ELOOP:
            raise StateError("it is a symbolic link") from None
        raise StateError(exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError("not a regular file")
        if st.st_uid != os.geteuid():
            raise StateError(f"it belongs to another user (uid {st.st_uid})")
        if st.st_size > MAX_STATE_BYTES:
            raise StateError(f"too large ({st.st_size} bytes, at most {MAX_STATE_BYTES})")
        chunks, size = [], 0
        while size <= MAX_STATE_BYTES:
            chunk = os.read(fd, MAX_STATE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_STATE_BYTES:
            raise StateError(f"too large (over {MAX_STATE_BYTES} bytes)")
        return b"".join(chunks)
    except OSError as exc:
        raise StateError(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def parse_state(raw: bytes) -> dict:
    """A state file's content as a dict, checked as far as status and down rely on it (StateError)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise StateError("not UTF-8 text") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise StateError("invalid JSON: nested too deeply") from None
    except ValueError as exc:
        raise StateError(f"invalid JSON: {str(exc).splitlines()[0][:120]}") from None
    if not isinstance(data, dict):
        raise StateError(f"not a JSON object but {type(data).__name__}")
    if valid_pid(data.get("pid")) is None:
        raise StateError(f"invalid pid {short_repr(data.get('pid'))}" if "pid" in data else "no pid")
    if "state" in data and not isinstance(data["state"], str):
        raise StateError(f"invalid state {short_repr(data['state'])}")
    if data.get("identity") is not None:
        problem = identity_problem(data["identity"])
        if problem:
            raise StateError(f"invalid identity: {problem}")
    return data


def write_state(paths: InstancePaths, state: dict) -> None:
    """Replace the state file atomically (a 0600 temporary file renamed over it), stamped with the
    identity of the writing process, which is the instance the state describes."""
    paths.ensure()
    me = self_identity()
    state = {**state, "pid": me["pid"], "identity": me}
    data = (json.dumps(state, indent=2, default=str) + "\n").encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=paths.root, prefix=".state.", suffix=".tmp")  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, paths.state)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_state(paths: InstancePaths) -> dict | None:
    """The state file, validated; None when there is none; StateError (one line) when unusable,
    which includes an instance folder that another user owns or group or others may write."""
    problem = trust_problem(paths.root, "instance folder")
    if problem:
        raise StateError(problem)
    try:
        raw = _read_bounded(paths.state)
    except FileNotFoundError:
        return None
    except StateError as exc:
        raise StateError(f"cannot read {paths.state}: {exc}") from None
    try:
        return parse_state(raw)
    except StateError as exc:
        raise StateError(f"cannot read {paths.state}: {exc}") from None


# --------------------------------------------------------------------------------------------- events


class EventLog:
    """JSON lines, one per event, flushed at once so a crash loses nothing that was decided."""

    def __init__(self, path: Path | None, keep: int = 200):
        self.path = path
        self.recent: list[dict] = []
        self.keep = keep
        if path is not None:
            private_dir(path.parent, tighten=True)

    def emit(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        self.recent.append(record)
        del self.recent[: -self.keep]
        if self.path is not None:
            with open_log(self.path, encoding="utf-8") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record


def find_instances(setting: str | None = None) -> list[InstancePaths]:
    root = checked_state_dir(setting)
    try:
        entries = sorted(root.iterdir()) if root.is_dir() else []
    except OSError as exc:
        raise SpecopsError(f"cannot list {root}: {exc.strerror or exc}") from None
    return [InstancePaths(p) for p in entries if (p / "state.json").is_file()]
