"""One engine process: launched in its own process group, its output streamed, stopped without orphans.

The engine (vLLM, llama-server) forks workers of its own; signalling only the direct child leaves them
behind. So the child starts a new session (its own process group), receives SIGTERM on the group, then
SIGKILL on the group after a timeout, and stopping waits until no process of the group is left. The
child also gets SIGTERM if specops itself dies (PR_SET_PDEATHSIG), so even a SIGKILLed specops leaves
no engine behind.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from specops.backends.base import LaunchPlan
from specops.errors import SpecopsError
from specops.resolve.ports import describe, holders, listening_inodes, socket_inodes
from specops.run.identity import proc_starttime, proc_state
from specops.run.instance import open_log

PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # runs in the child between fork and exec: keep it minimal
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) PIDs whose process group is ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_state(entry)
            if st is not None and st[1] == pgid and st[0] != "Z":
                pids.append(int(entry))
    return pids


@dataclass
class ExitInfo:
    code: int | None
    signal: int | None
    at: float

    def describe(self) -> str:
        if self.signal:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"killed by {name}"
        return f"exited with code {self.code}"


def missing_program(plan: LaunchPlan, env: dict[str, str]) -> str:
    """Why the engine's program could not be started: what was looked for, where, and how to fix it."""
    program = plan.argv[0]
    if os.sep in program:
        where = f"{program} does not exist"
    else:
        dirs = [d for d in env.get("PATH", "").split(os.pathsep) if d]
        shown = os.pathsep.join(dirs[:12]) + (f"{os.pathsep}… ({len(dirs)} folders)" if len(dirs) > 12 else "")
        where = f"no program `{program}` in any folder of PATH ({shown or 'PATH is empty'})"
        if plan.engine_version:
            where += (
                f"; the plan names `{program}` because the version is given ({plan.engine_version}), so specops "
                "did not search for the engine"
            )
    try:
        from specops.plugins import get_registry

        hint = get_registry().backend(plan.backend).install_hint
    except Exception:  # the hint is a courtesy: never hide the real error behind another
        hint = ""
    fix = hint.split(": ", 1)[1] if ": " in hint else hint
    return f"cannot start {plan.backend}: {where}" + (f". To fix: {fix}" if fix else "")


class EngineProcess:
    """A launched engine. ``on_line`` receives every output line (already decoded, without newline)."""

    def __init__(
        self, plan: LaunchPlan, *, on_line: Callable[[str], None], log_path: Path | None = None, keep_lines: int = 40
    ):
        self.plan = plan
        self.on_line = on_line
        self.log_path = log_path
        self.last_lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.exit: ExitInfo | None = None
        self._reader: asyncio.Task | None = None
        self._waiter: asyncio.Task | None = None
        self._log = None
        self._leader_start: int | None = None
        #: the sockets listening on the engine's port before the launch (another process's, when any)
        self._listeners_before: frozenset[int] = frozenset()
        #: who answered the health URL instead of the engine (another process holds its port), if anyone did
        self.other_answer: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exit is None

    async def start(self) -> None:
        env = {**os.environ, **dict(self.plan.env)}
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.log_path is not None:
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._log = open_log(self.log_path, encoding="utf-8", errors="replace")  # created 0600
            except OSError as exc:
                raise SpecopsError(f"cannot write the engine log {self.log_path}: {exc.strerror or exc}") from None
            self._log.write(f"\n===== {time.strftime('%Y-%m-%dT%H:%M:%S')} start: {self.plan.shell()}\n")
            self._log.flush()
        self._listeners_before = listening_inodes(self.plan.port)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.plan.argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_setup,
                limit=1 << 20,
            )
        except FileNotFoundError:
            self._close_log()
            raise SpecopsError(missing_program(self.plan, env)) from None
        except PermissionError:
            self._close_log()
            raise SpecopsError(
                f"cannot start {self.plan.argv[0]}: permission denied (not executable by this user); "
                "point engine.executable or engine.python at a program you may run"
            ) from None
        self.started_at = time.monotonic()
        self._leader_start = proc_starttime(self.proc.pid)  # not reaped yet: this is our child
        self._reader = asyncio.create_task(self._read_output())
        self._waiter = asyncio.create_task(self._wait_exit())

    async def _read_output(self) -> None:
        assert self.proc and self.proc.stdout
        while True:
            try:
                raw = await self.proc.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):  # an absurdly long line: skip it
                continue
            if not raw:
                break
            line = self.plan.redact(raw.decode("utf-8", "replace").rstrip("\r\n"))
            self.last_lines.append(line)
            if self._log:
                self._log.write(line + "\n")
                self._log.flush()
            try:
                self.on_line(line)
            except Exception:  # a consumer bug must not stop the engine's output from draining
                pass

    async def _wait_exit(self) -> ExitInfo:
        assert self.proc
        rc = await self.proc.wait()
        if self._reader:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), timeout=2)
            except asyncio.TimeoutError:
                pass
        self.exit = ExitInfo(code=rc if rc >= 0 else None, signal=-rc if rc < 0 else None, at=time.monotonic())
        if self._log:
            self._log.write(f"===== {time.strftime('%Y-%m-%dT%H:%M:%S')} {self.exit.describe()}\n")
        self._close_log()
        return self.exit

    def _close_log(self) -> None:
        if self._log:
            self._log.close()
            self._log = None

    async def wait_exit(self) -> ExitInfo:
        assert self._waiter
        return await asyncio.shield(self._waiter)

    async def wait_ready(
        self, timeout: float, interval: float = 0.25, progress: Callable[[float], None] | None = None
    ) -> bool:
        """Poll the health URL until the engine answers 200; False when the process exits first or ``timeout``
        passes. A 200 from another process that holds the port (:meth:`answered_by_another`) is no answer."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        client_timeout = aiohttp.ClientTimeout(total=max(1.0, interval * 4))
        async with aiohttp.ClientSession(timeout=client_timeout) as session:
            while time.monotonic() < deadline:
                if not self.running:
                    return False
                try:
                    async with session.get(self.plan.health_url) as resp:
                        status = resp.status
                    if status == 200:
                        other = self.answered_by_another()
                        if other is None and self.running:
                            self.ready_at = time.monotonic()
                            return True
                        self.other_answer = other or self.other_answer
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                if progress:
                    progress(time.monotonic() - (self.started_at or time.monotonic()))
                # poll fast at first (small engines are up in well under a second), then every `interval`
                done, _ = await asyncio.wait({self._waiter}, timeout=min(interval, delay))
                delay *= 1.5
                if done:
                    return False
        return False

    def answered_by_another(self) -> str | None:
        """Who listens on the engine's port when it is not the engine: the port's listening sockets are all
        older than the launch and none is held by the engine's process group. None when the engine (or a
        socket bound since the launch: a helper outside the group) listens, or when /proc cannot tell: the
        health check is then trusted."""
        listening = listening_inodes(self.plan.port)
        if not listening or listening - self._listeners_before or self.proc is None:
            return None
        if any(socket_inodes(pid) & listening for pid in group_members(self.proc.pid)):
            return None
        return describe(holders(listening)) or "another process (this user cannot see which)"

    async def stop(self, timeout: float) -> ExitInfo | None:
        """SIGTERM the group, SIGKILL it after ``timeout``, and wait until no member is left."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the child leads its own group
        self._signal_group(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.wait_exit(), timeout=timeout)
        except asyncio.TimeoutError:
            self._signal_group(pgid, signal.SIGKILL)
            await self.wait_exit()
        # workers of the engine may outlive its main process: give them the same treatment
        deadline = time.monotonic() + timeout
        while group_members(pgid):
            if time.monotonic() > deadline:
                self._signal_group(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 5
            await asyncio.sleep(0.1)
        return self.exit

    def kill_now(self) -> None:
        """Last-resort synchronous SIGKILL of the whole group (used at interpreter exit)."""
        if self.proc is not None:
            self._signal_group(self.proc.pid, signal.SIGKILL)

    def _signal_group(self, pgid: int, sig: int) -> None:
        """Signal the engine's group, only while it is still ours. A group's number is not reused while
        any process is in it; once it is empty, the number may come back as a stranger's pid and group.
        So nothing is sent to an empty group, nor when a process with the leader's pid exists but
        started at another time than our engine (the number was reused)."""
        if not group_members(pgid):
            return
        if self._leader_start is not None:
            now = proc_starttime(pgid)
            if now is not None and now != self._leader_start:
                return
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
