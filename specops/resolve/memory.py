"""Weight memory of target + draft per GPU, from Hub metadata (never by downloading weights).

Sources, best first: the Hub's safetensors metadata (parameter count per dtype), the sizes of the weight
files (siblings / paths-info, or the chosen .gguf), the catalog's parameter count at 2 bytes each. The
KV cache and activations come on top: the estimate is a floor, and the warning fires when even the
weights do not fit the profile's ``gpus.memory_gb``.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F4": 0.5,
    "F6_E2M3": 0.75,
    "F6_E3M2": 0.75,
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class Weights:
    bytes: int
    source: str  # "safetensors metadata", "file sizes", "catalog parameter count"

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def from_safetensors(meta: dict | None) -> Weights | None:
    if not meta or not isinstance(meta.get("parameters"), dict):
        return None
    total = 0.0
    for dtype, n in meta["parameters"].items():
        total += int(n) * DTYPE_BYTES.get(str(dtype).upper(), 2)
    return Weights(int(total), "safetensors metadata") if total else None


def from_files(sizes: dict[str, int | None], only: str | None = None) -> Weights | None:
    """Sum of weight file sizes (``only``: just that file, e.g. the chosen GGUF). Prefers safetensors over
    .bin when a repo ships both."""
    if only is not None:
        s = sizes.get(only)
        return Weights(int(s), "file size") if s else None
    names = [n for n in sizes if n.endswith(WEIGHT_SUFFIXES) and not n.endswith(".gguf")]
    if any(n.endswith(".safetensors") for n in names):
        names = [n for n in names if n.endswith(".safetensors")]
    total = sum(int(sizes[n] or 0) for n in names)
    return Weights(total, "file sizes") if total else None


#: Average bits per weight of llama.cpp quantisations (llama.cpp's quantize table), for sizing from a count.
GGUF_BITS = {
    "Q2_K": 2.96,
    "Q3_K_S": 3.5,
    "Q3_K_M": 3.91,
    "Q3_K_L": 4.27,
    "IQ4_XS": 4.25,
    "IQ4_NL": 4.5,
    "Q4_0": 4.55,
    "Q4_K_S": 4.58,
    "Q4_K_M": 4.89,
    "Q5_0": 5.54,
    "Q5_K_S": 5.54,
    "Q5_K_M": 5.69,
    "Q6_K": 6.56,
    "Q8_0": 8.5,
    "F16": 16.0,
    "BF16": 16.0,
    "F32": 32.0,
}


def from_params(billions: float | None, quant: str | None = None) -> Weights | None:
    """Size from a parameter count: 2 bytes each, or the GGUF quantisation's bits per weight."""
    if not billions:
        return None
    bits = GGUF_BITS.get((quant or "").upper())
    if bits:
        return Weights(int(billions * 1e9 * bits / 8), f"catalog parameter count at {quant.upper()} (~{bits:g} bits)")
    return Weights(int(billions * 1e9 * 2), "catalog parameter count (2 bytes each)")


@dataclass(frozen=True)
class MemoryEstimate:
    target: Weights | None
    draft: Weights | None
    gpus: int
    per_gpu_bytes: int | None
    budget_gb: float | None
    layout: str
    has_draft: bool = True

    @property
    def per_gpu_gib(self) -> float | None:
        return None if self.per_gpu_bytes is None else self.per_gpu_bytes / GIB

    @property
    def over_budget(self) -> bool:
        return (
            self.budget_gb is not None and self.per_gpu_bytes is not None and self.per_gpu_bytes > self.budget_gb * GIB
        )

    def to_dict(self) -> dict:
        r = lambda w: None if w is None else {"bytes": w.bytes, "gib": round(w.gib, 2), "source": w.source}  # noqa: E731
        return {
            "target": r(self.target),
            "draft": r(self.draft),
            "gpus": self.gpus,
            "per_gpu_gib": None if self.per_gpu_gib is None else round(self.per_gpu_gib, 2),
            "budget_gb": self.budget_gb,
            "layout": self.layout,
            "has_draft": self.has_draft,
        }

    def line(self) -> str:
        def g(w):
            return "?" if w is None else f"{w.gib:.1f} GiB"

        per = "?" if self.per_gpu_gib is None else f"{self.per_gpu_gib:.1f} GiB"
        budget = f" of {self.budget_gb:g} GiB" if self.budget_gb else ""
        draft = f" + draft {g(self.draft)}" if self.has_draft else ""
        return f"weights: target {g(self.target)}{draft} → {per} per GPU{budget} ({self.layout})"


def estimate(
    profile,
    target: Weights | None,
    draft: Weights | None,
    *,
    has_draft: bool = True,
    parallel_layout: bool | None = None,
) -> MemoryEstimate:
    """Per-GPU weight share under the profile's layout.

    A backend with ``parallel_layout`` (vLLM): the target is split over tensor × pipeline parallel ranks; a
    draft with ``draft_tensor_parallel_size`` equal to the target's TP is split the same way, otherwise (TP
    1) it sits whole on the first GPU. Without it (llama.cpp): the target is split by ``tensor_split`` (or
    evenly) over ``devices``; the draft sits whole on one device. ``parallel_layout`` None: the profile's
    backend's (True when it is not installed).
    """
    g = profile.gpus
    budget = g.memory_gb
    if parallel_layout is None:
        from specops.plugins import get_registry

        parallel_layout = getattr(get_registry().backends.get(profile.backend), "parallel_layout", True)
    if not parallel_layout:
        n = max(1, len(g.devices or []) or 1)
        if g.tensor_split and len(g.tensor_split) == n and sum(g.tensor_split) > 0:
            share = max(g.tensor_split) / sum(g.tensor_split)
        else:
            share = 1 / n
        layout = f"{n} device(s), largest share {share:.0%}"
        if target is None:
            return MemoryEstimate(target, draft, n, None, budget, layout, has_draft)
        per = target.bytes * share + (draft.bytes if draft else 0)
        return MemoryEstimate(target, draft, n, int(per), budget, layout, has_draft)
    tp, pp = g.tensor_parallel_size, g.pipeline_parallel_size
    n = tp * pp
    draft_tp = profile.speculative.draft_tensor_parallel_size or 1
    layout = f"TP {tp} × PP {pp}, draft TP {draft_tp}"
    if target is None:
        return MemoryEstimate(target, draft, n, None, budget, layout, has_draft)
    per = target.bytes / n
    if draft is not None:
        per += draft.bytes / (tp if draft_tp == tp else 1)
    return MemoryEstimate(target, draft, n, int(per), budget, layout, has_draft)
