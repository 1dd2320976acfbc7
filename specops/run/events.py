"""What the supervisor reports, and what it is told: typed events, listeners and orders.

The supervisor runs one engine at a time and reports *facts* as frozen dataclasses to the listeners it
was given at construction (the state writer, the watcher, the fallback decider): the engine started,
became ready, exited, printed a line; the state changed; the step of the chain changed. It never decides
where to go when a step cannot run: it reports a :class:`StepFailed` (a launch failed, a crash loop, a
refusal before launch) to its :class:`FailureDecider` and executes the :class:`FallbackOrder` it gets
back. A switch asked for while an engine serves arrives as a :class:`SwitchOrder`.

Nothing here imports anything above the run layer: the listeners and the decider are whatever the
caller (``specops up``) wires in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

from specops.backends.base import LaunchPlan
from specops.methods import Method


class State(str, Enum):
    """The supervisor's states (supervisord's vocabulary)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FATAL = "fatal"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# ---------------------------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class EngineStarting:
    """An engine process for chain step ``index`` was launched (not ready yet)."""

    index: int
    method: Method
    plan: LaunchPlan


@dataclass(frozen=True)
class EngineReady:
    """The engine of step ``index`` answers its health URL; ``seconds`` from launch to ready."""

    index: int
    method: Method
    plan: LaunchPlan
    seconds: float


@dataclass(frozen=True)
class EngineExited:
    """The engine of step ``index`` exited while it was serving (``how``: e.g. ``killed by SIGKILL``)."""

    index: int
    method: Method
    how: str


@dataclass(frozen=True)
class EngineLine:
    """One line of the engine's output (decoded, redacted, without the newline)."""

    line: str


@dataclass(frozen=True)
class StateChanged:
    """The supervisor moved from ``previous`` to ``state`` (only real changes are reported)."""

    previous: State
    state: State
    index: int
    method: Method
    restarts: int


@dataclass(frozen=True)
class StepChanged:
    """The supervisor now runs chain step ``to_index`` instead of ``from_index``.

    ``requested`` is True for a switch the watcher asked for (``decision`` is the policy's decision as a
    dict), False for a fallback after a failure.
    """

    from_index: int
    to_index: int
    from_method: Method
    to_method: Method
    reason: str
    requested: bool
    decision: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepFailed:
    """Chain step ``index`` cannot run; ``reason`` says why in words. Subclasses say how it failed."""

    index: int
    method: Method
    reason: str
    #: The name of the failure in decision events (``rule``); kept as the event log has always shown it.
    rule: ClassVar[str] = "failure"


@dataclass(frozen=True)
class LaunchFailed(StepFailed):
    """The engine never became ready (exited, timed out, or started without the speculation asked for),
    or its plan could not be rendered."""

    rule: ClassVar[str] = "launch failure"


@dataclass(frozen=True)
class CrashLoop(StepFailed):
    """The engine exited ``supervisor.crash_loop_exits`` times within ``crash_loop_window``."""

    rule: ClassVar[str] = "crash loop"


@dataclass(frozen=True)
class RefusedBeforeLaunch(StepFailed):
    """The step was refused before any launch (e.g. the compatibility checks refused its draft)."""

    rule: ClassVar[str] = "refused before launch"


SupervisorEvent = EngineStarting | EngineReady | EngineExited | EngineLine | StateChanged | StepChanged
#: A listener receives every event, synchronously, in the supervisor's task: keep it quick.
Listener = Callable[[SupervisorEvent], None]


# ---------------------------------------------------------------------------------------------- orders


@dataclass(frozen=True)
class FallbackOrder:
    """What to do after a :class:`StepFailed`: run step ``target`` next, or give up (``None``: FATAL)."""

    target: int | None
    reason: str


@dataclass(frozen=True)
class SwitchOrder:
    """Move to step ``index`` now (drain, stop, start, release), because ``reason``."""

    index: int
    reason: str
    decision: Mapping[str, Any] = field(default_factory=dict)


class FailureDecider(Protocol):
    """Decides where the supervisor goes when a step cannot run (the fallback policy, under ``up``)."""

    def decide_after_failure(self, failure: StepFailed) -> FallbackOrder: ...
