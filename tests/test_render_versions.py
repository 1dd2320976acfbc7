"""Version-dependent rendering details that the golden matrix does not show on its own."""

from __future__ import annotations

import ast
import json
import re
import subprocess

import pytest

from specops.backends.render import render_plan
from specops.config.profile import load_profile
from specops.plugins import get_registry


def _plan(tmp_path, body: str, version: str):
    path = tmp_path / "p.yaml"
    path.write_text(body, encoding="utf-8")
    return render_plan(load_profile(path, env={}), get_registry(), backend_version=version, probe=False)


EAGLE = (
    "name: m\nbackend: vllm\nmodel: {id: a/b}\nspeculative: {method: eagle, draft: c/EAGLE-d, num_speculative_tokens: 4"
)


def _config(p) -> str:
    return p.argv[p.argv.index("--speculative-config") + 1]


def test_vllm_082_gets_json_when_it_reads_the_same_as_a_python_literal(tmp_path):
    p = _plan(tmp_path, EAGLE + "}\n", "0.8.2")
    text = _config(p)
    assert (
        json.loads(text)
        == ast.literal_eval(text)
        == {"method": "eagle", "model": "c/EAGLE-d", "num_speculative_tokens": 4}
    )


def test_vllm_082_gets_a_python_literal_when_json_would_not_parse(tmp_path):
    """0.8.2 reads the option with ast.literal_eval: `false` would fail there, `False` does not."""
    p = _plan(tmp_path, EAGLE + ", options: {disable_logprobs: false}}\n", "0.8.2")
    text = _config(p)
    assert ast.literal_eval(text)["disable_logprobs"] is False
    assert "false" not in text
    newer = _config(_plan(tmp_path, EAGLE + ", options: {disable_logprobs: false}}\n", "0.9.0"))
    assert json.loads(newer)["disable_logprobs"] is False


def test_legacy_vllm_explains_how_it_picks_the_method(tmp_path):
    p = _plan(tmp_path, EAGLE + "}\n", "0.6.6")
    assert "--speculative-config" not in p.argv
    assert p.argv[p.argv.index("--speculative-model") + 1] == "c/EAGLE-d"
    assert any("has no `method` setting" in n and "'eagle-' in the repo name" in n for n in p.notes)
    ngram = _plan(tmp_path, "name: m\nbackend: vllm\nmodel: {id: a/b}\nspeculative: {method: ngram}\n", "0.6.6")
    assert not any("has no `method` setting" in n for n in ngram.notes)  # [ngram] names itself


def test_llamacpp_multi_gpu_layout_renders_devices_and_split(tmp_path):
    body = (
        "name: m\nbackend: llamacpp\nmodel: {id: /m/x.gguf}\ngpus:\n  devices: [0, 1]\n  split_mode: layer\n"
        "  tensor_split: [3, 1]\n  gpu_layers: 99\n"
    )
    p = _plan(tmp_path, body, "current")
    argv = list(p.argv)
    assert argv[argv.index("-dev") + 1] == "CUDA0,CUDA1"
    assert argv[argv.index("-sm") + 1] == "layer" and argv[argv.index("-ts") + 1] == "3,1"
    assert argv[argv.index("-fit") + 1] == "off"  # explicit layout: llama-server must not re-fit it


def test_llamacpp_spec_type_generation_enables_a_draft_model_with_md_alone(tmp_path):
    """In the `--spec-type` generation that option names n-gram drafters only: llama-server 0.3.20's build
    exits on `--spec-type draft` (the support matrix saw it), so a draft model is `-md` plus `--draft-max`."""
    body = (
        "name: m\nbackend: llamacpp\nmodel: {id: /m/x.gguf}\n"
        "speculative: {method: draft_model, draft: /m/d.gguf, num_speculative_tokens: 5}\n"
    )
    argv = list(_plan(tmp_path, body, "spec-type").argv)
    assert "--spec-type" not in argv
    assert argv[argv.index("-md") + 1] == "/m/d.gguf" and argv[argv.index("--draft-max") + 1] == "5"
    current = list(_plan(tmp_path, body, "current").argv)
    assert current[current.index("--spec-type") + 1] == "draft-simple"


def test_a_malformed_version_is_refused_naming_where_it_came_from(tmp_path):
    """``--backend-version`` is refused by either backend; the profile's own field already by the loader, located."""
    from specops.errors import SpecopsError

    llama = "name: m\nbackend: llamacpp\nmodel: {id: t.gguf}\nspeculative: {method: ngram}\n"
    for body in (EAGLE + "}\n", llama):
        with pytest.raises(SpecopsError, match=r"^--backend-version: not a version"):
            _plan(tmp_path, body, "0.8.2; rm -rf /")
    path = tmp_path / "v.yaml"
    path.write_text(EAGLE + "}\nengine: {version: '0.8.2; rm'}\n", encoding="utf-8")
    with pytest.raises(SpecopsError, match=r"v\.yaml:5:19: engine\.version: not a version"):
        load_profile(path, env={})


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_llama_server_extra_args_take_either_spelling_its_help_lists(tmp_path):
    """llama-server's --help pads a short alias to a column (``-t,    --threads N``): both spellings are options
    of the build, so `specops render` against the probed binary takes ``--threads`` as it takes ``-t``."""
    from support_cli import run
    from support_engines import need_llama_server

    from specops.backends.llamacpp import parse_help

    exe = need_llama_server()
    helptext = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60).stdout
    flags, _ = parse_help(helptext)
    pairs = re.findall(r"^(-[a-zA-Z][a-zA-Z-]*),\s+(--[a-z][a-z0-9-]*)", helptext, re.M)
    assert ("-t", "--threads") in pairs
    assert [p for p in pairs if not set(p) <= flags] == []
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: m\nbackend: llamacpp\nmodel: {id: /m/x.gguf}\nspeculative: {method: ngram}\ngpus: {devices: []}\n"
        f"engine: {{executable: {json.dumps(str(exe))}}}\nserver: {{extra_args: [--threads, '1', -tb, '1']}}\n"
    )
    res = run("render", path)
    assert res.code == 0, res.stderr
    assert "--threads 1 -tb 1" in res.stdout
