"""What the support matrix saw engines do, as facts render, validate and resolve can act on.

``specops/data/support_matrix.json`` is written by ``specops engines matrix``: for each engine version, each
method and draft format, it launched the real engine with tiny checkpoints and recorded whether it
speculated, started without speculating, or refused (with the engine's own error line and where it was
raised). A version gate in :mod:`specops.backends.versions` was read in the engine's source; a cell here was
seen. This module turns the cells into three answers: did the engine refuse the method on this version (so
specops refuses to render it), which measured version runs it instead, and whether a render's support is
measured or only inferred.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from specops.backends.versions import Version

DATA = "data/support_matrix.json"
#: Where a refusal was raised (recorded per cell by the matrix runner from the engine's traceback). Every
#: cell was measured on a CPU build, so only a ``config`` refusal (the engine's parser: the same on every
#: platform) is enforced for every profile; a ``runner`` or unclassified one is enforced for CPU profiles
#: only (the CPU model runner has its own paths in shared files), and a ``cpu-build`` one (CPU kernels and
#: stand-ins) likewise: each is reported to GPU profiles, never enforced on them.
PLATFORM_INDEPENDENT = frozenset({"config"})


@dataclass(frozen=True)
class Cell:
    """One measured (engine, version, method, draft format) cell."""

    engine: str
    version: str
    method: str
    format: str
    outcome: str
    detail: str
    level: str | None = None
    acceptance: float | None = None
    #: When specops refused to render the cell, what the engine did with the runner's hand-written flags.
    by_hand: str | None = None

    @property
    def speculating(self) -> bool:
        return self.outcome == "speculating"

    def refused_for(self, cpu: bool) -> bool:
        """The engine refused it, at a level that holds for a CPU (``cpu``) or any profile."""
        return self.outcome == "engine-refused" and (cpu or self.level in PLATFORM_INDEPENDENT)


@lru_cache(maxsize=1)
def cells() -> tuple[Cell, ...]:
    """Every measured cell shipped with specops (none when the data file is absent or unreadable)."""
    try:
        data = json.loads(resources.files("specops").joinpath(DATA).read_text(encoding="utf-8"))
        rows = data["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    out = []
    for r in rows:
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("engine", "version", "method")):
            continue
        out.append(
            Cell(
                engine=r["engine"],
                version=r["version"],
                method=r["method"],
                format=str(r.get("format", "")),
                outcome=str(r.get("outcome", "")),
                detail=str(r.get("detail", "")),
                level=r.get("level") if isinstance(r.get("level"), str) else None,
                acceptance=r.get("acceptance") if isinstance(r.get("acceptance"), (int, float)) else None,
                by_hand=_outcome(r.get("engine_check")),
            )
        )
    return tuple(out)


def _outcome(check: object) -> str | None:
    return check.get("outcome") if isinstance(check, dict) and isinstance(check.get("outcome"), str) else None


def _same_version(measured: str, wanted: str) -> bool:
    if measured == wanted:
        return True
    try:
        return Version(measured) == Version(wanted)
    except ValueError:
        return False


def method_cells(engine: str, method: str, version: str | None = None) -> list[Cell]:
    """The measured cells of ``method`` on ``engine`` (on ``version`` only, when given)."""
    return [
        c
        for c in cells()
        if c.engine == engine and c.method == method and (version is None or _same_version(c.version, version))
    ]


def nearest_working(engine: str, method: str, version: str) -> str | None:
    """The measured version closest to ``version`` on which ``method`` speculated (newer wins a tie)."""
    working = {c.version for c in method_cells(engine, method) if c.speculating}
    try:
        want = Version(version)
        ranked = sorted(working, key=lambda v: (_distance(Version(v), want), -_order(Version(v))))
    except ValueError:
        ranked = sorted(working)
    return ranked[0] if ranked else None


def _distance(a: Version, b: Version) -> tuple[int, ...]:
    return tuple(abs(x - y) for x, y in zip(a.release, b.release, strict=False))


def _order(v: Version) -> int:
    return sum(x * 1000 ** (3 - i) for i, x in enumerate(v.release[:3]))


def baseline_served(engine: str, version: str) -> bool:
    """Whether the engine served the tiny model without speculation on ``version`` (true when that cell
    was not measured): if it did not, its refusals say nothing about the methods."""
    base = method_cells(engine, "none", version)
    return not base or any(c.outcome == "started-without-speculation" for c in base)


def refusal(engine: str, method: str, version: str, display: str, *, cpu: bool = False) -> str | None:
    """Why specops refuses ``method`` on ``version``: the engine refused every draft format of it there, at
    a level that holds for this profile (``cpu``: a CPU profile, see :data:`PLATFORM_INDEPENDENT`), and it
    served the model without speculation. None when it ran, was never measured, or cannot be told."""
    here = method_cells(engine, method, version)
    measured = [c for c in here if c.outcome not in ("not-measured", "rendered-refused")]
    if not measured or not baseline_served(engine, version) or any(not c.refused_for(cpu) for c in measured):
        return None
    first = measured[0]
    where = f" ({first.level} level)" if first.level else ""
    near = nearest_working(engine, method, version)
    instead = f"; measured running on {display} {near}" if near else "; no measured version runs it"
    return f"{display} {version} refused method {method} when measured{where}: {_line(first.detail)}{instead}"


def support(engine: str, method: str, version: str, display: str) -> tuple[str, str]:
    """``("measured", why)`` when ``method`` on ``version`` was seen speculating, else ``("inferred", why)``."""
    here = method_cells(engine, method, version)
    if any(c.speculating for c in here):
        formats = sorted({c.format for c in here if c.speculating})
        return "measured", f"{method} on {display} {version}: measured speculating with tiny checkpoints " + (
            f"({'; '.join(formats)})"
        )
    cpu_only = [c for c in here if c.outcome == "engine-refused" and not c.refused_for(cpu=False)]
    if cpu_only:
        level = f" ({cpu_only[0].level} level)" if cpu_only[0].level else ""
        return "inferred", (
            f"{method} on {display} {version}: inferred, not measured: the CPU build refused it{level} "
            f"({_line(cpu_only[0].detail)}), not enforced for a GPU profile"
        )
    near = nearest_working(engine, method, version)
    also = f" (nearest version measured speculating: {near})" if near else " (no version measured speculating)"
    return "inferred", f"{method} on {display} {version}: inferred from the engine's source, not measured{also}"


def _line(detail: str, limit: int = 200) -> str:
    text = " ".join(detail.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ------------------------------------------------------------------------------- multi-node groups

#: The multi-node rows (``specops engines matrix --multi-node``): groups of pods run on loopback.
GROUP_DATA = "data/support_matrix_multinode.json"
#: Outcomes of a group row that a render of the same engine, mode and method is warned about.
GROUP_FAILED = ("engine-refused", "engine-timeout", "started-without-speculation")


@lru_cache(maxsize=1)
def group_rows() -> tuple[dict, ...]:
    """The multi-node rows shipped with specops (none when the file is absent or unreadable)."""
    try:
        data = json.loads(resources.files("specops").joinpath(GROUP_DATA).read_text(encoding="utf-8"))
        return tuple(r for r in data["rows"] if isinstance(r, dict))
    except (OSError, ValueError, KeyError, TypeError):
        return ()


def group_refusal(engine: str, version: str | None, mode: str, method: str) -> dict | None:
    """The measured row where a group of ``engine`` in ``mode`` failed with ``method`` (on ``version``,
    when known; else on any version, when none was seen working), or None."""
    rows = [r for r in group_rows() if (r.get("engine"), r.get("mode"), r.get("method")) == (engine, mode, method)]
    if version:
        rows = [r for r in rows if r.get("version") == version]
    if not rows or any(r.get("outcome") == "speculating" for r in rows):
        return None
    failed = [r for r in rows if r.get("outcome") in GROUP_FAILED]
    return failed[0] if failed else None
