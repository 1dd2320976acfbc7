"""A hostile Hub: unsafe file names, malformed / deep / huge config.json files, lying sizes, a tampered lock.

Everything runs the real huggingface_hub client against the fake Hub on 127.0.0.1 (tests/fakehub.py).
A bad candidate is a refused candidate with a reason, a bad target a one-line error; never a traceback,
never a file name with ``..`` picked, pinned or joined under the HF cache, never a 60 MB download.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import (  # noqa: F401
    BIG_CONFIG_BYTES,
    LLAMA31_8B,
    QWEN25_05B,
    QWEN25_7B,
    UNSAFE_GGUF_NAMES,
    fake_hub,
    seed_hostile,
    seed_llama31,
    seed_unsafe_gguf,
)

from specops.config.profile import load_profile
from specops.errors import ProfileError, SpecopsError
from specops.reponames import (
    UnsafeName,
    check_repo_file,
    is_commit_sha,
    is_repo_id,
    is_safe_repo_file,
    revision_problem,
)
from specops.resolve import lock_profile, resolve, resolve_profile, synthetic_profile
from specops.resolve.detect import config_problems, declared_targets, detect_method, facts_from_config
from specops.resolve.hub import MAX_JSON_BYTES, FileTooLarge, Hub, _capped_progress

pytestmark = pytest.mark.timeout(180)

TARGET = "meta-llama/Llama-3.1-8B-Instruct"
SPECOPS = Path(sys.executable).with_name("specops")


def specops(*args, cwd=None) -> subprocess.CompletedProcess:
    cmd = [str(SPECOPS)] if SPECOPS.exists() else [sys.executable, "-m", "specops.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=150, env=dict(os.environ), cwd=cwd)


def by_draft(res, draft):
    return next(c for c in res.candidates if c.draft == draft)


# ------------------------------------------------------------------------------------------ the validator


@pytest.mark.parametrize("name", UNSAFE_GGUF_NAMES + ("", "C:x.gguf", "a/../b.gguf", "a/", "x\n.gguf", "a" * 2000))
def test_unsafe_repo_file_names_are_rejected(name):
    assert not is_safe_repo_file(name)
    with pytest.raises(UnsafeName) as exc:
        check_repo_file(name)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 300


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "qwen2.5-0.5b-instruct-q4_k_m.gguf",
        "Q4_K_M/model-00001-of-00002.gguf",
        "a..b.gguf",
        ".gitattributes",
        "sub/dir/x.safetensors",
    ],
)
def test_ordinary_repo_file_names_pass(name):
    assert check_repo_file(name) == name


def test_repo_ids_revisions_and_shas():
    assert is_repo_id("meta-llama/Llama-3.1-8B-Instruct") and is_repo_id("gpt2")
    for bad in ("a/../b", "../x", "a/b/c", "a--b/c", "/abs", "a\\b", "", 5, "x/" + "a" * 97):
        assert not is_repo_id(bad)
    assert revision_problem("main") is None and revision_problem("refs/pr/1") is None
    for bad in ("../../x", "/etc", "a\x00", "--upload-pack=x", ""):
        assert revision_problem(bad) is not None
    assert is_commit_sha("a" * 40) and not is_commit_sha("../" + "a" * 37) and not is_commit_sha("A" * 40)


# ------------------------------------------------------------------------------------------ config.json shapes


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": 5},
        {"architectures": [1, None, {"a": 1}]},
        {"architectures": "LlamaForCausalLMEagle3"},
        {"transformer_layer_config": [1, 2], "architectures": ["X"]},
        {"speculators_config": {"verifier": 5}},
        {"speculators_config": {"algorithm": ["eagle3"], "verifier": {"name_or_path": {"x": 1}}}},
        {"eagle_config": "x"},
        {"vocab_size": {"a": [1]}},
        {"vocab_size": -1},
        {"vocab_size": float("nan")},
        {"hidden_size": True},
        {"model_type": 5},
        {"eagle_aux_hidden_state_layer_ids": [1, "2"]},
        {"text_config": {"vocab_size": "many"}},
        {"base_model_name_or_path": ["x"], "medusa_num_heads": 5},
    ],
)
def test_malformed_configs_are_named_and_never_crash_the_pure_parts(config):
    assert config_problems(config)
    facts_from_config(config)  # none of these raise
    detect_method(config, "x/y-eagle3")
    declared_targets(config, {"base_model": 5})
    declared_targets(config, {"base_model": [1, {"a": 2}]})


def test_real_configs_have_no_problems():
    from fakehub import DEEPSEEK_V3, EAGLE3_LLAMA31_8B, MEDUSA_VICUNA_7B, speculators_eagle3

    for cfg in (
        LLAMA31_8B,
        QWEN25_7B,
        DEEPSEEK_V3,
        EAGLE3_LLAMA31_8B,
        MEDUSA_VICUNA_7B,
        speculators_eagle3(TARGET),
        {**LLAMA31_8B, "max_position_embeddings": 4096.0, "sliding_window": None},
    ):
        assert config_problems(cfg) == []


# ------------------------------------------------------------------------------------------ through the real client


def test_hostile_heads_are_refused_with_reasons(fake_hub):
    seed_llama31(fake_hub)
    hostile = seed_hostile(fake_hub)
    res = resolve(synthetic_profile(TARGET, method="eagle3"), max_checked=20)

    assert res.choice is not None and res.choice.draft not in hostile  # a real head still wins
    for repo, why in hostile.items():
        c = by_draft(res, repo)
        assert c.verdict == "refused", (repo, c.verdict, c.reason)
        assert why in c.reason, (repo, c.reason)
        assert "\n" not in c.reason and "Traceback" not in c.reason
    # the 60 MB config.json was never fetched: its size on the Hub refused it first
    big = fake_hub.repos["evil/huge-config-eagle3"].files["config.json"]
    assert not any("huge-config" in p and "config.json" in p for p in fake_hub.paths_requested("GET"))
    assert not any(big.sha256 in p for p in fake_hub.paths_requested("GET"))
    # the understated 2 MiB one was cut off by the cap (the size the download announced)
    assert fake_hub.bytes_served < BIG_CONFIG_BYTES // 4
    cache = Path(os.environ["HF_HOME"]) / "hub"
    assert not any(p.stat().st_size > MAX_JSON_BYTES for p in cache.rglob("*") if p.is_file())


def test_hostile_heads_do_not_break_auto_resolve_and_lock_cli(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    hostile = seed_hostile(fake_hub)
    r = specops("resolve", TARGET, "--json")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    data = json.loads(r.stdout)
    assert data["choice"]["draft"] not in hostile
    for c in data["candidates"]:
        if c["draft"] in hostile:
            assert c["verdict"] in ("refused", "unchecked")

    path = tmp_path / "auto.yaml"
    path.write_text(f"name: a\nbackend: vllm\nmodel: {{id: {TARGET}}}\nspeculative: {{method: eagle3, draft: auto}}\n")
    r = specops("lock", str(path))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    lock = json.loads((tmp_path / "auto.lock.json").read_text())
    assert lock["speculative"]["draft"] not in hostile


def test_hostile_target_config_is_one_line_error(fake_hub, tmp_path):
    fake_hub.add_model("evil/Llama-3.1-8B-Instruct", {"config.json": {**LLAMA31_8B, "architectures": 5}})
    res = resolve(synthetic_profile("evil/Llama-3.1-8B-Instruct"))
    assert res.choice is None
    assert any("architectures must be a list of strings" in f.message and f.path == ("model", "id") for f in res.errors)
    r = specops("resolve", "evil/Llama-3.1-8B-Instruct")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "architectures must be a list of strings" in r.stdout


def test_unusable_hub_metadata_is_refused(fake_hub):
    seed_llama31(fake_hub)
    fake_hub.add_model(
        "evil/badsha-eagle3", {"config.json": LLAMA31_8B}, sha="../../../../tmp/x", card_data={"base_model": TARGET}
    )
    fake_hub.add_model("evil/bad--id-eagle3", {"config.json": LLAMA31_8B}, card_data={"base_model": TARGET})
    fake_hub.add_model(
        "evil/counts-eagle3",
        {"config.json": {**LLAMA31_8B, "architectures": ["LlamaForCausalLMEagle3"]}},
        card_data={"base_model": TARGET},
    )
    fake_hub.repos["evil/counts-eagle3"].downloads = "lots"  # a string where a count belongs
    res = resolve(synthetic_profile(TARGET, method="eagle3"), max_checked=20)
    # search results with an unusable id or commit are left out of discovery, with a note
    assert all(c.draft not in ("evil/bad--id-eagle3", "evil/badsha-eagle3") for c in res.candidates)
    assert any("left out a result" in n and "'evil/bad--id-eagle3'" in n for n in res.notes)
    assert any("left out evil/badsha-eagle3" in n and "commit sha" in n for n in res.notes)
    assert by_draft(res, "evil/counts-eagle3").downloads == 0
    # named explicitly, the one with a bad commit is refused with the reason
    profile = synthetic_profile(TARGET, method="eagle3")
    profile = profile.model_copy(
        update={"speculative": profile.speculative.model_copy(update={"draft": "evil/badsha-eagle3"})}
    )
    res = resolve(profile)
    sha = by_draft(res, "evil/badsha-eagle3")
    assert sha.verdict == "refused" and "commit sha is not 40 hex digits" in sha.reason


@pytest.mark.parametrize("name", UNSAFE_GGUF_NAMES)
def test_unsafe_gguf_sibling_is_never_picked_or_pinned(fake_hub, tmp_path, name):
    fake_hub.add_model(
        "Qwen/Qwen2.5-7B-Instruct-GGUF",
        {"qwen2.5-7b-instruct-q4_k_m.gguf": 4_683_073_632},
        card_data={"base_model": "Qwen/Qwen2.5-7B-Instruct"},
        gguf={"total": 7_615_616_512, "architecture": "qwen2", "context_length": 32768},
    )
    fake_hub.add_model("Qwen/Qwen2.5-7B-Instruct", {"config.json": QWEN25_7B})
    fake_hub.add_model("Qwen/Qwen2.5-0.5B-Instruct", {"config.json": QWEN25_05B})
    evil = seed_unsafe_gguf(fake_hub, name)
    path = tmp_path / "g.yaml"
    path.write_text(
        f"name: g\nbackend: llamacpp\nmodel: {{id: Qwen/Qwen2.5-7B-Instruct-GGUF}}\n"
        f"speculative: {{method: draft_model, draft: {evil}}}\n"
    )
    with pytest.raises(ProfileError) as exc:
        lock_profile(load_profile(path))
    assert "unsafe file name" in str(exc.value)
    assert not (tmp_path / "g.lock.json").exists()
    assert fake_hub.weight_downloads == []

    # as the target: a one-line error too
    res = resolve(synthetic_profile(evil, backend="llamacpp"))
    assert res.choice is None and any("unsafe file name" in f.message for f in res.errors)


def test_unsafe_gguf_through_the_lock_cli(fake_hub, tmp_path):
    fake_hub.add_model(
        "Qwen/Qwen2.5-7B-Instruct-GGUF",
        {"qwen2.5-7b-instruct-q4_k_m.gguf": 4_683_073_632},
        gguf={"total": 7_615_616_512, "architecture": "qwen2", "context_length": 32768},
    )
    evil = seed_unsafe_gguf(fake_hub, "../../../../tmp/x-Q4_K_M.gguf")
    path = tmp_path / "g.yaml"
    path.write_text(
        f"name: g\nbackend: llamacpp\nmodel: {{id: Qwen/Qwen2.5-7B-Instruct-GGUF}}\n"
        f"speculative: {{method: draft_model, draft: {evil}}}\n"
    )
    r = specops("lock", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "unsafe file name '../../../../tmp/x-Q4_K_M.gguf'" in r.stderr
    assert not (tmp_path / "g.lock.json").exists()


def test_a_profile_file_with_dotdot_is_refused_before_any_cache_path(fake_hub, tmp_path):
    fake_hub.add_model("Qwen/Qwen2.5-7B-Instruct-GGUF", {"qwen2.5-7b-instruct-q4_k_m.gguf": 4_683_073_632})
    fake_hub.add_model("Qwen/Qwen2.5-0.5B-Instruct-GGUF", {"qwen2.5-0.5b-instruct-q4_k_m.gguf": 491_400_064})
    from specops.resolve.catalog import load_catalog
    from specops.resolve.models import load_model

    view = load_model(
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        hub=Hub(),
        catalog=load_catalog(),
        gguf=True,
        file="../../../../tmp/x-Q4_K_M.gguf",
    )
    assert view.fatal is not None and view.fatal.kind == "invalid" and view.gguf_file is None


# ------------------------------------------------------------------------------------------ lock read back

LOCKED = f"name: llama\nbackend: vllm\nmodel: {{id: {TARGET}}}\nspeculative: {{method: auto}}\n"


@pytest.mark.parametrize(
    "where,value,why",
    [
        (("speculative", "draft_file"), "../../../../tmp/x-Q4_K_M.gguf", "'..' path segment"),
        (("speculative", "draft_file"), "/etc/passwd", "absolute path"),
        (("speculative", "draft_file"), "a\\b.gguf", "backslash"),
        (("speculative", "draft_file"), 5, "not a string"),
        (("speculative", "draft_revision"), "../../../etc", "'..' path segment"),
        (("target", "revision"), "--upload-pack=x", "starts with '-'"),
        (("target", "file"), "x\x00.gguf", "NUL"),
        (("speculative", "draft"), "a/../../b", "namespace/name"),
        (("speculative", "draft"), ["x"], "Hub repo id or a path"),
    ],
)
def test_a_tampered_lock_is_refused_with_a_located_line(fake_hub, tmp_path, where, value, why):
    seed_llama31(fake_hub)
    path = tmp_path / "llama.yaml"
    path.write_text(LOCKED)
    lock_file, _ = lock_profile(load_profile(path))
    data = json.loads(lock_file.read_text())
    data[where[0]][where[1]] = value
    lock_file.write_text(json.dumps(data))
    with pytest.raises(SpecopsError) as exc:
        resolve_profile(load_profile(path))
    msg = str(exc.value)
    assert f"{where[0]}.{where[1]}" in msg and why in msg and str(lock_file) in msg
    assert "\n" not in msg


def test_a_tampered_lock_through_the_cli(fake_hub, tmp_path):
    seed_llama31(fake_hub)
    path = tmp_path / "llama.yaml"
    path.write_text(LOCKED)
    lock_file, _ = lock_profile(load_profile(path))
    data = json.loads(lock_file.read_text())
    data["speculative"]["draft_file"] = "../../../../tmp/x-Q4_K_M.gguf"
    lock_file.write_text(json.dumps(data))
    for args in (("lock", "--check", str(path)), ("render", str(path))):
        r = specops(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        assert "speculative.draft_file '../../../../tmp/x-Q4_K_M.gguf' is unusable" in r.stderr
        assert "-hff" not in r.stdout


# ------------------------------------------------------------------------------------------ the HF cache


def test_cache_joins_only_safe_names(tmp_path):
    hub = Hub(cache_dir=tmp_path / "hub", offline=True)
    repo_dir = tmp_path / "hub" / "models--a--b"
    sha = "1" * 40
    (repo_dir / "snapshots" / sha).mkdir(parents=True)
    (repo_dir / "snapshots" / sha / "config.json").write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    (tmp_path / "secret.gguf").write_text("x")
    assert hub.cached("a/b", "config.json") is not None
    assert hub.cached("a/b", "../../../../secret.gguf") is None
    assert hub.cached("a/b", "config.json", revision="../../../../secret.gguf") is None
    assert hub.cached("a/../b", "config.json") is None
    (repo_dir / "refs" / "junk").write_text("../../../..")
    assert hub.cached_sha("a/b", "junk") is None
    assert hub.cached_files("a/b") == ["config.json"]


def test_offline_cached_config_is_read_only_up_to_the_cap(fake_hub, monkeypatch):
    """A config.json in the HF cache that grew past the cap is refused, not read whole."""
    seed_llama31(fake_hub)
    hub = Hub()
    path = hub.download(TARGET, "config.json")
    real = path.resolve()
    real.chmod(0o644)
    real.write_bytes(b'{"pad": "' + b"x" * (MAX_JSON_BYTES + 10) + b'"}')
    res = resolve(synthetic_profile(TARGET), hub=Hub(offline=True))
    assert res.choice is None
    assert any("larger than" in f.message or "specops reads at most" in f.message for f in res.errors)


def test_capped_progress_stops_a_stream_past_the_cap():
    cls = _capped_progress(100)
    with pytest.raises(FileTooLarge):
        cls(total=101, disable=True)
    bar = cls(total=None, disable=True)
    bar.update(60)
    with pytest.raises(FileTooLarge):
        bar.update(60)


def test_terminal_escapes_from_the_hub_never_reach_the_output(fake_hub):
    seed_llama31(fake_hub)
    fake_hub.add_model(
        "evil/ansi-eagle3",
        {
            "config.json": {
                **LLAMA31_8B,
                "num_hidden_layers": 1,
                "architectures": ["\x1b]0;pwn\x07LlamaForCausalLMEagle3"],
                "draft_vocab_size": 32000,
            }
        },
        card_data={"base_model": [TARGET, "\x1b[2Jother/model"]},
        downloads=10_000_000,
    )
    r = specops("resolve", TARGET, "--method", "eagle3", "--all")
    assert r.returncode == 0, r.stderr
    assert "evil/ansi-eagle3" in r.stdout
    assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr


def test_a_repo_listing_too_many_files_is_refused(fake_hub):
    from specops.resolve.hub import MAX_SIBLINGS

    seed_llama31(fake_hub)
    files = {f"shard-{i:06d}.bin": 1 for i in range(MAX_SIBLINGS)}  # + config.json: one too many
    fake_hub.add_model("evil/many-files-eagle3", {"config.json": LLAMA31_8B, **files})
    profile = synthetic_profile(TARGET, method="eagle3")
    profile = profile.model_copy(
        update={"speculative": profile.speculative.model_copy(update={"draft": "evil/many-files-eagle3"})}
    )
    c = by_draft(resolve(profile), "evil/many-files-eagle3")
    assert c.verdict == "refused" and f"it lists {MAX_SIBLINGS + 1} files" in c.reason
