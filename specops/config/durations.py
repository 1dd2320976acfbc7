"""Human durations in profiles: ``90``, ``"250ms"``, ``"60s"``, ``"10m"``, ``"1h30m"`` → seconds.

Every duration is finite and at most :data:`MAX_DURATION` (7 days): no setting of specops needs more,
and an unbounded one (``.inf``, ``99999999999999999999h``) only overflows later, far from the profile.
"""

from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
#: The longest duration any setting accepts.
MAX_DURATION = 7 * 86400.0


def parse_duration(value: object, maximum: float = MAX_DURATION) -> float:
    """Seconds from a number or a string like ``1h30m``; raises ValueError with a useful hint."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like 30s, 10m or 1h, not a boolean")
    try:
        if isinstance(value, (int, float)):
            seconds = float(value)
        elif isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            if len(text) > 64:
                raise ValueError("invalid duration: longer than 64 characters")
            if re.fullmatch(r"\d+(?:\.\d+)?", text):
                seconds = float(text)
            elif text and _PART.sub("", text) == "":
                seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
            else:
                raise ValueError(f"invalid duration {value!r}: use a number of seconds or e.g. 500ms, 30s, 10m, 1h30m")
        else:
            raise ValueError(f"expected a duration like 30s, 10m or 1h, not {type(value).__name__}")
    except OverflowError:  # an integer too large for a float
        seconds = math.inf
    if math.isnan(seconds):
        raise ValueError("a duration must be a number, not NaN")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    if seconds > maximum:
        raise ValueError(f"a duration must be at most {format_duration(maximum)}")
    return seconds


def format_duration(seconds: float) -> str:
    """The inverse, for messages: 600 → ``10m``, 90 → ``1m30s``, 0.25 → ``250ms``."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    out, rest = "", seconds
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if rest >= size:
            n = int(rest // size)
            out += f"{n}{unit}"
            rest -= n * size
    if rest or not out:
        out += f"{rest:g}s"
    return out
