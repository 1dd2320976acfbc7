"""llama-server (``engines/llama-server-<v>/bin/llama-server``), built from the llama.cpp sources vendored
in the llama-cpp-python sdist (its ``vendor/llama.cpp``), with ``-DBUILD_SHARED_LIBS=OFF`` so the binary
can move.

The default build (:data:`LLAMA_CPP_PYTHON_VERSION`, the one tests, the demo and ``up`` use) lives in
``engines/llama-server-<v>/``. Other sdists, for the support matrix (``specops engines setup llamacpp
--llama-cpp-python-version X``), go to ``engines/versions/llama-server-<X>/``: outside the
``llama-server-*`` glob the llamacpp backend uses to find a build, so building one never changes which
llama-server ``up`` picks. Which sdist vendors which flag generation (read from each sdist's
``vendor/llama.cpp/common/arg.cpp``): 0.3.16 legacy (``--draft-max`` only); 0.3.18-0.3.21 ``--spec-type``
(n-gram types, no ``--spec-draft-n-max``); 0.3.22-0.3.33 ``--spec-draft-n-max`` (no ``draft-simple``);
0.3.36 current (``draft-simple``, ``draft-eagle3``, ``draft-mtp``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from specops.devenv.steps import Progress, StepLog, StepResult, locked, read_marker, write_marker
from specops.errors import SpecopsError
from specops.paths import engines_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary that can be moved (no RUNPATH into the build tree)
)


def _version(version: str | None) -> str:
    return version or LLAMA_CPP_PYTHON_VERSION


def check_version(version: str) -> str:
    """A release number (``0.3.20``): anything else would end up in a path or a pip argument."""
    if not re.fullmatch(r"\d+(\.\d+){1,3}", version or ""):
        raise SpecopsError(f"not a release version: {version!r} (e.g. 0.3.20)")
    return version


def llama_server_dir(version: str | None = None) -> Path:
    v = _version(version)
    if v == LLAMA_CPP_PYTHON_VERSION:
        return engines_dir() / f"llama-server-{v}"
    return engines_dir() / "versions" / f"llama-server-{v}"


def llama_server_bin(version: str | None = None) -> Path:
    return llama_server_dir(version) / "bin" / "llama-server"


def llama_build_dir(version: str | None = None) -> Path:
    # Outside the ``llama-server-*`` glob the llamacpp backend uses to find installed builds.
    return engines_dir() / "build" / f"llama-server-{_version(version)}"


def downloads_dir() -> Path:
    return engines_dir() / "downloads"


def llama_sdist(version: str | None = None) -> Path:
    return downloads_dir() / f"llama_cpp_python-{_version(version)}.tar.gz"


def llama_step(version: str | None = None) -> str:
    v = _version(version)
    return "llamacpp" if v == LLAMA_CPP_PYTHON_VERSION else f"llamacpp-{v}"


def llama_ready(version: str | None = None) -> bool:
    m = read_marker(llama_server_dir(version))
    return bool(m and m.get("llama-cpp-python") == _version(version) and os.access(llama_server_bin(version), os.X_OK))


def llama_server_version(exe: Path, timeout: float = 30) -> str:
    """The ``version: N (commit)`` a llama-server binary reports; SpecopsError when it does not run."""
    try:
        res = subprocess.run(
            [str(exe), "--version"],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "LLAMA_LOG_COLORS": "0"},
        )
    except (FileNotFoundError, PermissionError, OSError) as exc:
        raise SpecopsError(f"cannot run {exe}: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise SpecopsError(f"{exe} --version did not answer within {timeout:.0f} s") from None
    m = re.search(r"version:\s*(.+)", res.stdout + res.stderr)
    if res.returncode != 0 or not m:
        last = ((res.stderr or res.stdout).strip().splitlines() or ["no output"])[-1]
        raise SpecopsError(f"{exe} --version failed (exit {res.returncode}): {last}")
    return m.group(1).strip()


def _sdist_ok(path: Path) -> bool:
    try:
        with tarfile.open(path) as tf:
            return any(n.endswith("vendor/llama.cpp/CMakeLists.txt") for n in tf.getnames())
    except (OSError, tarfile.TarError):
        return False


def _extract(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist into ``dest`` (once: a ``.complete`` file records it) → the vendored llama.cpp dir."""
    done = dest / ".complete"
    if not done.exists():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(sdist) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(dest, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tf.extractall(dest)
        done.write_text(sdist.name + "\n")
    found = sorted(dest.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise SpecopsError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
    return found[0].parent


def _has_shared_llama_libs(exe: Path) -> list[str]:
    """Shared libllama/libggml libraries the binary needs (should be none in a static build)."""
    ldd = shutil.which("ldd")
    if not ldd:
        return []
    try:
        res = subprocess.run([ldd, str(exe)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({m.group(0) for m in re.finditer(r"lib(?:llama|ggml|mtmd)[\w.-]*\.so[\w.]*", res.stdout)})


def setup_llamacpp(
    *,
    version: str | None = None,
    force: bool = False,
    jobs: int | None = None,
    keep_build: bool = False,
    progress: Progress | None = None,
) -> StepResult:
    """Build a static ``llama-server`` from the llama.cpp vendored in the llama-cpp-python sdist and
    install it as ``engines/llama-server-<v>/bin/llama-server`` (another ``version``:
    ``engines/versions/llama-server-<v>/``).

    An installed binary without a valid marker is verified (it must answer ``--version`` and need no
    shared libllama/libggml) and adopted; otherwise: download the sdist (kept in ``engines/downloads``),
    unpack, cmake configure + build (incremental if an earlier build was interrupted), copy, verify.
    """
    v = check_version(_version(version))
    dest = llama_server_dir(v)
    exe = llama_server_bin(v)
    step = llama_step(v)
    t0 = time.monotonic()
    if not force and llama_ready(v):
        return StepResult(step, "cached", time.monotonic() - t0, exe, read_marker(dest) or {})
    with locked(engines_dir() / f".lock-{step}"):
        if not force and llama_ready(v):
            return StepResult(step, "cached", time.monotonic() - t0, exe, read_marker(dest) or {})
        log = StepLog(step, progress)
        if not force and exe.exists():
            adopted = _adopt(exe, log, t0, v)
            if adopted:
                return adopted
        build = llama_build_dir(v)
        built = _build(_fetch_sdist(log, v), build, log, jobs)
        server_version = _install(built, exe, log)
        seconds = time.monotonic() - t0
        data = _llama_marker(server_version, seconds, "installed", v)
        write_marker(dest, data)
        log.note(f"installed {exe} ({server_version}) in {seconds:.1f} s")
        if not keep_build:
            shutil.rmtree(build, ignore_errors=True)
            with contextlib.suppress(OSError):
                build.parent.rmdir()  # only when empty
        return StepResult(step, "installed", seconds, exe, data, log.path)


def _adopt(exe: Path, log: StepLog, t0: float, v: str) -> StepResult | None:
    """Adopt a binary found without a valid marker when it runs and is static; None: rebuild it."""
    log.note(f"found {exe} without a valid marker: verifying it")
    try:
        version = llama_server_version(exe)
        shared = _has_shared_llama_libs(exe)
    except SpecopsError as exc:
        log.note(f"not usable ({exc}): rebuilding")
        return None
    if shared:
        log.note(f"it needs shared libraries {shared}: rebuilding")
        return None
    data = _llama_marker(version, time.monotonic() - t0, "adopted", v)
    write_marker(llama_server_dir(v), data)
    return StepResult(llama_step(v), "adopted", time.monotonic() - t0, exe, data, log.path)


def _fetch_sdist(log: StepLog, v: str) -> Path:
    """The llama-cpp-python sdist, downloaded unless a usable one is kept already."""
    sdist = llama_sdist(v)
    if _sdist_ok(sdist):
        return sdist
    downloads_dir().mkdir(parents=True, exist_ok=True)
    sdist.unlink(missing_ok=True)
    log.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(downloads_dir()),
            f"llama-cpp-python=={v}",
        ],
        f"pip download llama-cpp-python=={v} (sdist)",
    )
    if not _sdist_ok(sdist):
        raise log.fail(f"pip download did not produce a usable {sdist.name}")
    return sdist


def _build(sdist: Path, build: Path, log: StepLog, jobs: int | None) -> Path:
    """Unpack the sdist under ``build`` and build llama-server there → the built binary."""
    log.note(f"unpacking {sdist.name} into {build / 'src'}")
    try:
        source = _extract(sdist, build / "src")
    except (OSError, tarfile.TarError, SpecopsError) as exc:
        raise log.fail(f"cannot unpack {sdist}: {exc}") from None
    tree = build / "cmake-build"
    log.run(["cmake", "-S", str(source), "-B", str(tree), *LLAMA_CMAKE_FLAGS], "cmake configure")
    jobs = jobs or max(1, os.cpu_count() or 1)
    log.run(
        ["cmake", "--build", str(tree), "--target", "llama-server", f"-j{jobs}"],
        f"cmake build llama-server (-j{jobs}; ~8 min on 2 cores)",
    )
    built = tree / "bin" / "llama-server"
    if not built.exists():
        raise log.fail(f"the build did not produce {built}")
    return built


def _install(built: Path, exe: Path, log: StepLog) -> str:
    """Copy the binary into place (atomically) and check it runs and is static → its version."""
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f".llama-server.{os.getpid()}.tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, exe)
    try:
        version = llama_server_version(exe)
    except SpecopsError as exc:
        raise log.fail(f"the installed binary does not run: {exc}") from None
    shared = _has_shared_llama_libs(exe)
    if shared:
        raise log.fail(f"the binary needs shared libraries {shared} (expected a static build)")
    return version


def _llama_marker(version: str, seconds: float, how: str, v: str | None = None) -> dict:
    return {
        "llama-cpp-python": _version(v),
        "llama-server": version,
        "binary": str(llama_server_bin(v)),
        "cmake_flags": list(LLAMA_CMAKE_FLAGS),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "seconds": round(seconds, 1),
        "how": how,
    }


def _cpu_model() -> str | None:
    """GGML_NATIVE builds for this CPU: recorded so a cache copied elsewhere can be explained."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
