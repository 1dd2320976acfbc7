"""Knowledge follows the measurement: version gates checked against the support matrix, and measured
refusals turned into located errors by render, validate and resolve."""

from __future__ import annotations

import pytest
from support_cli import run

from specops.backends import measured
from specops.backends.render import render_plan
from specops.backends.versions import VLLM_METHOD_SINCE, Version, vllm_method_problem
from specops.config.profile import load_profile
from specops.errors import ProfileError
from specops.methods import Method
from specops.plugins import get_registry

KNOWN = {m.value for m in Method}


def _method_verdicts(engine: str) -> dict[tuple[str, str], list[measured.Cell]]:
    """The engine-run cells of the shipped matrix per (method, version), for the methods specops renders."""
    out: dict[tuple[str, str], list[measured.Cell]] = {}
    for c in measured.cells():
        if c.engine == engine and c.method in KNOWN and c.outcome not in ("not-measured", "rendered-refused"):
            out.setdefault((c.method, c.version), []).append(c)
    return out


def test_the_shipped_matrix_measured_vllm_032():
    """The gates below are only as good as the data: the installed engines' rows must be in it."""
    versions = {c.version for c in measured.cells() if c.engine == "vllm"}
    assert "0.32.0" in versions
    assert {c.method for c in measured.cells() if c.engine == "vllm" and c.version == "0.32.0"} >= set(
        VLLM_METHOD_SINCE
    ) - {"dspark"}


def test_vllm_version_gates_agree_with_the_matrix():
    """A gate read in vLLM's source must not claim support where the engine's config refused the method on
    every draft format (a refusal that holds on every platform), nor refuse a method the engine was seen
    speculating with. Versions whose engine did not even serve the model without speculation say nothing."""
    wrong = []
    for (method, version), here in sorted(_method_verdicts("vllm").items()):
        if not measured.baseline_served("vllm", version):
            continue
        gate = vllm_method_problem(method, Version(version))
        if any(c.speculating for c in here) and gate:
            wrong.append(f"{method} on {version}: the engine speculated, the gate says: {gate}")
        refused = [c for c in here if c.refused_for(cpu=False)]
        if refused and len(refused) == len(here) and not gate:
            lines = "; ".join(f"{c.format}: {c.detail[:300]}" for c in refused)
            wrong.append(f"{method} on {version}: the gate allows it, the engine's config refused it ({lines})")
    assert wrong == []


def test_specops_renders_every_method_the_engine_was_seen_running_by_hand():
    """Where specops refused to render a cell and the runner's hand-written flags then made the engine
    speculate, specops refused what the engine runs: the method must be one specops knows and allows there."""
    registry = get_registry()
    bad = []
    for c in measured.cells():
        if c.outcome != "rendered-refused" or c.by_hand != "speculating":
            continue
        if c.method not in KNOWN:
            bad.append(f"{c.engine} {c.version}: specops has no method {c.method!r}")
            continue
        problem = registry.backend(c.engine).method_problem(Method(c.method), c.version)
        if problem:
            bad.append(f"{c.engine} {c.version} {c.method}: {problem}")
    assert bad == []


# ------------------------------------------------------------------------- refusals become located errors


def _fake(monkeypatch, *rows: measured.Cell) -> None:
    monkeypatch.setattr(measured, "cells", lambda: rows)


def _cell(version, outcome, level=None, detail="", method="eagle3", fmt="EAGLE-3 head"):
    return measured.Cell(
        "vllm", version, method, fmt, outcome, detail, level, 0.5 if outcome == "speculating" else None
    )


PROFILE = (
    "name: m\nbackend: vllm\nengine: {version: '%s'}\nmodel: {id: a/b}\nspeculative: {method: eagle3, draft: c/d}\n"
    "gpus: {devices: %s}\n"
)


def _render(tmp_path, version: str, devices: str = "[]"):
    path = tmp_path / "p.yaml"
    path.write_text(PROFILE % (version, devices), encoding="utf-8")
    return render_plan(load_profile(path, env={}), get_registry(), probe=False)


def test_a_measured_refusal_is_refused_with_the_engine_line_and_the_nearest_working_version(tmp_path, monkeypatch):
    _fake(
        monkeypatch,
        _cell("0.31.0", "engine-refused", "runner", "ValueError: Unknown speculative decoding method: eagle3"),
        _cell("0.28.0", "speculating"),
        _cell("0.32.0", "speculating"),
    )
    with pytest.raises(ProfileError) as exc:
        _render(tmp_path, "0.31.0")
    text = str(exc.value)
    assert "p.yaml:5:" in text and "speculative.method" in text  # located at the method
    assert "Unknown speculative decoding method: eagle3" in text and "runner level" in text
    assert "measured running on vLLM 0.32.0" in text  # nearest: 0.32 is one minor away, 0.28 three

    ok = _render(tmp_path, "0.32.0")
    assert any("measured speculating" in n for n in ok.notes)
    # measured on a CPU build: a runner-level refusal is not enforced on a GPU profile, only reported
    gpu = _render(tmp_path, "0.31.0", devices="[0]")
    assert any("CPU build refused it (runner level)" in n and "not enforced" in n for n in gpu.notes)


def test_a_config_level_refusal_holds_for_every_profile(tmp_path, monkeypatch):
    _fake(
        monkeypatch,
        _cell("0.31.0", "engine-refused", "config", "Value error, unknown method"),
        _cell("0.32.0", "speculating"),
    )
    with pytest.raises(ProfileError, match="config level"):
        _render(tmp_path, "0.31.0", devices="[0]")


def test_no_refusal_when_the_engine_did_not_serve_at_all(tmp_path, monkeypatch):
    """If the version could not even serve the model without speculation (a broken install, a tokenizer it
    cannot load), its refusals are not about the method."""
    _fake(
        monkeypatch,
        _cell("0.15.1", "engine-refused", None, "RuntimeError: Failed to load the tokenizer"),
        _cell("0.15.1", "engine-refused", None, "RuntimeError: Failed to load the tokenizer", method="none", fmt="x"),
    )
    assert _render(tmp_path, "0.15.1").argv


def test_a_cpu_build_failure_is_reported_not_enforced(tmp_path, monkeypatch):
    _fake(monkeypatch, _cell("0.24.0", "engine-refused", "cpu-build", "unexpected keyword argument 'USE_FP64_GUMBEL'"))
    plan = _render(tmp_path, "0.24.0", devices="[0]")
    assert any("CPU build refused it" in n and "USE_FP64_GUMBEL" in n and "inferred" in n for n in plan.notes)


def test_one_working_format_is_enough(tmp_path, monkeypatch):
    """A method refused with one draft format but running with another is not refused as a method."""
    _fake(
        monkeypatch,
        _cell("0.30.0", "engine-refused", "config", "weights not initialized", fmt="original layout"),
        _cell("0.30.0", "speculating", fmt="speculators layout"),
    )
    assert _render(tmp_path, "0.30.0").argv


def test_without_data_support_is_inferred(tmp_path, monkeypatch):
    _fake(monkeypatch)
    plan = _render(tmp_path, "0.30.0")
    assert any("inferred from the engine's source, not measured" in n for n in plan.notes)


def test_validate_refuses_a_pinned_version_the_gates_refuse(tmp_path):
    """Without rendering, validate applies the pinned version's gates (MLP speculators: V0 only)."""
    path = tmp_path / "mlp.yaml"
    path.write_text(
        "name: m\nbackend: vllm\nengine: {version: 0.32.0}\nmodel: {id: a/b}\n"
        "speculative: {method: mlp_speculator, draft: ibm-granite/granite-7b-instruct-accelerator}\n",
        encoding="utf-8",
    )
    res = run("validate", str(path))
    assert res.code == 1
    assert "mlp.yaml:5:" in res.stdout and "cannot run method mlp_speculator" in res.stdout
    path.write_text(path.read_text().replace("0.32.0", "0.9.2"), encoding="utf-8")
    res = run("validate", "--format", "json", str(path))
    assert res.code == 0, res.stdout
    # no version was measured running MLP speculators: the shipped support matrix makes this one inferred
    assert '"support": "inferred"' in res.stdout, res.stdout
    assert "mlp_speculator on vLLM 0.9.2: inferred from the engine's source, not measured" in res.stdout


def test_a_probed_llama_server_is_judged_by_its_flags_not_its_build_number(tmp_path):
    """A llama-server built from source reports "build 1"; read as a release build that would be the legacy
    flag generation, which has no n-gram drafter. The probed binary's --help decides instead."""
    from specops.backends.base import EngineInfo

    probed = EngineInfo(
        "llamacpp",
        "0.5.0-dev (build 1, commit 0c1e570)",
        "llama-server --version",
        ("llama-server",),
        flags=frozenset({"--spec-type", "--spec-draft-n-max", "-md"}),
        flag_values={"--spec-type": ("none", "draft-simple", "ngram-mod")},
    )
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: m\nbackend: llamacpp\nmodel: {id: /m/x.gguf}\nspeculative: {method: ngram}\n", encoding="utf-8"
    )
    plan = render_plan(load_profile(path, env={}), get_registry(), engine=probed)
    assert "ngram-mod" in plan.argv
    assert get_registry().backend("llamacpp").method_problem(Method.NGRAM, "b1") is not None  # a pinned b1 is legacy
