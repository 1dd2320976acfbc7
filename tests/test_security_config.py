"""Secrets written into a profile's text are refused with a located error by every command that loads it.

Regressions of a security review (issue 25, items 6 and 7): ``k8s render`` wrote a ``${VAR:-literal}``
default of a secret field, a secret-named variable's default and URL passwords into the ConfigMap (exit 0);
``server.extra_args: ["--alias", "${HF_TOKEN}"]`` validated, printed ``***`` and put the token on the
engine's command line, which every user reads in ``ps``. Each case runs the real CLI (``validate``,
``render``, ``k8s render``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support_cli import run

HEAD = "name: sec\nbackend: vllm\nengine: {version: 0.32.0}\nmodel: {id: m/x}\nspeculative: {method: ngram}\n"
#: what the pods need besides the case itself (``k8s render`` refuses an api_key without a Secret)
POD_KEY = "deploy: {secrets: {api_key: {name: s, key: k}}}\n"
#: the rendering machine has none of these set (as in CI); the pods get them from Secrets
ENV = {"API_KEY": None, "HF_TOKEN": None, "SPECOPS_API_KEY": None, "PROMETHEUS_URL": None, "DB_PASS": None}
COMMANDS = (("validate",), ("render",), ("k8s", "render"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sec.yaml"
    path.write_text(HEAD + text, encoding="utf-8")
    return path


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


@pytest.mark.parametrize(
    "text, needle, field, secret, why",
    [
        # item 6: a default on a secret field is the secret itself, written in the profile
        (
            'server:\n  api_key: "${API_KEY:-hunter2-MUST-NOT-SHOW}"\n' + POD_KEY,
            "api_key",
            "server.api_key",
            "hunter2-MUST-NOT-SHOW",
            "default",
        ),
        (
            'server:\n  env:\n    HF_TOKEN: "${HF_TOKEN:-hf_MUST_NOT_SHOW}"\n',
            "HF_TOKEN:",
            "server.env.HF_TOKEN",
            "hf_MUST_NOT_SHOW",
            "default",
        ),
        # a secret-named variable with a default, anywhere (here a harmless-looking env entry)
        (
            'server:\n  env:\n    EXTRA_HEADER: "Bearer ${HF_TOKEN:-abcMUSTNOTSHOW}"\n',
            "EXTRA_HEADER",
            "server.env.EXTRA_HEADER",
            "abcMUSTNOTSHOW",
            "default",
        ),
        # passwords in URLs, anywhere in the profile
        (
            'monitor:\n  source: promql\n  prometheus_url: "http://admin:pw-MUST-NOT-SHOW@prom:9090"\n',
            "prometheus_url",
            "monitor.prometheus_url",
            "pw-MUST-NOT-SHOW",
            "password",
        ),
        (
            'server:\n  env:\n    DATABASE_URL: "postgres://u:pass-MUST-NOT-SHOW@db:5432/x"\n',
            "DATABASE_URL",
            "server.env.DATABASE_URL",
            "pass-MUST-NOT-SHOW",
            "password",
        ),
        (
            'server:\n  extra_args: ["--kv-events-config", "postgres://u:argv-MUST-NOT-SHOW@db/x"]\n',
            "extra_args",
            "server.extra_args[1]",
            "argv-MUST-NOT-SHOW",
            "password",
        ),
        # a URL's password as the default of a variable
        (
            'monitor:\n  source: promql\n  prometheus_url: "${PROMETHEUS_URL:-http://a:dflt-MUST-NOT-SHOW@prom}"\n',
            "prometheus_url",
            "monitor.prometheus_url",
            "dflt-MUST-NOT-SHOW",
            "password",
        ),
    ],
)
def test_secrets_written_in_the_profile_are_refused_by_every_command(tmp_path, text, needle, field, secret, why):
    path = _write(tmp_path, text)
    line = _line_of(path, needle)
    for command in COMMANDS:
        res = run(*command, path, env=ENV)
        out = res.stdout + res.stderr
        assert res.code == 1, (command, out)
        assert re.search(rf"sec\.yaml:{line}:\d+: {re.escape(field)}: ", out), (command, out)
        assert why in out and secret not in out and "Traceback" not in out, (command, out)


@pytest.mark.parametrize(
    "text",
    [
        'server:\n  api_key: "${SPECOPS_API_KEY:-}"\n' + POD_KEY,  # an empty default: no key, nothing written
        'server:\n  api_key: "${SPECOPS_API_KEY}"\n' + POD_KEY,
        'server:\n  env:\n    SERVED: "${SERVED:-org/model}"\n',  # a default of a variable that is no secret
        'server:\n  env:\n    DATABASE_URL: "postgres://u:${DB_PASS}@db:5432/x"\n',  # the password from the pods
        'server:\n  env:\n    DATABASE_URL: "https://user@example.com/x"\n',  # a user name is no password
        'monitor:\n  source: promql\n  prometheus_url: "${PROMETHEUS_URL:-http://prom:9090}"\n',
        'server:\n  extra_args: ["--chat-template", "${HOME}/t.jinja"]\n',  # a public variable
        'server:\n  extra_args: ["--alias", "$${HF_TOKEN}"]\n',  # `$$`: the text ${HF_TOKEN}, no variable
    ],
)
def test_references_and_public_values_still_load(tmp_path, text):
    path = _write(tmp_path, text)
    res = run("validate", path, env={**ENV, "SPECOPS_API_KEY": "sk-x", "DB_PASS": "pw"})
    assert res.code == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    "arg, name",
    [("${HF_TOKEN}", "HF_TOKEN"), ("--api=${API_KEY}", "API_KEY"), ("${SERVED_NAME}", "SERVED_NAME")],
)
def test_a_private_variable_is_refused_in_extra_args(tmp_path, arg, name):
    """Item 7: the engine's argv held the token (``ps`` shows it) while renders printed ``***``."""
    path = _write(tmp_path, f'server:\n  extra_args: ["--alias", "{arg}"]\n')
    env = {**ENV, "HF_TOKEN": "hf_ARGV_MUST_NOT_SHOW", "API_KEY": "sk-ARGV-MUST-NOT-SHOW", "SERVED_NAME": "shown"}
    line = _line_of(path, "extra_args")
    for command in COMMANDS[:2]:
        res = run(*command, path, env=env)
        out = res.stdout + res.stderr
        assert res.code == 1, (command, out)
        assert f"sec.yaml:{line}:" in out and "server.extra_args[1]" in out and f"${{{name}}}" in out, out
        assert "MUST_NOT_SHOW" not in out and "MUST-NOT-SHOW" not in out and "`ps`" in out, out


def test_a_variable_listed_as_public_may_go_into_extra_args_and_a_secret_named_one_never(tmp_path):
    path = _write(tmp_path, 'server:\n  extra_args: ["--served-model-name", "${SERVED_NAME}"]\n')
    res = run("render", path, env={**ENV, "SERVED_NAME": "my-model", "SPECOPS_PUBLIC_VARS": "SERVED_NAME"})
    assert res.code == 0 and "--served-model-name my-model" in res.stdout, res.stdout + res.stderr
    path = _write(tmp_path, 'server:\n  extra_args: ["--alias", "${HF_TOKEN}"]\n')
    res = run("render", path, env={**ENV, "HF_TOKEN": "hf_x", "SPECOPS_PUBLIC_VARS": "HF_TOKEN"})
    assert res.code == 1 and "server.extra_args[1]" in res.stdout + res.stderr


def test_a_secret_in_a_base_file_is_refused_through_the_profile_that_extends_it(tmp_path):
    (tmp_path / "base.yaml").write_text('server:\n  env:\n    DATABASE_URL: "postgres://u:base-MUST-NOT-SHOW@db/x"\n')
    path = tmp_path / "sec.yaml"
    path.write_text("extends: base.yaml\n" + HEAD)
    res = run("validate", path, env=ENV)
    out = res.stdout + res.stderr
    assert res.code == 1 and "base.yaml:3:" in out and "server.env.DATABASE_URL" in out, out
    assert "base-MUST-NOT-SHOW" not in out


def test_up_refuses_before_it_starts_anything(tmp_path):
    """``specops up`` loads the profile as ``validate`` does: the same located error, nothing launched."""
    import os
    import subprocess

    from support_cli import SPECOPS

    path = _write(tmp_path, 'server:\n  api_key: "${API_KEY:-hunter2-MUST-NOT-SHOW}"\n')
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    env["SPECOPS_STATE"] = str(tmp_path / "state")
    res = subprocess.run([str(SPECOPS), "up", str(path)], capture_output=True, text=True, env=env, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and f"sec.yaml:{_line_of(path, 'api_key')}:" in out and "server.api_key" in out, out
    assert "hunter2" not in out and not (tmp_path / "state").exists(), out
