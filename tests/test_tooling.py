"""The linters the project is held to, run as part of the suite: ruff (lint and format) and mypy --strict on
the pure core. Their configuration is in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_strict_on_the_pure_core():
    res = run(str(BIN / "mypy"))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "Success" in res.stdout


def test_ruff_lint():
    res = run(str(BIN / "ruff"), "check", ".")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_ruff_format():
    res = run(str(BIN / "ruff"), "format", "--check", ".")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
