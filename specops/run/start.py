"""Start one engine and wait until it is ready: the single way specops does it (``up`` and ``bench``/``tune``).

:class:`EngineStart` launches the plan's process, polls its health URL until it answers, and watches the
output for lines that say the speculative method did not take effect (``launch_problem``: llama-server keeps
serving without a draft it cannot use). The result is a :class:`StartResult`: ``READY``, ``FAILED`` (with
the reason and the engine's last lines) or ``STOPPED`` (the caller's stop event was set meanwhile). The
process is never stopped here: on anything but ``READY`` the caller stops it (the supervisor logs that as
a state change, a measurement harness in its ``finally``).
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

    @property
    def ready(self) -> bool:
        return self.outcome is StartOutcome.READY


class EngineStart:
    """One launch of ``plan``: ``await start.run(timeout)`` → :class:`StartResult`; ``start.process`` is the engine.

    ``on_line`` receives every output line; ``launch_problem(line)`` says why a line shows the speculation
    did not take effect (checked until the start is decided).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        on_line: Callable[[str], None] | None = None,
        launch_problem: Callable[[str], str | None] | None = None,
        log_path: Path | None = None,
    ):
        self.plan = plan
        self.on_line = on_line or (lambda line: None)
        self.launch_problem = launch_problem or (lambda line: None)
        self.problems: list[str] = []
        self._deciding = True
        self.process = EngineProcess(plan, on_line=self._line, log_path=log_path)

    def _line(self, line: str) -> None:
        if self._deciding and not self.problems:
            problem = self.launch_problem(line)
            if problem:
                self.problems.append(problem)
        self.on_line(line)

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
        waits = {ready_task}
        stop_task = None
        if stop is not None:
            stop_task = asyncio.create_task(stop.wait())
            waits.add(stop_task)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stop_task is not None:
                stop_task.cancel()
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
        if ready and not self.problems:
            return StartResult(StartOutcome.READY, elapsed)
        if self.problems:
            why = self.problems[0]
        elif proc.exit is not None:
            why = f"engine {proc.exit.describe()} before it was ready"
        else:
            why = f"engine not ready after {format_duration(timeout)}{timeout_hint}"
        return StartResult(StartOutcome.FAILED, elapsed, why, tuple(list(proc.last_lines)[-12:]))
