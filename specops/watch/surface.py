"""The goodput surface: what ``specops tune`` measured on a deployment, output tokens/s per option (a method
and its k; ``none``; a draft idle at k 0) per concurrency level, with the mean acceptance length each option
had, and where it was measured. Read from a tune record or a lock file; interpolated in log2(concurrency).

:func:`per_batch_schedule` turns a surface into vLLM's ``num_speculative_tokens_per_batch_size`` ranges
(k = 0 where drafting nothing is faster), so an engine that takes one follows load without restarts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.config.yamlsource import read_text
from specops.errors import ProfileError, SpecopsError
from specops.methods import Method

SURFACE_VERSION = 1
#: The largest batch size a schedule is rendered for when the profile gives none.
DEFAULT_MAX_BATCH = 256


def option_label(method: Method, k: int | None) -> str:
    """``none``, or ``method k=K`` (the same words as ``specops tune``'s settings)."""
    return "none" if method is Method.NONE else f"{method.value} k={k}"


@dataclass(frozen=True)
class SurfacePoint:
    """One measured point: ``method`` with ``k`` draft tokens (0 for none) at ``concurrency`` clients."""

    method: Method
    k: int
    concurrency: int
    tokens_per_s: float
    mean_acceptance_length: float | None = None

    @property
    def label(self) -> str:
        return option_label(self.method, self.k)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method.value,
            "k": self.k,
            "concurrency": self.concurrency,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mean_acceptance_length": None
            if self.mean_acceptance_length is None
            else round(self.mean_acceptance_length, 3),
        }


def _interp_log2(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation in log2(x) between sorted points; flat outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lx = math.log2(x)
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            l0, l1 = math.log2(x0), math.log2(x1)
            return y0 + (y1 - y0) * ((lx - l0) / (l1 - l0) if l1 > l0 else 0.0)
    return ys[-1]  # pragma: no cover - unreachable for sorted xs


@dataclass
class Surface:
    """Measured tokens/s per option and concurrency, with where it was measured (``meta``: date, engine,
    engine version, draft sha)."""

    points: list[SurfacePoint]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by: dict[tuple[Method, int], list[SurfacePoint]] = {}
        for p in sorted(self.points, key=lambda p: p.concurrency):
            self._by.setdefault((p.method, p.k), []).append(p)

    # ---- reading and writing
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Surface:
        """From the ``surface`` entry of a tune record; raises ValueError naming what is wrong."""
        if not isinstance(data, Mapping) or not isinstance(data.get("points"), list):
            raise ValueError("a surface is a mapping with a list of points")
        points = []
        for i, p in enumerate(data["points"]):
            try:
                method = Method(p["method"])
                k = 0 if method is Method.NONE else int(p["k"])
                c = int(p["concurrency"])
                tps = float(p["tokens_per_s"])
                tau = p.get("mean_acceptance_length")
                tau = None if tau is None else float(tau)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"surface point {i}: {exc}") from None
            if c < 1 or k < 0 or not math.isfinite(tps) or tps < 0:
                raise ValueError(f"surface point {i}: concurrency >= 1, k >= 0 and finite tokens/s >= 0 are needed")
            points.append(SurfacePoint(method, k, c, tps, tau))
        if not points:
            raise ValueError("the surface has no points")
        meta = {k: v for k, v in data.items() if k != "points"}
        return cls(points, meta)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SURFACE_VERSION,
            **{k: v for k, v in self.meta.items() if k != "version"},
            "levels": self.levels(),
            "points": [p.to_dict() for p in sorted(self.points, key=lambda p: (p.label, p.concurrency))],
            "crossover": {label: c for label, c in self.crossovers().items()},
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Surface | None:
        """The surface of a tune record or of a lock file's ``tune`` entry; None when it holds none."""
        data = record.get("surface")
        if data is None and isinstance(record.get("tune"), Mapping):
            data = record["tune"].get("surface")
        return None if data is None else cls.from_dict(data)

    # ---- questions
    def levels(self) -> list[int]:
        return sorted({p.concurrency for p in self.points})

    def options(self) -> list[tuple[Method, int]]:
        return sorted(self._by, key=lambda o: (o[0] is not Method.NONE, o[0].value, o[1]))

    def ks(self, method: Method) -> list[int]:
        return sorted(k for m, k in self._by if m is method)

    def has(self, method: Method, k: int) -> bool:
        return (method, 0 if method is Method.NONE else k) in self._by

    def tokens_per_s(self, method: Method, k: int | None, concurrency: float) -> float | None:
        """Interpolated tokens/s of ``method`` at ``k`` (ignored for none) and ``concurrency``; None if unmeasured
        there: outside the option's own measured levels it is held flat only past the surface's lowest or highest
        level (an option that tune pruned after one level says nothing about the others)."""
        pts = self._by.get((method, 0 if method is Method.NONE else int(k or 0)))
        if not pts:
            return None
        c = max(1.0, concurrency)
        levels = self.levels()
        if (c < pts[0].concurrency and pts[0].concurrency > levels[0]) or (
            c > pts[-1].concurrency and pts[-1].concurrency < levels[-1]
        ):
            return None
        return _interp_log2([p.concurrency for p in pts], [p.tokens_per_s for p in pts], c)

    def tau(self, method: Method, k: int | None) -> float | None:
        """The mean acceptance length the option had when measured (the median over its levels)."""
        vals = sorted(
            p.mean_acceptance_length
            for p in self._by.get((method, int(k or 0)), ())
            if p.mean_acceptance_length is not None
        )
        return vals[len(vals) // 2] if vals else None

    def crossover(self, method: Method, k: int, *, max_concurrency: float | None = None) -> float | None:
        """The lowest concurrency (on a grid of 1/8 octaves, where both were measured) at which ``method`` at
        ``k`` stops beating ``none``: 1.0 when it never wins; None when it wins everywhere both were measured
        (or ``none`` was not measured)."""
        top = max_concurrency or max(self.levels())
        steps = int(math.ceil(math.log2(max(top, 1.0)) * 8)) + 1
        for i in range(steps):
            c = 2 ** (i / 8)
            spec, none = self.tokens_per_s(method, k, c), self.tokens_per_s(Method.NONE, 0, c)
            if spec is not None and none is not None and spec <= none:
                return round(c, 2)
        return None

    def crossovers(self) -> dict[str, float | None]:
        """Each speculating option's :meth:`crossover`; empty when ``none`` was not measured (unknown, not
        "pays everywhere": a tune whose budget ran out before its baseline)."""
        options = self.options()
        if (Method.NONE, 0) not in options:
            return {}
        return {option_label(m, k): self.crossover(m, k) for m, k in options if m is not Method.NONE and k > 0}


def _read_surface(p: Path) -> Surface:
    """The surface in the record at ``p``; raises ValueError saying why not (without the field's name).

    Read like the lock file, with a bounded read of a regular file: ``up`` must not wait on a FIFO or fill
    its memory from a link to /dev/zero."""
    try:
        record = json.loads(read_text(p, str(p)))
    except ProfileError as exc:
        raise ValueError(exc.problems[0].message) from None
    except ValueError as exc:
        raise ValueError(f"{p} is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{p} is not a tune record: JSON nested too deeply") from None
    try:
        surface = Surface.from_record(record) if isinstance(record, Mapping) else None
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
    if surface is None:
        raise ValueError(f"{p} holds no measured surface (run `specops tune` on the profile first)")
    return surface


def load_surface(path: str | Path) -> Surface:
    """The surface in a tune record (``<profile>.tune.json``) or lock file; raises SpecopsError saying why not."""
    try:
        return _read_surface(Path(path))
    except ValueError as exc:
        raise SpecopsError(f"fallback.goodput.surface: {exc}") from None


SURFACE_FIELD = ("fallback", "goodput", "surface")


def surface_file(value: str, profile_file: str | Path | None) -> Path:
    """Where ``fallback.goodput.surface`` points: ``~`` expanded, a relative path taken from the folder of
    ``profile_file`` (the profile that wrote it), so the deployment reads the same file from any folder."""
    p = Path(value).expanduser()
    if p.is_absolute() or profile_file is None:
        return p
    return Path(profile_file).parent / p


def profile_surface(loaded: Any) -> Surface | None:
    """The surface that a loaded profile's ``fallback.goodput.surface`` names (None when unset): a relative
    path is read from the folder of the profile file that wrote it (the base file, for a value from
    ``extends``); a missing or wrong file raises a ProfileError located at the field."""
    value = loaded.profile.fallback.goodput.surface
    if not value:
        return None
    where = loaded.document.locate(SURFACE_FIELD)
    written_in = where.file if where is not None and Path(where.file).is_file() else loaded.path
    try:
        return _read_surface(surface_file(value, written_in))
    except ValueError as exc:
        relative = "" if Path(value).expanduser().is_absolute() else f" (relative to {Path(written_in).parent})"
        raise ProfileError([loaded.problem(SURFACE_FIELD, f"{exc}{relative}")]) from None


# ---------------------------------------------------------------------------------------------- schedule


def per_batch_schedule(
    surface: Surface, method: Method, *, max_batch: int | None = None, ks: Iterable[int] | None = None
) -> list[list[int]]:
    """vLLM ``num_speculative_tokens_per_batch_size`` from the surface: ``[[start, end, k], ...]`` covering
    batch sizes 1..``max_batch`` (default: the largest measured level, at least 1), each size getting the k of
    ``method`` with the most tokens/s there, or 0 where drafting nothing beats every k. Ranges with the same k
    merge. Raises ValueError when the surface has no point of ``method``.

    What k 0 yields is the surface's ``method`` at k 0 where it was measured (the draft loaded, drafting
    nothing), else ``none``'s tokens/s. The two differ: at k 0 vLLM still runs the draft's forward pass over
    each step's tokens to keep the draft's KV cache in step (``llm_base_proposer.py``: "No draft tokens
    requested (e.g. Dynamic SD decided K=0)"), which a draft model pays in full."""
    candidates = sorted(set(ks) if ks is not None else set(surface.ks(method)))
    candidates = [k for k in candidates if k > 0 and surface.has(method, k)]
    if not candidates:
        raise ValueError(f"the surface has no measurement of {method.value}")
    top = max(1, int(max_batch or max(surface.levels())))
    idle = method if surface.has(method, 0) else Method.NONE
    out: list[list[int]] = []
    for b in range(1, top + 1):
        best_k, best = 0, surface.tokens_per_s(idle, 0, b)
        for k in candidates:
            v = surface.tokens_per_s(method, k, b)
            if v is not None and (best is None or v > best):
                best_k, best = k, v
        if out and out[-1][2] == best_k:
            out[-1][1] = b
        else:
            out.append([b, b, best_k])
    return out


def scheduled_k(schedule: Sequence[Sequence[int]], batch: float) -> int | None:
    """The k a ``per_batch_size`` schedule gives at ``batch`` (rounded, at least 1); None outside its ranges."""
    b = max(1, round(batch))
    for start, end, k in schedule:
        if start <= b <= end:
            return k
    return None
