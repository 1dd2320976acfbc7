"""What ``specops tune`` sweeps: :class:`Setting` (one point), the k grids, and the order to measure them.

Every speculative setting is an engine start-up flag on both engines (llama-server compiles per-request
overrides out), so each setting is one engine launch; the concurrency levels of one setting share it.
What a setting can vary depends on the engine, asked through its backend object: whether a method takes
k (:meth:`~specops.backends.base.Backend.k_applies`) and whether n-gram drafters are picked by name
(:meth:`~specops.backends.base.Backend.ngram_variants`, llama.cpp) or tuned by k and min/max (vLLM).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specops.config.fields import MAX_SEQUENCES
from specops.errors import SpecopsError
from specops.methods import NEEDS_DRAFT, Method

#: The k values tried when the user gives none (plus the profile's own k).
DEFAULT_K_GRID = (1, 2, 3, 4, 6, 8)
K_GRID = {
    Method.MTP: (1, 2, 3, 4),
    Method.MLP_SPECULATOR: (1, 2, 3),
    Method.MEDUSA: (1, 2, 3, 4),
    Method.SUFFIX: (4, 8, 16, 24),
    Method.DFLASH: (4, 8, 12, 15),  # a DFlash drafter proposes a whole block per step (16 in z-lab's releases)
    Method.DSPARK: (3, 5, 7),
}


#: How far ``specops tune`` widens k past the grid while the curve still rises (a stated cap), per method.
K_WIDEN_CAP = {Method.MTP: 8, Method.MLP_SPECULATOR: 8, Method.MEDUSA: 8, Method.DFLASH: 16, Method.DSPARK: 16}
DEFAULT_K_WIDEN_CAP = 32


def k_widen_cap(method: Method) -> int:
    return K_WIDEN_CAP.get(method, DEFAULT_K_WIDEN_CAP)


def next_k(tried: Sequence[int], best_k: int, cap: int) -> int | None:
    """The next k to try when ``best_k`` is at an edge of ``tried``: half as much again above the largest
    (at most ``cap``), or half the smallest below it; None when the best is bracketed (or at the cap / 1)."""
    hi, lo = max(tried), min(tried)
    if best_k == hi and hi < cap:
        return min(cap, hi + max(1, hi // 2))
    if best_k == lo and lo > 1 and len(tried) > 1:
        return max(1, lo // 2)
    return None


def backend_of(backend):
    """The backend object for ``backend`` (a name, looked up in the plugin registry, or the object itself)."""
    if isinstance(backend, str):
        from specops.plugins import get_registry

        return get_registry().backend(backend)
    return backend


@dataclass(frozen=True)
class Setting:
    """One point of the sweep. ``k`` is None where the method has no k (``none``, llama.cpp n-gram)."""

    method: Method
    k: int | None = None
    ngram_min: int | None = None  # vLLM prompt_lookup_min (method ngram)
    ngram_max: int | None = None  # vLLM prompt_lookup_max
    ngram_type: str | None = None  # llama.cpp --spec-type of an n-gram drafter
    draft: str | None = None  # for methods that need one

    @property
    def label(self) -> str:
        if self.method is Method.NONE:
            return "none"
        if self.ngram_type:
            return f"ngram {self.ngram_type}"
        out = f"{self.method.value} k={self.k}"
        if self.ngram_min is not None:
            out += f" n={self.ngram_min}..{self.ngram_max}"
        return out

    @property
    def idle(self) -> bool:
        """The draft loaded but drafting nothing (k 0: a ``per_batch_size`` range of k 0 at every batch size)."""
        return self.method is not Method.NONE and self.k == 0

    def apply(self, profile):
        """``profile`` running this setting (the rest of the deployment unchanged).

        ``per_batch_size`` is cleared: it would override k for some batch sizes and blur what is measured. An
        :attr:`idle` setting runs k 1 with one range of k 0 over every batch size instead.
        """
        spec = profile.speculative
        update: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.k, "per_batch_size": None}
        if self.idle:
            update.update(num_speculative_tokens=1, per_batch_size=[(1, MAX_SEQUENCES, 0)])
        if self.method in NEEDS_DRAFT:
            update["draft"] = self.draft
            if self.draft != spec.draft:
                update.update(draft_revision=None, draft_file=None)
        else:
            update.update(draft=None, draft_revision=None, draft_file=None)
        if self.method is Method.NGRAM:
            ngram = {}
            if self.ngram_min is not None:
                ngram.update(min=self.ngram_min, max=self.ngram_max)
            if self.ngram_type is not None:
                ngram["type"] = self.ngram_type
            update["ngram"] = spec.ngram.model_copy(update=ngram)
        return profile.model_copy(update={"speculative": spec.model_copy(update=update)})

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"label": self.label, "method": self.method.value, "k": self.k}
        if self.ngram_min is not None:
            out.update(ngram_min=self.ngram_min, ngram_max=self.ngram_max)
        if self.ngram_type is not None:
            out["ngram_type"] = self.ngram_type
        if self.draft is not None:
            out["draft"] = self.draft
        return out


@dataclass(frozen=True)
class MethodChoice:
    """A method to sweep, with the draft it runs with (for methods that need one)."""

    method: Method
    draft: str | None = None


def current_setting(profile, default_ngram_type: str | None = None) -> Setting:
    """The setting a (resolved) profile runs now."""
    spec, method = profile.speculative, profile.speculative.method
    if method is Method.NONE:
        return Setting(Method.NONE)
    if method is Method.NGRAM and backend_of(profile.backend).ngram_variants():
        return Setting(Method.NGRAM, ngram_type=spec.ngram.type or default_ngram_type)
    if method is Method.NGRAM:
        return Setting(Method.NGRAM, spec.k, spec.ngram.min, spec.ngram.max)
    return Setting(method, spec.k, draft=spec.draft if method in NEEDS_DRAFT else None)


def coverage_order(items: Sequence[Any], key: Callable[[Any], float], first: Any = None) -> list:
    """``items`` reordered so each next one is the farthest (by ``key``) from those already taken.

    A sweep cut short by the budget then still spans the range (k = 4, 8, 1, 6, 2, 3 rather than 1..4).
    ``first`` (when among the items) leads; ties keep the given order.
    """
    rest = list(dict.fromkeys(items))
    out = []
    if first is not None and first in rest:
        out.append(first)
        rest.remove(first)
    while rest:
        if not out:
            out.append(rest.pop(0))
            continue
        taken = [key(x) for x in out]
        best = max(range(len(rest)), key=lambda i: (min(abs(key(rest[i]) - t) for t in taken), -i))
        out.append(rest.pop(best))
    return out


def k_grid(method: Method, current_k: int | None = None) -> list[int]:
    """The default k values for ``method``, plus ``current_k``."""
    grid = set(K_GRID.get(method, DEFAULT_K_GRID))
    if current_k:
        grid.add(current_k)
    return sorted(grid)


def plan_settings(
    current: Setting,
    choices: Sequence[MethodChoice],
    backend,
    *,
    k_values: Sequence[int] | None = None,
    ngram_pairs: Sequence[tuple[int, int]] | None = None,
    ngram_types: Sequence[str] | None = None,
    ngram_default: tuple[int, int] = (2, 5),
) -> list[Setting]:
    """Every setting to measure, in the order to measure them (the current one first when it is swept).

    ``backend`` is a backend name or object. Per method: the k grid (``k_values``, else
    :data:`DEFAULT_K_GRID` plus the current k); n-gram tuned by k: k × ``ngram_pairs`` (default:
    ``ngram_default``, the profile's min/max); n-gram drafters picked by name: ``ngram_types`` (default:
    every one the engine has); ``none``: itself. Methods are interleaved so a budget cut leaves none
    unmeasured.
    """
    if not choices:
        raise SpecopsError("nothing to tune: no method to sweep")
    backend = backend_of(backend)
    per_method = [
        _method_settings(current, choice, backend, k_values, ngram_pairs, ngram_types, ngram_default)
        for choice in choices
    ]
    # the method holding the current setting leads; then round-robin
    per_method.sort(key=lambda lst: 0 if current in lst else 1)
    out: list[Setting] = []
    for i in range(max(len(x) for x in per_method)):
        for lst in per_method:
            if i < len(lst) and lst[i] not in out:
                out.append(lst[i])
    return out


def _method_settings(
    current: Setting, choice: MethodChoice, backend, k_values, ngram_pairs, ngram_types, ngram_default
) -> list[Setting]:
    """The settings of one method, in the order to measure them (see :func:`plan_settings`)."""
    m = choice.method
    if m is Method.NONE:
        settings = [Setting(Method.NONE)]
    elif m is Method.NGRAM and backend.ngram_variants():
        settings = [Setting(Method.NGRAM, ngram_type=t) for t in list(ngram_types or backend.ngram_variants())]
    else:
        cur_k = current.k if current.method is m else None
        ks = sorted(set(k_values)) if k_values else k_grid(m, cur_k)
        if m is Method.NGRAM:
            pairs = list(ngram_pairs or [ngram_default])
            settings = [Setting(m, k, lo, hi) for k in ks for lo, hi in pairs]
        else:
            settings = [Setting(m, k, draft=choice.draft) for k in ks]
    if backend.k_applies(m):
        return coverage_order(settings, lambda s: s.k, current if current in settings else None)
    if current in settings:
        settings.remove(current)
        settings.insert(0, current)
    return settings


def parse_ints(text: str, what: str) -> list[int]:
    """``"1,2,4"`` or ``"1-4"`` or ``"1-4,6,8"`` → sorted unique positive ints."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SpecopsError(f"{what}: {part!r} is not a number or a range like 1-4")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo < 1 or hi < lo:
            raise SpecopsError(f"{what}: {part!r} must be positive and ascending")
        out.update(range(lo, hi + 1))
    if not out:
        raise SpecopsError(f"{what}: no values")
    if len(out) > 32:
        raise SpecopsError(f"{what}: {len(out)} values; each is an engine start: pick at most 32")
    return sorted(out)


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"1:3,2:5"`` → [(1, 3), (2, 5)] (n-gram min:max)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+):(\d+)", part)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise SpecopsError(f"--ngram: {part!r} is not MIN:MAX with 1 <= MIN <= MAX")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise SpecopsError("--ngram: no pairs")
    return list(dict.fromkeys(out))
