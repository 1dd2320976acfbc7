"""The verification-cost curve: the speedup model prices verification with it (c_verify ≡ 1 only without one),
and advise, bench's model column, init's n-gram draft size, tune's plan and the goodput model use it.

The curve below is the shape llama.cpp's batched verification has on a 2-core CPU: a pass over n tokens costs
about 0.25 steps per extra token. The engine probe itself is in ``test_verifycost_engines.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specops.speedup import (
    FLAT,
    VerifyCost,
    best_k,
    cost_basis,
    expected_speedup,
    max_paying_k,
    speedup_from_length,
)

CPU = {"1": 1.05, "2": 1.3, "4": 1.8, "8": 2.9, "16": 5.0, "32": 9.0, "64": 17.0}
RECORD = {"engine": "llamacpp", "version": "b1", "device": "CPU: test, 2 cores", "date": "2026-12-06", "relative": CPU}
SPECOPS = Path(sys.executable).with_name("specops")


def cpu_curve() -> VerifyCost:
    return VerifyCost.from_mapping(CPU, "test CPU")


# ------------------------------------------------------------------------------------------- the model


def test_the_curve_is_normalized_to_one_token_and_interpolated():
    v = cpu_curve()
    assert v.at(1) == 1.0 and v.at(0) == 1.0  # verifying the one token of a plain step costs one step
    assert v.at(2) == pytest.approx(1.3 / 1.05)
    assert v.at(3) == pytest.approx((1.3 + 0.25) / 1.05)  # halfway between 2 and 4
    assert v.at(128) == pytest.approx((17.0 + 8.0 * 64 / 32) / 1.05)  # past 64 along the last segment
    assert VerifyCost(((1, 0.5), (2, 0.3), (4, 0.9))).at(2) == 0.5  # more tokens never cost less than one


def test_speedup_prices_verification_with_the_curve():
    v = cpu_curve()
    # a draft of 16 always accepted: 17 tokens for one pass, but that pass costs c_verify(17) steps
    assert expected_speedup(1.0, 16, 0.0, v) == pytest.approx(17 / v.at(17))
    assert expected_speedup(1.0, 16, 0.0, v) < 4.0 < expected_speedup(1.0, 16, 0.0)  # flat says 17x
    # the issue's Gemma cell: mean acceptance length 17 at drafts of 16 — the flat model said 9–17x
    assert speedup_from_length(17.0, 16.0, 0.0, v) == pytest.approx(17 / v.at(17))
    assert speedup_from_length(17.0, 16.0, 0.05) == pytest.approx(17 / 1.8)  # no curve: τ / (1 + k·c)
    assert expected_speedup(0.9, 0, 0.1, v) == 1.0


def test_what_a_step_pays_per_token_outside_its_pass_is_not_amortized():
    # Gemma 3 270M on 2 cores (llama-server, probed): a pass over one token is 0.14 of a decode step, the rest
    # is sampling over 262,144 tokens, paid for every token kept
    gemma = VerifyCost.from_mapping({"1": 0.14, "2": 0.15, "4": 0.16, "8": 0.23, "16": 0.30, "32": 0.62, "64": 0.73})
    assert gemma.per_token == pytest.approx(0.86) and gemma.at(1) == pytest.approx(0.14)
    assert expected_speedup(0.9, 0, 0.0, gemma) == pytest.approx(1.0)  # k = 0 is still one step
    # the issue's code cell: mean acceptance length 17 at drafts of 16 measured 0.91-1.01x; flat said 9.44x
    s = speedup_from_length(17.0, 16.0, 0.0, gemma)
    assert s == pytest.approx(17 / (0.30 + 17 * 0.86 + 0.32 / 16)) and 0.9 < s < 1.2
    assert speedup_from_length(17.0, 16.0, 0.0, gemma) < 1 / gemma.per_token  # the ceiling, whatever the draft


def test_no_curve_is_todays_formula_and_says_so():
    for k in (1, 4, 16):
        assert expected_speedup(0.8, k, 0.05, None) == expected_speedup(0.8, k, 0.05)
        assert expected_speedup(0.8, k, 0.05, VerifyCost(((1, 2.0), (64, 2.0)))) == pytest.approx(
            expected_speedup(0.8, k, 0.05)
        )  # a flat measured curve is the same model
    assert cost_basis(None) == FLAT and "assumed" in FLAT
    assert cost_basis(cpu_curve()) == "c_verify measured (test CPU)"


def test_best_k_shrinks_on_a_cpu_curve():
    assert best_k(0.9, 0.0, 64) == 64  # free verification: draft as much as allowed
    assert best_k(0.9, 0.0, 64, cpu_curve()) == 5
    steep = VerifyCost(((1, 1.0), (2, 2.5), (4, 5.0)))  # worse than linear: nothing pays
    assert best_k(0.9, 0.0, 8, steep) == 0
    assert max_paying_k(0.0, steep, 8) == 0 and max_paying_k(0.0, None, 8) == 8


def test_a_curve_needs_its_one_token_point_and_sane_costs():
    for bad in ({"2": 1.0}, {"1": 0}, {"1": "x"}, {"1": float("nan")}, []):
        with pytest.raises(ValueError, match="verification-cost curve"):
            VerifyCost.from_mapping(bad)


# ------------------------------------------------------------------------------------------- stored curves


def test_a_stored_curve_is_found_only_for_its_engine_model_and_device(tmp_path):
    from specops.perf.verifycost import CurveKey, load_curve, save_curve

    key = CurveKey("llamacpp", "b1", "/m/model.gguf (10 bytes)", "CPU: test, 2 cores")
    record, path = save_curve(key, {"relative": CPU, "date": "d"}, tmp_path)
    assert record["device"] == key.device and path.parent == tmp_path
    assert load_curve(key, tmp_path).at(2) == pytest.approx(1.3 / 1.05)
    for other in (
        CurveKey("llamacpp", "b1", "/m/model.gguf (10 bytes)", "CPU: other, 64 cores"),
        CurveKey("llamacpp", "b2", "/m/model.gguf (10 bytes)", "CPU: test, 2 cores"),
        CurveKey("llamacpp", "b1", "/m/other.gguf (10 bytes)", "CPU: test, 2 cores"),
    ):
        assert load_curve(other, tmp_path) is None
    path.write_text("{not json")
    assert load_curve(key, tmp_path) is None


def test_a_changed_model_file_is_another_model(tmp_path):
    from specops.perf.verifycost import model_identity

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    before = model_identity(str(f))
    f.write_bytes(b"x" * 11)
    assert model_identity(str(f)) != before and model_identity("org/repo") == "org/repo"


# ------------------------------------------------------------------------------------------- the users


def test_bench_model_column_uses_the_probed_curve():
    from specops.perf.bench_report import summarize

    cells = [
        {"set": "code", "concurrency": 1, "mode": mode, "round": 1, "tokens_per_s": tps, "errors": 0,
         "output_tokens": 100, "wall_s": 1.0, "draft_tokens": 160 if mode == "spec" else None,
         "accepted": 160 if mode == "spec" else None, "drafts": 10 if mode == "spec" else None,
         **{f"{n}_ms": {"median": 1.0} for n in ("ttft", "itl", "tpot")}}
        for mode, tps in (("spec", 9.0), ("base", 10.0))
    ]  # fmt: skip
    meta = {"settings": {"draft_cost_ratio": 0.0}}
    flat = summarize(cells, meta)
    probed = summarize(cells, {**meta, "verify_cost": RECORD})
    assert flat["speedup"][0]["model_speedup"] == pytest.approx(17.0)  # drafts of 16, all accepted
    assert probed["speedup"][0]["model_speedup"] == pytest.approx(17 / cpu_curve().at(17))
    assert probed["model_basis"].startswith("c_verify measured") and flat["model_basis"].startswith(FLAT)


def test_advise_says_which_verification_cost_it_used(tmp_path):
    curve_file = tmp_path / "curve.json"
    curve_file.write_text(json.dumps(RECORD))

    def advise(*extra):
        r = subprocess.run(
            [str(SPECOPS), "advise", "--alpha", "0.9", "-k", "16", "-c", "0", "--k-max", "16", "--json", *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    flat, measured = advise(), advise("--verify-cost", str(curve_file))
    assert flat["best_k"] == 16 and flat["cost_model"]["verify_cost"] == FLAT
    assert measured["best_k"] == best_k(0.9, 0.0, 16, cpu_curve()) == 5
    assert measured["speedup"] == pytest.approx(expected_speedup(0.9, 16, 0.0, cpu_curve()))
    assert measured["cost_model"]["verify_cost"].startswith("c_verify measured (llamacpp b1 on CPU: test")
    bad = tmp_path / "bad.json"
    bad.write_text('{"relative": {"2": 1}}')
    r = subprocess.run([str(SPECOPS), "advise", "--alpha", "0.9", "--verify-cost", str(bad)], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 1 and f"--verify-cost {bad}: not a verification-cost record" in r.stderr
    assert "Traceback" not in r.stderr


def test_init_sizes_ngram_drafts_on_the_curve():
    from specops.commands.init import NGRAM_MOD_FLAGS, ngram_size

    flags = frozenset(NGRAM_MOD_FLAGS)
    args, why, pays = ngram_size(cpu_curve(), flags, "CPU: test")
    # at α 0.8 the model finds 3 best on this curve (64, llama-server's default, is best without one)
    assert pays and args == ["--spec-ngram-mod-n-max", "3", "--spec-ngram-mod-n-min", "2"]
    assert "c_verify measured (test CPU)" in why and "k = 3 best" in why
    flat_args, flat_why, _ = ngram_size(None, flags, "CPU: test")
    assert flat_args == [] and "no verification cost was measured" in flat_why and "--probe-verify" in flat_why
    assert ngram_size(VerifyCost(((1, 1.0), (2, 3.0), (4, 6.0))), flags, "CPU: test")[2] is False
    assert ngram_size(cpu_curve(), frozenset({"--port"}), "CPU: test")[0] == []  # a build without the flags


def test_tune_plan_skips_k_the_curve_rules_out():
    from specops.methods import Method
    from specops.perf.tune.plan import priced_settings
    from specops.perf.tune.settings import Setting

    settings = [Setting(Method.DRAFT_MODEL, k) for k in (1, 2, 4, 8)] + [Setting(Method.NONE)]
    steep = VerifyCost(((1, 1.0), (2, 1.5), (3, 2.0), (5, 6.0), (9, 20.0)))
    notes: list[str] = []
    kept = priced_settings(settings, settings[3], steep, 0.05, notes)
    assert [s.k for s in kept] == [1, 2, 8, None]  # k 4 cannot pay; k 8 is the profile's own, kept
    assert "k 4 not measured" in notes[0] and "c_verify measured" in notes[0]
    notes.clear()
    assert priced_settings(settings, settings[0], None, None, notes) == settings
    assert notes == [f"verification cost: {FLAT}"]


def test_goodput_predicts_an_unmeasured_k_only_on_a_measured_curve():
    from specops.methods import Method
    from specops.speedup import expected_tokens_per_step
    from specops.watch.goodput import GoodputModel, Option, alpha_from_length
    from specops.watch.surface import Surface

    points = [
        {"method": "none", "k": 0, "concurrency": 1, "tokens_per_s": 10.0},
        {"method": "draft_model", "k": 4, "concurrency": 1, "tokens_per_s": 15.0, "mean_acceptance_length": 3.0},
    ]
    flat = GoodputModel(Surface.from_dict({"points": points}))
    curved = GoodputModel(Surface.from_dict({"points": points, "verify_cost": cpu_curve().to_dict()}))
    k8 = Option(Method.DRAFT_MODEL, 8)
    assert flat.raw(k8, 1) is None  # nothing measured, nothing modelled without a curve
    tau8 = expected_tokens_per_step(alpha_from_length(3.0, 4), 8)
    assert curved.raw(k8, 1) == pytest.approx(10.0 * tau8 / (8 * 0.05 + cpu_curve().at(9)))
    assert curved.raw(Option(Method.DRAFT_MODEL, 4), 1) == 15.0  # measured beats modelled
    assert curved.observe(k8, 1, 12.0) is None and curved.correction == {}  # no correction from a model


# ------------------------------------------------------------------------------------------- speculative steps

#: A probe of real speculative steps (the shape of Gemma 3 270M's on 2 cores): batch 1 and 4, and a draft model's
#: step at 0.3 of the target's alone, 0.5 at batch 4 (a batched target step costs more per step, the draft less).
STEPS_RECORD = {
    **RECORD,
    "probe": "speculative-steps",
    "relative": {"1": 1.0, "5": 2.0, "9": 3.0},
    "batches": {
        "1": {"t_step_ms": 20.0, "relative": {"1": 1.0, "5": 2.0, "9": 3.0}},
        "4": {"t_step_ms": 30.0, "relative": {"1": 1.0, "5": 3.0, "9": 5.0}},
    },
    "drafts": {"/m/draft.gguf": {"path": "/m/draft.gguf", "ratio": {"1": 0.3, "4": 0.5}}},
}


def _cells(level: int, mal: float, k: float) -> list[dict]:
    drafts = 10
    return [
        {"set": "code", "concurrency": level, "mode": mode, "round": 1, "tokens_per_s": 10.0, "errors": 0,
         "output_tokens": int(mal * drafts), "wall_s": 1.0,  # every token from a drafting step
         "draft_tokens": k * drafts if mode == "spec" else None,
         "accepted": (mal - 1) * drafts if mode == "spec" else None,
         "drafts": drafts if mode == "spec" else None,
         **{f"{n}_ms": {"median": 1.0} for n in ("ttft", "itl", "tpot")}}
        for mode in ("spec", "base")
    ]  # fmt: skip


def test_a_step_curve_is_read_at_the_batch_the_engine_decodes():
    from specops.perf.verifycost import curve_of

    assert curve_of(STEPS_RECORD).at(5) == 2.0 and curve_of(STEPS_RECORD, 4).at(5) == 3.0
    assert curve_of(STEPS_RECORD, 2).at(5) == pytest.approx(2.0 + (3.0 - 2.0) / 3)  # between batch 1 and 4
    assert curve_of(STEPS_RECORD, 8).at(9) == 5.0  # past the largest batch measured: the largest
    assert "speculative steps at batch 4" in curve_of(STEPS_RECORD, 4).source
    assert curve_of(RECORD, 4).at(2) == pytest.approx(1.3 / 1.05)  # an older record: its one curve


def test_bench_model_prices_each_cell_at_its_batch_and_the_measured_draft_cost():
    from specops.perf.bench_report import summarize

    def row(method, draft, level, parallel=4, c=None):
        meta = {
            "settings": {"draft_cost_ratio": c},
            "profile": {"method": method, "draft": draft, "parallel": parallel},
            "verify_cost": STEPS_RECORD,
        }
        return summarize(_cells(level, 4.0, 4.0), meta)["speedup"][0]

    # prompt lookup: the lookup is inside the timed steps, c = 0; at four clients the batch-4 curve
    assert row("ngram", None, 1)["model_speedup"] == pytest.approx(4.0 / 2.0)
    assert row("ngram", None, 4)["model_speedup"] == pytest.approx(4.0 / 3.0)
    assert row("ngram", None, 4, parallel=1)["model_speedup"] == pytest.approx(2.0)  # one slot: batch 1
    # a draft model: its own measured step, at the cell's batch
    pair1, pair4 = row("draft_model", "/m/draft.gguf", 1), row("draft_model", "/m/draft.gguf", 4)
    assert pair1["model_speedup"] == pytest.approx(4.0 / (4 * 0.3 + 2.0)) and pair1["model_draft_cost"] == 0.3
    assert pair4["model_speedup"] == pytest.approx(4.0 / (4 * 0.5 + 3.0)) and pair4["model_batch"] == 4
    # a draft it has not measured, and a c given, price as they say
    assert row("draft_model", "/m/other.gguf", 1)["model_draft_cost"] == 0.05
    assert row("draft_model", "/m/draft.gguf", 1, c=0.1)["model_draft_cost"] == 0.1
    report = summarize(
        _cells(1, 4.0, 4.0), {"settings": {}, "profile": {"method": "ngram"}, "verify_cost": STEPS_RECORD}
    )
    assert "speculative steps" in report["model_basis"] and "prompt lookup" in report["model_basis"]


def test_the_model_prices_whole_requests_their_prompt_passes_and_draftless_steps():
    from specops.perf.bench_report import summarize

    # two requests, 42 tokens: 2 from the prompt passes, 5 drafting steps of 4 drafts yielding 4 each (20),
    # 20 steps that found no draft; a prompt pass takes 100 ms = 5 steps of 20 ms (the base's first token)
    cells = [
        {"set": "code", "concurrency": 1, "mode": mode, "round": 1, "tokens_per_s": 10.0, "errors": 0, "ok": 2,
         "output_tokens": 42, "wall_s": 1.0, "draft_tokens": 20 if mode == "spec" else None,
         "accepted": 15 if mode == "spec" else None, "drafts": 5 if mode == "spec" else None,
         "ttft_ms": {"median": 100.0 if mode == "base" else 900.0}, "itl_ms": {"median": 1.0},
         "tpot_ms": {"median": 1.0}}
        for mode in ("spec", "base")
    ]  # fmt: skip

    def model(method, draft=None):
        meta = {"settings": {}, "profile": {"method": method, "draft": draft}, "verify_cost": STEPS_RECORD}
        report = summarize(cells, meta)
        return report["speedup"][0]["model_speedup"], report["model_basis"]

    # without speculation 2 x 5 + 40 steps; with it 2 x 5 + 5 x c_verify(5) = 2 + 20 plain steps
    ngram, basis = model("ngram")
    assert ngram == pytest.approx(50 / (10 + 5 * 2.0 + 20)) and "whole requests" in basis
    # a draft model also reads each prompt (its c of a prompt pass) and pays k x c a drafting step
    assert model("draft_model", "/m/draft.gguf")[0] == pytest.approx(50 / (10 * 1.3 + 5 * (4 * 0.3 + 2.0) + 20))
    # the drafting steps alone would have said 4 / 2.0
    assert ngram < 2.0
    # an engine whose speculative path costs on steps that draft nothing (measured: idle) prices those too,
    # at the cell's batch, interpolated between the batches probed
    idle = {**STEPS_RECORD, "batches": {"1": {**STEPS_RECORD["batches"]["1"], "idle": 1.2},
                                        "4": {**STEPS_RECORD["batches"]["4"], "idle": 1.5}}}  # fmt: skip
    meta = {"settings": {}, "profile": {"method": "ngram", "parallel": 4}, "verify_cost": idle}
    assert summarize(cells, meta)["speedup"][0]["model_speedup"] == pytest.approx(50 / (10 + 5 * 2.0 + 20 * 1.2))
    assert "steps without a draft at the draftless step measured" in summarize(cells, meta)["model_basis"]
    assert "steps without a draft at one step" in basis  # a record probed before the draftless step was
    from specops.perf.verifycost import idle_of

    assert idle_of(idle, 2) == pytest.approx(1.2 + (1.5 - 1.2) / 3) and idle_of(STEPS_RECORD, 4) == 1.0


def test_a_draftless_step_is_timed_apart_from_the_few_steps_that_drafted():
    from specops.perf.verifyprobe import _Decode, _idle_step_ms
    from specops.speedup import VerifyCost

    # 20 steps in 1100 ms, one of them a draft of 4 (rejected) at its speculative step's 100 ms
    assert _idle_step_ms([_Decode(600.0, 10, 4), _Decode(500.0, 10, 0)], 4, None, 100.0) == pytest.approx(1000 / 19)
    assert _idle_step_ms([_Decode(500.0, 10, None)], 4, 0, 100.0) == pytest.approx(50.0)  # counters (vLLM)
    assert _idle_step_ms([_Decode(1000.0, 10, 12)], 4, None, 100.0) is None  # 3 of 10 steps drafted: too many
    with pytest.raises(ValueError, match="draftless step"):
        VerifyCost(((1, 1.0),), idle=0.0)


def test_a_speculative_step_is_the_requests_time_less_their_draftless_steps():
    from specops.errors import SpecopsError
    from specops.perf.verifyprobe import _Decode, _spec_step_ms

    # two requests of 10 steps; drafts of 4: 32 and 30 tokens drafted (the last draft cut short by the end)
    decodes = [_Decode(1000.0, 10, 32), _Decode(1000.0, 10, 30)]
    ms, share = _spec_step_ms(decodes, 4, None, 50.0)
    assert share == pytest.approx(16 / 20) and ms == pytest.approx((2000 - 4 * 50) / 16)
    # an engine that counts drafts only in its counters (vLLM)
    assert _spec_step_ms([_Decode(900.0, 9, None)], 4, 9, 50.0) == (pytest.approx(100.0), 1.0)
    with pytest.raises(SpecopsError, match="drafts of 4 tokens were found in 2 of 10 steps"):
        _spec_step_ms([_Decode(1000.0, 10, 8)], 4, None, 50.0)


def test_a_record_keeps_the_draft_costs_measured_before(tmp_path):
    from specops.perf.verifycost import CurveKey, covers, load_record, save_curve

    key = CurveKey("llamacpp", "b1", "/m/target.gguf (10 bytes)", "CPU: test, 2 cores")
    save_curve(key, STEPS_RECORD, tmp_path)
    later = {**STEPS_RECORD, "drafts": {"/m/d2.gguf": {"path": "/m/d2.gguf", "ratio": {"1": 0.2}}}}
    record, _ = save_curve(key, later, tmp_path)
    assert set(record["drafts"]) == {"/m/draft.gguf", "/m/d2.gguf"} == set(load_record(key, tmp_path)["drafts"])
    from types import SimpleNamespace

    from specops.methods import Method

    def profile(method, draft=None):
        return SimpleNamespace(speculative=SimpleNamespace(method=method, draft=draft))

    assert covers(record, profile(Method.NGRAM)) and covers(record, profile(Method.DRAFT_MODEL, "/m/d2.gguf"))
    assert not covers(record, profile(Method.DRAFT_MODEL, "/m/d3.gguf"))  # its draft not measured: probe again
    assert not covers(RECORD, profile(Method.NGRAM))  # prompt passes only: probe again


def test_the_probe_counts_the_load_of_processes_outside_its_tree():
    import time

    from specops.perf.verifyprobe import _OtherLoad

    assert _OtherLoad().cores is None  # nothing measured yet
    # a process outside our tree (its parent exits at once: init reaps it) spins one core for 2 s, then stops
    spin = "import time; t = time.time() + 2.0\nwhile time.time() < t: pass"
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{spin}" >/dev/null 2>&1 &'], check=True, timeout=10)
    busy = _OtherLoad()
    with busy.during():
        time.sleep(1.0)
    assert busy.cores > 0.3, busy.cores


def test_a_draft_of_a_measured_drafts_shape_costs_what_it_measured(tmp_path):
    """A fine-tuned copy of a measured draft (the same config.json shape, other weights) is priced at the measured
    draft's step, from the shape the record stored or, for an older record, from the measured folder itself; a
    draft of another shape (fewer layers, another dtype) is not."""
    from specops.perf.verifycost import draft_ratio, draft_shape

    config = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "dtype": "bfloat16",
              "_name_or_path": "base"}  # fmt: skip

    def folder(name, **changes):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        return str(path)

    base, tuned = folder("base"), folder("tuned", _name_or_path="tuned", architectures=["Qwen2ForCausalLM"])
    shallow, fp32 = folder("shallow", num_hidden_layers=12), folder("fp32", dtype="float32")
    entry = {"path": base, "k": 4, "ratio": {"1": 0.38, "4": 0.42}}
    stored = {"drafts": {base: {**entry, "shape": draft_shape(base)}}}
    older = {"drafts": {base: entry}}  # no stored shape: read from the measured folder
    for record in (stored, older):
        assert draft_ratio(record, tuned) == 0.38 and draft_ratio(record, tuned, 4) == 0.42
        assert draft_ratio(record, shallow) is None and draft_ratio(record, fp32) is None
    (tmp_path / "base" / "config.json").unlink()  # the measured folder gone: only a stored shape still matches
    assert draft_ratio(stored, tuned) == 0.38 and draft_ratio(older, tuned) is None
    assert draft_shape(str(tmp_path / "gone")) is None and draft_shape("/m/draft.gguf") is None


def test_a_hand_edited_record_reads_only_positive_numbers_per_batch():
    from specops.perf.verifycost import idle_of, step_ms

    record = {"batches": {"1": {"t_step_ms": True, "idle": 1.1}, "4": {"t_step_ms": 300.0, "idle": "x"}, "b": {}}}
    assert step_ms(record, 1) == 300.0  # batch 1's true is no step: the one measured batch stands for all
    assert idle_of(record, 4) == pytest.approx(1.1)
    assert step_ms({"batches": {"1": {"t_step_ms": False}}}) is None and idle_of({"batches": []}) == 1.0
    assert step_ms({"t_step_ms": True}) is None and step_ms({"t_step_ms": 250}) == 250.0  # an older record's one step
