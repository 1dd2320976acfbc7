"""What every ``specops doctor`` check shares: the levels, :class:`Check`, :class:`Report`, the :class:`Context`
the checks read (the loaded profile, nvidia-smi's answer asked once), and the one-line text of an error."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

OK, WARNING, ERROR = "ok", "warning", "error"
LEVELS = (OK, WARNING, ERROR)
#: How long an outside program (nvidia-smi, an engine's --version) may take.
TOOL_TIMEOUT_S = 15.0


@dataclass
class Check:
    """One finding: ``level`` ok | warning | error, what was found (``summary``), what to do (``fix``)."""

    name: str
    level: str
    summary: str
    fix: str = ""
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "level": self.level,
            "summary": self.summary,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    profile: str | None = None

    @property
    def errors(self) -> int:
        return sum(c.level == ERROR for c in self.checks)

    @property
    def warnings(self) -> int:
        return sum(c.level == WARNING for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "profile": self.profile,
            "errors": self.errors,
            "warnings": self.warnings,
            "checks": [c.to_dict() for c in self.checks],
        }

    def lines(self) -> list[str]:
        out = [f"specops doctor{f' {self.profile}' if self.profile else ''}"]
        width = max((len(c.name) for c in self.checks), default=8)
        for c in self.checks:
            out.append(f"  {c.level:<7}  {c.name:<{width}}  {c.summary}")
            pad = " " * (2 + 7 + 2 + width + 2)
            out += [f"{pad}{d}" for d in c.details]
            if c.fix:
                out.append(f"{pad}fix: {c.fix}")
        n_err, n_warn = self.errors, self.warnings
        out.append(
            f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}"
            + ("" if n_err else ": nothing blocks `specops up`" if self.profile else "")
        )
        return out


@dataclass
class Context:
    """What the checks share: the loaded profile (None without one or when it did not load), settings."""

    registry: Any
    offline: bool
    profile_path: str | None = None
    loaded: Any = None
    gpus: list[dict] | None = None  # what nvidia-smi listed
    _smi: tuple[list[dict] | None, str] | None = None

    def nvidia(self) -> tuple[list[dict] | None, str]:
        """nvidia-smi's answer, asked once."""
        if self._smi is None:
            self._smi = nvidia_smi()
        return self._smi

    hub_ok: bool = False
    resolved: Any = None  # the LoadedProfile after resolution
    resolution: Any = None
    engine_version: str | None = None  # the engine version the profile rendered for


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def nvidia_smi() -> tuple[list[dict] | None, str]:
    """GPUs nvidia-smi lists (None when it is missing or fails) and what happened, in words."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "no nvidia-smi on PATH"
    query = "--query-gpu=index,name,memory.total,memory.used"
    try:
        res = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{exe} did not run: {type(exc).__name__}"
    if res.returncode != 0:
        first = (res.stderr or res.stdout).strip().splitlines()
        return None, f"{exe} failed (exit {res.returncode}): {one_line(first[0] if first else '', 200)}"
    gpus = []
    for line in res.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        try:
            total, used = float(parts[2]), float(parts[3])
        except ValueError:
            total = used = float("nan")
        gpus.append({"index": int(parts[0]), "name": parts[1][:100], "memory_mib": total, "used_mib": used})
    return gpus, exe
