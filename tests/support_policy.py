"""What the suite demands of its own tests, as pytest hooks (tests/conftest.py imports them: a conftest's
``pytest_*`` names are its hooks; tests/test_suite_policy.py puts them in an inner suite the same way):

- under CI (``CI`` set) a skipped test is a failed test, whatever skipped it: ``pytest.skip``, a ``skipif``
  mark, ``pytest.importorskip`` in a test or at a module's top. CI installs everything the suite needs
  itself (scripts/setup), so a skip there is a test that never ran counted as fine. Outside CI a skip stays
  a skip;
- a test that starts or probes an engine must be marked ``engines``, so that ``-m "not engines"`` is the fast
  tier it claims to be: :func:`require_engines_marker` fails it, called where the suite reaches a real engine
  (tests/support_engines.py's ``need_*``, the tiny-model fixtures of tests/conftest.py, tests/support_up.py's
  ``UpRun``), and :func:`_engine_audit` calls it for any process the test process starts from the engine cache
  (llama-server, rpc-server, the vLLM venv's python), whoever starts it: the test, a fixture, specops itself;
- a test marked ``engines`` that names no timeout gets :data:`ENGINES_TIMEOUT_S` (pyproject's ``timeout``
  is for the others);
- under pytest-xdist with ``--dist loadgroup`` (scripts/test's engine pass runs ``-n 2 --dist loadgroup``) the
  tests that start engines keep to the two lanes of :func:`lane`, each lane one test at a time on one worker,
  longest lane first; tests that start nothing are in no lane and spread over all workers.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from specops.paths import engines_dir

_NEEDS_ROOT = (
    "it needs root to chown a folder to another user: it depends on who runs the suite, not on anything "
    "scripts/setup installs (CI runs as root, so it runs there)"
)
#: The skips CI accepts: node id (or a prefix of it) → why that skip is not a missing part of the set-up.
#: Every test that skips unless root is here (tests/test_suite_policy.py checks).
CI_SKIP_ALLOWED: dict[str, str] = {
    "tests/test_instance_safety.py::test_a_state_folder_of_another_user_is_refused": _NEEDS_ROOT,
    "tests/test_security_instance.py::test_a_state_folder_of_another_user_is_refused": _NEEDS_ROOT,
}


#: The timeout of a test marked `engines` that names none itself.
ENGINES_TIMEOUT_S = 900
_RUNNING: dict[str, pytest.Item | None] = {"item": None}


def lane(item: pytest.Item) -> str | None:
    """The xdist group of a test that starts engines, ``None`` for one that starts none.

    A test's engine and its load generator share the machine, so a lane runs its tests one at a time, and two
    lanes balance on two cores: ``vllm``, the vLLM tests (those that name vLLM or take the HF tiny models, made
    for vLLM) but the support-matrix cells, 14.6 min one after the other in a fresh-clone run here; and
    ``cells-llama``, the matrix cells of every engine with the llama-server and Prometheus tests, 13.2 min.
    """
    if item.get_closest_marker("engines") is None and item.get_closest_marker("prometheus") is None:
        return None
    if item.path.stem.endswith("matrix_engines"):  # tests/test_matrix_engines.py
        return "cells-llama"
    if "vllm" in item.nodeid.lower() or "tiny_models" in getattr(item, "fixturenames", ()):
        return "vllm"
    return "cells-llama"


#: The lanes, longest first: each starts as soon as a worker is free, and the suite lasts as long as its longest
#: lane, so that one goes first.
LANES = ("vllm", "cells-llama")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    # the workers collect (the controller does not): there xdist sets the option `loadgroup` for --dist loadgroup
    lanes = config.pluginmanager.hasplugin("xdist") and getattr(config.option, "loadgroup", False)
    for item in items:
        if item.get_closest_marker("engines") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ENGINES_TIMEOUT_S))
        if lanes and (name := lane(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(name))
    if lanes:  # stable: within a lane, and among the tests that start nothing, the order stays as collected
        items.sort(key=lambda item: LANES.index(name) if (name := lane(item)) is not None else len(LANES))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _RUNNING["item"] = item  # before any fixture of the test is set up, module- and session-scoped included


def require_engines_marker(what: str) -> None:
    """Fail the running test if it is not marked ``engines``: it ``what`` (starts or probes an engine), so
    ``-m "not engines"`` (scripts/test --fast) would run it while claiming to leave engines out."""
    item = _RUNNING["item"]
    if item is not None and item.get_closest_marker("engines") is None:
        pytest.fail(
            f"{item.nodeid} {what} but is not marked `engines`: add @pytest.mark.engines (and a timeout)",
            pytrace=False,
        )


#: The engine cache `specops engines setup` fills, read once: a test that points ``SPECOPS_CACHE`` at a cache
#: of its own puts stand-ins there, not engines. Both spellings: the cache folder may be a link.
_ENGINE_DIRS = {Path(os.path.abspath(engines_dir())), engines_dir().resolve()}


def engine_program(executable, env) -> Path | None:
    """The program a new process runs (as ``subprocess.Popen`` audits it), when it is in the engine cache."""
    program = os.fsdecode(executable)
    if os.sep not in program:  # looked up on the PATH it is started with
        path = (env if env is not None else os.environ).get("PATH", os.defpath)
        program = shutil.which(program, path=os.fsdecode(path)) or program
    found = Path(os.path.abspath(program))  # not resolved: the vLLM venv's python links out of the cache
    return found if any(found.is_relative_to(d) for d in _ENGINE_DIRS) else None


def _engine_audit(event: str, args: tuple) -> None:
    """Every process started from the test process passes here (an audit hook): one from the engine cache
    needs the ``engines`` marker, even when a helper or specops starts it and no ``need_*`` was called."""
    if event == "subprocess.Popen" and _RUNNING["item"] is not None:
        executable, _argv, _cwd, env = args
        program = engine_program(executable, env)
        if program is not None:
            require_engines_marker(f"starts {program.name} from the engine cache ({program})")


sys.addaudithook(_engine_audit)  # once per process: a module is imported once


def _in_ci() -> bool:
    return bool(os.environ.get("CI"))


def _allowed(nodeid: str) -> bool:
    return any(nodeid == k or nodeid.startswith(k + "[") for k in CI_SKIP_ALLOWED)


def _reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        path, line, why = longrepr
        return f"{why.removeprefix('Skipped: ')} ({path}:{line + 1 if isinstance(line, int) else line})"
    return str(longrepr)


def _failed_skip(nodeid: str, longrepr) -> str:
    return (
        f"skipped under CI=true: {_reason(longrepr)}. A skip in CI is a failure: CI installs every part the "
        f"suite needs (scripts/setup); fix the set-up, or, if the skip does not depend on it, add {nodeid} "
        "with its reason to CI_SKIP_ALLOWED in tests/support_policy.py"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and _in_ci() and not _allowed(item.nodeid):
        rep.outcome = "failed"
        rep.longrepr = _failed_skip(item.nodeid, rep.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at collection (``pytest.importorskip`` or ``pytest.skip(allow_module_level)``)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and _in_ci() and not _allowed(rep.nodeid):
        rep.outcome = "failed"
        rep.longrepr = _failed_skip(rep.nodeid, rep.longrepr)
