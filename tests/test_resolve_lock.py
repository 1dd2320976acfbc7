"""Lock files: round trip, determinism, pins applied without the Hub, staleness, offline use."""

from __future__ import annotations

import json

import pytest
from fakehub import EAGLE3_LLAMA31_8B, fake_hub, seed_llama31  # noqa: F401

from specops.config.profile import load_profile
from specops.errors import SpecopsError
from specops.methods import Method
from specops.resolve import check_loaded, lock_path, lock_profile, resolve_profile

pytestmark = pytest.mark.timeout(120)

AUTO = """name: llama-auto
backend: vllm
model:
  id: meta-llama/Llama-3.1-8B-Instruct
  max_model_len: {ctx}
speculative:
  method: auto
fallback:
  window: {window}
"""


def write(tmp_path, ctx=2048, window="60s"):
    path = tmp_path / "llama-auto.yaml"
    path.write_text(AUTO.format(ctx=ctx, window=window))
    return path


def test_lock_round_trip_pins_everything_and_needs_no_hub(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = write(tmp_path)
    lock_file, res = lock_profile(load_profile(path))
    assert lock_file == tmp_path / "llama-auto.lock.json" == lock_path(path)
    text = lock_file.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"  # sorted, stable
    spec = data["speculative"]
    draft = res.choice.draft
    assert spec == {"method": "eagle3", "draft": draft, "draft_revision": fake_hub.repos[draft].sha, "draft_file": None}
    assert data["target"] == {
        "id": "meta-llama/Llama-3.1-8B-Instruct",
        "file": None,
        "revision": fake_hub.repos["meta-llama/Llama-3.1-8B-Instruct"].sha,
    }
    assert data["choice"]["draft"] == draft and data["choice"]["verdict"] == "ok"
    alts = {(a["method"], a["draft"]): a["verdict"] for a in data["alternatives"]}
    assert alts[("ngram", None)] == "ok" and len(alts) >= 4
    assert "downloads" not in text and fake_hub.url not in text  # nothing that drifts by itself

    # the same Hub state gives the same bytes
    lock_profile(load_profile(path))
    assert lock_file.read_text() == text

    # render/up path: the lock is applied, not a single Hub request
    n = len(fake_hub.requests)
    used = resolve_profile(load_profile(path))
    assert len(fake_hub.requests) == n
    assert used.from_lock and used.notes[0].startswith("using llama-auto.lock.json: eagle3 " + draft)
    p = used.profile
    assert (p.speculative.method, p.speculative.draft) == (Method.EAGLE3, draft)
    assert p.speculative.draft_revision == fake_hub.repos[draft].sha
    assert p.model.revision == fake_hub.repos["meta-llama/Llama-3.1-8B-Instruct"].sha
    assert used.choice is not None and used.choice.draft == draft


def test_lock_keeps_the_pinned_commit_when_the_hub_moves_on(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = write(tmp_path)
    _, res = lock_profile(load_profile(path))
    pinned = res.profile.speculative.draft_revision
    new_sha = fake_hub.update_file(res.choice.draft, "README.md", "retrained!")
    assert new_sha != pinned
    again = resolve_profile(load_profile(path))
    assert again.profile.speculative.draft_revision == pinned  # reproducible deploy
    # validate --resolve checks the pinned commit, not the new head
    n = len(fake_hub.requests)
    assert [f for f in check_loaded(load_profile(path)) if f.severity == "error"] == []
    asked = [p for _, p in fake_hub.requests[n:]]
    assert any(p.startswith(f"/api/models/{res.choice.draft}/revision/{pinned}?") for p in asked)
    assert not any(new_sha in p for p in asked)
    # a pin to a commit that does not exist is refused with one line
    lock = json.loads(lock_path(path).read_text())
    lock["speculative"]["draft_revision"] = "0" * 40
    lock_path(path).write_text(json.dumps(lock))
    assert any("revision not found" in f.message and f.severity == "error" for f in check_loaded(load_profile(path)))


def test_stale_lock_is_reported_and_resolved_afresh(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = write(tmp_path)
    lock_profile(load_profile(path))
    # a change outside the resolution inputs does not stale the lock
    write(tmp_path, window="90s")
    assert resolve_profile(load_profile(path)).from_lock
    # a change of the served context does
    write(tmp_path, ctx=8192)
    n = len(fake_hub.requests)
    res = resolve_profile(load_profile(path))
    assert not res.from_lock and len(fake_hub.requests) > n
    assert res.notes[0].startswith("lock is stale: the profile changed since it was locked (model.max_model_len)")
    stale = [f for f in check_loaded(load_profile(path)) if f.check == "lock"]
    assert stale and stale[0].severity == "warning"


def test_offline_render_uses_the_lock(fake_hub, tmp_path, monkeypatch):
    seed_llama31(fake_hub)
    path = write(tmp_path)
    lock_profile(load_profile(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-cache"))
    n = len(fake_hub.requests)
    res = resolve_profile(load_profile(path), offline=True)
    assert res.from_lock and res.profile.speculative.method is Method.EAGLE3
    assert len(fake_hub.requests) == n


def test_lock_of_an_explicit_draft_pins_its_commit(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = tmp_path / "explicit.yaml"
    path.write_text(
        "name: x\nbackend: vllm\nmodel: {id: meta-llama/Llama-3.1-8B-Instruct, max_model_len: 2048}\n"
        "speculative: {method: eagle3, draft: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B}\n"
    )
    lock_file, _ = lock_profile(load_profile(path))
    data = json.loads(lock_file.read_text())
    assert data["speculative"]["draft_revision"] == fake_hub.repos["yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"].sha
    assert [a["draft"] for a in data["alternatives"]] == ["yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"]


def test_lock_refuses_a_profile_whose_draft_does_not_fit(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    fake_hub.add_model("x/head-for-another-model", {"config.json": {**EAGLE3_LLAMA31_8B, "hidden_size": 8192}})
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: x\nbackend: vllm\nmodel: {id: meta-llama/Llama-3.1-8B-Instruct}\n"
        "speculative: {method: eagle3, draft: x/head-for-another-model}\n"
    )
    with pytest.raises(SpecopsError, match="hidden_size 8192 != target hidden_size 4096"):
        lock_profile(load_profile(path))
    assert not lock_path(path).exists()


def test_a_broken_lock_file_is_a_clear_error(fake_hub, tmp_path):
    path = write(tmp_path)
    lock_path(path).write_text("{not json")
    with pytest.raises(SpecopsError, match="not a valid lock file"):
        resolve_profile(load_profile(path))
    lock_path(path).write_text('{"lock_version": 99}')
    with pytest.raises(SpecopsError, match="run `specops lock` again"):
        resolve_profile(load_profile(path))


def test_relocking_keeps_a_tune_record_only_while_it_describes_the_locked_draft(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = write(tmp_path)
    lock_file, _ = lock_profile(load_profile(path))
    data = json.loads(lock_file.read_text())
    data["tune"] = {"date": "2026-11-30", "chosen": {"k": 3}}
    lock_file.write_text(json.dumps(data))
    lock_profile(load_profile(path))  # same method and draft: the record stays
    assert json.loads(lock_file.read_text())["tune"]["chosen"] == {"k": 3}
    data = json.loads(lock_file.read_text())
    data["speculative"]["draft"] = "someone/else"  # the record was measured on another draft
    lock_file.write_text(json.dumps(data))
    lock_profile(load_profile(path))
    assert "tune" not in json.loads(lock_file.read_text())
