"""Helpers for tests that use the engines and generated models set up by ``specops engines setup``.

Other test modules use these to skip cleanly when an engine is not set up (and to fail in CI, which sets
everything up itself)::

    from support_engines import need_llama_server, need_vllm_python, tiny_model
    exe = need_llama_server()                 # Path, or skip (fail when CI is set)
    target = tiny_model("gguf-target.gguf")   # generated on first use (GGUF needs nothing; HF needs vLLM)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from conftest import unavailable
from support_policy import require_engines_marker

from specops.devenv import engines
from specops.devenv import testmodels as fixtures

#: The suite's vLLM engines run without torch.compile (``server.extra_args``): the tests check specops (launch,
#: watch, switch, measure), not vLLM's compiler, and the tiny target is ready in 0.63x the time this way
#: (``benchmarks/bench_vllm_start.py --tiny --variants aot-off,eager``, benchmarks/RESULTS.md).
VLLM_TEST_ARGS = ["--enforce-eager"]


def need_vllm_python() -> Path:
    """The vLLM venv's python, or skip the test (naming the set-up command; a failure in CI)."""
    require_engines_marker("needs the vLLM CPU venv")
    if not engines.vllm_ready():
        unavailable(f"vLLM CPU venv not set up at {engines.vllm_venv_dir()}: run `specops engines setup vllm`")
    return engines.vllm_python()


def need_llama_server() -> Path:
    """The cached llama-server binary, or skip the test (a failure in CI)."""
    require_engines_marker("needs llama-server")
    if not engines.llama_ready():
        unavailable(f"llama-server not set up at {engines.llama_server_bin()}: run `specops engines setup llamacpp`")
    return engines.llama_server_bin()


def need_dev_engine(pattern: str) -> Path:
    """specops' CPU development engine matching ``pattern`` (as ``dev_engines`` globs it in the engine cache),
    or skip the test (a failure in CI). Probing it runs the engine (``--version``, ``--help``)."""
    from specops.backends.devengines import dev_engines

    require_engines_marker(f"probes the development engine {pattern}")
    found = dev_engines(pattern)
    if not found:
        unavailable(f"no CPU development engine {pattern} in the engine cache (specops engines setup)")
    return found[0]


def need_real_model(name: str) -> Path:
    """A real model of :mod:`specops.devenv.realmodels` (set up by `specops engines setup models-real`, checked
    against its pinned sha256), or skip the test (a failure in CI)."""
    from specops.devenv.realmodels import is_ready, real_model_path

    require_engines_marker(f"takes the real model {name} that real engines serve")
    if not is_ready(name):
        unavailable(f"real model {name} not set up at {real_model_path(name)}: run `specops engines setup models-real`")
    return real_model_path(name)


def tiny_model(name: str) -> Path:
    """A tiny generated model by name (see specops.devenv.testmodels.TINY_MODELS), for a test of real engines;
    HF ones skip without vLLM."""
    require_engines_marker(f"takes the tiny model {name} that real engines serve")
    if name.startswith("hf-"):
        need_vllm_python()
    return fixtures.model_path(name)


def sha256_tree(path: Path) -> dict[str, str]:
    """relative path → sha256 of every file under ``path`` (or of ``path`` itself when it is a file)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p.relative_to(path.parent if path.is_file() else path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files
    }


def mtimes(paths) -> dict[str, int]:
    """st_mtime_ns of every file under the given paths (to prove a second run wrote nothing)."""
    out = {}
    for p in paths:
        p = Path(p)
        for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
            out[str(f)] = f.stat().st_mtime_ns
    return out
