"""The draft catalog (specops/data/catalog.yaml) against its own rules and the measured support matrix, and what
`specops resolve` prints about a catalog pair: its source, and whether its draft format was measured speculating
(on which engine version) or is documented only. Offline throughout: no Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specops.backends.measured import Cell
from specops.errors import SpecopsError
from specops.methods import Method
from specops.resolve import resolve, synthetic_profile
from specops.resolve.catalog import (
    FORMATS,
    KNOWN,
    format_evidence,
    load_catalog,
    measured_speculating,
    measurements,
    parse_catalog,
)
from specops.resolve.resolver import catalog_findings

MATRIX = Path(__file__).resolve().parent.parent / "specops" / "data" / "support_matrix.json"
SPECOPS = Path(sys.executable).with_name("specops")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """An empty HF cache, no Hub, only the shipped catalog."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("SPECOPS_CATALOG", raising=False)
    return tmp_path


def matrix_cells() -> list[dict]:
    return json.loads(MATRIX.read_text(encoding="utf-8"))["cells"]


def specops(*args) -> subprocess.CompletedProcess:
    cmd = [str(SPECOPS)] if SPECOPS.exists() else [sys.executable, "-m", "specops.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=dict(os.environ))


# --------------------------------------------------------------------------------------- the shipped data


def test_every_entry_has_a_source_a_format_and_says_how_it_is_known(offline):
    cat = load_catalog()
    missing = [
        f"{e.target} -> {e.draft}"
        for e in cat.entries
        if not e.source.startswith("https://") or e.format not in FORMATS or e.known not in KNOWN
    ]
    assert not missing, f"entries without an https source, a known draft format or a `known`: {missing}"
    for e in cat.entries:
        assert FORMATS[e.format].method is e.method, (e.draft, e.format)


def test_known_follows_the_support_matrix(offline):
    """`known: tiny-format` exactly where the matrix measured the entry's format speculating on an engine the
    entry lists; a new matrix row that changes that fails here, naming the entries to update."""
    cat = load_catalog()
    wrong = [
        f"{e.draft} for {e.target}: known {e.known}, but the matrix says "
        + (", ".join(f"{m.engine} {m.version}" for m in measured_speculating(e)) or "no speculating cell")
        for e in cat.entries
        if (e.known == "tiny-format") != bool(measured_speculating(e))
    ]
    assert not wrong, "\n".join(wrong)


def test_each_measured_format_names_cells_the_matrix_has():
    """A format's matrix cells are found by the cell's own format text: renaming it in the matrix must not turn
    measured formats into 'documented only' without a word."""
    cells = matrix_cells()
    engines = {c["engine"] for c in cells}
    for fmt in FORMATS.values():
        for engine, prefix in fmt.cells:
            if engine not in engines:
                continue
            hits = [
                c
                for c in cells
                if c["engine"] == engine
                and c["method"] == fmt.method.value
                and c["format"].lower().startswith(prefix.lower())
            ]
            assert hits, f"format {fmt.name}: no {engine} cell for method {fmt.method} starts with {prefix!r}"
            assert len(measurements(fmt)) >= len(hits)


def test_the_draft_formats_are_the_catalogs_formats_section():
    """FORMATS is data (specops/data/catalog.yaml ``formats:``), read in file order; a malformed item is a
    located error, and importing the catalog module parses no YAML."""
    import yaml

    from specops.resolve.catalog import _draft_formats

    data = yaml.safe_load((MATRIX.parent / "catalog.yaml").read_text(encoding="utf-8"))
    assert list(FORMATS) == list(data["formats"])
    assert FORMATS["gguf-draft"].cells == (("llamacpp", "GGUF draft model"),)
    assert FORMATS["medusa-original"].caveat.startswith("random weights cannot show what vLLM loads: before 0.25")
    assert FORMATS["dspark"].cells == () and FORMATS["dspark"].method is Method.DSPARK
    for bad, message in (
        ({"x": {"method": "nope", "what": "y"}}, "formats.x: unknown method 'nope'"),
        ({"x": {"method": "eagle"}}, "formats.x: a draft format needs a method and what it is"),
        ({"x": {"method": "eagle", "what": "y", "cell": {}}}, "formats.x: unknown format keys cell"),
        ({"x": {"method": "eagle", "what": "y", "cells": ["vllm"]}}, "formats.x: cells must map an engine"),
    ):
        with pytest.raises(SpecopsError, match=message):
            _draft_formats(bad, "t.yaml")
    code = "import specops.resolve.catalog as c; print(c._shipped_data.cache_info().currsize)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr  # not read on import


def test_no_published_pair_is_one_the_sources_do_not_show(offline):
    cat = load_catalog()
    drafts = {e.draft for e in cat.entries}
    # the EAGLE project never published an EAGLE-3 head for Llama-3.1-70B; IBM's granite-7b accelerator is
    # ibm-granite/granite-7b-instruct-accelerator
    assert "yuhuili/EAGLE3-LLaMA3.1-Instruct-70B" not in drafts
    assert "ibm-ai-platform/granite-7b-lab-accelerator" not in drafts
    for_70b = [e for e in cat.for_target("meta-llama/Llama-3.1-70B-Instruct") if e.method is Method.EAGLE3]
    assert for_70b == []


def test_the_catalog_does_not_offer_original_layout_medusa_heads_to_vllm(offline):
    cat = load_catalog()
    medusa = [e for e in cat.entries if e.method is Method.MEDUSA]
    assert {e.format for e in medusa} >= {"medusa-vllm", "medusa-original"}
    for e in medusa:
        loads_in_vllm = "vllm" in e.backends
        assert loads_in_vllm == (e.format == "medusa-vllm"), (e.draft, e.format, e.backends)


def test_yuhuili_eagle3_heads_say_their_method_must_be_stated(offline):
    heads = [e for e in load_catalog().entries if e.draft.startswith("yuhuili/EAGLE3-")]
    assert heads
    for e in heads:
        assert any("LlamaForCausalLMEagle3" in c for c in e.caveats), e.draft


# --------------------------------------------------------------------------------------- parsing the fields


@pytest.mark.parametrize(
    "extra,msg",
    [
        ("format: eagle9", "unknown draft format 'eagle9'"),
        ("format: medusa-vllm", "format medusa-vllm is a medusa draft, not eagle3"),
        ("known: rumoured", "known must be one of documented, tiny-format"),
        ("min_version: {vllm: soon}", "min_version.vllm: not a version"),
        ("min_version: 0.19.0", "min_version must map an engine to a version"),
    ],
)
def test_bad_new_fields_are_reported(extra, msg):
    text = f"entries:\n  - {{target: a/b, draft: c/d, method: eagle3, source: s, {extra}}}\n"
    with pytest.raises(SpecopsError) as exc:
        parse_catalog(text, "mine.yaml", ("vllm",))
    assert msg in str(exc.value)


def test_empty_backends_stay_empty_and_unset_backends_take_the_default():
    cat = parse_catalog(
        "default_backends: [vllm]\nentries:\n"
        "  - {target: a/b, draft: c/d, method: medusa, format: medusa-original, backends: [], source: s}\n"
        "  - {target: a/b, draft: c/e, method: medusa, format: medusa-vllm, source: s}\n",
        "mine.yaml",
    )
    assert [e.backends for e in cat.entries] == [(), ("vllm",)]


# --------------------------------------------------------------------------------------- evidence lines


def _entry(fmt: str, backends: str = "[vllm]"):
    method = FORMATS[fmt].method.value
    draft = "self" if method == "mtp" else "c/d"
    text = f"entries:\n  - {{target: a/b, draft: {draft}, method: {method}, format: {fmt}, backends: {backends}, source: s}}\n"
    return parse_catalog(text, "t.yaml").entries[0]


def _cell(method: str, fmt_text: str, outcome: str, version: str = "9.9.9", engine: str = "vllm") -> Cell:
    return Cell(engine=engine, version=version, method=method, format=fmt_text, outcome=outcome, detail="")


def test_evidence_names_the_engine_version_a_format_speculated_on():
    e = _entry("eagle3-speculators")
    cells = (
        _cell("eagle3", "EAGLE-3 head, speculators layout", "speculating", "0.40.0"),
        _cell("eagle3", "EAGLE-3 head, speculators layout", "engine-refused", "0.8.5"),
        _cell("eagle3", "EAGLE-3 head, original layout (d2t)", "speculating", "0.41.0"),  # another format
    )
    line = format_evidence(e, cells)
    assert line.startswith("format eagle3-speculators measured speculating on vLLM 0.40.0 (tiny checkpoint")
    assert line.endswith("; not on vLLM 0.8.5: engine-refused")
    assert "0.41.0" not in line


def test_evidence_for_a_refused_format_and_for_an_unmeasured_one():
    refused = format_evidence(_entry("mlp-speculator"), (_cell("mlp_speculator", "MLP speculator", "engine-refused"),))
    assert refused.startswith("documented only; format mlp-speculator measured not speculating")
    assert "vLLM 9.9.9: engine-refused" in refused
    assert format_evidence(_entry("mtp"), ()).startswith("documented only (format mtp not measured")
    # specops refusing to render a format is not a measurement of the engine
    unrendered = (_cell("mlp_speculator", "MLP speculator", "rendered-refused"),)
    assert format_evidence(_entry("mlp-speculator"), unrendered).startswith(
        "documented only (format mlp-speculator not"
    )
    # the matrix measured a llama.cpp cell: it says nothing about an entry listed for vLLM only
    gguf = format_evidence(_entry("draft-model"), (_cell("draft_model", "HF draft model", "speculating", engine="x"),))
    assert gguf.startswith("documented only")


def test_evidence_for_a_format_no_engine_loads_as_published_keeps_its_caveat():
    line = format_evidence(
        _entry("medusa-original", "[]"), (_cell("medusa", "Medusa, FasterDecoding layout", "speculating"),)
    )
    assert line.startswith("documented only: no engine specops renders for loads it as published")
    assert "medusa_fc_bias" in line


# --------------------------------------------------------------------------------------- min_version


def test_min_version_refuses_an_older_pinned_engine_and_warns_when_none_is_pinned(offline):
    cat = load_catalog()
    needs = [e for e in cat.entries if e.min_version_for("vllm")]
    assert needs, "no entry carries a vLLM min_version"
    e = needs[0]
    floor = e.min_version_for("vllm")
    major, minor, *_ = (int(x) for x in floor.split("."))
    older = f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0"

    def findings(version):
        return catalog_findings(e, synthetic_profile(e.target, method=e.method.value, engine_version=version))

    too_old = findings(older)
    assert [f.severity for f in too_old] == ["error"]
    assert f">= {floor}" in too_old[0].message and older in too_old[0].message and e.source in too_old[0].message
    assert findings(floor) == []
    unpinned = findings(None)
    assert [f.severity for f in unpinned] == ["warning"] and "no engine.version is pinned" in unpinned[0].message


def test_resolve_refuses_the_catalog_head_below_its_min_version(offline):
    e = next(e for e in load_catalog().entries if e.min_version_for("vllm"))
    res = resolve(synthetic_profile(e.target, method=e.method.value, engine_version="0.10.2"), offline=True)
    cand = next(c for c in res.candidates if c.draft == e.draft)
    assert cand.verdict == "refused"
    assert any(f.check == "catalog" and e.min_version_for("vllm") in f.message for f in cand.findings)


# --------------------------------------------------------------------------------------- `specops resolve`


def test_resolve_prints_each_catalog_pairs_source_and_measured_format(offline):
    target = "meta-llama/Llama-3.1-8B-Instruct"
    r = specops("resolve", target, "--method", "eagle3", "--offline")
    out = r.stdout
    cat = load_catalog()
    entries = [e for e in cat.for_target(target) if e.method is Method.EAGLE3]
    assert entries
    speculating = {c["version"] for c in matrix_cells() if c["method"] == "eagle3" and c["outcome"] == "speculating"}
    for e in entries:
        assert e.draft in out
        assert f"source   {e.source}" in out
    known = [ln.split("known", 1)[1].strip() for ln in out.splitlines() if ln.strip().startswith("known ")]
    assert len(known) == len(entries)
    for line in known:
        version = line.split("measured speculating on vLLM ", 1)[1].split()[0].rstrip(",")
        assert version in speculating, line


def test_resolve_llama31_70b_eagle3_offers_only_heads_that_exist(offline):
    target = "meta-llama/Llama-3.1-70B-Instruct"
    r = specops("resolve", target, "--method", "eagle3", "--offline")
    assert r.returncode == 1, r.stdout  # no EAGLE-3 head was published for this model
    assert "EAGLE3-LLaMA3.1-Instruct-70B" not in r.stdout
    rows = [ln for ln in r.stdout.splitlines() if ln[:3].strip().rstrip("*").strip().isdigit()]
    assert rows == []
    # the Llama-3.3-70B heads (same tokenizer and shape) are named in a note, not offered
    sibling = {
        e.draft for e in load_catalog().for_target("meta-llama/Llama-3.3-70B-Instruct") if e.method.value == "eagle3"
    }
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("note") and "not this one" in ln]
    assert sibling and {d for d in sibling if any(d in n for n in notes)} == sibling


def test_resolve_json_carries_the_catalog_fields(offline):
    r = specops("resolve", "Qwen/Qwen3-8B", "--method", "eagle3", "--offline", "--json")
    data = json.loads(r.stdout)
    cat = load_catalog()
    with_catalog = [c for c in data["candidates"] if "catalog" in c]
    assert with_catalog
    for c in with_catalog:
        e = cat.pair("Qwen/Qwen3-8B", c["draft"], Method.EAGLE3)
        assert c["catalog"]["source"] == e.source and c["catalog"]["format"] == e.format
        assert c["catalog"]["known"] == e.known and c["catalog"]["evidence"] == format_evidence(e)
