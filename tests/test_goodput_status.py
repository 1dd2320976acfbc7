"""``specops status`` shows what mode goodput decides with: the live concurrency, the tokens/s predicted per
option, the verdict and why, the switch cost and the crossovers (from the state a real decider writes)."""

from __future__ import annotations

import json

from support_cli import run
from support_goodput import IDLE, Events, window

from specops.config.profile import ChainStep
from specops.methods import Method
from specops.run.instance import InstancePaths, write_state
from specops.watch.decide import FallbackDecider
from specops.watch.decision import PolicyConfig
from specops.watch.goodput import GoodputConfig, Load
from specops.watch.policy import Policy
from specops.watch.surface import Surface

SURFACE = {
    "date": "2026-12-01",
    "points": [
        {"method": "none", "k": 0, "concurrency": c, "tokens_per_s": v} for c, v in ((1, 30), (4, 100), (16, 200))
    ]
    + [
        {"method": "draft_model", "k": 4, "concurrency": c, "tokens_per_s": v, "mean_acceptance_length": 5.0}
        for c, v in ((1, 80), (4, 110), (16, 120))
    ],
}


def _state(tmp_path) -> InstancePaths:
    g = GoodputConfig(hysteresis=0.05, sustain_s=10.0, min_dwell_s=30.0, regime_s=100.0, switch_cost_s=None)
    policy = Policy(
        PolicyConfig(mode="goodput", window_s=20.0, min_draft_tokens=100, goodput=g),
        [ChainStep(method=Method.DRAFT_MODEL, draft="d.gguf", num_speculative_tokens=4), ChainStep(method=Method.NONE)],
        surface=Surface.from_dict(SURFACE),
    )
    decider = FallbackDecider(policy, events=Events(), say=lambda m: None, clock=lambda: 5.0, wall=lambda: 1e9)
    policy.note_switch_cost(0.4)  # a switch measured at 0.4 s
    # c=16 for 5 s: k=4 120 vs none 200 (live 100 tok/s on k=4: the bucket's correction becomes 100/120)
    decider.observe(IDLE, 0.0, Load(16, None, "proxy in flight + waiting"))
    decider.observe(IDLE, 5.0, Load(16, 100.0, "proxy in flight + waiting"))
    paths = InstancePaths(tmp_path / "g")
    write_state(paths, {"name": "g", "state": "ready", "method": "draft_model", **decider.snapshot(5.0)})
    return paths


def test_status_text_shows_the_goodput_block(tmp_path):
    paths = _state(tmp_path)
    res = run("status", "g", "--state-dir", tmp_path)
    assert res.code == 0, res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.startswith("  ")}
    assert "concurrency 16.00 (proxy in flight + waiting), live 100.0 tok/s" in lines["goodput"]
    # corrected by 100/120: k=4 100.0, none 166.7
    assert "draft_model k=4 100.0, none 166.7 tok/s (best: none)" in lines["predicted"]
    assert "verdict" not in lines  # no acceptance-threshold verdict in mode goodput
    assert "[goodput-sustain]" in lines["why"] and "none is better at concurrency 16.00" in lines["why"]
    # crossover of k=4 against none: 4.76 (hand-computed in test_goodput.py)
    assert lines["switching"].startswith("  switching  switch cost 0.4s (measured); draft_model k=4 stops paying")
    assert "c=4.76" in lines["switching"] and "surface of 2026-12-01" in lines["switching"]
    # the JSON view has the same numbers
    res = run("status", "g", "--state-dir", tmp_path, "--json")
    row = json.loads(res.stdout)
    row = row[0] if isinstance(row, list) else row
    assert row["last_goodput"]["predicted"] == {"draft_model k=4": 100.0, "none": 166.67}
    assert row["policy"]["goodput"]["switch_cost_basis"] == "measured"
    assert paths.state.stat().st_mode & 0o777 == 0o600


def test_status_text_without_goodput_shows_no_block(tmp_path):
    write_state(InstancePaths(tmp_path / "t"), {"name": "t", "state": "ready", "method": "ngram"})
    res = run("status", "t", "--state-dir", tmp_path)
    assert res.code == 0 and "goodput" not in res.stdout and "predicted" not in res.stdout


def test_status_shows_a_left_methods_aged_acceptance(tmp_path):
    # the collapse of test_goodput_stale.py: τ 1.2 at c=1 → switch to none at 30; at 50 the live τ is 20 s old,
    # weight 0.5^(20/100) = 0.8706, expected τ 5 − 3.8 × 0.8706 = 1.692
    g = GoodputConfig(
        hysteresis=0.05, sustain_s=10.0, min_dwell_s=30.0, regime_s=100.0, switch_cost_s=5.0, stale_half_life_s=100.0
    )
    policy = Policy(
        PolicyConfig(mode="goodput", window_s=20.0, min_draft_tokens=100, goodput=g),
        [ChainStep(method=Method.DRAFT_MODEL, draft="d.gguf", num_speculative_tokens=4), ChainStep(method=Method.NONE)],
        surface=Surface.from_dict(SURFACE),
    )
    decider = FallbackDecider(policy, events=Events(), say=lambda m: None, clock=lambda: 0.0, wall=lambda: 1e9)
    collapsed = window(1.2)
    one = Load(1, None, "proxy in flight + waiting")
    decider.observe(collapsed, 20.0, one)
    assert decider.observe(collapsed, 30.0, one).to_index == 1
    policy.on_switched(1, 32.0)
    decider.observe(IDLE, 50.0, one)
    paths = InstancePaths(tmp_path / "g")
    write_state(paths, {"name": "g", "state": "ready", "method": "none", **decider.snapshot(50.0)})
    res = run("status", "g", "--state-dir", tmp_path)
    assert res.code == 0, res.stderr
    aged = [ln for ln in res.stdout.splitlines() if ln.startswith("  aged")]
    assert aged == [
        "  aged       draft_model k=4: live acceptance 20.0s old (weight 0.871, half-life 100.0s), expected mean "
        "acceptance length 1.692"
    ]
