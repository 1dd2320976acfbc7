"""Secrets never print: values from the environment, secret-named settings, URL passwords.

Regressions of a security review: an interpolated token echoed in an "invalid value" error; a key inside
``model.id`` rendered as is; redaction after shell quoting (a key with a quote leaked in pieces, also into
engine.log); a one-letter key that mangled unrelated text and so revealed itself; ``${VAR}`` re-parsed as
YAML (``"s3cret #prod"`` became ``s3cret``); secrets in ``extra_args``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from support_cli import run

from specops.backends.render import format_plan, render_plan
from specops.config.profile import load_profile
from specops.errors import ProfileError
from specops.plugins import get_registry

KEY = "sk-live-SECRETS-TEST-9c1f"
QUOTED = "sk-it's-secret"
VLLM = "name: m\nbackend: vllm\nengine: {version: 0.32.0}\n"
LLAMA = "name: m\nbackend: llamacpp\nengine: {version: current}\n"


def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _render_all(path: Path, env: dict) -> dict[str, str]:
    out = {}
    for fmt in ("shell", "json", "args"):
        res = run("render", path, "--format", fmt, env=env)
        assert res.code == 0, res
        out[fmt] = res.stdout
    return out


def _plan(path: Path, env: dict):
    return render_plan(load_profile(path, env=env, registry=get_registry()), get_registry(), probe=False)


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("token", ["hf_SECRETS_TEST_invalid_value_77", "ab", "x", "a", "e"])
@pytest.mark.parametrize("fmt", ["text", "json", "github"])
def test_an_interpolated_value_is_hidden_in_an_invalid_value_error(tmp_path, token, fmt):
    path = _write(tmp_path, VLLM + 'model: {id: a/b}\nspeculative:\n  method: "${HF_TOKEN}"\n')
    res = run("validate", "--format", fmt, path, env={"HF_TOKEN": token})
    assert res.code == 1
    out = res.stdout + res.stderr
    assert f"'{token}'" not in out and f'"{token}"' not in out and "Traceback" not in out
    assert "invalid value '***'" in out
    assert "should be 'eagle', 'eagle3'" in out  # the rest of the message is intact, even for a 1-letter value


def test_render_error_hides_the_interpolated_value(tmp_path):
    path = _write(tmp_path, LLAMA + 'model:\n  id: "./weights/${WEIGHTS}"\n')
    res = run("render", path, env={"WEIGHTS": "SECRETS-TEST-dir-name"})
    assert res.code == 1 and "SECRETS-TEST" not in res.stderr
    assert "'./weights/***': llama.cpp needs a .gguf file" in res.stderr


def test_a_short_value_is_hidden_where_the_message_quotes_it_and_nowhere_else(tmp_path):
    path = _write(tmp_path, LLAMA + 'model:\n  id: "${M}"\n')
    res = run("validate", path, env={"M": "a"})
    assert res.code == 1
    assert "model.id: '***' is neither a local .gguf file nor a Hub repo id (org/name)" in res.stdout


def test_extends_named_by_the_environment_is_hidden_in_errors(tmp_path):
    path = _write(tmp_path, "extends: ${BASE}\n" + VLLM + "model: {id: a/b}\n")
    res = run("validate", path, env={"BASE": "SECRETS-TEST-base.yaml"})
    assert res.code == 1 and "SECRETS-TEST" not in res.stdout and "file not found: ***" in res.stdout


# --------------------------------------------------------------------------------------------- renders


def test_an_interpolated_key_inside_model_id_is_hidden_in_every_format(tmp_path):
    path = _write(tmp_path, VLLM + 'model: {id: "x/${API_KEY}"}\n')
    outputs = _render_all(path, {"API_KEY": KEY})
    for fmt, out in outputs.items():
        assert KEY not in out, fmt
    assert " x/*** " in outputs["shell"] or " 'x/***' " in outputs["shell"]
    plan_ = json.loads(outputs["json"])
    assert plan_["argv"][2] == "x/***" and plan_["model_name"] == "x/***"
    assert "x/***" in outputs["args"].splitlines()


@pytest.mark.parametrize("fmt", ["shell", "json", "args"])
def test_a_key_with_a_quote_is_redacted_before_quoting(tmp_path, fmt):
    """`'sk-it'"'"'s-secret'` no longer slips past a search for the raw value."""
    path = _write(
        tmp_path,
        VLLM + 'model: {id: a/b}\nserver:\n  api_key: "${API_KEY}"\n  env:\n    OTHER: "pre-${API_KEY}-post"\n',
    )
    out = run("render", path, "--format", fmt, env={"API_KEY": QUOTED}).stdout
    for piece in ("sk-it", "s-secret", QUOTED):
        assert piece not in out, (fmt, out)
    if fmt == "shell":
        words = shlex.split(out)
        assert "VLLM_API_KEY=***" in words and "OTHER=pre-***-post" in words


def test_engine_log_lines_are_redacted_in_every_spelling(tmp_path):
    """What specops writes to engine.log: the start line (plan.shell) and each engine line (plan.redact)."""
    path = _write(tmp_path, VLLM + 'model: {id: a/b}\nserver:\n  api_key: "${API_KEY}"\n')
    p = _plan(path, {"API_KEY": QUOTED})
    assert QUOTED not in p.shell() and "sk-it" not in p.shell()
    for line in (
        f"api_key={QUOTED}",
        f"args: {{'api_key': {QUOTED!r}}}",
        f"args: {json.dumps({'k': QUOTED})}",
        f"cmd: --api-key {shlex.quote(QUOTED)}",
        "x" + repr(QUOTED + '"'),
    ):
        assert "sk-it" not in p.redact(line), line
    assert p.redact("INFO serving on http://127.0.0.1:8000") == "INFO serving on http://127.0.0.1:8000"


def test_a_one_letter_key_hides_itself_only_where_it_stands(tmp_path):
    """A search for `a` would print `met***-ll***m***` and so tell everyone the key is `a`."""
    path = _write(
        tmp_path,
        VLLM + 'model: {id: meta-llama/Llama-3.1-8B-Instruct}\nserver:\n  api_key: "${API_KEY}"\n'
        "  env: {HF_TOKEN: a}\n",
    )
    out = _render_all(path, {"API_KEY": "a"})
    assert out["shell"] == (
        "HF_TOKEN=*** VLLM_API_KEY=*** vllm serve meta-llama/Llama-3.1-8B-Instruct --host 127.0.0.1 --port 8000\n"
    )
    p = _plan(path, {"API_KEY": "a"})
    assert (
        p.redact("loading meta-llama/Llama-3.1-8B-Instruct as a model")
        == "loading meta-llama/Llama-3.1-8B-Instruct as a model"
    )


def test_a_short_interpolated_value_is_hidden_at_its_position(tmp_path):
    """Position, not search: `org/b:Q4_K_M` prints as `org/***:Q4_K_M`, every other `b` stays."""
    path = _write(
        tmp_path,
        LLAMA + 'model:\n  id: "org/${K}"\n  quantization: Q4_K_M\nserver:\n  env:\n    MINE: "${K}"\n    PLAIN: b\n',
    )
    plan_ = json.loads(run("render", path, "--format", "json", env={"K": "b"}).stdout)
    argv = plan_["argv"]
    assert argv[argv.index("-hf") + 1] == "org/***:Q4_K_M"
    assert plan_["env"] == {"MINE": "***", "PLAIN": "b"}
    assert plan_["model_name"] == "org/***"


def test_a_number_from_the_environment_is_hidden_unless_its_variable_is_public(tmp_path):
    path = _write(tmp_path, VLLM + "model: {id: a/b}\nserver:\n  port: ${PORT}\n")
    hidden = json.loads(run("render", path, "--format", "json", env={"PORT": "8123"}).stdout)
    argv = hidden["argv"]
    assert argv[argv.index("--port") + 1] == "***" and "8123" not in json.dumps(hidden)
    shown = json.loads(
        run("render", path, "--format", "json", env={"PORT": "8123", "SPECOPS_PUBLIC_VARS": "PORT"}).stdout
    )
    assert shown["argv"][shown["argv"].index("--port") + 1] == "8123"


def test_public_variables_print_as_they_are(tmp_path):
    path = _write(tmp_path, LLAMA + 'model:\n  id: "${SPECOPS_MODELS}/${MODEL}.gguf"\n')
    env = {"SPECOPS_MODELS": "/models", "MODEL": "target"}
    assert "-m '/models/***.gguf'" in run("render", path, env=env).stdout
    assert "-m /models/target.gguf" in run("render", path, env={**env, "SPECOPS_PUBLIC_VARS": "MODEL, OTHER"}).stdout
    # a secret-looking name is never public, whatever the list says
    path2 = _write(tmp_path, VLLM + 'model: {id: "x/${HF_TOKEN}"}\n', "q.yaml")
    out = run("render", path2, env={"HF_TOKEN": "hf_SECRETS_public_list", "SPECOPS_PUBLIC_VARS": "HF_TOKEN"}).stdout
    assert "hf_SECRETS" not in out


def test_a_default_written_in_the_profile_is_not_secret(tmp_path):
    path = _write(tmp_path, VLLM + 'model: {id: "${MODEL:-org/model}"}\n')
    assert "vllm serve org/model " in run("render", path, env={"MODEL": None}).stdout


def test_fallback_step_draft_from_the_environment_stays_hidden_after_a_switch(tmp_path):
    path = _write(
        tmp_path,
        VLLM + "model: {id: a/b}\nspeculative: {method: eagle3, draft: org/e3}\n"
        'fallback:\n  chain:\n    - {method: draft_model, draft: "org/${D}"}\n    - none\n',
    )
    loaded = load_profile(path, env={"D": "q"}, registry=get_registry())
    from specops.config.profile import LoadedProfile

    switched = LoadedProfile(loaded.profile.at_step(1), loaded.document, loaded.path)
    text = format_plan(render_plan(switched, get_registry(), probe=False), "json")
    assert '\\"model\\":\\"org/***\\"' in text and "org/q" not in text


def test_validate_json_hides_a_name_from_the_environment(tmp_path):
    path = _write(tmp_path, "name: ${NAME}\nbackend: vllm\nmodel: {id: a/b}\n")
    data = json.loads(run("validate", "--format", "json", path, env={"NAME": "secret-name"}).stdout)
    assert data["profiles"][0]["name"] == "***"


# ------------------------------------------------------------------------------------ secret settings


def test_url_passwords_and_secret_assignments_are_redacted(tmp_path):
    # a URL password written in the profile is refused (tests/test_security_config.py); one from a variable
    # listed as public (so not hidden whole) is still hidden where it stands
    path = _write(
        tmp_path,
        VLLM + "model: {id: a/b}\nserver:\n  extra_args: [--kv-events-config, "
        '"${EVENTS_URL}", --middleware, "DB_PASSWORD=SECRETS-pw"]\n'
        '  env:\n    DATABASE_URL: "https://tok-SECRETS@example.com/x"\n',
    )
    env = {"SPECOPS_PUBLIC_VARS": "EVENTS_URL", "EVENTS_URL": "postgres://user:pw-SECRETS-url@db:5432/x"}
    for fmt, out in _render_all(path, env).items():
        assert "SECRETS" not in out, (fmt, out)
        assert "postgres://user:***@db:5432/x" in out and "DB_PASSWORD=***" in out, fmt
        assert "https://***@example.com/x" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--api-key", KEY],
        [f"--api-key={KEY}"],
        ["--hf-token", "hf_x"],
        ["-hft", "hf_x"],
        ["--token", "t"],
        ["--db-password=pw"],
    ],
)
def test_secret_flags_in_extra_args_are_refused(tmp_path, args):
    path = _write(tmp_path, VLLM + "model: {id: a/b}\nserver:\n  extra_args: " + json.dumps(args) + "\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path, env={}, registry=get_registry())
    [problem] = info.value.problems
    assert problem.field == "server.extra_args[0]" and "server.api_key" in problem.message
    assert KEY not in str(info.value) and "hf_x" not in str(info.value)


def test_flags_that_only_look_like_secrets_are_allowed(tmp_path):
    args = [
        "--api-key-file",
        "/k",
        "--ssl-keyfile",
        "/k.pem",
        "--tokenizer",
        "org/tok",
        "--max-num-batched-tokens",
        "8192",
        "--enable-prompt-tokens-details",
    ]
    path = _write(tmp_path, VLLM + "model: {id: a/b}\nserver:\n  extra_args: " + json.dumps(args) + "\n")
    assert load_profile(path, env={}, registry=get_registry()).profile.server.extra_args == args


# --------------------------------------------------------------------------------- interpolation as text


@pytest.mark.parametrize(
    "value",
    [
        "s3cret #prod",
        "&x realkey",
        "  spaced  ",
        "0123",
        "yes",
        "*alias",
        "[1, 2]",
        "a: b",
        "!!int 3",
        "~",
        "null",
        "- item",
    ],
)
def test_an_interpolated_value_is_text_exactly_as_set(tmp_path, value):
    path = _write(
        tmp_path, VLLM + 'model:\n  id: "${M}"\nserver:\n  api_key: ${K}\n  env:\n    A: ${K}\ndescription: ${K}\n'
    )
    profile = load_profile(path, env={"K": value, "M": "a/b"}, registry=get_registry()).profile
    assert profile.server.api_key == value and profile.server.env["A"] == value and profile.description == value


def test_numbers_and_booleans_from_the_environment_still_convert(tmp_path):
    path = _write(
        tmp_path,
        VLLM + "model:\n  id: a/b\n  trust_remote_code: ${T}\nserver:\n  port: ${PORT}\n"
        "gpus:\n  memory_utilization: ${MU}\nfallback:\n  window: ${W}\n",
    )
    p = load_profile(path, env={"PORT": "8123", "T": "true", "MU": "0.5", "W": "90s"}, registry=get_registry()).profile
    assert (p.server.port, p.model.trust_remote_code, p.gpus.memory_utilization, p.fallback.window) == (
        8123,
        True,
        0.5,
        90.0,
    )
    with pytest.raises(ProfileError, match="server.port"):
        load_profile(path, env={"PORT": "true", "T": "true", "MU": "0.5", "W": "90s"}, registry=get_registry())


def test_events_and_logs_print_argv_and_env_as_the_render_does(tmp_path):
    """The supervisor's start event redacts each argv element and env value with plan.redact."""
    path = _write(
        tmp_path,
        LLAMA + 'model:\n  id: "org/${K}"\n  quantization: Q4_K_M\nserver:\n  env:\n    HF_TOKEN: "${TOKEN}"\n',
    )
    p = _plan(path, {"K": "q", "TOKEN": "t"})
    assert [p.redact(a) for a in p.argv] == p.printed_argv()
    assert {k: p.redact(v) for k, v in p.env} == p.printed_env() == {"HF_TOKEN": "***"}
    assert "org/***:Q4_K_M" in p.printed_argv()
