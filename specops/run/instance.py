"""A running instance's footprint on disk: state file, event log and engine log, under one folder.

``specops up`` writes ``<state_dir>/<name>/state.json`` (atomically, on every change) and appends to
``events.jsonl``; ``specops status`` / ``down`` read them to reach the instance without a server of
their own. The folder is private (0700) and every file in it is created 0600.

A state file names a pid, and pids are reused (after a crash, after a reboot), so a pid alone is never
trusted: the writer records its *identity* (pid, start time in clock ticks from ``/proc/<pid>/stat``
and the kernel's boot id) and a process is taken for the instance only when all of it matches. A state
file whose process is gone or is now someone else is reported as stale and nothing is ever signalled.
The ``up.pid`` lock is held with ``flock`` for the life of ``specops up``, so a crashed instance leaves
no lock behind whatever became of its pid.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specops.errors import SpecopsError
from specops.paths import private_dir, state_dir

#: The largest state or lock file read; a bigger one is reported as unreadable, never loaded.
MAX_STATE_BYTES = 1 << 20
#: PID_MAX_LIMIT on 64-bit Linux: no pid is larger.
PID_MAX = 1 << 22
FILE_MODE = 0o600


class StateError(SpecopsError):
    """A state file that cannot be used as it is; the message is one line saying why."""


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

    def ensure(self) -> Path:
        """Create the instance folder (0700, and the state folder above it when missing)."""
        return private_dir(self.root, tighten=True)


# --------------------------------------------------------------------------------------------- processes

def valid_pid(value) -> int | None:
    """``value`` when it can name a process specops may have written (an int, not a bool, in 2..PID_MAX)."""
    return value if type(value) is int and 1 < value <= PID_MAX else None


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat from field 3 (state) on, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096).decode("ascii", "replace")
    except (OSError, ValueError):
        return None
    # the fields after the command name (which may contain spaces) start after the last ')'
    rest = raw[raw.rfind(")") + 2:].split()
    return rest if len(rest) > 19 else None


def proc_state(pid: int | str) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid`` from /proc, or None when there is no such process."""
    rest = _stat_fields(pid)
    try:
        return (rest[0], int(rest[2])) if rest else None
    except ValueError:
        return None


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks after boot."""
    rest = _stat_fields(pid)
    try:
        return int(rest[19]) if rest else None
    except ValueError:
        return None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip() or None
    except (OSError, ValueError):
        return None


def process_identity(pid: int) -> dict | None:
    """What tells this process apart from any later one given the same pid: start time and boot id."""
    start = proc_starttime(pid)
    if start is None:
        return None
    return {"pid": pid, "starttime": start, "boot_id": boot_id()}


_self_identity: dict | None = None


def self_identity() -> dict:
    global _self_identity
    if _self_identity is None or _self_identity["pid"] != os.getpid():
        _self_identity = process_identity(os.getpid()) or {"pid": os.getpid(), "starttime": None,
                                                           "boot_id": boot_id()}
    return dict(_self_identity)


def pid_alive(pid) -> bool:
    """Whether some live (non-zombie) process has this pid: says nothing of *which* process it is."""
    pid = valid_pid(pid)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    st = proc_state(pid)
    return st is None or st[0] != "Z"  # a zombie is not alive (no /proc entry: trust kill(0))


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def identity_problem(identity) -> str | None:
    """Why ``identity`` (as recorded) is malformed, or None."""
    if not isinstance(identity, dict):
        return f"identity is not an object: {_short(identity)}"
    if valid_pid(identity.get("pid")) is None:
        return f"invalid pid {_short(identity.get('pid'))}"
    if type(identity.get("starttime")) is not int or identity["starttime"] < 0:
        return f"invalid start time {_short(identity.get('starttime'))}"
    if identity.get("boot_id") is not None and not isinstance(identity.get("boot_id"), str):
        return f"invalid boot id {_short(identity.get('boot_id'))}"
    return None


def why_not_running(identity: dict) -> str | None:
    """None when the process ``identity`` records is alive now; else why not (one line).

    ``identity`` must be well formed (see :func:`identity_problem`)."""
    pid = identity["pid"]
    recorded_boot, now_boot = identity.get("boot_id"), boot_id()
    if recorded_boot and now_boot and recorded_boot != now_boot:
        return f"pid {pid} was recorded before the last reboot"
    rest = _stat_fields(pid)
    if rest is None or rest[0] in ("Z", "X"):
        return f"pid {pid} is not running"
    if rest[19] != str(identity["starttime"]):
        return f"pid {pid} is now another process (the pid was reused)"
    return None


def owner_problem(state: dict) -> str | None:
    """None when the specops process that wrote ``state`` is alive; else why the state is stale."""
    identity = state.get("identity")
    if identity is None:
        return (f"cannot tell whether pid {state.get('pid')} is this instance (no process identity in "
                f"the state file: written by an older specops?)")
    problem = identity_problem(identity)
    if problem is None and identity["pid"] != state.get("pid"):
        problem = "the identity names another pid than the state"
    if problem:
        return f"unusable process identity: {problem}"
    return why_not_running(identity)


def signal_process(identity: dict, sig: int) -> str | None:
    """Send ``sig`` to the process ``identity`` records, only if it is that very process.

    Returns None when sent, else why not. A pidfd pins the process between the check and the signal,
    so a pid reused in between cannot receive it."""
    pid = identity["pid"]
    fd = None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return f"pid {pid} is not running"
    except (AttributeError, OSError):
        fd = None  # no pidfd (old kernel): the identity check just before the signal still holds
    try:
        why = why_not_running(identity)
        if why:
            return why
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return f"pid {pid} is not running"
        except PermissionError:
            return f"not allowed to signal pid {pid} (another user's process)"
        return None
    finally:
        if fd is not None:
            os.close(fd)


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
        raise StateError(f"invalid pid {_short(data.get('pid'))}" if "pid" in data else "no pid")
    if "state" in data and not isinstance(data["state"], str):
        raise StateError(f"invalid state {_short(data['state'])}")
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
    """The state file, validated; None when there is none; StateError (one line) when unusable."""
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


def remove_stale_state(paths: InstancePaths) -> bool:
    """Remove the state file when no ``specops up`` of this name runs (its lock is free)."""
    with try_lock(paths) as free:
        if not free:
            return False
        try:
            paths.state.unlink()
        except FileNotFoundError:
            pass
        return True


# --------------------------------------------------------------------------------------------- the lock

_held: dict[Path, int] = {}


def _lock_holder(fd: int) -> dict | None:
    """The identity written in a lock file (None when empty or unreadable). An old plain pid → {'pid'}."""
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if type(data) is int:  # written by an older specops: a bare pid
        return {"pid": data} if valid_pid(data) else None
    return data if isinstance(data, dict) and identity_problem(data) is None else None


def _holder_is_live_specops(holder: dict | None) -> bool:
    if holder is None or valid_pid(holder.get("pid")) is None:
        return False
    if "starttime" in holder:
        return why_not_running(holder) is None
    # a bare pid (older specops, which held no flock): believe it only when that process is specops
    try:
        with open(f"/proc/{holder['pid']}/cmdline", "rb") as f:
            cmdline = f.read(65536)
    except OSError:
        return False
    return pid_alive(holder["pid"]) and b"specops" in cmdline


def _open_locked(path: Path, blocking_for: float) -> tuple[int | None, int | None]:
    """(fd holding an exclusive flock on ``path``, None) or (None, fd of the file someone else holds)."""
    deadline = time.monotonic() + blocking_for
    while True:
        fd = open_private(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() < deadline and not _holder_is_live_specops(_lock_holder(fd)):
                os.close(fd)       # held for a moment by `down` checking for staleness: try again
                time.sleep(0.05)
                continue
            return None, fd
        except OSError:
            os.close(fd)
            raise
        try:  # the previous holder may have removed the file between our open and our flock
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, None
        os.close(fd)


def acquire(paths: InstancePaths, say: Callable[[str], None] | None = None) -> None:
    """Refuse a second ``up`` of the same profile name while the first one lives.

    The lock is an ``flock`` on ``up.pid`` held until :func:`release` or the process ends; the file
    names its holder (pid, start time, boot id) for the message. A lock file left by a dead instance,
    or naming a pid that is now another process, is stale and taken over."""
    if paths.lock in _held:
        return
    paths.ensure()
    try:
        fd, busy = _open_locked(paths.lock, blocking_for=2.0)
    except OSError as exc:
        raise SpecopsError(f"cannot lock {paths.lock}: {exc.strerror or exc}") from None
    if fd is None:
        holder = _lock_holder(busy)
        os.close(busy)
        who = f"specops pid {holder['pid']}" if holder else "another specops"
        raise SpecopsError(f"{paths.root.name} is already up ({who}); `specops down {paths.root.name}` first")
    holder = _lock_holder(fd)
    if holder is not None and holder.get("pid") != os.getpid() and _holder_is_live_specops(holder):
        os.close(fd)  # an older specops (no flock) still running with this name
        raise SpecopsError(f"{paths.root.name} is already up (specops pid {holder['pid']}); "
                           f"`specops down {paths.root.name}` first")
    if holder is not None and holder.get("pid") != os.getpid():
        if pid_alive(holder.get("pid")):
            why = f"pid {holder['pid']} is alive but is not the specops instance that locked it"
        else:
            why = f"pid {holder['pid']} is not running"
        (say or _warn)(f"{paths.lock}: stale lock ({why}); taking it over")
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(self_identity()) + "\n").encode(), 0)
    _held[paths.lock] = fd


def release(paths: InstancePaths) -> None:
    fd = _held.pop(paths.lock, None)
    if fd is None:
        return
    try:
        paths.lock.unlink()  # while still holding it: a waiter that opened this file sees it is gone
    except OSError:
        pass
    os.close(fd)


class try_lock:
    """``with try_lock(paths) as free:`` — True, with the lock held inside the block, when no ``up`` of
    this name holds it. Never waits. The lock file (stale, since nobody holds it) is removed on exit."""

    def __init__(self, paths: InstancePaths):
        self.paths = paths
        self.fd: int | None = None

    def __enter__(self) -> bool:
        if self.paths.lock in _held:
            return False
        try:
            fd, busy = _open_locked(self.paths.lock, blocking_for=0)
        except OSError:
            return False
        if fd is None:
            os.close(busy)
            return False
        self.fd = fd
        return True

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                self.paths.lock.unlink()  # before closing: a waiter that opened it sees it is gone
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None


def _warn(msg: str) -> None:
    try:
        print(f"specops: {msg}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


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
    root = state_dir(setting)
    try:
        entries = sorted(root.iterdir()) if root.is_dir() else []
    except OSError as exc:
        raise SpecopsError(f"cannot list {root}: {exc.strerror or exc}") from None
    return [InstancePaths(p) for p in entries if (p / "state.json").is_file()]
