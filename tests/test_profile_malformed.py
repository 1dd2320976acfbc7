"""Malformed profiles: each gives exactly one clear, located error and exit code 1, never a traceback.

Every file in tests/malformed/ starts with ``# expect: [FILE:]LINE:COL FIELD`` (FIELD ``-`` when the error
belongs to no field, e.g. a YAML syntax error; FILE, relative to tests/malformed/, when the error is in
another file, e.g. an extends cycle found in a base). Helpers that cases extend live in _parts/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support_cli import ROOT, run

MALFORMED = Path(__file__).resolve().parent / "malformed"
CASES = sorted(p for p in MALFORMED.glob("*.yaml"))
#: The variable env-unset.yaml refers to; the tests make sure it is unset.
UNSET = "SPECOPS_MALFORMED_SURELY_UNSET_7Q"
ENV = {UNSET: None}
EXPECT = re.compile(r"^# expect: (?:(?P<file>[^\s:]+):)?(?P<line>\d+):(?P<col>\d+) (?P<field>\S+)$")


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def expectation(path: Path) -> tuple[str, int, int, str]:
    first = path.read_bytes().split(b"\n", 1)[0].decode("ascii")
    m = EXPECT.match(first)
    assert m, f"{path.name}: first line must be `# expect: LINE:COL FIELD`, not {first!r}"
    file = (MALFORMED / m["file"]) if m["file"] else path
    return (str(file.relative_to(ROOT)), int(m["line"]), int(m["col"]), "" if m["field"] == "-" else m["field"])


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30
    assert len({expectation(p)[3] for p in CASES}) >= 25  # they exercise many different fields


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_validate_reports_exactly_one_located_error(path):
    file, line, col, field = expectation(path)
    res = run("validate", str(path.relative_to(ROOT)), env=ENV)
    assert res.code == 1, res
    assert "Traceback" not in res.stdout + res.stderr
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, res.stdout
    text = errors[0].split(None, 1)[1]
    prefix = f"{file}:{line}:{col}: " + (f"{field}: " if field else "")
    assert text.startswith(prefix), f"expected {prefix!r}, got {text!r}"
    message = text[len(prefix) :]
    assert len(message) >= 10 and "\n" not in message  # says what is wrong, on one line
    if not field:
        assert not re.match(r"^[\w.\[\]]+: ", message), message  # no field means none was left out


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_render_reports_the_same_single_error(path):
    file, line, col, field = expectation(path)
    res = run("render", str(path.relative_to(ROOT)), "--backend-version", "0.32.0", env=ENV)
    assert res.code == 1
    assert res.stdout == ""  # nothing half-rendered
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {file}:{line}:{col}: "), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_json_format_carries_the_location(path):
    file, line, col, field = expectation(path)
    res = run("validate", "--format", "json", str(path.relative_to(ROOT)), env=ENV)
    assert res.code == 1
    data = json.loads(res.stdout)
    assert data["ok"] is False
    [profile] = data["profiles"]
    assert profile["ok"] is False and len(profile["errors"]) == 1
    err = profile["errors"][0]
    assert (err["file"], err["line"], err["column"], err["field"]) == (file, line, col, field)


def test_the_unset_variable_case_passes_once_the_variable_is_set():
    """env-unset.yaml fails only because of the variable: with it set, the profile is valid."""
    res = run("validate", "tests/malformed/env-unset.yaml", env={UNSET: "sk-test"})
    assert res.code == 0, res
    assert res.stdout.startswith("ok ")


def test_did_you_mean_hints():
    hints = {
        "unknown-top-level-key.yaml": "did you mean 'speculative'?",
        "unknown-nested-key.yaml": "did you mean 'num_speculative_tokens'?",
        "unknown-method.yaml": "did you mean 'eagle3'?",
        "unknown-backend.yaml": "did you mean 'vllm'?",
    }
    for name, hint in hints.items():
        res = run("validate", f"tests/malformed/{name}", env=ENV)
        assert hint in res.stdout, (name, res.stdout)


def test_duplicate_key_names_the_first_definition():
    res = run("validate", "tests/malformed/duplicate-key.yaml", env=ENV)
    assert "first defined at line 3" in res.stdout


def test_a_directory_of_malformed_profiles_lists_one_error_each():
    """Validating the whole folder: one error line per case, and the exit code is 1."""
    res = run("validate", "tests/malformed", env=ENV)
    assert res.code == 1
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error")]
    # every case once, plus the two _parts files of the extends cycle: they are bases, but a cycle is a real
    # error in them (not just the missing fields a partial base is allowed to have)
    # (the extends-cycle case's own error is located in _parts too: 3 errors point there; the error of
    # extends-base-unknown-key is in its base, _parts/typo-base.txt, which validate does not collect)
    parts = [e for e in errors if "/_parts/" in e.split(":", 1)[0]]
    cycle = [e for e in parts if "extends cycle" in e]
    assert len(cycle) == 3 and len(parts) == 4, parts
    assert "_parts/typo-base.txt:3:1: unknown top-level field" in "".join(parts)
    assert len(errors) == len(CASES) + 2
    assert "Traceback" not in res.stdout + res.stderr


def test_nothing_from_a_non_profile_or_a_refused_secret_is_ever_printed():
    """Cases whose files hold text marked MUST-NOT-SHOW (a file named by `extends` that is not a profile, a
    secret in extra_args): no output format quotes it, CI annotations included."""
    for fmt in ("text", "json", "github"):
        res = run("validate", "--format", fmt, "tests/malformed", env=ENV)
        out = res.stdout + res.stderr
        assert res.code == 1 and "Traceback" not in out
        for needle in ("MUST-NOT-SHOW", "MUST_NOT_SHOW", "hunter2", "AKIA", "$6$"):
            assert needle not in out, (fmt, needle)
