"""Who listens on a TCP port of this machine, read from the kernel: ``/proc/net/tcp`` and ``tcp6`` list the
listening sockets with their inode, ``/proc/PID/fd`` links name the sockets each process holds.

Used before a launch, to name the process that holds the address an engine is about to bind, and once the
health URL answers, to tell the engine specops started from another server answering on the same port.
Where /proc cannot be read (another OS, a hardened container, another user's process) the answers are
empty: the callers then only say that the port is in use, or trust the health check.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

#: TCP_LISTEN in the ``st`` column of /proc/net/tcp.
_LISTEN = "0A"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
#: A holder's command line is shown up to this many characters.
COMMAND_CHARS = 160


def listening_inodes(port: int) -> frozenset[int]:
    """Inodes of the sockets listening on TCP ``port``, on any address, IPv4 and IPv6 (empty: none, or
    /proc unreadable)."""
    found: set[int] = set()
    for table in _TABLES:
        try:
            with open(table, encoding="ascii", errors="replace") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(cols) < 10 or cols[3] != _LISTEN:
                continue
            try:
                if int(cols[1].rsplit(":", 1)[1], 16) == port and int(cols[9]):
                    found.add(int(cols[9]))
            except ValueError:
                continue
    return frozenset(found)


def socket_inodes(pid: int | str) -> frozenset[int]:
    """Inodes of the sockets process ``pid`` holds open (empty: none, gone, or not ours to read)."""
    out: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return frozenset()
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                pass
    return frozenset(out)


def holders(inodes: Iterable[int]) -> list[int]:
    """PIDs of the processes (this user may read) that hold one of ``inodes``, lowest first."""
    wanted = frozenset(inodes)
    if not wanted:
        return []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return sorted(int(e) for e in entries if e.isdigit() and socket_inodes(e) & wanted)


def command_of(pid: int) -> str | None:
    """``pid``'s command line as one short line, values of secret-looking flags and URL passwords hidden."""
    from specops.redact import MARK, redact_patterns, secret_flag, unmark

    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read(8192).split(b"\0") if a]
    except OSError:
        return None
    if not argv:
        return None
    shown: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            shown.append(MARK)
            hide_next = False
            continue
        flag = secret_flag(arg)
        if flag and "=" in arg:
            arg = f"{flag}={MARK}"
        elif flag:
            hide_next = True
        shown.append(arg)
    shown[0] = os.path.basename(shown[0]) or shown[0]
    text = " ".join(unmark(redact_patterns(" ".join(shown))).split())  # one line, whatever the arguments hold
    return text if len(text) <= COMMAND_CHARS else text[: COMMAND_CHARS - 1] + "…"


def describe(pids: Iterable[int], most: int = 3) -> str | None:
    """``pid 1234 (python3 -m http.server 8080)`` for each of the first ``most`` ``pids`` (a server's forked
    workers share its socket); None when none is given."""
    pids = list(pids)
    parts = []
    for pid in pids[:most]:
        command = command_of(pid)
        parts.append(f"pid {pid}" + (f" ({command})" if command else ""))
    more = f" and {len(pids) - most} more" if len(pids) > most else ""
    return ", ".join(parts) + more if parts else None


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port``: ``pid 1234 (command)``; None when nobody does or it cannot be told."""
    return describe(holders(listening_inodes(port)))
