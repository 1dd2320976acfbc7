"""GGUF drafts for llama.cpp: pick the file for a quantisation, read vocab facts from local GGUF metadata.

llama.cpp accepts a draft when (common/speculative.cpp) the vocab type and BOS/EOS match, the vocab sizes
are at most 128 apart, and every token text from id 5 up to the smaller vocab is identical. The metadata of
files that are already local (a path, or the HF cache) is read by a bounded parser of its own: weights are
never downloaded to check them, and a hostile file costs no more than its first :data:`MAX_METADATA_BYTES`
(the ``gguf`` package builds a Python object per array element: a file of a million empty tokens took 26 s
and 1.6 GB). Arrays the checks do not need are skipped by their byte length; the token texts stay one block
of bytes (:class:`TokenTexts`).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID.
MAX_VOCAB_DIFFERENCE = 128
CHECK_START_TOKEN_ID = 5
#: The metadata (every key and value) must end within this many bytes of the file's start: real models need
#: a few MB (a 262k-token vocab with its merges about 15 MB), and walking this much takes about a second.
MAX_METADATA_BYTES = 64 << 20
#: Real files have a few dozen keys.
MAX_KEYS = 4096
#: A per-layer array (head counts) is read when it has at most this many elements; longer ones are skipped.
MAX_LAYER_ARRAY = 1 << 16
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
#: GGUF value types (the spec's numbering): struct codes of the fixed-size ones, then string and array.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
TOKENS_KEY = "tokenizer.ggml.tokens"


class GGUFError(ValueError):
    """A GGUF file whose metadata cannot be read within the bounds; the message says why."""


class TokenTexts:
    """A vocab's token texts as the file holds them: one block of ``<u64 length><bytes>`` entries and where
    each entry ends, so that a million tokens cost a few MB instead of a million Python strings."""

    def __init__(self, block: bytes = b"", ends: array | None = None):
        self._block = block
        self._ends = array("I") if ends is None else ends

    def __len__(self) -> int:
        return len(self._ends)

    def raw(self, i: int) -> bytes:
        """Token ``i``'s text as bytes."""
        return self._block[self._start(i) + 8 : self._ends[i]]

    def __getitem__(self, i: int) -> str:
        return self.raw(i).decode("utf-8", "replace")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenTexts) and self._block == other._block

    def __hash__(self) -> int:
        return hash(self._block)

    def _start(self, i: int) -> int:
        return self._ends[i - 1] if i else 0

    def first_difference(self, other: TokenTexts, start: int, stop: int) -> int | None:
        """The first id in ``[start, stop)`` whose text differs between the two vocabs; None when none does.
        Equal entry blocks are equal texts (each entry carries its length), so the common case is one compare."""
        if start >= stop:
            return None
        mine = memoryview(self._block)[self._start(start) : self._ends[stop - 1]]
        theirs = memoryview(other._block)[other._start(start) : other._ends[stop - 1]]
        if mine == theirs:
            return None
        return next((i for i in range(start, stop) if self.raw(i) != other.raw(i)), None)


@dataclass(frozen=True)
class _Value:
    """Where one metadata value stands in the file: its type, and for an array the element type and count."""

    kind: int
    offset: int
    elem: int | None = None
    count: int = 1


class _Cursor:
    """Bounds-checked reads from the start of a memory-mapped GGUF file: nothing past the file's end or
    :data:`MAX_METADATA_BYTES` is read, so a declared size can never make it allocate or wait."""

    def __init__(self, buf: mmap.mmap, size: int):
        self.buf, self.size, self.pos, self.order = buf, size, 0, "<"
        self.limit = min(size, MAX_METADATA_BYTES)

    def overrun(self) -> GGUFError:
        if self.limit < self.size:
            return GGUFError(
                f"its metadata runs past the first {MAX_METADATA_BYTES >> 20} MiB (real models need a few MB)"
            )
        return GGUFError(
            f"a declared size runs past the end of the file ({self.size} bytes): truncated or not a GGUF file"
        )

    def skip(self, n: int) -> int:
        """Move past ``n`` bytes; where they start."""
        start = self.pos
        if n > self.limit - start:
            raise self.overrun()
        self.pos = start + n
        return start

    def number(self, code: str) -> int | float | bool:
        return struct.unpack_from(self.order + code, self.buf, self.skip(struct.calcsize(code)))[0]

    def key(self) -> str:
        n = self.number("Q")
        if n > 0xFFFF:
            raise GGUFError(f"a metadata key of {n} bytes (the format allows at most 65535)")
        start = self.skip(n)
        return self.buf[start : start + n].decode("utf-8", "replace")

    def value(self, kind: int, ends: array | None = None) -> _Value:
        """Move past one value of type ``kind``; a string array's entry ends go to ``ends`` when given."""
        start = self.pos
        if kind in _FIXED:
            self.skip(struct.calcsize(_FIXED[kind]))
        elif kind == _STRING:
            self.skip(self.number("Q"))
        elif kind == _ARRAY:
            elem, count = self.number("I"), self.number("Q")
            start = self.pos
            if elem in _FIXED:
                self.skip(count * struct.calcsize(_FIXED[elem]))
            elif elem == _STRING:
                self._strings(count, ends)
            else:
                raise GGUFError(f"an array of value type {elem} (only arrays of numbers or strings are read)")
            return _Value(kind, start, elem, count)
        else:
            raise GGUFError(f"unknown value type {kind}")
        return _Value(kind, start)

    def _strings(self, count: int, ends: array | None) -> None:
        """Walk past ``count`` strings by their lengths, without building them (each takes at least 8 bytes)."""
        if count > (self.limit - self.pos) // 8:
            raise self.overrun()
        length = struct.Struct(self.order + "Q").unpack_from
        buf, end, base = self.buf, self.limit, self.pos
        pos = base
        note = ends.append if ends is not None else None
        for _ in range(count):
            if pos > end - 8:
                raise self.overrun()
            pos += 8 + length(buf, pos)[0]
            if pos > end:
                raise self.overrun()
            if note is not None:
                note(pos - base)
        self.pos = pos


class _Metadata:
    """The key/value section of a GGUF file: one bounded pass notes where every value stands (and where each
    token text ends); the few values the checks use are read afterwards."""

    def __init__(self, buf: mmap.mmap, size: int):
        self.cur = cur = _Cursor(buf, size)
        if buf[:4] != b"GGUF":
            raise GGUFError("not a GGUF file (no GGUF magic)")
        cur.skip(4)
        version = cur.number("I")
        if version not in (2, 3):
            cur.order = ">"  # a big-endian file reads as a huge version
            version = struct.unpack(">I", struct.pack("<I", version))[0]
            if version not in (2, 3):
                raise GGUFError(f"GGUF version {version} is not read (versions 2 and 3 are)")
        cur.number("Q")  # tensors: never read
        keys = cur.number("Q")
        if keys > MAX_KEYS:
            raise GGUFError(
                f"it declares {keys} metadata keys (real models have a few dozen; at most {MAX_KEYS} are read)"
            )
        self.values: dict[str, _Value] = {}
        self.token_ends = array("I")
        for _ in range(keys):
            key = cur.key()
            ends = None
            if key == TOKENS_KEY:
                ends = self.token_ends = array("I")
            self.values[key] = cur.value(cur.number("I"), ends)

    def get(self, key: str):
        """A number, a short text, or a short list of numbers; None when absent or anything else."""
        v, buf, order = self.values.get(key), self.cur.buf, self.cur.order
        if v is None:
            return None
        if v.kind in _FIXED:
            return struct.unpack_from(order + _FIXED[v.kind], buf, v.offset)[0]
        if v.kind == _STRING:
            n = struct.unpack_from(order + "Q", buf, v.offset)[0]
            return buf[v.offset + 8 : v.offset + 8 + n].decode("utf-8", "replace") if n <= 256 else None
        if v.elem in _FIXED and v.count <= MAX_LAYER_ARRAY:
            return list(struct.unpack_from(f"{order}{v.count}{_FIXED[v.elem]}", buf, v.offset))
        return None

    def tokens(self) -> TokenTexts:
        v = self.values.get(TOKENS_KEY)
        if v is None or v.elem != _STRING or not self.token_ends:
            return TokenTexts()
        return TokenTexts(self.cur.buf[v.offset : v.offset + self.token_ends[-1]], self.token_ends)


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
    tokens: TokenTexts
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


def read_gguf(path: str | Path) -> GGUFVocab:
    """Vocab and shape facts of a local GGUF file: only its metadata is read, within bounds (a regular file;
    GGUFError, or OSError, says why a file cannot be read)."""
    with _mapped(path) as buf:
        meta = _Metadata(buf, len(buf))
        arch = _name(meta.get("general.architecture"))

        def arch_key(name):
            return meta.get(f"{arch}.{name}") if arch else None

        tokens = meta.tokens()
        return GGUFVocab(
            path=str(path),
            arch=arch,
            tokenizer_model=_name(meta.get("tokenizer.ggml.model")),
            size=_int_or_none(arch_key("vocab_size")) or len(tokens),
            bos=_token_id(meta.get("tokenizer.ggml.bos_token_id")),
            eos=_token_id(meta.get("tokenizer.ggml.eos_token_id")),
            add_bos=_flag(meta.get("tokenizer.ggml.add_bos_token")),
            tokens=tokens,
            context=_int_or_none(arch_key("context_length")),
            hidden=_int_or_none(arch_key("embedding_length")),
            layers=_int_or_none(arch_key("block_count")),
            mtp_layers=_int_or_none(arch_key("nextn_predict_layers")) or 0,
            heads=_int_or_none(arch_key("attention.head_count")),
            kv_heads=_int_or_none(arch_key("attention.head_count_kv")),
            key_length=_int_or_none(arch_key("attention.key_length")),
            value_length=_int_or_none(arch_key("attention.value_length")),
        )


@contextmanager
def _mapped(path: str | Path) -> Iterator[mmap.mmap]:
    """The file memory-mapped, read-only: a regular file only (a FIFO or a device is refused, never waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError("not a regular file")
        if st.st_size < 24:
            raise GGUFError(f"{st.st_size} bytes: too short for a GGUF file")
        buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with buf:
        yield buf


def _name(value) -> str | None:
    return value if isinstance(value, str) else None


def _flag(value) -> bool | None:
    return value if isinstance(value, bool) else None


def _token_id(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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
    i = target.tokens.first_difference(draft.tokens, CHECK_START_TOKEN_ID, n)
    if i is not None:
        out.append(
            (
                "error",
                f"token {i} differs: draft {draft.tokens[i][:80]!r} vs target {target.tokens[i][:80]!r} "
                f"(llama.cpp compares token text from id {CHECK_START_TOKEN_ID} on)",
            )
        )
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
