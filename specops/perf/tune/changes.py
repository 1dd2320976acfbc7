"""Which profile values must change for the profile to run the winning setting, and how they are shown."""

from __future__ import annotations

import json
from typing import Any

from specops.config.yamledit import UNSET as UNSET_VALUE
from specops.methods import NEEDS_DRAFT, RANK, Method
from specops.perf.tune.settings import Setting

__all__ = ["UNSET_VALUE", "desired_changes", "format_changes"]

SPEC = ("speculative",)


def desired_changes(file_profile, resolved_profile, winner: Setting, *, per_batch_size=None) -> dict[tuple, Any]:
    """Field path → new value (or :data:`UNSET_VALUE`) for the merged profile to run ``winner``.

    ``file_profile`` is the profile as written (``auto`` kept); ``resolved_profile`` what it resolved to.
    The method and draft are written only when the winner's differ from the resolved ones (an ``auto``
    that resolves to the winner stays ``auto``); k is written explicitly whenever it differs from the
    written value (a default k becomes explicit: the comment says why).
    """
    fspec, rspec = file_profile.speculative, resolved_profile.speculative
    out: dict[tuple, Any] = {}
    m = winner.method
    if m is not rspec.method or (m in NEEDS_DRAFT and winner.draft != rspec.draft):
        out.update(_method_changes(file_profile, winner))
    if winner.k is None:
        if fspec.num_speculative_tokens is not None:
            out[SPEC + ("num_speculative_tokens",)] = UNSET_VALUE
    elif fspec.num_speculative_tokens != winner.k:
        out[SPEC + ("num_speculative_tokens",)] = winner.k
    if winner.ngram_min is not None:
        if fspec.ngram.min != winner.ngram_min:
            out[SPEC + ("ngram", "min")] = winner.ngram_min
        if fspec.ngram.max != winner.ngram_max:
            out[SPEC + ("ngram", "max")] = winner.ngram_max
    if winner.ngram_type is not None and fspec.ngram.type != winner.ngram_type:
        out[SPEC + ("ngram", "type")] = winner.ngram_type
    if per_batch_size is not None:
        out[SPEC + ("per_batch_size",)] = [list(x) for x in per_batch_size]
    elif fspec.per_batch_size is not None and winner.method is Method.NONE:
        out[SPEC + ("per_batch_size",)] = UNSET_VALUE
    return out


def _method_changes(file_profile, winner: Setting) -> dict[tuple, Any]:
    """The changes of a method switch: method, draft (set or removed) and the fallback chain, which keeps
    only the methods ranked below the new one."""
    fspec = file_profile.speculative
    m = winner.method
    out: dict[tuple, Any] = {SPEC + ("method",): m.value}
    if m in NEEDS_DRAFT:
        out[SPEC + ("draft",)] = winner.draft
    elif fspec.draft is not None:
        out[SPEC + ("draft",)] = UNSET_VALUE
    if m in NEEDS_DRAFT or fspec.draft is not None:
        for f in ("draft_revision", "draft_file"):
            if getattr(fspec, f) is not None:
                out[SPEC + (f,)] = UNSET_VALUE
    chain = file_profile.fallback.chain
    if chain is not None:
        kept = [st for st in chain if st.method is not m and RANK.get(st.method, 99) > RANK.get(m, 99)]
        if len(kept) != len(chain):
            out[("fallback", "chain")] = [_chain_item(st) for st in kept]
    return out


def _chain_item(step) -> Any:
    if step.draft is None and step.num_speculative_tokens is None:
        return step.method.value
    d: dict[str, Any] = {"method": step.method.value}
    if step.draft is not None:
        d["draft"] = step.draft
    if step.num_speculative_tokens is not None:
        d["num_speculative_tokens"] = step.num_speculative_tokens
    return d


def format_changes(changes: dict[tuple, Any]) -> list[str]:
    """Each change as ``field.path: value`` (``(removed)`` for an unset key)."""
    from specops.config.located import format_path

    return [f"{format_path(p)}: {'(removed)' if v is UNSET_VALUE else json.dumps(v)}" for p, v in changes.items()]
