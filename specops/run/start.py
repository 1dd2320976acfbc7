"""Start one engine and wait until it is ready: the single way specops does it (``up`` and ``bench``/``tune``).

:class:`EngineStart` launches the plan's process, polls its health URL until it answers, and watches the
output for lines that say the speculative method did not take effect (``launch_problem``: llama-server keeps
serving without a draft it cannot use) and for lines that say the engine cannot bind its address
(``bind_failure``). The result is a :class:`StartResult`: ``READY``, ``FAILED`` (with the reason and the
engine's last lines; ``fatal`` when no method can fix it: the port is taken) or ``STOPPED`` (the caller's
stop event was set meanwhile). Ready means the engine itself answers: a 200 from another process that holds
the port does not count. The process is never stopped here: on anything but ``READY`` the caller stops it
(the supervisor logs that as a state change, a measurement harness in its ``finally``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from specops.backends.base import LaunchPlan
from specops.config.durations import format_duration
from specops.resolve.ports import port_holder
from specops.run.process import EngineProcess

#: How long to let the output reader catch up with lines printed just before the engine answered.
SETTLE_S = 0.05
#: How often a slow start is reported (``say``), in seconds.
PROGRESS_EVERY_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StartOutcome(str, Enum):
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StartResult:
    outcome: StartOutcome
    seconds: float
    reason: str = ""  # why it FAILED
    last_lines: tuple[str, ...] = ()  # the engine's last lines when it FAILED
    #: FAILED for a reason no speculative method fixes (its address is taken): stop, do not fall back
    fatal: bool = False

    @property
    def ready(self) -> bool:
        return self.outcome is StartOutcome.READY


class EngineStart:
    """One launch of ``plan``: ``await start.run(timeout)`` → :class:`StartResult`; ``start.process`` is the engine.

    ``on_line`` receives every output line; ``launch_problem(line)`` says why a line shows the speculation
    did not take effect (checked until the start is decided); ``bind_failure(line)`` gives the engine's words
    when a line says it cannot bind its address (the start then fails at once, as fatal).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        on_line: Callable[[str], None] | None = None,
        launch_problem: Callable[[str], str | None] | None = None,
        bind_failure: Callable[[str], str | None] | None = None,
        log_path: Path | None = None,
    ):
        self.plan = plan
        self.on_line = on_line or (lambda line: None)
        self.launch_problem = launch_problem or (lambda line: None)
        self.bind_failure = bind_failure or (lambda line: None)
        self.problems: list[str] = []
        self.fatal: str | None = None  # why the engine cannot bind its address, once a line said so
        self._fatal_seen = asyncio.Event()
        self._deciding = True
        self.process = EngineProcess(plan, on_line=self._line, log_path=log_path)

    def _line(self, line: str) -> None:
        if self._deciding and self.fatal is None:
            words = self.bind_failure(line)
            if words:
                self.fatal = self._cannot_bind(words)
                self._fatal_seen.set()
        if self._deciding and not self.problems:
            problem = self.launch_problem(line)
            if problem:
                self.problems.append(problem)
        self.on_line(line)

    def _cannot_bind(self, words: str) -> str:
        """The one line that says why: the address, who holds it (when /proc tells), the engine's words."""
        plan = self.plan
        holder = self.process.other_answer or port_holder(plan.port)
        where = f"{plan.host}:{plan.port}"
        return (
            f"{plan.backend} cannot bind {where}"
            + (f": it is in use by {holder}" if holder else "")
            + f" (engine: {words}); no method can fix that"
        )

    async def run(
        self,
        timeout: float,
        *,
        interval: float = 0.25,
        stop: asyncio.Event | None = None,
        say: Callable[[str], None] | None = None,
        timeout_hint: str = "",
    ) -> StartResult:
        """Launch and wait up to ``timeout`` seconds for the health URL (``SpecopsError`` if it cannot exec).

        ``stop`` set meanwhile → ``STOPPED``; ``say`` gets a progress line every :data:`PROGRESS_EVERY_S`;
        ``timeout_hint`` is appended to the timeout reason (e.g. the setting to raise).
        """
        proc = self.process
        t0 = time.monotonic()
        await proc.start()
        last_report = [0.0]

        def progress(elapsed: float) -> None:
            if say is not None and elapsed - last_report[0] >= PROGRESS_EVERY_S:
                last_report[0] = elapsed
                last = proc.last_lines[-1] if proc.last_lines else "(no output yet)"
                say(f"waiting for {self.plan.health_url}: {elapsed:.0f}s, last engine line: {last[-160:]}")

        ready_task = asyncio.create_task(proc.wait_ready(timeout, interval, progress))
        fatal_task = asyncio.create_task(self._fatal_seen.wait())
        waits = {ready_task, fatal_task}
        stop_task = None
        if stop is not None:
            stop_task = asyncio.create_task(stop.wait())
            waits.add(stop_task)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            fatal_task.cancel()
            if stop_task is not None:
                stop_task.cancel()
        if self.fatal is not None and not ready_task.done():
            ready_task.cancel()
            await asyncio.gather(ready_task, return_exceptions=True)
            self._deciding = False
            tail = tuple(list(proc.last_lines)[-12:])
            return StartResult(StartOutcome.FAILED, time.monotonic() - t0, self.fatal, tail, fatal=True)
        if stop is not None and stop.is_set():
            ready_task.cancel()
            await asyncio.gather(ready_task, return_exceptions=True)
            self._deciding = False
            return StartResult(StartOutcome.STOPPED, time.monotonic() - t0)
        ready = ready_task.result()
        if ready:
            await asyncio.sleep(SETTLE_S)  # let the output reader catch up with lines printed just before ready
            if not self.problems:
                self.problems += [p for p in map(self.launch_problem, proc.last_lines) if p][:1]
        self._deciding = False
        elapsed = time.monotonic() - t0
        tail = tuple(list(proc.last_lines)[-12:])
        if ready and not self.problems:
            return StartResult(StartOutcome.READY, elapsed)
        if self.fatal is not None:
            return StartResult(StartOutcome.FAILED, elapsed, self.fatal, tail, fatal=True)
        if proc.other_answer is not None:  # the engine never answered; a process that held its port did
            why = (
                f"another process answers {self.plan.health_url}, not the engine: {proc.other_answer} "
                f"holds port {self.plan.port}; no method can fix that"
            )
            return StartResult(StartOutcome.FAILED, elapsed, why, tail, fatal=True)
        if self.problems:
            why = self.problems[0]
        elif proc.exit is not None:
            why = f"engine {proc.exit.describe()} before it was ready"
        else:
            why = f"engine not ready after {format_duration(timeout)}{timeout_hint}"
        return StartResult(StartOutcome.FAILED, elapsed, why, tail)
