"""``fallback.goodput.surface``: a relative path is the profile's neighbour, whatever folder specops runs in, and a
missing file is an error located at the field."""

from __future__ import annotations

import json

import pytest
from support_goodput import Events

from specops.config.profile import load_profile
from specops.errors import ProfileError
from specops.perf.advise import find_surface
from specops.watch.decide import FallbackDecider
from specops.watch.policy import Policy

SURFACE = {
    "points": [
        {"method": "none", "k": 0, "concurrency": 1, "tokens_per_s": 30.0},
        {"method": "draft_model", "k": 4, "concurrency": 1, "tokens_per_s": 80.0, "mean_acceptance_length": 5.0},
    ]
}
HEAD = (
    "name: g\nbackend: llamacpp\nmodel: {id: /m/t.gguf}\n"
    "speculative: {method: draft_model, draft: /m/d.gguf, num_speculative_tokens: 4}\n"
)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """specops runs in another folder than the profile's."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def _write(folder, name, text):
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / name
    f.write_text(text, encoding="utf-8")
    return f


def test_a_relative_surface_is_read_beside_the_profile(tmp_path, elsewhere):
    deploy = tmp_path / "deploy"
    _write(deploy, "p.tune.json", json.dumps({"surface": SURFACE}))
    prof = _write(deploy, "p.yaml", HEAD + "fallback:\n  mode: goodput\n  goodput: {surface: p.tune.json}\n")
    loaded = load_profile(prof, env={})
    policy = Policy.from_profile(loaded)
    assert policy.goodput is not None and policy.goodput.model.surface is not None
    assert policy.goodput.model.surface.levels() == [1]
    decider = FallbackDecider.from_profile(loaded, events=Events(), say=print)
    assert decider.policy.goodput.model.surface.tokens_per_s(decider.policy.steps[0].method, 4, 1) == 80.0
    # advise finds it the same way, from the profile's path
    assert find_surface(str(prof), loaded.profile).levels() == [1]
    # a file of the same name in the current folder is not the one read
    _write(elsewhere, "p.tune.json", "not json")
    assert Policy.from_profile(loaded).goodput.model.surface.levels() == [1]


def test_a_missing_surface_is_located_at_the_field(tmp_path, elsewhere):
    deploy = tmp_path / "deploy"
    prof = _write(deploy, "p.yaml", HEAD + "fallback:\n  mode: goodput\n  goodput:\n    surface: gone.tune.json\n")
    loaded = load_profile(prof, env={})
    with pytest.raises(ProfileError) as info:
        Policy.from_profile(loaded)
    (problem,) = info.value.problems
    assert problem.field == "fallback.goodput.surface"
    assert (problem.location.line, problem.location.column) == (8, 14)
    assert problem.location.file.endswith("p.yaml")
    assert "gone.tune.json" in problem.message and f"relative to {deploy}" in problem.message
    # a record without a surface is located too
    _write(deploy, "gone.tune.json", json.dumps({"tune_version": 1}))
    with pytest.raises(ProfileError, match="holds no measured surface"):
        Policy.from_profile(loaded)


def test_a_surface_set_in_a_base_profile_is_relative_to_that_file(tmp_path, elsewhere):
    base_dir = tmp_path / "base"
    _write(base_dir, "surface.tune.json", json.dumps({"surface": SURFACE}))
    _write(base_dir, "base.yaml", "fallback:\n  mode: goodput\n  goodput: {surface: surface.tune.json}\n")
    prof = _write(tmp_path, "p.yaml", "extends: base/base.yaml\n" + HEAD)
    loaded = load_profile(prof, env={})
    assert loaded.profile.fallback.goodput.surface == "surface.tune.json"
    assert Policy.from_profile(loaded).goodput.model.surface.levels() == [1]


def test_watch_reads_a_relative_surface_beside_the_profile(tmp_path, elsewhere):
    """`specops watch PROFILE` builds its policy as `specops up` does: the surface beside the profile, located."""
    from support_cli import run

    deploy = tmp_path / "deploy"
    prof = _write(deploy, "p.yaml", HEAD + "fallback:\n  mode: goodput\n  goodput:\n    surface: gone.tune.json\n")
    res = run("watch", str(prof), "--once")
    assert res.code == 1, res.stdout + res.stderr
    assert f"{prof}:8:14" in res.stderr and f"relative to {deploy}" in res.stderr, res.stderr
