"""Shared test set-up. Area-specific fixtures live in tests/support_<area>.py modules."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can `import support_<area>`


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
    from specops.fixtures import ensure_tiny_models
    from specops.paths import tiny_models_dir
    ensure_tiny_models()
    return tiny_models_dir()
