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


# ------------------------------------------------------------------------------------------- twins

MIB = 1024**2
#: Bytes per element of llama.cpp's KV cache types (``-ctk``/``-ctv``; quantised blocks of 32 with their scales).
KV_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "iq4_nl": 18 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}


@dataclass(frozen=True)
class ModelSize:
    """What the twins' fit needs of one model: its weights and, for llama.cpp, its KV cache per context token
    (from the GGUF's attention shape) and trained context (llama-server's ``-c`` when the profile sets none)."""

    weights: Weights | None
    kv_per_token: int | None = None
    context: int | None = None


def size_of_view(view) -> ModelSize | None:
    """A resolved model's size (a :class:`~specops.resolve.models.ModelView`), None when nothing is known."""
    if view is None:
        return None
    gguf = getattr(view, "gguf_vocab", None)
    if view.weights is None and gguf is None:
        return None
    return ModelSize(
        view.weights,
        gguf.kv_bytes_per_token() if gguf is not None else None,
        gguf.context if gguf is not None else None,
    )


def local_size(ref: str | None) -> ModelSize | None:
    """The size of a model that is a local file or folder (a GGUF's header, the weight files' sizes); None for a
    Hub repo or a missing path. Never reaches the network: what ``validate`` and the pre-launch check can know."""
    import os
    from pathlib import Path

    if not ref:
        return None
    path = Path(os.path.expanduser(ref))
    if path.is_file():
        try:
            size = path.stat().st_size
        except OSError:
            return None
        gguf = None
        if path.suffix == ".gguf":
            from specops.resolve.ggufinfo import read_gguf

            try:
                gguf = read_gguf(path)
            except Exception:  # noqa: BLE001 - a corrupt file is the target check's to report, not the fit's
                gguf = None
        weights = Weights(size, "file size")
        return ModelSize(weights, gguf.kv_bytes_per_token() if gguf else None, gguf.context if gguf else None)
    if path.is_dir():
        try:
            sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
        except OSError:
            return None
        weights = from_files(sizes)
        return ModelSize(weights) if weights else None
    return None


def available_memory() -> int | None:
    """This machine's ``MemAvailable`` (/proc/meminfo): what can be allocated without swapping, page cache that
    can be dropped included. None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _kv_element_bytes(extra_args: list[str]) -> float:
    """The KV cache's bytes per element from ``-ctk``/``-ctv`` in the engine's extra arguments (default f16)."""
    out = []
    for flags in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
        value = "f16"
        for i, arg in enumerate(extra_args[:-1]):
            if arg in flags:
                value = extra_args[i + 1]
        out.append(KV_TYPE_BYTES.get(value.lower(), 2.0))
    return sum(out) / 2


def _mib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


@dataclass(frozen=True)
class EngineNeed:
    """One engine of a profile with twins: what it holds on its own (per GPU, or in memory)."""

    engine: str  # "primary", or the twin's method
    method: str
    own: int | None  # bytes (None: not known)
    parts: str  # what ``own`` is made of, for the message
    share: float | None = None  # vLLM: its --gpu-memory-utilization


@dataclass(frozen=True)
class TwinFit:
    """The engines of a profile with twins against the memory they share (a floor: compute buffers and
    activations come on top).

    ``by_share`` (vLLM): each engine may take its share of each GPU and must hold its own weights in it. Otherwise
    (llama.cpp): the engines add up; on CPU the target GGUF is mapped once (``shared``: its pages sit once in the
    page cache) and each engine adds its own KV cache (and draft); on GPU each engine holds its own copy."""

    engines: tuple[EngineNeed, ...]
    shared: int
    budget: int | None
    budget_from: str  # where the budget comes from, e.g. "gpus.memory_gb" or "available memory (MemAvailable)"
    by_share: bool
    where: str  # "per GPU" or "in memory"
    explicit_shares: bool = False

    @property
    def total(self) -> int | None:
        if any(e.own is None for e in self.engines):
            return None
        return self.shared + sum(e.own or 0 for e in self.engines)

    def line(self) -> str:
        names = ", ".join(f"{e.engine} {_mib(e.own) if e.own is not None else '?'} ({e.parts})" for e in self.engines)
        if self.by_share:
            shares = ", ".join(f"{e.engine} {e.share:g}" for e in self.engines)
            return f"{len(self.engines)} engines' own weights {self.where}: {names}; GPU shares {shares}"
        shared = f"{_mib(self.shared)} mapped once + " if self.shared else ""
        total = _mib(self.total) if self.total is not None else "?"
        return f"{len(self.engines)} engines need {total} {self.where} at least: {shared}{names}"

    def problems(self) -> list[tuple[tuple, str]]:
        """Each engine or set of engines that does not fit, with the profile field to change."""
        if self.budget is None:
            return []
        budget = f"{_mib(self.budget)} ({self.budget_from})"
        if self.by_share:
            out = []
            for e in self.engines:
                room = (e.share or 0) * self.budget
                if e.own is not None and e.own > room:
                    path = ("routing", "memory_utilization", e.engine) if self.explicit_shares else ("routing", "twins")
                    who = {"primary": "the primary", "canary": "a canary"}.get(e.engine, f"the {e.engine} twin")
                    out.append(
                        (
                            path,
                            f"{who} holds {_mib(e.own)} of weights {self.where} ({e.parts}) but its share "
                            f"{e.share:g} of {budget} is {_mib(room)}, before any KV cache: give it a larger "
                            "routing.memory_utilization share, fewer twins or more GPUs (tensor_parallel_size)",
                        )
                    )
            return out
        total = self.total
        if total is not None and total > self.budget:
            return [
                (
                    ("routing", "twins"),
                    f"{self.line()}; over {budget} before compute buffers: fewer twins, a smaller "
                    "model.max_model_len (the KV caches) or more memory",
                )
            ]
        return []


def twin_fit(
    profile,
    target: ModelSize | None,
    drafts: dict[str, ModelSize | None],
    *,
    parallel_layout: bool,
    budget: int | None,
    budget_from: str,
) -> TwinFit | None:
    """The fit of a profile's engines (primary and twins) in ``budget`` bytes (per GPU, or of memory on CPU).

    ``parallel_layout`` (vLLM): on GPUs each engine takes its share of them; on CPU each loads its own weights.
    Otherwise (llama.cpp) the engines memory-map the target GGUF: on CPU its pages are shared, on GPU each engine
    uploads its own copy. ``drafts``: each draft's size by its reference (a missing one counts as unknown). With
    ``routing.canary`` on, a canary runs the primary's step beside them while a new draft is measured: it is
    counted as one more engine, its draft taken as the size of the current one. None without twins or when the
    target's size is unknown."""
    from specops.config.engines import CANARY, PRIMARY, gpu_shares
    from specops.methods import NEEDS_DRAFT

    twins = profile.routing.local_twins  # a remote twin runs elsewhere
    if not twins or target is None or target.weights is None:
        return None
    steps = profile.steps
    engines = [(PRIMARY, 0)] + [(m.value, next(i for i, s in enumerate(steps) if s.method is m)) for m in twins]
    if profile.routing.canary.enabled:
        engines.append((CANARY, 0))
    cpu = not profile.gpus.devices  # [] (CPU) or unset (the engine's default; a CPU profile, as doctor counts it)
    by_share = parallel_layout and profile.gpus.devices != []
    shares = gpu_shares(profile) if by_share else {}
    mapped_once = not parallel_layout and cpu and "--no-mmap" not in profile.server.extra_args
    n_ctx = profile.model.max_model_len or target.context
    element = _kv_element_bytes(list(profile.server.extra_args))
    needs = []
    for name, index in engines:
        step = steps[index]
        draft_ref = step.draft if step.method in NEEDS_DRAFT else None
        draft = drafts.get(draft_ref) if draft_ref else None
        at = profile.at_step(index)
        parts: list[str] = []
        if by_share:
            est = estimate(
                at, target.weights, draft.weights if draft else None, has_draft=draft_ref is not None,
                parallel_layout=True,
            )  # fmt: skip
            own = est.per_gpu_bytes
            parts.append(f"target{' + draft' if draft_ref else ''}, {est.layout}")
            if draft_ref and (draft is None or draft.weights is None):
                parts.append("draft size unknown")
            needs.append(EngineNeed(name, step.method.value, own, "; ".join(parts), shares.get(name)))
            continue
        own = 0
        if not mapped_once:
            est = estimate(at, target.weights, None, has_draft=False, parallel_layout=parallel_layout)
            own += est.per_gpu_bytes or 0
            parts.append(f"weights {_mib(est.per_gpu_bytes or 0)}")
        if parallel_layout:
            pass  # vLLM on CPU: its KV cache is VLLM_CPU_KVCACHE_SPACE, sized by the engine, not from the model
        elif n_ctx and target.kv_per_token:
            kv = int(n_ctx * target.kv_per_token * element / 2)
            own += kv
            parts.append(f"KV cache {_mib(kv)} at -c {n_ctx}")
        else:
            parts.append("KV cache size unknown")
        if draft_ref:
            if draft is None or draft.weights is None:
                parts.append("draft size unknown")
            else:
                own += draft.weights.bytes
                parts.append(f"draft {_mib(draft.weights.bytes)}")
                if n_ctx and draft.kv_per_token:
                    own += n_ctx * draft.kv_per_token
                    parts.append(f"draft KV {_mib(n_ctx * draft.kv_per_token)}")
        needs.append(EngineNeed(name, step.method.value, own, ", ".join(parts)))
    return TwinFit(
        tuple(needs),
        target.weights.bytes if mapped_once else 0,
        budget,
        budget_from,
        by_share,
        "in memory" if cpu and not by_share else "per GPU",
        explicit_shares=bool(profile.routing.memory_utilization),
    )


def engine_drafts(profile) -> list[str]:
    """The drafts the engines of a profile with twins load (the primary's, each twin's step's), each once."""
    from specops.config.engines import PRIMARY
    from specops.methods import NEEDS_DRAFT

    wanted = {PRIMARY, *(m.value for m in profile.routing.local_twins)}
    out: list[str] = []
    for i, step in enumerate(profile.steps):
        name = PRIMARY if i == 0 else step.method.value
        if name in wanted and step.method in NEEDS_DRAFT and step.draft and step.draft not in out:
            out.append(step.draft)
            wanted.discard(name)
    return out


def twin_problems(
    profile,
    target: ModelSize | None,
    drafts: dict[str, ModelSize | None],
    *,
    budget: int | None = None,
    budget_from: str = "",
) -> tuple[TwinFit | None, list[tuple[tuple, str]]]:
    """The twins' fit against ``budget`` bytes (default: ``gpus.memory_gb``), and what does not fit, each with the
    profile field to change. ``(None, [])`` without twins or sizes."""
    from specops.config.engines import splits_gpu_by_share

    if not profile.routing.twins:
        return None, []
    if budget is None and profile.gpus.memory_gb:
        budget, budget_from = int(profile.gpus.memory_gb * GIB), "gpus.memory_gb"
    fit = twin_fit(
        profile, target, drafts, parallel_layout=splits_gpu_by_share(profile.backend), budget=budget,
        budget_from=budget_from,
    )  # fmt: skip
    return fit, (fit.problems() if fit is not None else [])


def local_twin_problems(profile, *, at_launch: bool = False) -> list[tuple[tuple, str]]:
    """:func:`twin_problems` with what this machine reads without the network (local model files), against
    ``gpus.memory_gb``; ``at_launch``, also against this machine's available memory when the engines run on CPU and
    their memory adds up (llama.cpp): what ``validate`` and the pre-launch check of ``specops up`` refuse."""
    from specops.config.engines import splits_gpu_by_share

    if not profile.routing.twins:
        return []
    target = local_size(profile.model.id)
    if target is None:
        return []
    drafts = {ref: local_size(ref) for ref in engine_drafts(profile)}
    _, problems = twin_problems(profile, target, drafts)
    if problems or not at_launch or profile.gpus.devices or splits_gpu_by_share(profile.backend):
        return problems
    free = available_memory()
    if free is None:
        return []
    _, problems = twin_problems(profile, target, drafts, budget=free, budget_from="available memory (MemAvailable)")
    return problems
