"""GGUF drafts for llama.cpp: pick the file for a quantisation, read vocab facts from local GGUF metadata.

llama.cpp accepts a draft when (common/speculative.cpp) the vocab type and BOS/EOS match, the vocab sizes
are at most 128 apart, and every token text from id 5 up to the smaller vocab is identical. The
metadata is read with the ``gguf`` package from files that are already local (a path, or the HF cache):
weights are never downloaded to check them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID.
MAX_VOCAB_DIFFERENCE = 128
CHECK_START_TOKEN_ID = 5
DEFAULT_QUANT = "Q4_K_M"
#: When the requested quantisation is missing, the nearest ones to try, in order.
QUANT_FALLBACK = (
    "Q4_K_M",
    "Q4_K_S",
    "Q4_0",
    "Q5_K_M",
    "Q5_K_S",
    "Q5_0",
    "Q6_K",
    "Q8_0",
    "Q3_K_L",
    "Q3_K_M",
    "IQ4_XS",
    "IQ4_NL",
    "BF16",
    "F16",
    "F32",
)


@dataclass(frozen=True)
class GGUFVocab:
    """Tokenizer and shape facts from one GGUF file's metadata."""

    path: str
    arch: str | None
    tokenizer_model: str | None
    size: int
    bos: int | None
    eos: int | None
    add_bos: bool | None
    tokens: tuple[str, ...]
    context: int | None
    hidden: int | None
    layers: int | None
    #: MTP layers (``<arch>.nextn_predict_layers``; llama.cpp reads an absent key as 0 and then refuses
    #: ``--spec-type draft-mtp`` with "model doesn't contain MTP layers", seen on llama-server 0c1e570).
    mtp_layers: int = 0
    #: Attention shape, for the KV cache's size: heads, KV heads (GQA) and the K/V widths per head.
    heads: int | None = None
    kv_heads: int | None = None
    key_length: int | None = None
    value_length: int | None = None

    def kv_bytes_per_token(self, element_bytes: float = 2.0) -> int | None:
        """Bytes of llama.cpp's KV cache per context token (every layer's K and V; f16: 2 bytes an element)."""
        if not (self.layers and self.hidden and self.heads):
            return None
        kv_heads = self.kv_heads or self.heads
        k = self.key_length or self.hidden // self.heads
        v = self.value_length or self.hidden // self.heads
        return int(self.layers * kv_heads * (k + v) * element_bytes)


def _scalar(reader, key):
    f = reader.get_field(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a malformed field is treated as absent
        return None


def read_gguf(path: str | Path) -> GGUFVocab:
    """Vocab and shape facts of a local GGUF file (memory-mapped; only the header is read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    arch = _scalar(reader, "general.architecture")
    tokens = _scalar(reader, "tokenizer.ggml.tokens") or []

    def arch_key(name):
        return _scalar(reader, f"{arch}.{name}") if arch else None

    n_vocab = arch_key("vocab_size")
    return GGUFVocab(
        path=str(path),
        arch=arch,
        tokenizer_model=_scalar(reader, "tokenizer.ggml.model"),
        size=int(n_vocab) if n_vocab else len(tokens),
        bos=_scalar(reader, "tokenizer.ggml.bos_token_id"),
        eos=_scalar(reader, "tokenizer.ggml.eos_token_id"),
        add_bos=_scalar(reader, "tokenizer.ggml.add_bos_token"),
        tokens=tuple(tokens),
        context=arch_key("context_length"),
        hidden=arch_key("embedding_length"),
        layers=arch_key("block_count"),
        mtp_layers=int(arch_key("nextn_predict_layers") or 0),
        heads=_int_or_none(arch_key("attention.head_count")),
        kv_heads=_int_or_none(arch_key("attention.head_count_kv")),
        key_length=_int_or_none(arch_key("attention.key_length")),
        value_length=_int_or_none(arch_key("attention.value_length")),
    )


def _int_or_none(value) -> int | None:
    """A positive int from a GGUF field (a per-layer array, as some models write head counts: its largest)."""
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if isinstance(v, int)), default=None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def compare_vocab(target: GGUFVocab, draft: GGUFVocab) -> list[tuple[str, str]]:
    """llama.cpp's draft compatibility rules: ``[(severity, message)]``, empty when compatible."""
    out: list[tuple[str, str]] = []
    if target.tokenizer_model != draft.tokenizer_model:
        out.append(
            (
                "error",
                f"vocab type differs: draft {draft.tokenizer_model} vs target {target.tokenizer_model} "
                f"(llama.cpp refuses the draft)",
            )
        )
    diff = abs(target.size - draft.size)
    if diff > MAX_VOCAB_DIFFERENCE:
        out.append(
            (
                "error",
                f"vocab sizes {draft.size} (draft) and {target.size} (target) are {diff} apart; "
                f"llama.cpp allows at most {MAX_VOCAB_DIFFERENCE}",
            )
        )
    if target.bos != draft.bos or target.eos != draft.eos:
        out.append(("error", f"BOS/EOS differ: draft {draft.bos}/{draft.eos} vs target {target.bos}/{target.eos}"))
    if target.add_bos is not None and draft.add_bos is not None and target.add_bos != draft.add_bos:
        out.append(("error", "add_bos_token differs between draft and target"))
    n = min(len(target.tokens), len(draft.tokens))
    for i in range(CHECK_START_TOKEN_ID, n):
        if target.tokens[i] != draft.tokens[i]:
            out.append(
                (
                    "error",
                    f"token {i} differs: draft {draft.tokens[i]!r} vs target {target.tokens[i]!r} "
                    f"(llama.cpp compares token text from id {CHECK_START_TOKEN_ID} on)",
                )
            )
            break
    return out


def quant_of(filename: str) -> str | None:
    m = re.search(r"(?<![A-Z0-9])(I?Q\d+_[A-Z0-9]+(?:_[A-Z0-9]+)?|BF16|F16|F32)(?![A-Z0-9])", filename.upper())
    return m.group(1) if m else None


def pick_file(files: list[str], quant: str | None) -> tuple[str | None, str]:
    """The ``.gguf`` file for ``quant`` (default Q4_K_M), or the nearest available; and why."""
    wanted = (quant or DEFAULT_QUANT).upper()
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    # a split model is named by its first part
    ggufs = [f for f in ggufs if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f) or re.search(r"-00001-of-\d{5}\.gguf$", f)]
    if not ggufs:
        return None, "the repo has no .gguf file"
    by_quant: dict[str, list[str]] = {}
    for f in sorted(ggufs):
        q = quant_of(Path(f).name)
        if q:
            by_quant.setdefault(q, []).append(f)
    if wanted in by_quant:
        return by_quant[wanted][0], f"{wanted} as requested"
    for q in QUANT_FALLBACK:
        if q in by_quant:
            return by_quant[q][0], f"{wanted} is not in the repo; nearest available is {q}"
    if len(ggufs) == 1:
        return ggufs[0], f"{wanted} is not in the repo; it has one .gguf file"
    return None, f"{wanted} is not in the repo (it has {', '.join(sorted(by_quant) or ggufs)})"


def split_parts(first: str, files: list[str]) -> list[str]:
    """All parts of a split GGUF (``…-00001-of-00003.gguf``) present in ``files``; ``[first]`` otherwise."""
    m = re.search(r"-00001-of-(\d{5})\.gguf$", first)
    if not m:
        return [first]
    stem = first[: m.start()]
    parts = [f"{stem}-{i:05d}-of-{m.group(1)}.gguf" for i in range(1, int(m.group(1)) + 1)]
    return [p for p in parts if p in files] or [first]
