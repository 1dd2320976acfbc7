"""The watcher's test set-up: a llamacpp profile that decides after one short window, a clock the test moves,
and a watcher wired to a real decider (tests/test_watcher_unit.py, tests/test_fleet_view.py)."""

from __future__ import annotations

import json
import urllib.request

from support_upstream import Upstream

from specops.backends.base import LaunchPlan
from specops.config.profile import Profile
from specops.methods import Method
from specops.plugins import get_registry
from specops.run.instance import EventLog
from specops.watch.decide import FallbackDecider
from specops.watch.decision import PolicyConfig
from specops.watch.policy import Policy
from specops.watch.watcher import SpecopsMetrics, Watcher

PROFILE = Profile.model_validate(
    {
        "name": "unit",
        "backend": "llamacpp",
        "model": {"id": "/models/target.gguf"},
        "speculative": {"method": "draft_model", "draft": "/models/draft.gguf"},
        "gpus": {"devices": []},
        "fallback": {
            "chain": ["ngram", "none"],
            "window": 2,
            "min_draft_tokens": 10,
            "consecutive_windows": 1,
            "cooldown": 0,
        },
        "monitor": {"interval": 0.1, "timeout": 1},
    }
)


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def backend():
    return get_registry().backend("llamacpp")


def complete(url: str, max_tokens: int) -> None:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"prompt": "x", "max_tokens": max_tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def plan_for(up: Upstream) -> LaunchPlan:
    return LaunchPlan(
        backend="llamacpp",
        engine_version="test",
        method=Method.DRAFT_MODEL,
        argv=("x",),
        env=(),
        host="127.0.0.1",
        port=up.port,
        model_name="tiny-test-model",
    )


def make_watcher(reader, clock, act, log: EventLog, said: list):
    decider = FallbackDecider(
        Policy(PolicyConfig.from_profile(PROFILE), PROFILE.steps), events=log, say=said.append, clock=clock
    )
    ticks = []
    watcher = Watcher(
        PROFILE,
        reader,
        decider,
        say=said.append,
        act=act,
        metrics=SpecopsMetrics(),
        clock=clock,
        on_tick=lambda: ticks.append(clock()),
    )
    return watcher, decider, ticks
