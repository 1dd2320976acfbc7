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

The same build makes ``rpc-server`` (``-DGGML_RPC=ON``): the workers of a multi-node llama.cpp group
(``deploy.multi_node.mode: rpc``), beside ``llama-server``, whose ``--rpc`` needs the same flag. A build is
ready only when its marker records this version *and* these cmake flags and both binaries are there: an
older build (without ``rpc-server``) is rebuilt, never silently reused.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
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
    "-DGGML_RPC=ON",  # llama-server --rpc, and rpc-server for the workers of a multi-node group
)
#: What one build installs into ``bin/``: the server, and the RPC worker of a multi-node group.
LLAMA_PROGRAMS = ("llama-server", "rpc-server")
#: The cmake targets of the RPC worker, newest name first (llama.cpp renamed ``rpc-server`` to
#: ``ggml-rpc-server``); it is installed as ``rpc-server`` whatever its target, the program the
#: LeaderWorkerSet workers of ``k8s render`` run.
RPC_TARGETS = ("ggml-rpc-server", "rpc-server")


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


def rpc_server_bin(version: str | None = None) -> Path:
    """The ``rpc-server`` built with ``llama-server`` (same folder)."""
    return llama_server_dir(version) / "bin" / "rpc-server"


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
    """The build of ``version`` is installed with today's cmake flags (a build made with other flags, e.g.
    before ``rpc-server`` was built, is not ready: set-up rebuilds it)."""
    m = read_marker(llama_server_dir(version))
    return bool(
        m
        and m.get("llama-cpp-python") == _version(version)
        and m.get("cmake_flags") == list(LLAMA_CMAKE_FLAGS)
        and all(os.access(p, os.X_OK) for p in (llama_server_bin(version), rpc_server_bin(version)))
    )


def _stale_marker(version: str) -> str | None:
    """Why the marker of ``version``'s build no longer fits (another version's or other flags'); None when
    there is none, or it fits."""
    m = read_marker(llama_server_dir(version))
    if not m or m.get("llama-cpp-python") != version:
        return None
    flags = m.get("cmake_flags")
    if flags != list(LLAMA_CMAKE_FLAGS):
        missing = [f for f in LLAMA_CMAKE_FLAGS if not isinstance(flags, list) or f not in flags]
        return f"it was built with other cmake flags (without {' '.join(missing) or 'the same set'})"
    return None


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
        stale = _stale_marker(v)
        if stale:
            log.note(f"{exe}: {stale}: rebuilding")
        elif not force and exe.exists():
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
    rpc = rpc_server_bin(v)
    if not os.access(rpc, os.X_OK):
        log.note(f"no {rpc.name} beside it (a build without -DGGML_RPC=ON): rebuilding")
        return None
    try:
        version = llama_server_version(exe)
        shared = _has_shared_llama_libs(exe) + _has_shared_llama_libs(rpc)
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
    log.pip_download(
        downloads_dir(),
        [f"llama-cpp-python=={v}"],
        f"pip download llama-cpp-python=={v} (sdist)",
        "--no-binary",
        ":all:",
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
    rpc = _rpc_target(source)
    log.run(
        ["cmake", "--build", str(tree), "--target", "llama-server", rpc, f"-j{jobs}"],
        f"cmake build llama-server {rpc} (-j{jobs}; ~8-15 min on 2 cores)",
    )
    for program in ("llama-server", rpc):
        if not (tree / "bin" / program).exists():
            raise log.fail(f"the build did not produce {tree / 'bin' / program}")
    if rpc != "rpc-server":
        shutil.copy2(tree / "bin" / rpc, tree / "bin" / "rpc-server")
    return tree / "bin" / "llama-server"


def _rpc_target(source: Path) -> str:
    """The cmake target of the RPC worker in this llama.cpp source (see :data:`RPC_TARGETS`)."""
    for rel in ("tools/rpc/CMakeLists.txt", "examples/rpc/CMakeLists.txt"):
        try:
            text = (source / rel).read_text(errors="replace")
        except OSError:
            continue
        for target in RPC_TARGETS:
            if re.search(rf"\b{re.escape(target)}\b", text):
                return target
    return "rpc-server"


def _install(built: Path, exe: Path, log: StepLog) -> str:
    """Copy the binaries into place (each atomically; ``rpc-server`` first, so that a llama-server of the new
    build is never seen without it) and check they are static and llama-server runs → its version."""
    exe.parent.mkdir(parents=True, exist_ok=True)
    for program in reversed(LLAMA_PROGRAMS):
        dest = exe.with_name(program)
        tmp = exe.with_name(f".{program}.{os.getpid()}.tmp")
        shutil.copy2(built.with_name(program), tmp)
        os.replace(tmp, dest)
        shared = _has_shared_llama_libs(dest)
        if shared:
            raise log.fail(f"{program} needs shared libraries {shared} (expected a static build)")
    try:
        version = llama_server_version(exe)
    except SpecopsError as exc:
        raise log.fail(f"the installed binary does not run: {exc}") from None
    return version


def _llama_marker(version: str, seconds: float, how: str, v: str | None = None) -> dict:
    return {
        "llama-cpp-python": _version(v),
        "llama-server": version,
        "binary": str(llama_server_bin(v)),
        "rpc_server": str(rpc_server_bin(v)),
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
