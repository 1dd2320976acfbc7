"""The support matrix without engines: its committed data, the README table, the runner's pure parts.

The measured rows themselves are re-measured and compared by tests/test_matrix_engines.py (marked engines).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specops.devenv import matrix as mx
from specops.errors import SpecopsError

README = Path(__file__).resolve().parent.parent / "README.md"


# ------------------------------------------------------------------------------------------ committed data


def test_committed_data_is_well_formed():
    data = mx.load_data()
    assert data["schema"] == mx.SCHEMA and data["cells"]
    keys = [mx.cell_key(r) for r in data["cells"]]
    assert len(keys) == len(set(keys)), "one record per (engine, version, method, format)"
    known = {c.key for c in mx.CELLS}
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
    assert json.loads(mx.DATA_FILE.read_text()) == {"schema": mx.SCHEMA, "cells": sorted(data["cells"], key=mx._order)}


def test_readme_table_is_in_sync_with_the_data():
    text = README.read_text(encoding="utf-8")
    assert "## Support matrix (measured)" in text
    assert mx.readme_section(text) == mx.markdown_table().strip(), (
        "run: python -m specops.devenv.matrix --readme README.md"
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
    assert "| vLLM | 0.32.0 | `eagle` | EAGLE-1 head | speculating | 0.50 (2.50) | ok |" in table
    assert "engine with `--speculative-config {}`: speculating, acceptance 0.10" in table
    assert "a | b" not in table  # pipes in details never break the table


# ------------------------------------------------------------------------------------------ runner parts


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
    monkeypatch.setattr(mx, "installed_engines", lambda: [mx.InstalledEngine("vllm", "0.32.0", Path("/p"))])
    assert [e.version for e in mx.select_engines(["vllm"], ["0.32.0"])] == ["0.32.0"]
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
    assert len(first) == 5 and len(measured) == 5 and len(lines) == 5
    again = mx.run(engines=["llamacpp"], methods=["ngram"], data_path=path, say=lines.append)
    assert len(measured) == 5 and again == first and "--force to redo" in lines[-1]
    mx.run(engines=["llamacpp"], methods=["ngram"], formats=["cache"], data_path=path, force=True)
    assert len(measured) == 6
    data = mx.load_data(path)
    assert [r["format"] for r in data["cells"]] == [c.format for c in mx.cells_for(["llamacpp"], ["ngram"])]


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
