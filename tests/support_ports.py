"""Loopback ports for the servers and engines tests start, handed out so that two never collide.

Asking the OS for a free port (bind to port 0, close, hand the number on) leaves a gap before the server
binds it, and the OS picks such ports from its ephemeral range: the one the next outgoing connection (any
client in the run, or another engineer's run on the same machine) may take as its source port. So
:func:`free_port` picks from below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), where
only an explicit bind takes a port, checks that the port binds now, and records it:

- in this process: a port is never handed out twice in one run;
- in a registry file shared by every test run of this user on the machine (``SPECOPS_TEST_PORTS``, default
  a file in the temp folder, 0600, under an exclusive ``flock``): a port handed out in the last
  :data:`RECENT_S` seconds, by any run, is not handed out again.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: A port handed out this recently (by any run) is not handed out again.
RECENT_S = 1800.0
#: The lowest port handed out (well above the well-known and registered-service ports tests might meet).
LOWEST = 20000
_GIVEN: set[int] = set()


def registry_path() -> Path:
    default = Path(tempfile.gettempdir()) / f"specops-test-ports-{os.getuid()}.json"
    return Path(os.environ.get("SPECOPS_TEST_PORTS") or default)


def ephemeral_range() -> tuple[int, int]:
    """The OS's range for outgoing connections' source ports (Linux default 32768-60999)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _candidates() -> Sequence[int]:
    lo, hi = ephemeral_range()
    if lo - LOWEST >= 2000:
        return range(LOWEST, lo)
    return range(max(1024, hi + 1), 65536) if 65535 - hi >= 2000 else range(LOWEST, 65536)


def free_port() -> int:
    """A loopback port that binds now, below the ephemeral range, not handed out recently by any test run."""
    path = registry_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        try:
            recent = {int(p): float(t) for p, t in json.loads(f.read() or "{}").items()}
        except (ValueError, TypeError, AttributeError):
            recent = {}
        now = time.time()
        recent = {p: t for p, t in recent.items() if now - t < RECENT_S}
        pool = _candidates()
        for _ in range(500):
            port = random.choice(pool)
            if port in _GIVEN or port in recent or not _binds(port):
                continue
            _GIVEN.add(port)
            recent[port] = now
            f.seek(0)
            f.truncate()
            f.write(json.dumps(recent))
            return port
    raise RuntimeError(f"no free loopback port in {min(pool)}-{max(pool)} after 500 tries (registry {path})")
