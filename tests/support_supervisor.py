"""The supervisor's test set-up: stand-in engine launch plans (tests/support_upstream.py), a fake clock, a
recorder of its facts and a scripted decider (tests/test_supervisor_unit.py, tests/test_reload.py)."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from pathlib import Path

from specops.backends.base import LaunchPlan
from specops.config.profile import Profile
from specops.methods import Method
from specops.run.events import (
    EngineLine,
    FallbackOrder,
    StateChanged,
)
from specops.run.instance import EventLog
from specops.run.supervise import Supervisor

STANDIN = Path(__file__).resolve().parent / "support_upstream.py"
METHODS = [Method.DRAFT_MODEL, Method.NGRAM, Method.NONE]


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class Recorder:
    """A supervisor listener that keeps every event (engine lines apart)."""

    def __init__(self):
        self.events: list = []
        self.lines: list[str] = []

    def __call__(self, event) -> None:
        if isinstance(event, EngineLine):
            self.lines.append(event.line)
        else:
            self.events.append(event)

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def states(self) -> list[str]:
        return [e.state.value for e in self.of(StateChanged)]


class ScriptedDecider:
    """Answers failures from a list of targets (None: give up), recording what it was told."""

    def __init__(self, *targets: int | None):
        self.targets = list(targets)
        self.failures: list = []

    def decide_after_failure(self, failure):
        self.failures.append(failure)
        target = self.targets.pop(0) if self.targets else None
        return FallbackOrder(target, failure.reason)


def make_profile(**supervisor) -> Profile:
    return Profile.model_validate(
        {
            "name": "unit",
            "backend": "llamacpp",
            "model": {"id": "/models/target.gguf"},
            "speculative": {"method": "draft_model", "draft": "/models/draft.gguf"},
            "gpus": {"devices": []},
            "engine": {"ready_timeout": supervisor.pop("ready_timeout", 20)},
            "fallback": {"chain": ["ngram", "none"]},
            "supervisor": {"stop_timeout": 5, "restart_backoff": 0.05, **supervisor},
        }
    )


def standin(index: int, port: int, *, argv: list[str] | None = None, acceptance: float | None = 0.5) -> LaunchPlan:
    """A plan whose engine is the stand-in (or ``argv``), for chain step ``index``."""
    if argv is None:
        argv = [sys.executable, str(STANDIN), "--port", str(port), "--name", f"step{index}"]
        if acceptance is not None:
            argv += ["--acceptance", str(acceptance)]
    return LaunchPlan(
        backend="llamacpp",
        engine_version="test",
        method=METHODS[index],
        argv=tuple(argv),
        env=(),
        host="127.0.0.1",
        port=port,
        model_name="tiny-test-model",
    )


def exits_at_once(code: int = 3) -> list[str]:
    return [sys.executable, "-c", f"import sys; print('cannot load the model', flush=True); sys.exit({code})"]


def supervisor(
    render, decider, *, profile: Profile | None = None, clock=None, events: EventLog | None = None, launch_problem=None
) -> tuple[Supervisor, Recorder]:
    rec = Recorder()
    kw = {"clock": clock} if clock is not None else {}
    sup = Supervisor(
        profile or make_profile(),
        render,
        events=events or EventLog(None),
        say=lambda m: None,
        decider=decider,
        listeners=[rec],
        health_interval=0.05,
        launch_problem=launch_problem,
        **kw,
    )
    return sup, rec


async def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return r.status


# ------------------------------------------------------------------------------------------- the state machine
