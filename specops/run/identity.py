"""Which process a pid names: process identity, and the pid safety checks that rest on it.

A state or lock file names a pid, and pids are reused (after a crash, after a reboot), so a pid alone is
never trusted: the writer records its *identity* (pid, start time in clock ticks from ``/proc/<pid>/stat``
and the kernel's boot id) and a process is taken for the one recorded only when all of it matches. A
process that is gone or is now someone else is reported as such, and nothing is ever signalled to it.

Those values are public (any user reads /proc), so a forged file can name a real process with its real
identity: ``specops down`` also wants the process to run ``specops up`` (:func:`specops_up_problem`) and
to hold the instance's lock (:func:`specops.run.lock.lock_holder_problem`).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable

#: PID_MAX_LIMIT on 64-bit Linux: no pid is larger.
PID_MAX = 1 << 22


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
    rest = raw[raw.rfind(")") + 2 :].split()
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
        _self_identity = process_identity(os.getpid()) or {"pid": os.getpid(), "starttime": None, "boot_id": boot_id()}
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


def short_repr(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def identity_problem(identity) -> str | None:
    """Why ``identity`` (as recorded) is malformed, or None."""
    if not isinstance(identity, dict):
        return f"identity is not an object: {short_repr(identity)}"
    if valid_pid(identity.get("pid")) is None:
        return f"invalid pid {short_repr(identity.get('pid'))}"
    if type(identity.get("starttime")) is not int or identity["starttime"] < 0:
        return f"invalid start time {short_repr(identity.get('starttime'))}"
    if identity.get("boot_id") is not None and not isinstance(identity.get("boot_id"), str):
        return f"invalid boot id {short_repr(identity.get('boot_id'))}"
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
        return (
            f"cannot tell whether pid {state.get('pid')} is this instance (no process identity in "
            f"the state file: written by an older specops?)"
        )
    problem = identity_problem(identity)
    if problem is None and identity["pid"] != state.get("pid"):
        problem = "the identity names another pid than the state"
    if problem:
        return f"unusable process identity: {problem}"
    return why_not_running(identity)


#: An interpreter that runs the ``specops`` entry script (python, python3, python3.12...).
_PYTHON = re.compile(r"python[0-9.]*")
#: Interpreter options that take their value as the next argument (``python -W error -m specops.cli``).
_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def is_specops_up_argv(argv: list[str]) -> bool:
    """Whether ``argv`` (a /proc cmdline) runs ``specops up``: the ``specops`` entry script (run by its
    interpreter through the shebang, or exec'd as is) or ``python -m specops.cli``, with ``up`` as command."""
    if not argv:
        return False
    i = 1
    if _PYTHON.fullmatch(os.path.basename(argv[0])):
        while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
            i += 2 if argv[i] in _PYTHON_OPTIONS_WITH_VALUE else 1
        if argv[i : i + 1] == ["-m"] and argv[i + 1 : i + 2] in (["specops.cli"], ["specops"]):
            i += 2
        elif i < len(argv) and os.path.basename(argv[i]) == "specops":
            i += 1
        else:
            return False
    elif os.path.basename(argv[0]) != "specops":
        return False
    return argv[i : i + 1] == ["up"]


def specops_up_problem(pid: int) -> str | None:
    """None when ``pid``'s command line is ``specops up`` (:func:`is_specops_up_argv`); else why not."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(1 << 16)
    except FileNotFoundError:
        return f"pid {pid} is not running"
    except OSError as exc:
        return f"cannot read the command line of pid {pid}: {exc.strerror or exc}"
    raw = raw[:-1] if raw.endswith(b"\0") else raw  # each argument ends with a NUL
    argv = [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")] if raw else []
    if is_specops_up_argv(argv):
        return None
    shown = short_repr(" ".join(argv[:4]), 80)
    return f"pid {pid} is not `specops up` (its command line is {shown})"


def signal_process(identity: dict, sig: int, confirm: Callable[[int], str | None] | None = None) -> str | None:
    """Send ``sig`` to the process ``identity`` records, only if it is that very process and ``confirm``
    (given the pid, once the process is pinned) returns None.

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
        why = why_not_running(identity) or (confirm(pid) if confirm is not None else None)
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
