"""Loader regressions: hostile or unusual YAML that once escaped as a crash (found by review and fuzzing)."""
from __future__ import annotations

import time

import pytest

from specops.errors import ProfileError
from specops.profile import load_profile

VALID = "name: m\nbackend: vllm\nmodel:\n  id: a/b\n"


def _problems(tmp_path, text: str, name: str = "p.yaml", env=None):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path, env=env or {})
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize("text,needle", [
    ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ("a: " + "{b: " * 40 + "1" + "}" * 40 + "\n", "nested more than 32 levels"),
    ("a: &a [*a]\n", "recursive alias"),
    ("a: !!int ''\n", "is not a valid int"),
    ("a: !!int abc\n", "'abc' is not a valid int"),
    ("a: !!float x\n", "'x' is not a valid float"),
    ("a: !custom x\n", "unsupported YAML tag '!custom'"),
    ("a: !!set {x}\n", "unsupported YAML tag 'tag:yaml.org,2002:set'"),
    ("a: !!python/object/apply:os.system [id]\n", "unsupported YAML tag"),
    ("extends: \"a\\0b\"\n" + VALID, "cannot use 'a\\x00b' as a file path"),
    ("extends: \"" + "x" * 5000 + "\"\n" + VALID, "cannot use"),
])
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
    path.write_text("name: m\nbackend: llamacpp\nmodel:\n  id: /m/x.gguf\ngpus:\n  devices: [0, 1, 2]\n"
                    "  split_mode: layer\n  tensor_split: [2, 1, 1]\n", encoding="utf-8")
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
    ok.write_text(base + "  ngram: {type: ngram-simple}\nserver:\n  extra_args: [--spec-ngram-simple-size-n, '4']\n",
                  encoding="utf-8")
    assert load_profile(ok, env={}).profile.speculative.ngram.type == "ngram-simple"
