"""Which rule decides the fallback when a profile sets no ``fallback.mode``: on tokens/s where specops knows them
(a goodput surface, else a verification-cost curve stored for the engine, model and machine), on acceptance only
where nothing better is known; what a decision says it used; and request classes judged the same way.

The three cases the 0.6 rule got wrong on a real model (issue 39), as the counters of a 60 s window give them:

    case                                          drafts  drafted  accepted  acceptance  τ      measured vs none
    Gemma 3 270M code set, ngram-mod, drafts 16   30      480      480       1.000       17.0   0.91x
    code set on a busy machine, drafts of 32 (*)  20      640      397       0.620       20.85  0.32x
    short cheap drafts (3 tokens)                 200     600      270       0.450       2.35   1.30x

(*) the run published acceptance and speed only: its draft length is assumed. The surfaces below hold what such a
run measures (tokens/s with and without speculation, none at 10 tok/s). The profiles run n-gram drafts of k tokens
on vLLM (whose k is the draft length; llama-server sizes its n-gram drafts with its own flags).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from support_cli import run
from support_goodput import Events

from specops.backends.counters import SpecCounters
from specops.config.profile import load_profile
from specops.doctor.base import OK as CHECK_OK
from specops.doctor.base import Context
from specops.doctor.profile import check_fallback
from specops.methods import Method
from specops.perf.verifycost import CurveKey, decision_curve, decision_draft_cost, save_curve
from specops.run.events import EngineReady
from specops.run.instance import InstancePaths, write_state
from specops.watch.classes import ClassTable
from specops.watch.decide import FallbackDecider
from specops.watch.decision import KEEP, SWITCH
from specops.watch.goodput import Load
from specops.watch.window import OK, Sample, SampleBuffer, WindowStats

W = 60.0
VERSION = "0.32.0"
#: Gemma 3 270M Q4_K_M on this 2-core Xeon (docs/performance.md): a pass over n tokens, in decode steps
GEMMA_CURVE = {"1": 0.12, "2": 0.15, "4": 0.21, "8": 0.46, "16": 0.82, "32": 0.83, "64": 1.58}
#: Qwen2.5-Coder 1.5B Q4_K_M, same machine
QWEN_CURVE = {"1": 0.594, "2": 0.753, "4": 1.2192, "8": 1.4236, "16": 1.7116, "32": 4.3555, "64": 4.2974}


@dataclass(frozen=True)
class Case:
    """One recorded window: the counters' increase over 60 s, and the speed measured against no speculation."""

    k: int
    drafts: int
    drafted: int
    accepted: int
    ratio: float

    @property
    def tau(self) -> float:
        return 1 + self.accepted / self.drafts


LONG_DRAFTS_ACCEPTED = Case(k=16, drafts=30, drafted=480, accepted=480, ratio=0.91)
BUSY_MACHINE = Case(k=32, drafts=20, drafted=640, accepted=397, ratio=0.32)
SHORT_CHEAP = Case(k=3, drafts=200, drafted=600, accepted=270, ratio=1.30)


def _profile(tmp_path, case: Case, fallback: str = "", *, model: str = "google/gemma-3-270m"):
    f = tmp_path / "p.yaml"
    f.write_text(
        f"name: real\nbackend: vllm\nmodel: {{id: {model}}}\n"
        f"speculative: {{method: ngram, num_speculative_tokens: {case.k}}}\n"
        + (f"fallback:\n{fallback}" if fallback else ""),
        encoding="utf-8",
    )
    return load_profile(f, env={})


def _surface(tmp_path, case: Case) -> str:
    """The tune record of what was measured at one and four clients: none 10 tok/s, ngram ``ratio`` of it."""
    points = [{"method": "none", "k": 0, "concurrency": c, "tokens_per_s": 10.0} for c in (1, 4)]
    points += [
        {
            "method": "ngram",
            "k": case.k,
            "concurrency": c,
            "tokens_per_s": 10.0 * case.ratio,
            "mean_acceptance_length": case.tau,
        }
        for c in (1, 4)
    ]
    rec = tmp_path / "p.tune.json"
    rec.write_text(json.dumps({"surface": {"date": "2026-12-06", "points": points}}), encoding="utf-8")
    return rec.name


def _store_curve(loaded, points: dict) -> str:
    record = {"relative": points, "date": "2026-12-06T17:00:00+00:00", "t_step_ms": 559.0}
    _, path = save_curve(CurveKey.of(loaded.profile, VERSION), record)
    return str(path)


def _decider(loaded, lines: list[str], curve=None) -> FallbackDecider:
    decider = FallbackDecider.from_profile(
        loaded, curve=curve, events=Events(), say=lines.append, clock=lambda: 0.0, wall=lambda: 1e9
    )
    decider.on_event(EngineReady(0, Method.NGRAM, None, 2.0))  # the engine started in 2 s: the switch's cost
    return decider


def _replay(decider: FallbackDecider, case: Case, until: float = 150.0) -> list:
    """Tick every 5 s for ``until`` s at one client, the counters rising as recorded; the decisions."""
    buf, out = SampleBuffer(W), []
    for t in range(0, int(until) + 1, 5):
        f = t / W
        buf.add(
            Sample(t, SpecCounters(draft_tokens=case.drafted * f, accepted=case.accepted * f, drafts=case.drafts * f))
        )
        out.append(decider.observe(buf.stats(t), float(t), Load(1.0, None, "proxy in flight")))
        if out[-1].action == SWITCH:
            break
    return out


# ---------------------------------------------------------------------------------------------- the three cases


@pytest.mark.parametrize(
    ("case", "falls_back"),
    [(LONG_DRAFTS_ACCEPTED, True), (BUSY_MACHINE, True), (SHORT_CHEAP, False)],
    ids=["acceptance-1.000-at-0.91x", "acceptance-0.62-at-0.32x", "acceptance-0.45-at-1.3x"],
)
def test_unset_mode_decides_on_measured_tokens_per_s(tmp_path, case, falls_back):
    rec = _surface(tmp_path, case)
    lines: list[str] = []
    decider = _decider(_profile(tmp_path, case, f"  goodput: {{surface: {rec}}}\n"), lines)
    assert lines == [
        "fallback decides on tokens/s (mode goodput: measured per method and load): fallback.mode unset, and a "
        f"goodput surface is measured (fallback.goodput.surface: {rec})"
    ]
    decisions = _replay(decider, case)
    switches = [d for d in decisions if d.action == SWITCH]
    if falls_back:  # none is better by more than the hysteresis, for the 30 s sustain: none from then on
        assert [(d.rule, d.to_method, d.at) for d in switches] == [("goodput", Method.NONE, 30.0)]
        assert f"none predicts 10.0 tok/s against {10 * case.ratio:.1f} for ngram k={case.k}" in switches[0].reason
    else:
        assert switches == [] and decisions[-1].rule == "goodput-best"
        assert decisions[-1].numbers["predicted"] == {f"ngram k={case.k}": 13.0, "none": 10.0}
    # the window's acceptance is what the threshold would have read
    assert decisions[-1].numbers["acceptance"] == pytest.approx(case.accepted / case.drafted)


@pytest.mark.parametrize(
    ("case", "falls_back"),
    [(LONG_DRAFTS_ACCEPTED, False), (BUSY_MACHINE, False), (SHORT_CHEAP, True)],
    ids=["acceptance-1.000-at-0.91x", "acceptance-0.62-at-0.32x", "acceptance-0.45-at-1.3x"],
)
def test_a_mode_set_in_the_profile_is_kept_even_with_a_surface(tmp_path, case, falls_back):
    """``mode: threshold`` written in the profile decides on acceptance, as before: the three cases go the
    other way (two windows below 0.6 switch at 120 s)."""
    rec = _surface(tmp_path, case)
    lines: list[str] = []
    decider = _decider(_profile(tmp_path, case, f"  mode: threshold\n  goodput: {{surface: {rec}}}\n"), lines)
    assert lines == [
        "fallback decides on acceptance (mode threshold: < 0.6): fallback.mode: threshold is set in the profile"
    ]
    switches = [d for d in _replay(decider, case) if d.action == SWITCH]
    assert [(d.rule, d.at) for d in switches] == ([("threshold", 120.0)] if falls_back else [])


def test_nothing_known_decides_on_acceptance_and_says_why(tmp_path):
    lines: list[str] = []
    decider = _decider(_profile(tmp_path, SHORT_CHEAP), lines)
    assert decider.policy.config.mode == "threshold"
    assert lines == [
        "fallback decides on acceptance (mode threshold: < 0.6): fallback.mode unset and nothing better is known: "
        "no goodput surface (`specops tune`), no verification-cost curve stored for this engine, model and machine "
        "(`specops bench PROFILE --probe-verify`)"
    ]
    assert decider.snapshot()["policy"]["rule"]["explicit"] is False


# ---------------------------------------------------------------------------------------------- the stored curve


def test_a_stored_curve_makes_the_model_decide_on_the_windows_measured_lengths(tmp_path):
    """Gemma's code cell on its probed curve, from the window's τ 17 and drafts of 16 (the profile says k 4):
    17 / (16 × 0.05 + pass(17) + 17 × 0.88) = 17 / (0.8 + 0.82 + 14.96) = 1.025; the flat formula says 9.44."""
    case = LONG_DRAFTS_ACCEPTED
    loaded = _profile(tmp_path, Case(4, case.drafts, case.drafted, case.accepted, case.ratio))
    path = _store_curve(loaded, GEMMA_CURVE)
    curve = decision_curve(loaded.profile, VERSION)
    assert curve is not None and curve.source == path
    assert decision_curve(loaded.profile, "0.31.0") is None  # another engine version: not this curve
    lines: list[str] = []
    decider = _decider(loaded, lines, curve)
    assert lines == [
        f"fallback decides on predicted tokens/s (mode model: speedup < 1, curve {path}): fallback.mode unset, no "
        "goodput surface, and a verification-cost curve is stored for this engine, model and machine"
    ]
    d = [x for x in _replay(decider, case, 60) if x.numbers.get("low") is not None][-1]
    n = d.numbers
    assert (d.action, d.rule) == (KEEP, "speedup-above-1")
    assert n["predicted_speedup"] == pytest.approx(17 / (0.8 + 0.82 + 1 / 16 * 0.01 + 17 * 0.88))
    assert (n["k"], n["k_measured"], n["tokens_per_step"]) == (16.0, True, 17.0)
    assert n["verify_cost"] == f"curve {path}"
    assert f"measured k=16, c=0.05, curve {path}; acceptance 1.000" in d.reason
    assert decider.snapshot()["last_verdict"]["verify_cost"] == f"curve {path}"


def test_the_model_prices_a_draft_model_at_its_measured_cost_unless_the_profile_sets_one(tmp_path):
    """The real 0.5B draft of Qwen2.5-Coder 1.5B on llama-server: accepted 0.815 (τ 4.24 on drafts of 4) at 0.81x
    of no speculation. Its steps, probed on this machine, cost 0.75 of a target step a draft token: 4.24 / (4 ×
    0.75 + 2.358) = 0.79 → fall back; with the default c of 0.05 the same window predicted 4.24 / 2.558 = 1.66."""
    f = tmp_path / "pair.yaml"
    f.write_text(
        "name: real\nbackend: vllm\nmodel: {id: /m/qwen-1.5b}\n"
        "speculative: {method: draft_model, draft: /m/qwen-0.5b, num_speculative_tokens: 4}\n",
        encoding="utf-8",
    )
    loaded = load_profile(f, env={})
    record = {"probe": "speculative-steps", "relative": {"1": 1.0, "5": 2.358}, "date": "2026-12-06T23:39:54+00:00",
              "t_step_ms": 93.4, "drafts": {"/m/qwen-0.5b": {"path": "/m/qwen-0.5b", "k": 4, "ratio": {"1": 0.752}}}}  # fmt: skip
    save_curve(CurveKey.of(loaded.profile, VERSION), record)
    window = Case(k=4, drafts=90, drafted=360, accepted=293, ratio=0.81)
    curve = decision_curve(loaded.profile, VERSION)
    measured = decision_draft_cost(loaded.profile, VERSION)
    assert measured == 0.752

    def last_verdict(loaded, draft_cost):
        decider = FallbackDecider.from_profile(
            loaded, curve=curve, draft_cost=draft_cost, events=Events(), say=lambda m: None, clock=lambda: 0.0,
            wall=lambda: 1e9,
        )  # fmt: skip
        decider.on_event(EngineReady(0, Method.DRAFT_MODEL, None, 2.0))
        return [x for x in _replay(decider, window, 150) if x.numbers.get("predicted_speedup") is not None][-1]

    d = last_verdict(loaded, measured)
    assert d.numbers["predicted_speedup"] == pytest.approx(4.2556 / (4 * 0.752 + 2.358), rel=1e-3)
    assert d.action == SWITCH and "c=0.752" in d.reason
    assert last_verdict(loaded, None).action == KEEP  # the default c: 1.66x predicted, it keeps the draft
    f.write_text(f.read_text() + "fallback: {draft_cost_ratio: 0.05}\n", encoding="utf-8")
    assert last_verdict(load_profile(f, env={}), measured).action == KEEP  # the profile's own c wins


def test_the_model_without_a_curve_says_flat(tmp_path):
    lines: list[str] = []
    decider = _decider(_profile(tmp_path, LONG_DRAFTS_ACCEPTED, "  mode: model\n"), lines)
    assert lines[0].startswith("fallback decides on predicted tokens/s (mode model: speedup < 1, flat: no curve")
    assert "fallback.mode: model is set in the profile; no verification-cost curve stored" in lines[0]
    d = [x for x in _replay(decider, LONG_DRAFTS_ACCEPTED, 60) if x.numbers.get("low") is not None][-1]
    assert d.numbers["verify_cost"] == "flat: no curve (c_verify = 1)"
    assert d.numbers["predicted_speedup"] == pytest.approx(17 / (1 + 16 * 0.05))  # 9.44


def test_without_a_count_of_drafts_the_engines_draft_length_is_used(tmp_path):
    """llama-server's per-response timings count no drafts: k is the longest draft the engine runs (its plan's),
    not the profile's k."""
    loaded = _profile(tmp_path, Case(4, 1, 1, 1, 1.0))
    _store_curve(loaded, QWEN_CURVE)
    decider = _decider(loaded, [], decision_curve(loaded.profile, VERSION))
    decider.policy.note_draft_length(0, 12)
    stats = WindowStats(OK, W, 0.0, 60.0, acceptance=0.5, draft_tokens=600.0, accepted=300.0, full=True)
    n = decider.observe(stats, 60.0).numbers
    assert (n["k"], n["k_measured"]) == (12.0, False)
    assert n["k_basis"] == "the engine's longest draft (the window counts no drafts)"


# ---------------------------------------------------------------------------------------------- request classes


def _class_window(table: ClassTable, key: str, t0: float, *, tokens: int, drafted: int, accepted: int) -> None:
    table.touch(key, t0)
    for i in range(20):  # 20 answers over the window
        table.note(
            key, t0 + i * 3, speculative=True, draft_tokens=drafted, accepted=accepted, tokens=tokens, seconds=2.0
        )


def test_a_class_is_judged_on_predicted_tokens_per_s_when_a_curve_is_known(tmp_path):
    """A class whose answers draft 3 tokens per target pass and keep 45 % of them: τ = 47 / (47 − 27) = 2.35 per
    pass, k = 60 / 20 = 3; on the Qwen 1.5B curve 2.35 / (0.15 + pass(4) + 2.35 × 0.406) = 1.011: it speculates,
    where its acceptance (0.45 < 0.6) would have sent it to the engine without speculation."""
    loaded = _profile(tmp_path, SHORT_CHEAP, model="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    _store_curve(loaded, QWEN_CURVE)
    decider = _decider(loaded, [], decision_curve(loaded.profile, VERSION))
    table = ClassTable(8, W)
    _class_window(table, "extract", 0.0, tokens=47, drafted=60, accepted=27)
    c, stats = table.get("extract"), table.stats("extract", 60.0)
    assert (stats.mean_acceptance_length, stats.mean_draft_length) == (pytest.approx(2.35), pytest.approx(3.0))
    verdict, why = decider.judge_class(c, stats, min_draft_tokens=200)
    assert verdict is True
    assert why.startswith("predicted speedup 1.011 (α=")
    assert "acceptance 0.450" in why
    assert table.decide("extract", verdict, why)  # what the router keeps (specops.serve.twins)
    # the hysteresis stands: one disjoint window of long, mostly refused drafts does not flip it (k 48, τ 1.2)
    _class_window(table, "extract", 61.0, tokens=24, drafted=960, accepted=4)
    verdict, why = decider.judge_class(c, table.stats("extract", 121.0), min_draft_tokens=200)
    assert verdict is True and "window 1 of 2 against the verdict (hysteresis)" in why


def test_a_class_without_a_curve_is_judged_on_its_acceptance(tmp_path):
    decider = _decider(_profile(tmp_path, SHORT_CHEAP), [])
    table = ClassTable(8, W)
    _class_window(table, "extract", 0.0, tokens=47, drafted=60, accepted=27)
    verdict, why = decider.judge_class(table.get("extract"), table.stats("extract", 60.0), min_draft_tokens=200)
    assert verdict is False and why.startswith("acceptance 0.450")


# ---------------------------------------------------------------------------------------------- where it is said


def test_status_validate_and_doctor_say_which_rule_applies(tmp_path):
    loaded = _profile(tmp_path, LONG_DRAFTS_ACCEPTED)
    path = _store_curve(loaded, GEMMA_CURVE)
    decider = _decider(loaded, [], decision_curve(loaded.profile, VERSION))
    paths = InstancePaths(tmp_path / "real")
    write_state(paths, {"name": "real", "state": "ready", "method": "ngram", **decider.snapshot(5.0)})
    res = run("status", "real", "--state-dir", tmp_path)
    assert res.code == 0, res.stderr
    rule = [ln for ln in res.stdout.splitlines() if ln.startswith("  rule ")]
    assert rule == [
        f"  rule       fallback decides on predicted tokens/s (mode model: speedup < 1, curve {path}): "
        "fallback.mode unset, no goodput surface, and a verification-cost curve is stored for this engine, "
        "model and machine"
    ]

    # validate starts no engine: a curve is matched only for a pinned engine.version
    res = run("validate", loaded.path)
    assert res.code == 0, res.stderr
    assert "fallback decides on acceptance (mode threshold: < 0.6)" in res.stdout
    assert "without engine.version no stored verification-cost curve can be matched" in res.stdout
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text((tmp_path / "p.yaml").read_text() + f"engine: {{version: {VERSION}}}\n")
    res = run("validate", "--format", "json", pinned)
    assert res.code == 0, res.stderr
    row = json.loads(res.stdout)["profiles"][0]["fallback_rule"]
    assert (row["mode"], row["explicit"], row["verify_cost"]) == ("model", False, f"curve {path}")

    # doctor: for the engine version it rendered for
    ctx = Context(registry=None, offline=True, loaded=loaded, engine_version=VERSION)
    [check] = check_fallback(ctx)
    assert (check.name, check.level) == ("fallback", CHECK_OK) and f"curve {path}" in check.summary
    ctx = Context(registry=None, offline=True, loaded=loaded, engine_version="0.31.0")
    [check] = check_fallback(ctx)
    assert "mode threshold" in check.summary and "--probe-verify" in check.fix
