"""Shared test set-up. Area-specific fixtures live in tests/support_<area>.py modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can `import support_<area>`

IN_CI = bool(os.environ.get("CI"))


def pytest_configure(config):
    # Rewriting goldens in CI would make every golden test compare the code with itself.
    if IN_CI and os.environ.get("SPECOPS_UPDATE_GOLDEN"):
        raise pytest.UsageError(
            "SPECOPS_UPDATE_GOLDEN is refused when CI is set: goldens are rewritten by a "
            "person, reviewed, and committed; CI only compares against them"
        )


def unavailable(why: str):
    """A test cannot run here (engine, model, tool missing): skip on a workstation, fail in CI.

    CI installs everything itself (scripts/setup), so a missing part there is a broken set-up, and a skip
    would count a test that never ran as fine.
    """
    if IN_CI:
        pytest.fail(f"{why} (CI=true: a missing part is a failure, not a skip)", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """Isolate specops' cache/state from the user's (engines stay shared through SPECOPS_CACHE)."""
    monkeypatch.setenv("SPECOPS_STATE", str(tmp_path / "state"))
    return tmp_path


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """The folder of generated tiny models (HF and GGUF), made once per machine (cached)."""
    from specops.devenv.testmodels import ensure_tiny_models
    from specops.paths import tiny_models_dir

    ensure_tiny_models()
    return tiny_models_dir()
