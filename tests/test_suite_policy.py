"""The suite's own rules (tests/support_policy.py, tests/support_ports.py, pyproject), each shown on a tiny inner
suite run by pytester with the project's hooks in its conftest, the way tests/conftest.py has them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import support_ports

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(120)

HOOKS = (
    "from support_policy import (\n    pytest_collection_modifyitems, pytest_make_collect_report,\n"
    "    pytest_runtest_makereport, pytest_runtest_setup,\n)\n"
)
SKIPS = """
import pytest

def test_passes():
    pass

def test_importorskip_in_the_body():
    pytest.importorskip("no_such_module_for_specops_tests")

def test_skip_call():
    pytest.skip("no engine here")

@pytest.mark.skipif(True, reason="never on this machine")
def test_skipif_mark():
    pass

@pytest.mark.xfail(reason="a known bug, not a skip")
def test_xfail():
    assert False
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest(HOOKS)
    pytester.makeini("[pytest]\nmarkers =\n    engines: starts engines\n")
    return pytester


def test_every_kind_of_skip_fails_when_ci_is_set(inner, monkeypatch):
    inner.makepyfile(test_inner_skips=SKIPS)
    inner.makepyfile(test_inner_module_skip='import pytest\npytest.importorskip("no_such_module_either")\n')
    local = inner.runpytest("-p", "no:cacheprovider")
    local.assert_outcomes(passed=1, skipped=4, xfailed=1)  # a workstation: a skip stays a skip

    monkeypatch.setenv("CI", "true")
    ci = inner.runpytest("-p", "no:cacheprovider", "test_inner_skips.py")
    ci.assert_outcomes(passed=1, failed=2, errors=1, xfailed=1)  # a skipif mark skips in set-up: an error
    out = ci.stdout.str()
    assert "skipped under CI=true: never on this machine" in out and "no engine here" in out
    assert "no_such_module_for_specops_tests" in out and "CI_SKIP_ALLOWED" in out
    assert ci.ret == 1
    module = inner.runpytest("-p", "no:cacheprovider", "test_inner_module_skip.py")
    module.assert_outcomes(errors=1)  # a whole module skipped at import: a collection error
    assert "skipped under CI=true: could not import 'no_such_module_either'" in module.stdout.str()
    assert module.ret != 0


def test_an_allowed_skip_stays_a_skip_in_ci(inner, monkeypatch):
    import support_policy

    assert all(why.strip() for why in support_policy.CI_SKIP_ALLOWED.values())  # each entry says why
    monkeypatch.setitem(support_policy.CI_SKIP_ALLOWED, "test_inner_allowed.py::test_listed", "depends on the user")
    inner.makepyfile(
        test_inner_allowed="import pytest\n\ndef test_listed():\n    pytest.skip('needs root')\n\n"
        "def test_another():\n    pytest.skip('needs root')\n"
    )
    monkeypatch.setenv("CI", "true")
    res = inner.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(skipped=1, failed=1)  # only the listed test may skip


def test_every_test_that_skips_unless_root_is_allowed_to_in_ci():
    """A test that skips when not run by root (``os.geteuid()`` and ``pytest.skip`` in its body) depends on who
    runs the suite, so CI_SKIP_ALLOWED lists it: twins of one such test are listed alike."""
    import ast

    import support_policy

    suite = Path(__file__).resolve().parent
    root_only = []
    for path in sorted(suite.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                calls = {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
                if {"os.geteuid", "pytest.skip"} <= calls:
                    root_only.append(f"tests/{path.name}::{node.name}")
    assert root_only, "no root-only test found: the scan is broken"
    assert sorted(root_only) == sorted(support_policy.CI_SKIP_ALLOWED), "CI_SKIP_ALLOWED and the root-only tests differ"


def test_a_test_that_starts_an_engine_must_be_marked_engines(inner):
    inner.makepyfile(
        test_inner_engines="""
import pytest
from support_policy import require_engines_marker

@pytest.fixture(scope="module")
def engine():
    require_engines_marker("starts llama-server")  # in a module-scoped fixture too

def test_unmarked(engine):
    pass

@pytest.mark.engines
def test_marked():
    require_engines_marker("starts llama-server")
"""
    )
    res = inner.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, errors=1)
    assert "test_unmarked starts llama-server but is not marked `engines`" in res.stdout.str()


def test_every_way_to_a_real_engine_needs_the_marker(inner, monkeypatch, tmp_path):
    """The places a test reaches a real engine without a ``need_*`` call: the tiny-model fixtures, ``UpRun``,
    and any process started from the engine cache (by the test, a helper or specops; found on the PATH too)."""
    import support_engines  # noqa: F401 - bound to this suite's conftest before the inner one takes the name
    import support_policy

    cache = tmp_path / "engines" / "llama.cpp-b1" / "bin"
    cache.mkdir(parents=True)
    for name in ("llama-server", "rpc-server"):
        (cache / name).write_text("#!/bin/sh\nexit 0\n")
        (cache / name).chmod(0o755)
    monkeypatch.setattr(support_policy, "_ENGINE_DIRS", {tmp_path / "engines"})  # the engine cache of this test
    suite = Path(__file__).resolve().parent
    inner.makeconftest(
        HOOKS + "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(suite / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "tiny_gguf_models, tiny_models = suite.tiny_gguf_models, suite.tiny_models\n"
    )
    inner.makepyfile(
        test_inner_reach=f"""
import subprocess, sys
from pathlib import Path
import pytest
from support_up import UpRun

BIN = Path({str(cache)!r})

def test_gguf_fixture(tiny_gguf_models):
    pass

def test_hf_fixture(tiny_models):
    pass

def test_up_run(tmp_path):
    UpRun(tmp_path / "p.yaml", tmp_path / "state", "p").start()

def test_popen_by_path():
    subprocess.run([str(BIN / "llama-server"), "--version"], check=True)

def test_popen_on_the_path():
    subprocess.run(["rpc-server"], env={{"PATH": str(BIN)}}, check=True)

def test_popen_of_anything_else():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.engines
def test_marked_popen():
    subprocess.run([str(BIN / "llama-server"), "--version"], check=True)
    subprocess.run(["rpc-server"], env={{"PATH": str(BIN)}}, check=True)
"""
    )
    res = inner.runpytest("-p", "no:cacheprovider", "-p", "no:xdist")
    res.assert_outcomes(passed=2, failed=3, errors=2)
    out = res.stdout.str()
    assert "test_gguf_fixture needs llama-server but is not marked `engines`" in out
    assert "test_hf_fixture needs the vLLM CPU venv but is not marked `engines`" in out
    assert "test_up_run starts `specops up p.yaml` on a real engine but is not marked `engines`" in out
    assert f"test_popen_by_path starts llama-server from the engine cache ({cache / 'llama-server'})" in out
    assert f"test_popen_on_the_path starts rpc-server from the engine cache ({cache / 'rpc-server'})" in out


def test_engines_tests_get_the_long_timeout_and_keep_their_own(inner):
    inner.makepyfile(
        test_inner_timeouts="""
import pytest
from support_policy import ENGINES_TIMEOUT_S

def timeout(request):
    mark = request.node.get_closest_marker("timeout")
    return mark.args[0] if mark else None

@pytest.mark.engines
def test_engines(request):
    assert timeout(request) == ENGINES_TIMEOUT_S

@pytest.mark.engines
@pytest.mark.timeout(120)
def test_engines_with_its_own(request):
    assert timeout(request) == 120

def test_plain(request):
    assert timeout(request) is None  # pyproject's `timeout` applies
"""
    )
    inner.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_engine_tests_keep_to_their_lanes_under_xdist(inner, tmp_path):
    """Under ``-n`` the tests that start engines run one at a time a lane (the vLLM tests on one worker, the
    matrix cells with the llama-server tests on another), lanes first, and the tests that start nothing are in
    no lane."""
    here = str(Path(__file__).resolve().parent)  # xdist's workers import the hooks' module too
    inner.makeconftest(f"import sys\nsys.path.insert(0, {here!r})\n" + HOOKS)
    record = tmp_path / "ran.jsonl"
    body = f"""
import json, os, pytest

def note(request):
    mark = request.node.get_closest_marker("xdist_group")
    with open({str(record)!r}, "a") as f:
        f.write(json.dumps([request.node.name, os.environ.get("PYTEST_XDIST_WORKER"), mark and mark.args[0]]) + "\\n")
"""
    tests = {
        "test_inner_vllm": ["test_vllm_a", "test_vllm_b", "test_vllm_c"],
        "test_inner_llama": ["test_llama_a", "test_llama_b", "test_llama_c"],
        # not test_matrix_engines: the suite's own module of that name is imported in this process already
        "test_inner_matrix_engines": ["test_vllm_cell_a", "test_vllm_cell_b"],
    }
    for module, names in tests.items():
        code = body + "".join(f"\n@pytest.mark.engines\ndef {n}(request):\n    note(request)\n" for n in names)
        code += "".join(f"\ndef {n.replace('test_', 'test_plain_')}(request):\n    note(request)\n" for n in names)
        inner.makepyfile(**{module: code})
    inner.runpytest("-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup").assert_outcomes(passed=16)
    ran = [json.loads(line) for line in record.read_text().splitlines()]
    lanes = {name: lane for name, _, lane in ran}
    assert {n: lanes[n] for n in tests["test_inner_vllm"]} == dict.fromkeys(tests["test_inner_vllm"], "vllm")
    llama_and_cells = tests["test_inner_llama"] + tests["test_inner_matrix_engines"]
    assert {n: lanes[n] for n in llama_and_cells} == dict.fromkeys(llama_and_cells, "cells-llama")
    assert all(lane is None for name, lane in lanes.items() if "plain" in name)
    for lane in ("vllm", "cells-llama"):
        assert len({worker for _, worker, got in ran if got == lane}) == 1, ran
    # without xdist nothing is grouped and the order is the collected one
    record.unlink()
    inner.runpytest("-p", "no:cacheprovider", "-p", "no:xdist").assert_outcomes(passed=16)
    assert [lane for _, _, lane in map(json.loads, record.read_text().splitlines())] == [None] * 16


def test_the_project_sets_a_default_timeout_and_lists_the_slowest_tests(pytestconfig):
    assert float(pytestconfig.getini("timeout")) >= 60  # pytest-timeout's ini option: every test is bounded
    assert "--durations=15" in pytestconfig.getini("addopts")
    assert "error::pytest.PytestUnhandledThreadExceptionWarning" in pytestconfig.getini("filterwarnings")


def test_an_xfail_that_passes_fails_the_run(inner, pytestconfig):
    """pyproject's ``xfail_strict``: an expected failure that passes is a failure (under CI too), not an XPASS
    nobody reads."""
    inner.makepyfile(
        test_inner_xpass="import pytest\n\n@pytest.mark.xfail(reason='a known bug')\ndef test_fixed():\n    pass\n"
    )
    strict = "true" if pytestconfig.getini("xfail_strict") else "false"  # unset: None (pytest 9: `strict`)
    res = inner.runpytest("-p", "no:cacheprovider", "-o", f"xfail_strict={strict}")
    res.assert_outcomes(failed=1)
    assert "[XPASS(strict)] a known bug" in res.stdout.str()


def test_vllm_engines_of_the_tests_start_without_the_aot_compile_cache():
    """Engines inherit the test process's environment (specops.run.process); ``specops up`` run by a test
    passes it on to vLLM."""
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"


# ------------------------------------------------------------------------------------------------- ports

GRAB = """
import json, sys
sys.path.insert(0, sys.argv[1])
from support_ports import free_port
print(json.dumps([free_port() for _ in range(int(sys.argv[2]))]))
"""


def test_ports_never_repeat_across_runs_and_stay_out_of_the_ephemeral_range(tmp_path, monkeypatch):
    registry = tmp_path / "ports.json"
    monkeypatch.setenv("SPECOPS_TEST_PORTS", str(registry))
    mine = [support_ports.free_port() for _ in range(40)]
    env = {**os.environ, "SPECOPS_TEST_PORTS": str(registry)}
    here = str(Path(__file__).resolve().parent)
    other = subprocess.run(
        [sys.executable, "-c", GRAB, here, "40"], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    theirs = json.loads(other.stdout)  # another run on the same machine, at the same time
    assert len(set(mine)) == 40 and len(set(theirs)) == 40 and not set(mine) & set(theirs)
    lo, _ = support_ports.ephemeral_range()
    assert all(support_ports.LOWEST <= p < lo for p in mine + theirs)  # no client's source port can take one
    assert set(json.loads(registry.read_text())) == {str(p) for p in mine + theirs}
    assert stat.S_IMODE(registry.stat().st_mode) == 0o600


def test_every_test_takes_its_ports_from_the_registry():
    """No test module takes ``free_port`` from anywhere but tests/support_ports.py: specops' own (bind to port 0,
    close) picks from the ephemeral range and records nothing, so two runs may be handed the same port."""
    import ast

    suite = Path(__file__).resolve().parent
    elsewhere = [
        f"{path.name}:{node.lineno}: from {node.module} import free_port"
        for path in sorted(suite.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom)
        and node.module != "support_ports"
        and any(alias.name == "free_port" for alias in node.names)
    ]
    assert not elsewhere, elsewhere


def test_a_port_in_use_is_not_handed_out(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("SPECOPS_TEST_PORTS", str(tmp_path / "ports.json"))
    pool = [support_ports.free_port() for _ in range(3)]
    monkeypatch.setattr(support_ports, "_candidates", lambda: pool)  # a pool of three ports
    monkeypatch.setattr(support_ports, "_GIVEN", set())
    (tmp_path / "ports.json").write_text("{}")  # forget them: only the bind check is left
    held = [socket.socket(), socket.socket()]
    try:
        for s, port in zip(held, pool[:2]):
            s.bind(("127.0.0.1", port))
            s.listen(1)
        assert support_ports.free_port() == pool[2]
        with pytest.raises(RuntimeError, match="no free loopback port"):
            support_ports.free_port()  # the last one was just handed out
    finally:
        for s in held:
            s.close()
