"""tests/support_procs.py, which every test that starts a process relies on to leave nothing behind: the
whole group goes, a grandchild included, also when the leader ignores SIGTERM or has already exited."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support_procs import process_group, stop_group, stop_group_async

pytestmark = pytest.mark.timeout(60)

#: A leader that starts a grandchild in its own group (``sleep 60``), prints its pid, then waits.
LEADER = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
if sys.argv[1] != "exit":
    time.sleep(60)
"""


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` ends within ``within`` s (a zombie waiting for its new parent counts as ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def leader(mode: str) -> list[str]:
    return [sys.executable, "-c", LEADER, mode]


def test_process_group_stops_the_grandchild_with_the_leader():
    with process_group(leader("wait"), stdout=subprocess.PIPE, text=True) as proc:
        grandchild = int(proc.stdout.readline())
        assert not gone(grandchild, within=0.2)  # alive while the test runs
    proc.stdout.close()
    assert proc.returncode == -signal.SIGTERM
    assert gone(grandchild)


def test_a_leader_that_ignores_sigterm_is_killed_after_the_timeout():
    proc = subprocess.Popen(leader("ignore-term"), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        grandchild = int(proc.stdout.readline())
        t0 = time.monotonic()
        assert stop_group(proc, timeout=0.5) == -signal.SIGKILL
        assert time.monotonic() - t0 >= 0.5
        assert gone(grandchild)
    finally:
        stop_group(proc, timeout=0.5)
        proc.stdout.close()


def test_what_an_exited_leader_left_in_its_group_is_stopped():
    proc = subprocess.Popen(leader("exit"), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        grandchild = int(proc.stdout.readline())
        assert proc.wait(timeout=10) == 0
        assert not gone(grandchild, within=0.2)  # the leader is gone, its child still runs in the group
        stop_group(proc, timeout=1)
        assert gone(grandchild)
    finally:
        stop_group(proc, timeout=0.5)
        proc.stdout.close()


def test_stop_group_async_stops_the_grandchild_too():
    async def main() -> tuple[int, int | None]:
        proc = await asyncio.create_subprocess_exec(
            *leader("wait"), stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        try:
            grandchild = int(await proc.stdout.readline())
        finally:
            code = await stop_group_async(proc, timeout=5)
        return grandchild, code

    grandchild, code = asyncio.run(main())
    assert code == -signal.SIGTERM
    assert gone(grandchild)
