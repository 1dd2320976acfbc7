"""Environment references in a profile (safe to expose, round three): every form a shell user would write either
interpolates as the shell would or is a located error naming the supported form, through ``specops validate``.

Before, ``$VAR``, ``${VAR-default}`` and ``${VAR:=default}`` stayed literal text: ``api_key: $SECKEY`` validated
"ok", and ``up`` then demanded the guessable text ``$SECKEY`` as the API key.
"""

from __future__ import annotations

import pytest
from support_cli import run

HEAD = "name: t\nbackend: vllm\nmodel: {id: org/model}\n"
ENV = {"SECKEY": "s3cret-value-MUST-NOT-SHOW", "EMPTY": "", "UNSET": None}


def _validate(tmp_path, line: str):
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + line + "\n", encoding="utf-8")
    return path, run("validate", path, env=ENV)


@pytest.mark.parametrize(
    "value,says",
    [
        ("$SECKEY", "$SECKEY is not interpolated: write ${SECKEY} (or $$SECKEY for the text $SECKEY)"),
        ("Bearer $SECKEY", "$SECKEY is not interpolated: write ${SECKEY}"),
        ("${SECKEY-fallback}", "${SECKEY-…} is not supported: write ${SECKEY:-…} (the default is taken when"),
        ("${SECKEY:=fallback}", "${SECKEY:=…} is not supported: write ${SECKEY:-…}: specops never sets a variable"),
        ("${SECKEY=fallback}", "${SECKEY=…} is not supported: write ${SECKEY:-…}: specops never sets a variable"),
        ("${SECKEY:?set it}", "${SECKEY:?…} is not supported: write ${SECKEY}: an unset variable is already an error"),
        ("${SECKEY?set it}", "${SECKEY?…} is not supported: write ${SECKEY}: an unset variable is already an error"),
        ("${SECKEY:+on}", "${SECKEY:+…} is not supported: write the text itself"),
        ("${SECKEY", "a ${ that is not ${VAR} or ${VAR:-default}: write one of them ($$ for a literal $)"),
        ("${1}", "a ${ that is not ${VAR} or ${VAR:-default}"),
        ("${SECKEY}-$UNSET", "$UNSET is not interpolated: write ${UNSET}"),
    ],
)
def test_a_shell_reference_specops_does_not_read_is_a_located_error(tmp_path, value, says):
    path, r = _validate(tmp_path, f"server: {{api_key: '{value}'}}")
    assert r.code == 1, r.stdout + r.stderr
    assert f"{path}:4:19: server.api_key: {says}" in r.stdout + r.stderr
    assert "fallback" not in r.stdout + r.stderr and "MUST-NOT-SHOW" not in r.stdout + r.stderr  # no value quoted


SHELL_LIKE = [
    ("$$SECKEY", "$SECKEY"),  # `$$` is a literal `$`
    ("$${SECKEY}", "${SECKEY}"),
    ("costs 5$ or $5", "costs 5$ or $5"),  # a `$` before no name stays as written
    ("^end$", "^end$"),
    ("${UNSET:-org/default}", "org/default"),
    ("${EMPTY:-org/default}", "org/default"),  # as in a shell, `:-` when unset or empty (it was: empty)
    ("${EMPTY}x", "x"),
]


def test_supported_references_interpolate_as_a_shell_would_and_a_literal_dollar_stays(tmp_path):
    from specops.config.profile import load_profile

    env = {k: v for k, v in ENV.items() if v is not None}
    for i, (value, becomes) in enumerate(SHELL_LIKE):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(HEAD.replace("org/model", f"'{value}'"), encoding="utf-8")
        assert run("validate", path, env=ENV).code == 0, value
        assert load_profile(path, env=env).profile.model.id == becomes, value
