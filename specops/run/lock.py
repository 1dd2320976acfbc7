"""The ``up.pid`` lock: one ``specops up`` per instance name.

The lock is held with ``flock`` for the life of ``specops up``, so a crashed instance leaves no lock
behind whatever became of its pid; the file names its holder's process identity
(:mod:`specops.run.identity`) for the message a second ``up`` gets. The flock is also the proof ``down``
wants before it signals a pid: only the ``up`` that holds it can be the instance (:func:`lock_holder_problem`).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specops.errors import SpecopsError
from specops.run.identity import identity_problem, pid_alive, self_identity, valid_pid, why_not_running
from specops.run.instance import InstancePaths, open_private

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
                os.close(fd)  # held for a moment by `down` checking for staleness: try again
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
        raise SpecopsError(
            f"{paths.root.name} is already up (specops pid {holder['pid']}); `specops down {paths.root.name}` first"
        )
    if holder is not None and holder.get("pid") != os.getpid():
        if pid_alive(holder.get("pid")):
            why = f"pid {holder['pid']} is alive but is not the specops instance that locked it"
        else:
            why = f"pid {holder['pid']} is not running"
        (say or _warn)(f"{paths.lock}: stale lock ({why}); taking it over")
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(self_identity()) + "\n").encode(), 0)
    _held[paths.lock] = fd


def _holds_flock(pid: int, fd: str) -> bool:
    """Whether the open file ``fd`` of ``pid`` carries an exclusive flock (its ``lock:`` lines in fdinfo)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            lines = f.read(65536).splitlines()
    except OSError:
        return False
    return any(line.startswith("lock:") and " FLOCK " in line and " WRITE " in line for line in lines)


def lock_holder_problem(paths: InstancePaths, pid: int) -> str | None:
    """None when ``pid`` holds the ``up.pid`` flock of this instance; else why it cannot be shown to.

    The proof comes from the kernel, not from a file: one of ``pid``'s open files is the lock file (same
    device and inode) and that open file holds the exclusive flock (/proc/PID/fdinfo). A process that
    cannot show it is not this instance's ``specops up``, whatever a state file says."""
    try:
        st = os.stat(paths.lock, follow_symlinks=False)
    except FileNotFoundError:
        return f"no lock file {paths.lock}: no `specops up` holds this instance"
    except OSError as exc:
        return f"cannot read {paths.lock}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"{paths.lock} is not a regular file"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return f"pid {pid} is not running"
    except OSError as exc:
        return f"cannot see the open files of pid {pid} to check it holds {paths.lock}: {exc.strerror or exc}"
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.path.basename(os.readlink(link)) != paths.lock.name:
                continue  # sockets, pipes and other files: stat only what may be the lock file
            target = os.stat(link)
        except OSError:
            continue
        if (target.st_dev, target.st_ino) == (st.st_dev, st.st_ino) and _holds_flock(pid, fd):
            return None
    return f"pid {pid} does not hold the instance's lock {paths.lock}"


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
