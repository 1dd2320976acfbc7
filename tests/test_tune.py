"""`specops tune`, the parts without engines: the sweep plan, the race (with a scripted engine and clock),
the per-batch-size proposal, the YAML write-back (comments, order, overlays, lock) and the report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import pytest

from specops.backends.counters import SpecCounters
from specops.config.profile import load_profile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.perf.tune import (
    UNSET_VALUE,
    BudgetTooSmall,
    LevelResult,
    MethodChoice,
    Round,
    Setting,
    SettingResult,
    TuneOptions,
    Tuner,
    TuneResult,
    comment_line,
    coverage_order,
    current_setting,
    desired_changes,
    edit_yaml,
    format_table,
    parse_ints,
    parse_pairs,
    plan_settings,
    plot,
    tune_record_path,
    write_back,
)
from specops.plugins import get_registry

pytestmark = pytest.mark.timeout(60)

DM = Method.DRAFT_MODEL


def dm(k: int) -> Setting:
    return Setting(DM, k, draft="/m/draft.gguf")


# ------------------------------------------------------------------------------------------- the plan


def test_coverage_order_spans_the_range_first():
    assert coverage_order([1, 2, 3, 4, 6, 8], key=lambda k: k, first=4) == [4, 8, 1, 6, 2, 3]
    assert coverage_order([1, 2, 4], key=lambda k: k) == [1, 4, 2]
    assert coverage_order([], key=lambda k: k) == []


def test_plan_puts_the_current_setting_first_and_interleaves_methods():
    cur = dm(3)
    choices = [MethodChoice(DM, "/m/draft.gguf"), MethodChoice(Method.NGRAM), MethodChoice(Method.NONE)]
    plan = plan_settings(cur, choices, "vllm", k_values=[1, 2, 3, 4], ngram_default=(2, 5))
    assert plan[0] == cur
    assert plan[1] == Setting(Method.NGRAM, 1, 2, 5) and plan[2] == Setting(Method.NONE)
    assert [s for s in plan if s.method is DM] == [dm(3), dm(1), dm(2), dm(4)]
    assert len(plan) == len(set(plan)) == 4 + 4 + 1


def test_plan_default_grid_includes_the_profile_k():
    plan = plan_settings(dm(5), [MethodChoice(DM, "/m/draft.gguf")], "vllm")
    assert sorted(s.k for s in plan) == [1, 2, 3, 4, 5, 6, 8] and plan[0].k == 5


def test_plan_vllm_ngram_sweeps_k_times_pairs_and_llama_ngram_sweeps_types():
    cur = Setting(Method.NGRAM, 4, 2, 5)
    plan = plan_settings(cur, [MethodChoice(Method.NGRAM)], "vllm", k_values=[2, 4], ngram_pairs=[(1, 3), (2, 5)])
    assert plan[0] == cur
    assert {(s.k, s.ngram_min, s.ngram_max) for s in plan} == {(2, 1, 3), (2, 2, 5), (4, 1, 3), (4, 2, 5)}
    cur = Setting(Method.NGRAM, ngram_type="ngram-mod")
    plan = plan_settings(cur, [MethodChoice(Method.NGRAM)], "llamacpp", ngram_types=["ngram-simple", "ngram-mod"])
    assert plan == [cur, Setting(Method.NGRAM, ngram_type="ngram-simple")]
    assert all(s.k is None for s in plan)


def test_settings_apply_to_a_profile(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(LLAMA)
    prof = load_profile(path).profile
    assert current_setting(prof) == Setting(DM, 3, draft="/models/draft.gguf")
    off = Setting(Method.NONE).apply(prof).speculative
    assert off.method is Method.NONE and off.draft is None and off.num_speculative_tokens is None
    ng = Setting(Method.NGRAM, ngram_type="ngram-simple").apply(prof).speculative
    assert ng.ngram.type == "ngram-simple" and ng.draft is None
    assert dm(6).apply(prof).speculative.k == 6


def test_parsers():
    assert parse_ints("1,2,4", "--k") == [1, 2, 4]
    assert parse_ints("1-3,6", "--k") == [1, 2, 3, 6]
    assert parse_pairs("1:3, 2:5") == [(1, 3), (2, 5)]
    for bad in ("0", "a", "3-1", ""):
        with pytest.raises(SpecopsError):
            parse_ints(bad, "--k")
    with pytest.raises(SpecopsError):
        parse_pairs("3:1")


# ------------------------------------------------------------------------------------------- the race


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeDriver:
    """A scripted engine: tokens/s per setting label (a list cycled per round), time advanced on a fake clock."""

    def __init__(
        self,
        clock,
        speeds,
        *,
        launch_s=1.0,
        round_s=0.5,
        fail=(),
        acceptance=0.8,
        k_of=None,
        counters=True,
        launch_prior_s=2.0,
    ):
        self.clock, self.speeds = clock, speeds
        self.launch_s, self.round_s = launch_s, round_s
        self.fail = set(fail)
        self.acceptance = acceptance
        self.counters = counters
        self.launch_prior_s = launch_prior_s
        self.launched: list[Setting] = []
        self.rounds: dict[str, int] = {}
        self.open = 0

    @contextlib.asynccontextmanager
    async def session(self, setting):
        self.launched.append(setting)
        self.clock.t += self.launch_s
        if setting.label in self.fail:
            raise SpecopsError(f"{setting.label} did not start")
        self.open += 1
        try:
            yield FakeSession(self, setting)
        finally:
            self.open -= 1
            self.clock.t += 0.2


class FakeSession:
    def __init__(self, driver, setting):
        self.d, self.s = driver, setting
        self.drafted = self.accepted = self.drafts = 0.0

    async def warmup(self, c):
        self.d.clock.t += 0.1

    async def run(self, c):
        speeds = self.d.speeds[self.s.label]
        n = self.d.rounds.get(self.s.label, 0)
        self.d.rounds[self.s.label] = n + 1
        v = speeds[n % len(speeds)] if isinstance(speeds, list) else speeds(c)
        self.d.clock.t += self.d.round_s
        k = self.s.k or 0
        self.drafts += 10
        self.drafted += 10 * k
        self.accepted += 10 * k * self.d.acceptance
        return Round(
            tokens_per_s=v,
            output_tokens=int(v * self.d.round_s),
            requests=4,
            draft_tokens=int(10 * k),
            accepted=int(10 * k * 0.5),
        )

    async def counters(self):
        if not self.d.counters or not self.s.k:
            return None
        return SpecCounters(draft_tokens=self.drafted, accepted=self.accepted, drafts=self.drafts)

    async def acceptance_since(self, before):
        from specops.perf.launch import acceptance_between

        return acceptance_between(before, await self.counters())


def race(settings, driver, clock, **opts):
    o = TuneOptions(**{"budget_s": 100.0, "levels": (1,), "min_rounds": 3, "max_rounds": 5, **opts})
    return asyncio.run(Tuner(settings, driver, o, current=settings[0], clock=clock).run())


def test_race_picks_the_best_median_and_stops_clearly_worse_settings_early():
    clock = Clock()
    speeds = {
        "draft_model k=1": [50, 52, 51],
        "draft_model k=2": [70, 90, 71, 69, 72],
        "draft_model k=4": [30, 31, 29],
        "draft_model k=3": [69, 75, 68, 74, 70],
    }
    drv = FakeDriver(clock, speeds)
    res = race([dm(2), dm(1), dm(4), dm(3)], drv, clock)
    assert res.winner.setting == dm(2) and res.winner.median(1) == 71
    by = {r.setting.k: r for r in res.results}
    assert by[1].status == by[4].status == "pruned" and by[1].rounds(1) == by[4].rounds(1) == 3
    assert "clearly worse" in by[1].reason
    assert by[3].status == "measured" and by[3].rounds(1) == 5  # close to the best: measured in full
    # the chosen one is the best median of everything recorded (pruned ones included)
    assert res.winner.median(1) == max(r.median(1) for r in res.results if r.median(1) is not None)
    assert drv.launched == [dm(2), dm(1), dm(4), dm(3)] and drv.open == 0
    acc = res.winner.levels[1]
    assert acc.acceptance == pytest.approx(0.8) and acc.mean_acceptance_length == pytest.approx(1 + 0.8 * 2)


def test_a_noisy_close_setting_is_not_pruned():
    clock = Clock()
    speeds = {"draft_model k=2": [100, 100, 100, 100, 100], "draft_model k=4": [90, 99, 91, 120, 118]}
    res = race([dm(2), dm(4)], FakeDriver(clock, speeds), clock)
    k4 = res.result_for(dm(4))
    assert k4.status == "measured" and res.winner.setting == dm(2)  # median 99 < 100, but it got its full rounds
    assert k4.rounds(1) == 5


def test_the_budget_sizes_rounds_and_skips_what_does_not_fit():
    clock = Clock()
    speeds = {f"draft_model k={k}": [10 * k] for k in range(1, 7)}
    drv = FakeDriver(clock, speeds, launch_s=2.0, round_s=1.0)
    res = race([dm(k) for k in range(1, 7)], drv, clock, budget_s=20.0, min_rounds=2, max_rounds=9)
    statuses = [r.status for r in res.results]
    assert "skipped" in statuses and statuses[0] == "measured"
    assert all(r.reason == "the budget ran out" for r in res.results if r.status == "skipped")
    assert res.elapsed_s <= 20.0 + 1.0
    assert res.winner is not None and res.winner.status == "measured"


def test_a_budget_too_small_for_one_setting_is_refused_up_front():
    clock = Clock()
    drv = FakeDriver(clock, {"draft_model k=1": [1]}, launch_prior_s=30.0)
    with pytest.raises(BudgetTooSmall, match=r"too small to measure one setting.*Nothing was changed"):
        race([dm(1)], drv, clock, budget_s=10.0)
    assert drv.launched == []  # no engine was started


def test_a_budget_that_runs_out_inside_the_first_setting_is_refused():
    clock = Clock()
    drv = FakeDriver(
        clock, {"draft_model k=1": [5], "draft_model k=2": [6]}, launch_s=1.0, round_s=4.0, launch_prior_s=1.0
    )
    with pytest.raises(BudgetTooSmall, match=r"then measured \d of 3 rounds at concurrency 1.*--budget"):
        race([dm(1), dm(2)], drv, clock, budget_s=9.0)
    assert drv.open == 0


def test_failed_settings_are_recorded_and_the_others_still_run():
    clock = Clock()
    speeds = {"draft_model k=1": [10, 11, 12], "draft_model k=2": [20, 21, 22]}
    res = race(
        [dm(1), dm(2), dm(4)], FakeDriver(clock, {**speeds, "draft_model k=4": [1]}, fail={"draft_model k=4"}), clock
    )
    k4 = res.result_for(dm(4))
    assert k4.status == "failed" and "did not start" in k4.reason
    assert res.winner.setting == dm(2)
    with pytest.raises(SpecopsError, match="no setting could be measured.*did not start"):
        race([dm(4)], FakeDriver(clock, {"draft_model k=4": [1]}, fail={"draft_model k=4"}), clock)


def test_request_errors_fail_the_setting():
    clock = Clock()

    class Bad(FakeDriver):
        @contextlib.asynccontextmanager
        async def session(self, setting):
            async with super().session(setting) as s:
                if setting.k == 2:

                    async def run(c):
                        return Round(0.0, 0, 4, errors=4, first_error="HTTP 500: boom")

                    s.run = run
                yield s

    res = race([dm(1), dm(2)], Bad(clock, {"draft_model k=1": [10]}), clock)
    k2 = res.result_for(dm(2))
    assert k2.status == "failed" and "4 of 4 requests failed: HTTP 500: boom" in k2.reason
    assert res.winner.setting == dm(1)


def test_every_level_is_measured_and_acceptance_falls_back_to_response_timings():
    clock = Clock()
    drv = FakeDriver(
        clock, {"draft_model k=2": lambda c: 100.0 * c, "draft_model k=1": lambda c: 90.0 * c}, counters=False
    )
    res = race([dm(1), dm(2)], drv, clock, levels=(4, 1))
    assert res.primary == 4 and res.winner.setting == dm(2)
    assert res.winner.median(4) == 400 and res.winner.median(1) == 100
    assert res.winner.levels[4].acceptance == pytest.approx(0.5)  # from per-response draft counts
    assert res.winner.levels[4].mean_acceptance_length is None


# ------------------------------------------------------------------------------------------- results


def result_with(medians: dict[int, dict[Setting, float]], levels=(8, 1), current=None) -> TuneResult:
    settings = list(dict.fromkeys(s for per in medians.values() for s in per))
    results = []
    for s in settings:
        r = SettingResult(s, status="measured")
        for c in levels:
            if s in medians.get(c, {}):
                v = medians[c][s]
                r.levels[c] = LevelResult(c, [Round(v, 100, 4)] * 3, acceptance=0.9, mean_acceptance_length=2.5)
        results.append(r)
    return TuneResult(results, levels, current or settings[0], 3, 60.0, 30.0)


def vdm(k):
    return Setting(DM, k, draft="org/draft")


def test_per_batch_size_proposal_follows_the_measured_surface():
    # levels 1 and 8, t = log2(b) / 3: k4 = 60 + 40t, k2 = 48 + 72t, none = 20 + 110t
    # b=1: k4 60; b=2 (t 1/3): k4 73.3 > k2 72.0 > none 56.7; b=3 (t 0.528): k2 86.0 > k4 81.1 > none 78.1;
    # b=4 (t 2/3): k2 96.0 > none 93.3; b=5 (t 0.774): none 105.1 > k2 103.7, and none gains faster up to 8 and
    # holds flat past it (130 > k2 120): k 0 to the end. (Split at the geometric mean of the levels, as tune
    # did before, gave [[1, 2, 4], [3, 8, 0]]: k 0 at 3 and 4, where k=2 measured faster than none.)
    none = Setting(Method.NONE)
    res = result_with({8: {vdm(4): 100, vdm(2): 120, none: 130}, 1: {vdm(4): 60, vdm(2): 48, none: 20}})
    prop = res.per_batch_size("vllm", "0.32.0", 8)
    assert prop["value"] == [[1, 2, 4], [3, 4, 2], [5, 8, 0]]
    assert (prop["method"], prop["k"]) == ("draft_model", 4)
    assert (
        "concurrency 8: best none (130.0 tok/s)" in prop["why"] and "concurrency 1: best draft_model k=4" in prop["why"]
    )
    assert res.per_batch_size("vllm", "0.32.0", 16)["value"] == [[1, 2, 4], [3, 4, 2], [5, 16, 0]]
    # without none: levels 1, 4, 16. 1..4 (t = log2(b)/2): k4 60 + 39t ≥ k2 50 + 48t up to 4 (99 vs 98);
    # 4..16 (t = (log2(b) − 2)/2): k2 98 + 22t > k4 99 + t once t > 1/21, b > 4.27: from 5 on
    res3 = result_with(
        {16: {vdm(4): 100, vdm(2): 120}, 4: {vdm(4): 99, vdm(2): 98}, 1: {vdm(4): 60, vdm(2): 50}}, levels=(16, 4, 1)
    )
    assert res3.per_batch_size("vllm", "0.32.0", 16)["value"] == [[1, 4, 4], [5, 16, 2]]
    assert res.per_batch_size("vllm", "0.20.0", 8) is None  # the field arrived in 0.24
    assert res.per_batch_size("llamacpp", None, 8) is None
    same = result_with({8: {vdm(4): 100, vdm(2): 90}, 1: {vdm(4): 60, vdm(2): 50}})
    assert same.per_batch_size("vllm", "0.32.0", 8) is None  # the same k wins everywhere
    loses = result_with({8: {vdm(4): 100, none: 130}, 1: {vdm(4): 19, none: 20}})
    assert loses.per_batch_size("vllm", "0.32.0", 8) is None  # k 0 everywhere: no speculation, no schedule


def test_an_option_pruned_after_one_level_is_not_extrapolated_to_the_others():
    # k=2 was measured at 8 only (the race pruned it there): it says nothing about 1..4. Held flat down to 1 it
    # would read 90 there and win the low batch sizes over k=4's measured 60. Without it, k4 60 + 40t vs none
    # 20 + 110t (t = log2(b)/3): b=3 (t 0.528) k4 81.1 > none 78.1; b=4 (t 2/3) none 93.3 > 86.7
    none = Setting(Method.NONE)
    res = result_with({8: {vdm(4): 100, vdm(2): 90, none: 130}, 1: {vdm(4): 60, none: 20}})
    assert res.per_batch_size("vllm", "0.32.0", 8)["value"] == [[1, 3, 4], [4, 8, 0]]
    from specops.watch.surface import Surface

    surface = Surface.from_dict({"points": res.surface_points()})
    assert surface.tokens_per_s(DM, 2, 1) is None and surface.tokens_per_s(DM, 2, 4) is None
    assert surface.tokens_per_s(DM, 2, 16) == 90  # past the surface's top level: held flat, as every option
    # crossovers only where both were measured: k=2 loses at its one level (90 < 130); k=4 where 60 + 40t = 20 +
    # 110t, t = 4/7, log2 c = 12/7 = 1.714 → the grid's next 1/8 octave 1.75, c = 2^1.75 = 3.36
    assert surface.crossover(DM, 2) == 8.0
    assert surface.crossover(DM, 4) == pytest.approx(3.36, abs=0.01)


def test_per_batch_size_can_stop_and_resume_drafting_where_the_surface_says():
    # levels 1, 4, 16 where none wins only around 4. 1..4 (t = log2(b)/2): k4 60 + 30t, k2 50 + 45t, none 20 + 80t:
    # b=2 k4 75 (k2 72.5); b=3 (t 0.792) k2 85.7 > k4 83.8 > none 83.4; b=4 none 100 > k2 95 > k4 90.
    # 4..16 (t = (log2(b) − 2)/2): none 100 + 50t, k2 95 + 65t: k2 wins once t > 1/3, b > 6.35: b=6 none 114.6 vs
    # k2 114.0, b=7 k2 121.2 vs none 120.2
    none = Setting(Method.NONE)
    res = result_with(
        {
            1: {vdm(4): 60, vdm(2): 50, none: 20},
            4: {vdm(4): 90, vdm(2): 95, none: 100},
            16: {vdm(4): 140, vdm(2): 160, none: 150},
        },
        levels=(16, 4, 1),
    )
    assert res.per_batch_size("vllm", "0.32.0", 16)["value"] == [[1, 2, 4], [3, 3, 2], [4, 6, 0], [7, 16, 2]]


def test_a_schedule_gives_k_0_only_where_the_idle_draft_measured_faster_not_where_none_did():
    # levels 1 and 16, t = log2(b) / 4: k4 = 41 + 100t, none = 22 + 150t, the draft idle at k 0 = 20 + 126t.
    # As none: k4 = none at t = 0.38 (b = 2.87): k 0 from 3. As measured: k4 = idle at t = 21/26, log2 b =
    # 3.23: b=9 (t 0.7925) k4 120.25 > idle 119.85; b=10 (t 0.8305) idle 124.64 > k4 124.05
    none, idle = Setting(Method.NONE), vdm(0)
    low, high = {vdm(4): 41, none: 22}, {vdm(4): 141, none: 172}
    res = result_with({16: dict(high), 1: dict(low)}, levels=(16, 1), current=vdm(4))
    prop = res.per_batch_size("vllm", "0.32.0", 16)
    assert prop["value"] == [[1, 2, 4], [3, 16, 0]] and "k 0 with the draft loaded was not measured" in prop["why"]
    res = result_with({16: {**high, idle: 146}, 1: {**low, idle: 20}}, levels=(16, 1), current=vdm(4))
    res.reference_only = frozenset({none, idle})
    prop = res.per_batch_size("vllm", "0.32.0", 16)
    assert prop["value"] == [[1, 9, 4], [10, 16, 0]] and "drafting nothing (measured at k 0)" in prop["why"]
    pts = [p for p in res.surface_points() if p["k"] == 0 and p["method"] == "draft_model"]
    assert [(p["concurrency"], p["mean_acceptance_length"]) for p in pts] == [(1, None), (16, None)]
    # the idle draft slower than k4 everywhere: one k at every batch size, no schedule
    res = result_with({16: {**high, idle: 111}, 1: {**low, idle: 20}}, levels=(16, 1), current=vdm(4))
    assert res.per_batch_size("vllm", "0.32.0", 16) is None
    res.reference_only = frozenset({none, idle})
    assert res.winner.setting == vdm(4)  # measured only for the schedule: never written


def test_the_idle_draft_is_measured_where_a_schedule_could_use_it_and_runs_a_k_0_range(tmp_path):
    from specops.perf.tune.plan import _idle_setting

    vllm = get_registry().backend("vllm")
    choices = [MethodChoice(DM, "org/draft"), MethodChoice(Method.NGRAM)]

    class Engine:
        version = "0.32.0"

    assert _idle_setting(vdm(4), choices, vllm, Engine, (8, 1)) == vdm(0)
    assert _idle_setting(vdm(4), choices, vllm, Engine, (8,)) is None  # one level: no schedule to render
    Engine.version = "0.20.0"
    assert _idle_setting(vdm(4), choices, vllm, Engine, (8, 1)) is None  # no per_batch_size before 0.24
    assert _idle_setting(dm(4), choices, get_registry().backend("llamacpp"), Engine, (8, 1)) is None
    assert vdm(0).label == "draft_model k=0" and vdm(0).idle and not vdm(4).idle and not Setting(Method.NONE).idle

    path = tmp_path / "v.yaml"
    path.write_text(
        "name: chat\nbackend: vllm\nengine:\n  version: 0.32.0\nmodel:\n  id: org/target\nspeculative:\n"
        "  method: draft_model\n  draft: org/draft\n  num_speculative_tokens: 3\n"
        "  per_batch_size: [[1, 4, 3], [5, 8, 1]]\nserver:\n  parallel: 8\n"
    )
    loaded = load_profile(path)
    profile = vdm(0).apply(loaded.profile)
    assert (profile.speculative.k, profile.speculative.per_batch_size) == (1, [(1, 65536, 0)])
    rendered = " ".join(vllm.render(profile, engine_for(loaded)).argv)
    assert '"num_speculative_tokens":1,"num_speculative_tokens_per_batch_size":[[1,65536,0]]' in rendered
    assert vdm(4).apply(loaded.profile).speculative.per_batch_size is None  # a swept k runs without the schedule


def test_table_marks_the_winner_and_shows_every_setting():
    res = result_with({8: {vdm(4): 100.0, vdm(2): 120.0}, 1: {vdm(4): 60.0, vdm(2): 50.0}}, current=vdm(4))
    text = format_table(res)
    lines = text.splitlines()
    assert "c=8 tok/s" in lines[0] and "c=1 tok/s" in lines[0]
    star = [x for x in lines if x.startswith("*")]
    assert len(star) == 1 and "draft_model k=2" in star[0] and "120.0 (3)" in star[0]
    assert "vs current" in lines[0] and "1.20x" in star[0]  # vs the current setting
    assert any("draft_model k=4 (now)" in x and "1.00x" in x for x in lines)
    assert comment_line(res, "2026-01-02", "p.tune.json").startswith(
        "specops tune 2026-01-02: draft_model k=2 best at concurrency 8, 120.0 tok/s median (vs k=4 100.0)"
    )


def test_plot_writes_a_png(tmp_path):
    res = result_with({8: {vdm(4): 100.0, vdm(2): 120.0, Setting(Method.NONE): 90.0}, 1: {vdm(4): 60.0, vdm(2): 50.0}})
    out = plot(res, tmp_path / "p.tune.png", title="t")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


# ------------------------------------------------------------------------------------------- YAML edits

ODD = """# Deployment of the chat service.
name:   chat            # odd spacing is kept
backend: llamacpp
model:
  id: /models/target.gguf
speculative:
  method: draft_model
  # the draft shares the target's tokenizer
  draft: /models/draft.gguf   # same family
# ---- layout ----
gpus:
  devices: []
fallback:
  chain:
      - ngram
      - none
# end
"""


def comments(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "#" in line and "specops tune" not in line]


def test_edit_keeps_comments_order_and_formatting():
    new, notes = edit_yaml(
        ODD,
        {("speculative", "num_speculative_tokens"): 4},
        comment="specops tune 2026-01-01: x",
        comment_at=("speculative", "num_speculative_tokens"),
    )
    assert notes == []
    assert comments(new) == comments(ODD)
    assert "name:   chat            # odd spacing is kept" in new  # untouched lines are byte-identical
    assert "      - ngram\n" in new
    lines = new.splitlines()
    i = lines.index("  num_speculative_tokens: 4")
    assert lines[i - 1] == "  # specops tune 2026-01-01: x"
    assert lines[i - 2] == "  draft: /models/draft.gguf   # same family"
    assert lines[i + 1] == "# ---- layout ----"  # the next section's comment stays with it
    # running again replaces specops' comment instead of stacking a second one
    again, _ = edit_yaml(
        new,
        {("speculative", "num_speculative_tokens"): 2},
        comment="specops tune 2026-01-02: y",
        comment_at=("speculative", "num_speculative_tokens"),
    )
    assert again.count("specops tune") == 1 and "# specops tune 2026-01-02: y" in again
    assert "num_speculative_tokens: 2" in again and comments(again) == comments(ODD)


def test_edit_removes_keys_without_losing_the_comments_around_them():
    edits = {
        ("speculative", "method"): "ngram",
        ("speculative", "draft"): UNSET_VALUE,
        ("speculative", "ngram", "type"): "ngram-simple",
        ("fallback", "chain"): ["none"],
    }
    new, _ = edit_yaml(ODD, edits, comment="specops tune 2026-01-01: x", comment_at=("speculative", "method"))
    assert "draft:" not in new
    assert comments(new) == [c for c in comments(ODD) if c != "draft: /models/draft.gguf   # same family"]
    assert "name:   chat            # odd spacing is kept" in new
    assert "  method: ngram\n  ngram:\n    type: ngram-simple\n" in new
    assert re.search(r"  chain:\n +- none\n# end\n$", new)  # a block list stays a block list
    assert new.index("type: ngram-simple") < new.index("# ---- layout ----") < new.index("gpus:")


def test_an_overlay_gets_null_for_what_only_its_base_sets():
    overlay = "extends: base.yaml\nname: prod  # prod\nserver:\n  port: 8000\n"
    base = {"speculative": {"method": "draft_model", "draft": "x", "num_speculative_tokens": 3}}
    edits = {
        ("speculative", "method"): "none",
        ("speculative", "draft"): UNSET_VALUE,
        ("speculative", "num_speculative_tokens"): UNSET_VALUE,
    }
    new, _ = edit_yaml(
        overlay, edits, base_data=base, comment="specops tune 2026-01-01: x", comment_at=("speculative", "method")
    )
    assert new.startswith(
        "extends: base.yaml\nname: prod  # prod\nspeculative:\n  # specops tune 2026-01-01: x\n"
        "  method: none\n  draft: null\n  num_speculative_tokens: null\nserver:\n"
    )


# ------------------------------------------------------------------------------------------- write-back

LLAMA = """# The chat service on CPU.
name: chat
backend: llamacpp
engine:
  version: b9300
model:
  id: /models/target.gguf   # the target
speculative:
  method: draft_model
  # same tokenizer as the target
  draft: /models/draft.gguf
  num_speculative_tokens: 3
gpus:
  devices: []
server:
  parallel: 2
fallback:
  chain: [ngram, none]   # what to fall back to
"""


def engine_for(loaded):
    backend = get_registry().backend(loaded.profile.backend)
    return backend.engine_info(loaded.profile, None, probe=False)


def llama_result(current, medians: dict[Setting, float]) -> TuneResult:
    return result_with({2: medians, 1: medians}, levels=(2, 1), current=current)


def test_write_back_writes_the_best_median_and_a_record_and_the_profile_still_validates(tmp_path):
    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    best = Setting(DM, 2, draft="/models/draft.gguf")
    res = llama_result(cur, {cur: 100.0, best: 130.0, Setting(DM, 1, draft="/models/draft.gguf"): 90.0})
    out = write_back(
        loaded,
        loaded.profile,
        res,
        get_registry(),
        engine=engine_for(loaded),
        workload={"sets": ["code"]},
        date="2026-01-02",
    )
    assert out.written and out.changes == ["speculative.num_speculative_tokens: 2"]
    text = path.read_text()
    assert comments(text) == comments(LLAMA)
    assert re.search(
        r"  # specops tune 2026-01-02: draft_model k=2 best at concurrency 2, 130.0 tok/s median "
        r"\(vs k=3 100.0, k=1 90.0\), acceptance 0.90, mean length 2.50; record chat.tune.json\n"
        r"  num_speculative_tokens: 2\n",
        text,
    )
    again = load_profile(path)
    assert again.profile.speculative.num_speculative_tokens == 2
    record = json.loads(tune_record_path(path).read_text())
    assert record["chosen"]["k"] == 2 and record["date"] == "2026-01-02" and record["written_to"] == "chat.yaml"
    medians = {r["label"]: r["levels"]["2"]["median_tokens_per_s"] for r in record["results"]}
    assert max(medians, key=medians.get) == record["chosen"]["label"]


def test_dry_run_changes_nothing_and_shows_the_diff(tmp_path):
    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    res = llama_result(cur, {cur: 100.0, Setting(DM, 6, draft="/models/draft.gguf"): 130.0})
    out = write_back(
        loaded,
        loaded.profile,
        res,
        get_registry(),
        engine=engine_for(loaded),
        workload={},
        dry_run=True,
        date="2026-01-02",
    )
    assert not out.written and path.read_text() == LLAMA and not tune_record_path(path).exists()
    assert "-  num_speculative_tokens: 3\n" in out.profile_diff and "+  num_speculative_tokens: 6\n" in out.profile_diff
    assert out.profile_diff.startswith("--- a/chat.yaml\n+++ b/chat.yaml\n")


def test_a_method_switch_rewrites_the_chain_and_validates(tmp_path):
    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    ng = Setting(Method.NGRAM, ngram_type="ngram-simple")
    res = llama_result(cur, {cur: 100.0, ng: 150.0, Setting(Method.NONE): 80.0})
    out = write_back(loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={})
    p = load_profile(path).profile
    assert p.speculative.method is Method.NGRAM and p.speculative.draft is None
    assert p.speculative.ngram.type == "ngram-simple" and p.speculative.num_speculative_tokens is None
    assert [s.method for s in p.chain] == [Method.NONE]
    assert 'fallback.chain: ["none"]' in out.changes
    assert re.search(r"\n  chain: \[none\] +# what to fall back to\n", path.read_text())


def test_an_overlay_is_written_and_its_base_is_not_touched(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(LLAMA.replace("name: chat\n", ""))
    overlay = tmp_path / "prod.yaml"
    overlay.write_text("# production\nextends: base.yaml\nname: chat-prod\nserver:\n  parallel: 4  # more\n")
    loaded = load_profile(overlay)
    cur = current_setting(loaded.profile)
    res = llama_result(cur, {cur: 100.0, Setting(DM, 5, draft="/models/draft.gguf"): 130.0})
    out = write_back(loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={})
    assert base.read_text() == LLAMA.replace("name: chat\n", "")
    assert any("prod.yaml extends base.yaml" in n and "written into prod.yaml" in n for n in out.notes)
    text = overlay.read_text()
    assert "speculative:\n  # specops tune " in text and "  num_speculative_tokens: 5\n" in text
    assert "# production" in text and "parallel: 4  # more" in text
    assert load_profile(overlay).profile.speculative.k == 5
    assert tune_record_path(overlay).exists()


def test_a_fresh_lock_gets_the_record_and_stays_fresh(tmp_path):
    from specops.resolve.lock import digest, inputs_of, lock_path, read_lock, stale_reason, write_lock

    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    inputs = inputs_of(loaded.profile)
    lock = {
        "lock_version": 1,
        "profile": "chat.yaml",
        "inputs": inputs,
        "inputs_sha256": digest(inputs),
        "speculative": {
            "method": "draft_model",
            "draft": "/models/draft.gguf",
            "draft_revision": None,
            "draft_file": None,
        },
        "alternatives": [],
    }
    write_lock(lock_path(path), lock)
    cur = current_setting(loaded.profile)
    res = llama_result(cur, {cur: 100.0, Setting(DM, 4, draft="/models/draft.gguf"): 130.0})
    out = write_back(loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={})
    assert out.record_path == lock_path(path) and not tune_record_path(path).exists()
    new_lock = read_lock(lock_path(path))
    assert new_lock["tune"]["chosen"]["k"] == 4 and new_lock["speculative"] == lock["speculative"]
    assert stale_reason(new_lock, load_profile(path).profile) is None  # still applies at render/up
    # a method switch leaves the lock alone (it pins the old method): the record gets its own file
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    res = llama_result(cur, {cur: 100.0, Setting(Method.NONE): 300.0})
    out = write_back(loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={})
    assert out.record_path == tune_record_path(path)
    assert any("specops lock" in n for n in out.notes)


def test_a_change_that_would_not_validate_changes_nothing(tmp_path, monkeypatch):
    import specops.perf.tune.writeback as tune

    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    res = llama_result(cur, {cur: 100.0, Setting(DM, 4, draft="/models/draft.gguf"): 130.0})
    monkeypatch.setattr(tune, "desired_changes", lambda *a, **k: {("speculative", "num_speculative_tokens"): 0})
    with pytest.raises(SpecopsError, match="would not validate, so nothing was changed.*num_speculative_tokens"):
        write_back(loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={})
    assert path.read_text() == LLAMA and not tune_record_path(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.yaml"]  # no temporary file left behind


def test_desired_changes_leave_auto_alone_when_it_resolves_to_the_winner(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        LLAMA.replace("method: draft_model", "method: draft_model").replace("draft: /models/draft.gguf", "draft: auto")
    )
    file_prof = load_profile(path).profile
    resolved = Setting(DM, 3, draft="/models/draft.gguf").apply(file_prof)
    ch = desired_changes(file_prof, resolved, Setting(DM, 5, draft="/models/draft.gguf"))
    assert ch == {("speculative", "num_speculative_tokens"): 5}
    ch = desired_changes(file_prof, resolved, Setting(Method.NONE))
    assert ch[("speculative", "method")] == "none" and ch[("speculative", "draft")] is UNSET_VALUE
    assert ch[("speculative", "num_speculative_tokens")] is UNSET_VALUE and ch[("fallback", "chain")] == []


def repo_profiles():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return sorted([*root.glob("profiles/**/*.yaml"), *root.glob("examples/*.yaml")])


@pytest.mark.parametrize("path", repo_profiles(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_profile_takes_a_new_k_with_a_two_line_diff(path):
    """Only the k line (and specops' comment, and a `speculative:` header an overlay lacks) may change."""
    import difflib

    from specops.perf.tune import base_data_of

    text = path.read_text()
    new, notes = edit_yaml(
        text,
        {("speculative", "num_speculative_tokens"): 7},
        base_data=base_data_of(path),
        comment="specops tune 2026-01-01: x",
        comment_at=("speculative", "num_speculative_tokens"),
    )
    assert notes == []
    diff = [d for d in difflib.ndiff(text.splitlines(), new.splitlines()) if d[:2] in ("- ", "+ ")]
    removed = [d[2:] for d in diff if d.startswith("- ")]
    added = [d[2:] for d in diff if d.startswith("+ ")]
    assert len(removed) <= 1 and all(line.strip().startswith("num_speculative_tokens:") for line in removed)
    eol = lambda line: line.split("#", 1)[1] if "#" in line else None  # noqa: E731
    k_lines = [line for line in added if line.startswith("  num_speculative_tokens: 7")]
    assert len(k_lines) == 1 and added.count("  # specops tune 2026-01-01: x") == 1
    assert [eol(line) for line in removed] in ([], [eol(k_lines[0])])  # the user's end-of-line comment stays
    assert set(added) <= {k_lines[0], "  # specops tune 2026-01-01: x", "speculative:"}


def test_no_change_only_refreshes_specops_comment(tmp_path):
    path = tmp_path / "chat.yaml"
    path.write_text(
        LLAMA.replace(
            "  num_speculative_tokens: 3\n", "  # specops tune 2025-12-01: old numbers\n  num_speculative_tokens: 3\n"
        )
    )
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    res = llama_result(cur, {cur: 140.0, Setting(DM, 1, draft="/models/draft.gguf"): 90.0})
    out = write_back(
        loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={}, date="2026-01-02"
    )
    text = path.read_text()
    assert out.changes == [] and "only specops' comment is updated" in out.notes[-1]
    assert "old numbers" not in text and "  # specops tune 2026-01-02: draft_model k=3 best" in text
    assert re.sub(r"  # specops tune .*\n", "", text) == LLAMA  # nothing else moved


def test_per_batch_size_is_written_with_the_low_load_best(tmp_path):
    vllm = (
        "name: chat\nbackend: vllm\nengine:\n  version: 0.32.0\nmodel:\n  id: org/target\nspeculative:\n"
        "  method: draft_model\n  draft: org/draft   # the small one\n  num_speculative_tokens: 3\n"
        "server:\n  parallel: 8\n"
    )
    path = tmp_path / "v.yaml"
    path.write_text(vllm)
    loaded = load_profile(path)
    none = Setting(Method.NONE)
    res = result_with({8: {vdm(4): 100, vdm(2): 120, none: 130}, 1: {vdm(4): 60, vdm(2): 48, none: 20}}, current=vdm(3))
    prop = res.per_batch_size("vllm", "0.32.0", 8)
    out = write_back(
        loaded,
        loaded.profile,
        res,
        get_registry(),
        engine=engine_for(loaded),
        workload={},
        per_batch=prop,
        apply_per_batch=True,
    )
    spec = load_profile(path).profile.speculative
    assert spec.method is DM and spec.k == 4 and spec.per_batch_size == [(1, 2, 4), (3, 4, 2), (5, 8, 0)]
    assert out.record["written"]["k"] == 4 and out.record["chosen"]["label"] == "none"
    assert "  per_batch_size:\n  - [1, 2, 4]\n  - [3, 4, 2]\n  - [5, 8, 0]\n" in path.read_text()
    rendered = get_registry().backend("vllm").render(load_profile(path).profile, engine_for(loaded))
    assert '"num_speculative_tokens_per_batch_size":[[1,2,4],[3,4,2],[5,8,0]]' in " ".join(rendered.argv)


def test_method_choices_and_concurrency_levels(tmp_path):
    from specops.perf.tune import concurrency_levels, method_choices

    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    reg, prof = get_registry(), loaded.profile
    primary = MethodChoice(DM, "/models/draft.gguf")
    assert method_choices(loaded, prof, reg, None) == [primary]
    assert method_choices(loaded, prof, reg, "chain") == [
        primary,
        MethodChoice(Method.NGRAM),
        MethodChoice(Method.NONE),
    ]
    assert method_choices(loaded, prof, reg, "none,draft_model") == [primary, MethodChoice(Method.NONE)]
    with pytest.raises(SpecopsError, match="unknown method 'eagle9'"):
        method_choices(loaded, prof, reg, "eagle9")
    with pytest.raises(SpecopsError, match="backend llamacpp cannot run medusa"):
        method_choices(loaded, prof, reg, "medusa")
    assert concurrency_levels(prof, None) == (2, 1)
    assert concurrency_levels(prof, "8,1,8") == (8, 1)
    with pytest.raises(SpecopsError):
        concurrency_levels(prof, "0")


def test_cli_refuses_bad_options_before_anything_runs(tmp_path):
    from support_cli import run

    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    res = run("tune", path, "--k", "two")
    assert res.code == 2 and "--k" in res.stderr and "not a number" in res.stderr
    res = run("tune", path, "--budget", "soon")
    assert res.code == 2 and "invalid duration 'soon'" in res.stderr
    res = run("tune", path, "--ngram", "5:2")
    assert res.code == 2 and "MIN:MAX" in res.stderr
    assert path.read_text() == LLAMA


def test_a_best_k_at_the_edge_of_the_grid_says_so():
    from specops.commands.tune import _grid_edge

    edge = result_with({1: {vdm(4): 100.0, vdm(8): 120.0}}, levels=(1,))
    assert _grid_edge(edge, [vdm(4), vdm(8)]) == (
        "the best k is the largest tried (8); a larger k may be faster still: try --k 8,10,12,16"
    )
    inside = result_with({1: {vdm(4): 130.0, vdm(8): 120.0, vdm(2): 90.0}}, levels=(1,))
    assert _grid_edge(inside, [vdm(2), vdm(4), vdm(8)]) is None


def test_requests_the_engine_refuses_stop_the_sweep_at_once():
    clock = Clock()

    class TooLong(FakeDriver):
        @contextlib.asynccontextmanager
        async def session(self, setting):
            async with super().session(setting) as s:

                async def run(c):
                    return Round(
                        0.0,
                        0,
                        4,
                        errors=1,
                        first_error="HTTP 400: request (398 tokens) exceeds the available context size (256 tokens)",
                    )

                s.run = run
                yield s

    drv = TooLong(clock, {})
    with pytest.raises(
        SpecopsError,
        match=r"the workload does not fit this deployment \(draft_model k=1: the engine "
        r"refused the requests: 1 of 4 requests failed: HTTP 400: .*--max-tokens",
    ):
        race([dm(1), dm(2), dm(4)], drv, clock)
    assert drv.launched == [dm(1)]  # not three times the same failure


def test_a_profile_with_per_batch_size_is_written_without_it_and_says_so(tmp_path):
    vllm = (
        "name: chat\nbackend: vllm\nengine:\n  version: 0.32.0\nmodel:\n  id: org/target\nspeculative:\n"
        "  method: draft_model\n  draft: org/draft\n  num_speculative_tokens: 3\n"
        "  per_batch_size: [[1, 4, 3], [5, 8, 1]]\nserver:\n  parallel: 8\n"
    )
    path = tmp_path / "v.yaml"
    path.write_text(vllm)
    loaded = load_profile(path)
    res = result_with({1: {vdm(4): 100.0, vdm(3): 90.0}}, levels=(1,), current=vdm(3))
    out = write_back(
        loaded,
        loaded.profile,
        res,
        get_registry(),
        engine=engine_for(loaded),
        workload={},
        dry_run=True,
        date="2026-01-02",
    )
    assert "speculative.per_batch_size is set and overrides k for the batch sizes it lists" in out.notes[0]
    assert out.changes == ["speculative.num_speculative_tokens: 4"] and path.read_text() == vllm


# ------------------------------------------------------------------------------------------- widening k


def curve(peak: int, top: float = 200.0):
    """A synthetic measurement: tokens/s rising by 10 per k up to ``peak``, then falling by 15 per k."""

    def speed(k: int) -> float:
        return top - 10 * (peak - k) if k <= peak else top - 15 * (k - peak)

    return speed


def widening_race(peak: int, grid=(1, 2, 4, 8), budget=1000.0, fail=()):
    clock = Clock()
    speed = curve(peak, top=200.0 + 10 * max(peak, 0))  # tokens/s > 0 from k = 1

    class Speeds(dict):
        def __missing__(self, label):  # any k the race asks for
            return [speed(int(label.split("k=")[1]))] * 5

    drv = FakeDriver(clock, Speeds(), fail=fail)
    o = TuneOptions(budget_s=budget, levels=(1,), min_rounds=3, max_rounds=3, widen=True)
    settings = [dm(k) for k in grid]
    return asyncio.run(Tuner(settings, drv, o, current=settings[0], clock=clock).run()), drv


def test_tune_widens_k_until_the_curve_turns_down():
    # peak at 13 (330 tok/s): the grid's best is 8 (280, the edge); next k = 8 + 4 = 12 (320, still the edge),
    # 12 + 6 = 18 (255 < 320: bracketed, the curve turned down)
    res, drv = widening_race(13)
    assert [s.k for s in drv.launched] == [1, 2, 4, 8, 12, 18]
    assert res.winner.setting == dm(12)
    [edge] = res.k_edges()
    assert edge["best_k"] == 12 and edge["at_edge"] is None and edge["tried"] == [1, 2, 4, 8, 12, 18]
    assert edge["why"].startswith("the curve turns down after k=12 (320.0 tok/s; next k: 255.0")


def test_an_interior_best_is_not_widened():
    res, drv = widening_race(3)
    assert [s.k for s in drv.launched] == [1, 2, 4, 8]
    assert res.winner.setting == dm(2)  # 220 tok/s: between 1 (210) and 4 (215)
    assert res.k_edges()[0]["at_edge"] is None


def test_widening_stops_at_the_cap_and_says_the_best_is_at_the_edge():
    res, drv = widening_race(100)  # rises everywhere: 8 → 12 → 18 → 27 → 32 (the cap), still rising
    assert [s.k for s in drv.launched] == [1, 2, 4, 8, 12, 18, 27, 32]
    [edge] = res.k_edges()
    assert edge["best_k"] == 32 and edge["at_edge"] == "high"
    assert edge["why"] == "k=32 is the cap for draft_model (32): the curve may still rise past it"
    assert res.to_dict()["k_range"] == [edge]


def test_widening_below_the_smallest_k_when_it_is_best():
    res, drv = widening_race(-5, grid=(4, 8))  # falls everywhere: 4 best → try 2 → try 1
    assert [s.k for s in drv.launched] == [4, 8, 2, 1]
    assert res.winner.setting == dm(1)


def test_widening_that_runs_out_of_budget_says_so():
    res, drv = widening_race(100, budget=14.0)  # each setting ≈ 1 + 0.1 + 3 × 0.5 + 0.2 = 2.8 s
    [edge] = res.k_edges()
    assert edge["at_edge"] == "high" and "the budget ran out" in edge["why"]


def test_a_k_the_engine_refuses_ends_the_widening():
    res, drv = widening_race(100, fail=("draft_model k=12",))
    [edge] = res.k_edges()
    assert edge["best_k"] == 8 and edge["at_edge"] == "high"
    assert "k=12 could not be measured (failed: draft_model k=12 did not start)" in edge["why"]


def race_with_baseline(budget_s: float, max_rounds: int):
    """k=2 and k=4 (50 and 60 tok/s) with none (90) as the surface's baseline; levels 2 and 1, 3 rounds min."""
    clock = Clock()
    speeds = {"draft_model k=2": [50] * 5, "draft_model k=4": [60] * 5, "none": [90] * 5}
    drv = FakeDriver(clock, speeds)
    o = TuneOptions(budget_s=budget_s, levels=(2, 1), min_rounds=3, max_rounds=max_rounds)
    tuner = Tuner([dm(2), dm(4)], drv, o, current=dm(2), clock=clock, reference=[Setting(Method.NONE)])
    return asyncio.run(tuner.run()), drv


def test_the_reference_none_is_measured_for_the_surface_but_never_wins():
    res, drv = race_with_baseline(100.0, max_rounds=3)
    assert drv.launched == [dm(2), dm(4), Setting(Method.NONE)]
    assert res.winner.setting == dm(4)  # none measured 90 but is only the baseline
    assert res.result_for(Setting(Method.NONE)).rounds(1) == 3  # not pruned: both levels
    pts = {(p["method"], p["k"], p["concurrency"]): p["tokens_per_s"] for p in res.surface_points()}
    assert pts[("none", 0, 2)] == 90 and pts[("draft_model", 4, 1)] == 60 and len(pts) == 6


def test_the_sweep_leaves_the_baseline_its_share_of_a_tight_budget():
    # 12 s: each setting costs about 1 + 0.1 + 3 rounds x 2 levels x 0.5 + 0.2 = 4.3 s, so two fit but not
    # three; the sweep comes first, so without a reserve k=4 took the time and none was skipped
    res, drv = race_with_baseline(12.0, max_rounds=5)
    none = res.result_for(Setting(Method.NONE))
    assert none.status == "measured" and min(none.rounds(2), none.rounds(1)) >= 3  # its minimum at both levels
    assert res.result_for(dm(4)).status == "skipped" and drv.launched == [dm(2), Setting(Method.NONE)]
    assert res.winner.setting == dm(2) and res.elapsed_s <= 12.0


def test_write_back_records_the_surface_with_where_it_was_measured(tmp_path):
    from specops.watch.surface import load_surface

    path = tmp_path / "chat.yaml"
    path.write_text(LLAMA)
    loaded = load_profile(path)
    cur = current_setting(loaded.profile)
    none = Setting(Method.NONE)
    res = result_with({2: {cur: 100.0, none: 120.0}, 1: {cur: 80.0, none: 40.0}}, levels=(2, 1), current=cur)
    res.reference_only = frozenset({none})
    out = write_back(
        loaded, loaded.profile, res, get_registry(), engine=engine_for(loaded), workload={}, date="2026-12-01"
    )
    assert out.record["chosen"]["label"] == cur.label  # none is faster at 2 but only the baseline
    s = out.record["surface"]
    assert (s["date"], s["backend"], s["levels"]) == ("2026-12-01", "llamacpp", [1, 2])
    assert s["crossover"] == {cur.label: pytest.approx(1.68, abs=0.01)}  # 80 + 20t = 40 + 80t at t = 2/3
    surface = load_surface(tune_record_path(path))
    assert surface.tokens_per_s(Method.NONE, 0, 2) == 120.0
