"""CI rules of the suite itself: a missing engine/model/tool fails in CI instead of skipping, and goldens are
never rewritten by a CI run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def pytest_run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "SPECOPS_UPDATE_GOLDEN")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_update_golden_is_refused_in_ci():
    out = pytest_run(
        ["--collect-only", "-q", str(TESTS / "test_speedup.py")],
        {"CI": "true", "SPECOPS_UPDATE_GOLDEN": "1"},
        TESTS.parent,
    )
    assert out.returncode == 4, out.stdout + out.stderr
    assert "SPECOPS_UPDATE_GOLDEN is refused when CI is set" in out.stderr
    out = pytest_run(["--collect-only", "-q", str(TESTS / "test_speedup.py")], {"CI": "true"}, TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_missing_part_skips_locally_and_fails_in_ci(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom conftest import unavailable\n\n"
        "def test_needs_an_engine():\n    unavailable('llama-server not set up')\n"
    )
    local = pytest_run(["-q", "-rs", "test_probe.py"], {}, tmp_path)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout
    ci = pytest_run(["-q", "test_probe.py"], {"CI": "true"}, tmp_path)
    assert ci.returncode == 1 and "1 failed" in ci.stdout, ci.stdout
    assert "llama-server not set up (CI=true: a missing part is a failure, not a skip)" in ci.stdout
