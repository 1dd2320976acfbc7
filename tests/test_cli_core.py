"""The CLI basics: version, help with examples, render formats, secret redaction, validate output formats,
usage errors (exit 2) versus profile errors (exit 1)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
from support_cli import ROOT, run, run_subprocess

import specops

SECRET_KEY = "sk-live-4f9a1c-CLI-TEST"
HF_SECRET = "hf_AbCdEf0123456789"
PASSWORD = "p4ssw0rd-CLI"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# ------------------------------------------------------------------------------------ version, help


def test_version():
    res = run("--version")
    assert res.code == 0
    assert res.stdout.strip() == f"specops, version {specops.__version__}"


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def _all_commands():
    from specops.cli import cli

    return [path for path, _ in _commands(cli)]


@pytest.mark.parametrize("path", _all_commands(), ids=lambda p: " ".join(p))
def test_every_command_has_help_with_an_example(path):
    res = run(*path, "--help")
    assert res.code == 0, res.stderr
    assert res.stdout.startswith(f"Usage: specops {' '.join(path)}")
    assert re.search(r"^\s*Examples?", res.stdout, re.M | re.I), f"`specops {' '.join(path)} --help` has no example"
    # the example really uses the command
    assert re.search(rf"^\s+specops {re.escape(' '.join(path))}\b", res.stdout, re.M), res.stdout


def test_top_level_help_lists_the_core_commands():
    res = run("--help")
    assert res.code == 0
    for name in ("validate", "render", "schema", "plugins"):
        assert re.search(rf"^\s+{name}\s", res.stdout, re.M), name
    assert run("-h").stdout == res.stdout


# --------------------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    "args,needle",
    [
        (["render", "profiles/llama31-8b-eagle3.yaml", "--no-such-option"], "No such option"),
        (["render"], "Missing argument"),
        (["validate"], "Missing argument"),
        (["render", "profiles/llama31-8b-eagle3.yaml", "--format", "yaml"], "Invalid value"),
        (["no-such-command"], "No such command"),
        (["render", "profiles/llama31-8b-eagle3.yaml", "--port", "eighty"], "Invalid value"),
    ],
)
def test_usage_errors_exit_2(args, needle):
    res = run(*args)
    assert res.code == 2, res
    assert needle in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_usage_error_in_a_real_process_exits_2():
    res = run_subprocess("render", "--bogus")
    assert res.code == 2 and "No such option" in res.stderr and "Traceback" not in res.stderr


def test_profile_error_exits_1_with_a_located_line():
    res = run("render", "tests/malformed/unknown-backend.yaml")
    assert res.code == 1
    assert res.stderr.startswith("error: tests/malformed/unknown-backend.yaml:3:10: backend: ")


def test_missing_profile_file_is_a_located_error_not_a_traceback():
    res = run("render", "profiles/does-not-exist.yaml")
    assert res.code == 1
    assert res.stderr.strip() == (
        "error: profiles/does-not-exist.yaml:1:1: file not found: profiles/does-not-exist.yaml"
    )


# ------------------------------------------------------------------------------------ render formats


def _profile(tmp_path: Path, backend: str) -> Path:
    if backend == "vllm":
        body = """name: redact-vllm
backend: vllm
engine: {version: 0.32.0}
model: {id: meta-llama/Llama-3.1-8B-Instruct}
speculative: {method: ngram, num_speculative_tokens: 3}
gpus: {devices: [0]}
"""
    else:
        body = """name: redact-llama
backend: llamacpp
engine: {version: current}
model: {id: /models/target.gguf}
speculative: {method: draft_model, draft: /models/draft.gguf, num_speculative_tokens: 6}
gpus: {devices: []}
"""
    body += f"""server:
  api_key: ${{CLI_TEST_KEY}}
  env:
    HF_TOKEN: {HF_SECRET}
    DB_PASSWORD: {PASSWORD}
    PLAIN_SETTING: visible-value
"""
    path = tmp_path / f"{backend}.yaml"
    path.write_text(body, encoding="utf-8")
    return path


@pytest.mark.parametrize("backend", ["vllm", "llamacpp"])
def test_formats_describe_the_same_plan(tmp_path, backend):
    path = _profile(tmp_path, backend)
    env = {"CLI_TEST_KEY": SECRET_KEY}
    shell = run("render", path, env=env)
    as_json = run("render", path, "--format", "json", env=env)
    args = run("render", path, "--format", "args", env=env)
    assert shell.code == as_json.code == args.code == 0
    plan = json.loads(as_json.stdout)
    # shell: VAR=value assignments, then the argv, one line that a POSIX shell splits back into them
    assert shell.stdout.count("\n") == 1
    words = shlex.split(shell.stdout)
    n_env = len(plan["env"])
    assert words[:n_env] == [f"{k}={v}" for k, v in plan["env"].items()]
    assert words[n_env:] == plan["argv"]
    # args: one element per line, environment first
    assert args.stdout.splitlines() == [f"{k}={v}" for k, v in plan["env"].items()] + plan["argv"]
    assert plan["backend"] == backend
    assert plan["health_url"].endswith("/health") and plan["metrics_url"].endswith("/metrics")


@pytest.mark.parametrize("backend", ["vllm", "llamacpp"])
@pytest.mark.parametrize("fmt", ["shell", "json", "args"])
def test_secrets_are_redacted_in_every_format(tmp_path, backend, fmt):
    path = _profile(tmp_path, backend)
    res = run("render", path, "--format", fmt, env={"CLI_TEST_KEY": SECRET_KEY})
    assert res.code == 0, res.stderr
    out = res.stdout
    for secret in (SECRET_KEY, HF_SECRET, PASSWORD):
        assert secret not in out, f"{secret} leaked in {fmt}"
    assert "visible-value" in out  # only secrets are hidden
    assert out.count("***") >= 3  # the key, the token, the password
    if fmt == "json":
        plan = json.loads(out)
        assert plan["env"]["HF_TOKEN"] == "***" and plan["env"]["DB_PASSWORD"] == "***"
        key_var = "VLLM_API_KEY" if backend == "vllm" else "LLAMA_API_KEY"
        assert plan["env"][key_var] == "***" and "--api-key" not in plan["argv"]  # not in argv: `ps` shows argv


def test_render_without_version_and_without_engine_says_how_to_fix(tmp_path):
    """The baseline profile pins no version: without an installed vLLM, render must explain itself."""
    res = run(
        "render", "profiles/llama31-8b-baseline.yaml", env={"PATH": str(tmp_path), "SPECOPS_CACHE": str(tmp_path)}
    )
    assert res.code == 1
    assert "--backend-version" in res.stderr and "Traceback" not in res.stderr
    ok = run("render", "profiles/llama31-8b-baseline.yaml", "--backend-version", "0.32.0")
    assert ok.code == 0 and ok.stdout.startswith("CUDA_VISIBLE_DEVICES=0 vllm serve ")


def test_render_host_and_port_override():
    res = run("render", "profiles/llama31-8b-eagle3.yaml", "--host", "127.0.0.2", "--port", "9123", "--format", "json")
    plan = json.loads(res.stdout)
    argv = plan["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.2" and argv[argv.index("--port") + 1] == "9123"
    assert plan["url"] == "http://127.0.0.2:9123"


# ----------------------------------------------------------------------------------------- validate


def test_validate_directory_checks_profiles_and_reports_bases():
    res = run("validate", "profiles", env={"SPECOPS_API_KEY": None, "PROMETHEUS_URL": None})
    assert res.code == 0, res.stdout
    ok = [ln for ln in res.stdout.splitlines() if ln.startswith("ok ")]
    assert len(ok) == len(list((ROOT / "profiles").rglob("*.yaml"))) - 1
    assert "base    profiles/gitops/base/llama31-8b-chat.yaml" in res.stdout
    assert re.search(r"^\d+ valid, 0 invalid$", res.stderr.strip(), re.M)


def test_validate_json_format():
    res = run("validate", "--format", "json", "profiles", env={"SPECOPS_API_KEY": None, "PROMETHEUS_URL": None})
    assert res.code == 0
    data = json.loads(res.stdout)
    assert data["ok"] is True
    assert data["skipped_bases"] == ["profiles/gitops/base/llama31-8b-chat.yaml"]
    names = {p["name"] for p in data["profiles"]}
    assert {"llama31-8b-eagle3", "qwen25-coder-32b-gguf", "llama31-8b-chat-prod"} <= names
    for p in data["profiles"]:
        assert p["ok"] and p["errors"] == [] and p["backend"] in ("vllm", "llamacpp")


def test_validate_github_annotations(tmp_path):
    """One `::error` workflow command per problem; `%` in the message and `,`/`:` in the file are escaped."""
    folder = tmp_path / "a,b"
    folder.mkdir()
    bad = folder / "bad.yaml"
    bad.write_text("name: m\nbackend: vllm\nmodel:\n  id: a/b\n  'id%2': x\n", encoding="utf-8")
    res = run("validate", "--format", "github", str(bad), "profiles/llama31-8b-eagle3.yaml")
    assert res.code == 1
    escaped_file = str(bad).replace(",", "%2C").replace(":", "%3A")
    assert res.stdout.splitlines() == [
        f"::error file={escaped_file},line=5,col=3,title=specops::model.id%252: unknown field 'id%252'; "
        "did you mean 'id'?",
    ]  # the valid profile adds no annotation
    assert "specops: 1 valid, 1 invalid" in res.stderr


def test_validate_github_annotations_one_per_problem(tmp_path):
    bad = tmp_path / "two.yaml"
    bad.write_text(
        "name: m\nbackend: vllm\nmodel: {id: a/b}\nspeculative:\n  method: ngram\n  ngram: {min: 9, max: 3}\n"
        "proxy: {engine_port: 8000}\n",
        encoding="utf-8",
    )
    res = run("validate", "--format", "github", str(bad))
    assert res.code == 1
    assert res.stdout.splitlines() == [
        f"::error file={bad},line=6,col=16,title=specops::speculative.ngram.min: ngram.min (9) must be <= ngram.max (3)",
        f"::error file={bad},line=7,col=22,title=specops::proxy.engine_port: the engine port must differ from the "
        "public port 8000",
    ]


def test_validate_empty_directory_is_an_error(tmp_path):
    res = run("validate", str(tmp_path))
    assert res.code == 1 and "no profiles found" in res.stderr


def test_validate_mixes_files_and_directories(tmp_path):
    res = run("validate", "profiles/llama31-8b-eagle3.yaml", "tests/malformed/empty.yaml")
    assert res.code == 1
    assert res.stdout.splitlines()[0].startswith(
        "ok      profiles/llama31-8b-eagle3.yaml  (vllm, eagle3, measured on 0.32.0)"
    )
    assert "error   tests/malformed/empty.yaml:1:1: the file is empty" in res.stdout


def test_plugins_lists_the_builtin_backends():
    res = run("plugins", "--json")
    assert res.code == 0
    rows = {r["backend"]: r for r in json.loads(res.stdout)}
    assert {"vllm", "llamacpp"} <= set(rows)
    assert "medusa" in rows["vllm"]["methods"] and "medusa" not in rows["llamacpp"]["methods"]
    assert rows["llamacpp"]["metrics_path"] == "/metrics" and rows["vllm"]["health_path"] == "/health"
    text = run("plugins").stdout
    assert re.search(r"^vllm\s", text, re.M) and re.search(r"^llamacpp\s", text, re.M)
