"""Processes a test starts itself (an engine, a stand-in, a watcher): each in its own process group, and the
whole group stopped when the test ends, however it ends, so one failure cannot leave a process that holds a
port or a core for the tests after it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> int | None:
    """SIGTERM ``proc``'s process group, wait up to ``timeout`` s, then SIGKILL the group; → its exit code."""
    pgid = proc.pid  # started with start_new_session=True: the group id is the leader's pid
    code = None
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        _killpg(pgid, sig)
        try:
            code = proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    _killpg(pgid, signal.SIGKILL)  # what the leader left behind in its group
    return code


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def process_group(argv: list[str], stop_timeout: float = 20.0, **popen) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(argv, start_new_session=True, **popen)``, its group stopped in ``finally``."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        stop_group(proc, stop_timeout)


async def stop_group_async(proc: asyncio.subprocess.Process, timeout: float = 20.0) -> int | None:
    """:func:`stop_group` for a process started with ``asyncio.create_subprocess_exec(start_new_session=True)``."""
    pgid = proc.pid
    code = None
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        _killpg(pgid, sig)
        try:
            code = await asyncio.wait_for(proc.wait(), wait_s)
            break
        except asyncio.TimeoutError:
            continue
    _killpg(pgid, signal.SIGKILL)
    return code
