"""Small statistics shared by the performance tools (bench, tune, workload): medians and percentiles that
skip missing values (``None``) and NaN, and answer ``None`` when nothing is left."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def present(values: Iterable[float | None]) -> list[float]:
    """``values`` without ``None`` and NaN, in their order."""
    return [v for v in values if v is not None and not math.isnan(v)]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the present values; None when there are none."""
    vals = present(values)
    return statistics.median(vals) if vals else None


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation) of the present values; None when there are none."""
    vals = sorted(present(values))
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
