"""Loader regressions: hostile or unusual YAML that once escaped as a crash (found by review and fuzzing)."""

from __future__ import annotations

import time

import pytest

from specops.config.profile import load_profile
from specops.errors import ProfileError

VALID = "name: m\nbackend: vllm\nmodel:\n  id: a/b\n"


def _problems(tmp_path, text: str, name: str = "p.yaml", env=None):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path, env=env or {})
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
        ("a: " + "{b: " * 40 + "1" + "}" * 40 + "\n", "nested more than 32 levels"),
        ("a: &a [*a]\n", "recursive alias"),
        ("a: !!int ''\n", "is not a valid int"),
        ("a: !!int abc\n", "'abc' is not a valid int"),
        ("a: !!float x\n", "'x' is not a valid float"),
        ("a: !custom x\n", "unsupported YAML tag '!custom'"),
        ("a: !!set {x}\n", "unsupported YAML tag 'tag:yaml.org,2002:set'"),
        ("a: !!python/object/apply:os.system [id]\n", "unsupported YAML tag"),
        ('extends: "a\\0b"\n' + VALID, "cannot use 'a\\x00b' as a file path"),
        ('extends: "' + "x" * 5000 + '"\n' + VALID, "cannot use"),
    ],
)
def test_hostile_yaml_is_a_located_error(tmp_path, text, needle):
    problems = _problems(tmp_path, text)
    assert any(needle in p for p in problems), problems
    assert all(p.startswith(str(tmp_path / "p.yaml") + ":") for p in problems), problems


def test_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    start = time.monotonic()
    problems = _problems(tmp_path, "\n".join(lines) + "\n")
    assert time.monotonic() - start < 2  # 10^9 values if expanded: must stop long before
    assert any("is an alias expanded many times?" in p for p in problems), problems


def test_empty_extends_list_extends_nothing(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("extends: []\n" + VALID, encoding="utf-8")
    assert load_profile(path, env={}).profile.name == "m"


def test_a_key_spelled_like_a_pydantic_step_is_reported_as_unknown(tmp_path):
    problems = _problems(tmp_path, VALID + "'tuple[int]': 1\n'function-before': 2\n")
    assert any("5:1: tuple[int]: unknown field 'tuple[int]'" in p for p in problems), problems
    assert any("6:1: function-before: unknown field" in p for p in problems), problems


def test_interpolated_value_that_is_bad_yaml_stays_text(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(VALID + "description: ${D}\n", encoding="utf-8")
    assert load_profile(path, env={"D": "!!int x"}).profile.description == "!!int x"


def test_llamacpp_may_spread_layers_over_any_number_of_gpus(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: m\nbackend: llamacpp\nmodel:\n  id: /m/x.gguf\ngpus:\n  devices: [0, 1, 2]\n"
        "  split_mode: layer\n  tensor_split: [2, 1, 1]\n",
        encoding="utf-8",
    )
    assert load_profile(path, env={}).profile.gpus.devices == [0, 1, 2]
    vllm = tmp_path / "v.yaml"
    vllm.write_text(VALID + "gpus:\n  devices: [0, 1, 2]\n", encoding="utf-8")
    with pytest.raises(ProfileError, match="3 devices listed"):
        load_profile(vllm, env={})


def test_llamacpp_ngram_settings_it_would_ignore_are_refused(tmp_path):
    base = "name: m\nbackend: llamacpp\nmodel:\n  id: /m/x.gguf\nspeculative:\n  method: ngram\n"
    problems = _problems(tmp_path, base + "  num_speculative_tokens: 8\n  ngram: {max: 4}\n")
    assert any("7:27: speculative.num_speculative_tokens: " in p and "--spec-ngram-mod-n-max" in p for p in problems)
    assert any("8:16: speculative.ngram.max: ngram.max is vLLM's prompt_lookup_max" in p for p in problems)
    ok = tmp_path / "ok.yaml"
    ok.write_text(
        base + "  ngram: {type: ngram-simple}\nserver:\n  extra_args: [--spec-ngram-simple-size-n, '4']\n",
        encoding="utf-8",
    )
    assert load_profile(ok, env={}).profile.speculative.ngram.type == "ngram-simple"


# ------------------------------------------------------------------------- extends: where it may read


def test_extends_outside_the_profiles_folder_is_refused_unless_allowed(tmp_path):
    """No git work tree above: the profile's own folder is the root; $SPECOPS_PROFILE_ROOT adds one."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.yaml").write_text("backend: vllm\nmodel: {id: a/b}\n", encoding="utf-8")
    (tmp_path / "deploy").mkdir()
    path = tmp_path / "deploy" / "p.yaml"
    path.write_text("extends: ../shared/base.yaml\nname: m\n", encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path, env={})
    [problem] = info.value.problems
    assert problem.field == "extends" and "is outside the profile's tree" in problem.message
    assert load_profile(path, env={"SPECOPS_PROFILE_ROOT": str(tmp_path / "shared")}).profile.backend == "vllm"


def test_extends_anywhere_inside_the_git_work_tree(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / "base.yaml").write_text("backend: vllm\nmodel: {id: a/b}\n", encoding="utf-8")
    (tmp_path / "envs" / "prod").mkdir(parents=True)
    path = tmp_path / "envs" / "prod" / "p.yaml"
    path.write_text("extends: ../../base.yaml\nname: m\n", encoding="utf-8")
    assert load_profile(path, env={}).profile.model.id == "a/b"


def test_a_symlink_out_of_the_tree_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.yaml").write_text("backend: vllm\nmodel: {id: SECRET-OUTSIDE}\n", encoding="utf-8")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "base.yaml").symlink_to(outside / "secret.yaml")
    problems = _problems(tree, "extends: base.yaml\nname: m\n")
    assert len(problems) == 1 and "outside the profile's tree" in problems[0] and "SECRET" not in problems[0]


@pytest.mark.parametrize(
    "content",
    [
        "root:$6$HASH-NOT-SHOWN:19000:0:99999:7:::\n",
        "password: HASH-NOT-SHOWN\nuser: HASH-NOT-SHOWN\n",
        "- HASH-NOT-SHOWN\n",
        "a: !HASH-NOT-SHOWN x\n",
        "a: *HASH-NOT-SHOWN\n",
        "HASH-NOT-SHOWN: [\n",
        '"HASH-NOT-SHOWN\\q"\n',
    ],
)
def test_a_file_named_by_extends_that_is_not_a_profile_is_never_quoted(tmp_path, content):
    (tmp_path / "other.conf").write_text(content, encoding="utf-8")
    problems = _problems(tmp_path, "extends: other.conf\n" + VALID)
    assert len(problems) == 1 and "HASH" not in problems[0], problems
    assert "not a specops profile" in problems[0]


def test_an_empty_base_says_so(tmp_path):
    (tmp_path / "base.yaml").write_text("# nothing yet\n", encoding="utf-8")
    problems = _problems(tmp_path, "extends: base.yaml\n" + VALID)
    assert len(problems) == 1 and problems[0].endswith("base.yaml:1:1: the file is empty"), problems


def test_a_base_with_a_typo_is_located_in_the_base_with_a_hint(tmp_path):
    (tmp_path / "base.yaml").write_text("backend: vllm\nspeculatve:\n  method: ngram\n", encoding="utf-8")
    problems = _problems(tmp_path, "extends: base.yaml\n" + VALID)
    assert len(problems) == 1 and problems[0].endswith(
        ":2:1: unknown top-level field; did you mean 'speculative'? "
        "(not quoted: files named by `extends` are quoted only once "
        "they read as profiles)"
    ), problems


def test_a_symlink_loop_in_extends_is_a_located_error(tmp_path):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    problems = _problems(tmp_path, "extends: a.yaml\n" + VALID)
    assert len(problems) == 1 and "extends: cannot use 'a.yaml' as a file path: symlink loop" in problems[0]


# ------------------------------------------------------------------------------- bounded reading


def test_a_profile_over_one_mib_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(VALID + "description: '" + "x" * (1 << 20) + "'\n", encoding="utf-8")
    with pytest.raises(ProfileError, match="larger than 1 MiB"):
        load_profile(path, env={})


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_at_once(tmp_path, target):
    start = time.monotonic()
    with pytest.raises(ProfileError, match="not a regular file"):
        load_profile(target, env={})
    (tmp_path / "base.yaml").symlink_to(target)
    problems = _problems(tmp_path, "extends: base.yaml\n" + VALID, env={"SPECOPS_PROFILE_ROOT": "/dev"})
    assert len(problems) == 1 and "not a regular file" in problems[0]
    assert time.monotonic() - start < 2


def test_a_fifo_does_not_block(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.yaml")
    with pytest.raises(ProfileError, match="not a regular file"):
        load_profile(tmp_path / "pipe.yaml", env={})


def test_validate_survives_symlink_loops_and_nul_bytes(tmp_path):
    from support_cli import run

    (tmp_path / "loop1.yaml").symlink_to(tmp_path / "loop2.yaml")
    (tmp_path / "loop2.yaml").symlink_to(tmp_path / "loop1.yaml")
    (tmp_path / "nul.yaml").write_text('extends: "a\\0b"\n' + VALID, encoding="utf-8")
    (tmp_path / "ext.yaml").write_text("extends: loop1.yaml\n" + VALID, encoding="utf-8")
    for args in (
        [str(tmp_path / "loop1.yaml")],
        [str(tmp_path)],
        [str(tmp_path / "nul.yaml")],
        [str(tmp_path / "ext.yaml")],
    ):
        res = run("validate", *args)
        assert res.code == 1 and "Traceback" not in res.stdout + res.stderr, (args, res)
        assert any(line.startswith("error ") for line in res.stdout.splitlines()), (args, res)


# ----------------------------------------------------------------------------------- number bounds


@pytest.mark.parametrize(
    "body,field",
    [
        ("server:\n  port: true\n", "server.port"),
        ("proxy:\n  engine_port: false\n", "proxy.engine_port"),
        ("gpus:\n  devices: [true]\n", "gpus.devices[0]"),
        ("gpus:\n  memory_utilization: true\n", "gpus.memory_utilization"),
        ("gpus:\n  tensor_split: [.nan]\n", "gpus.tensor_split[0]"),
        ("gpus:\n  memory_gb: .inf\n", "gpus.memory_gb"),
        ("gpus:\n  devices: [99999999999]\n", "gpus.devices[0]"),
        ("model:\n  id: a/b\n  max_model_len: 1000000000000\n", "model.max_model_len"),
        ("speculative:\n  method: ngram\n  num_speculative_tokens: 65\n", "speculative.num_speculative_tokens"),
        ("speculative:\n  method: ngram\n  ngram: {min: 1025}\n", "speculative.ngram.min"),
        (
            "fallback:\n  chain: [{method: ngram, num_speculative_tokens: 1000}]\n",
            "fallback.chain[0].num_speculative_tokens",
        ),
        ("fallback:\n  window: .nan\n", "fallback.window"),
        ("fallback:\n  cooldown: 8d\n", "fallback.cooldown"),
        ("monitor:\n  interval: 1e400\n", "monitor.interval"),
        ("supervisor:\n  stop_timeout: " + "9" * 400 + "\n", "supervisor.stop_timeout"),
        ("proxy:\n  queue_timeout: .inf\n", "proxy.queue_timeout"),
        (
            "speculative:\n  method: eagle3\n  draft: a/e\n  per_batch_size: [[1, 8, 65]]\n",
            "speculative.per_batch_size[0]",
        ),
        ("speculative:\n  method: eagle3\n  draft: a/e\n  options: {a: [1, -.inf]}\n", "speculative.options.a[1]"),
        ("engine:\n  version: '0.32.0; rm -rf /'\n", "engine.version"),
        ("engine:\n  version: '" + "1" * 65 + "'\n", "engine.version"),
    ],
)
def test_numbers_durations_and_versions_are_bounded(tmp_path, body, field):
    base = "name: m\nbackend: vllm\n" if body.startswith("model:") else VALID
    problems = _problems(tmp_path, base + body)
    assert len(problems) == 1 and f": {field}: " in problems[0], problems
    assert "rm -rf" not in problems[0] and "1" * 65 not in problems[0]


def test_a_huge_integer_is_not_echoed_in_full(tmp_path):
    problems = _problems(tmp_path, VALID + "speculative:\n  num_speculative_tokens: " + "9" * 5000 + "\n")
    assert len(problems) == 1 and len(problems[0]) < 300, problems


def test_durations_at_the_bound_are_fine(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(VALID + "fallback:\n  cooldown: 7d\n  window: 1h\n", encoding="utf-8")
    assert load_profile(path, env={}).profile.fallback.cooldown == 7 * 86400


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "0"],
        ["--port", "-1"],
        ["--port", "70000"],
        ["--backend-version", "0.32.0; rm -rf /"],
        ["--backend-version", "$(id)"],
    ],
)
def test_render_refuses_bad_ports_and_versions(args):
    from support_cli import ROOT, run

    res = run("render", str(ROOT / "profiles" / "llama31-8b-eagle3.yaml"), *args)
    assert res.code == 2 and res.stdout == "" and "Traceback" not in res.stderr
    assert "rm -rf" not in res.stderr and "$(id)" not in res.stderr


def test_a_bad_version_reaching_a_backend_is_refused_without_echo():
    """`up`, `tune` and `bench` pass --backend-version to the backend: it checks the text itself."""
    from support_cli import ROOT

    from specops.errors import SpecopsError
    from specops.plugins import get_registry

    loaded = load_profile(ROOT / "profiles" / "llama31-8b-eagle3.yaml", env={})
    for name in ("vllm", "llamacpp"):
        with pytest.raises(SpecopsError) as info:
            get_registry().backend(name).engine_info(loaded.profile, "0.32.0; rm -rf /", probe=False)
        assert "rm -rf" not in str(info.value) and "not a version" in str(info.value)


@pytest.mark.parametrize("command", ["render", "tune", "bench", "resolve"])
def test_backend_version_options_refuse_what_is_no_version(command):
    from support_cli import ROOT, run

    res = run(command, str(ROOT / "profiles" / "llama31-8b-eagle3.yaml"), "--backend-version", "0.32.0; rm -rf /")
    assert res.code == 2 and "not a version" in res.stderr and "rm -rf" not in res.stderr
