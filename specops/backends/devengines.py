"""specops' own CPU development engines, as engine discovery sees them.

``specops engines setup`` installs a vLLM CPU build and a CPU llama-server under the engine cache
(``$SPECOPS_CACHE/engines``) for the demo and the tests. Discovery falls back to them only for CPU
profiles (``gpus.devices`` unset or ``[]``): a profile that names GPUs never gets the CPU build by
accident; it says so, and how to use it anyway (point ``engine.python``/``engine.executable`` at it).
"""

from __future__ import annotations

import os
from pathlib import Path

from specops.paths import engines_dir

#: How a development engine is named in messages and in the engine's ``source``.
DEV_ENGINE = "specops' CPU development engine"
#: Written last by a set-up step: a folder without it is half-installed and never used.
READY_MARKER = ".specops-ready"


def dev_engines(pattern: str) -> list[Path]:
    """Programs matching ``pattern`` under the engine cache whose set-up finished, newest first."""
    found = [p for p in engines_dir().glob(pattern) if (p.parent.parent / READY_MARKER).is_file()]
    return sorted(found, key=os.path.getmtime, reverse=True)


def dev_engine_skipped(root: Path, program: Path, setting: str, devices) -> str:
    """Why a development engine was not used for a GPU profile, and how to use it anyway."""
    return (
        f"{DEV_ENGINE} {root} not used: it serves CPU profiles only (gpus.devices unset or []), and this "
        f"profile has gpus.devices {list(devices)}; to use it anyway, set {setting}: {program}"
    )


def dev_engine_for(profile, pattern: str, setting: str, looked: list[str]) -> str | None:
    """The newest development engine matching ``pattern`` when ``profile`` is a CPU profile, else None;
    says in ``looked`` what was found or skipped, and why."""
    dev = dev_engines(pattern)
    if not dev:
        looked.append(f"no CPU development engine in {engines_dir()}")
        return None
    root = dev[0].parent.parent
    if profile.gpus.devices:
        looked.append(dev_engine_skipped(root, dev[0], setting, profile.gpus.devices))
        return None
    looked.append(f"{DEV_ENGINE} {root} (a CPU profile)")
    return str(dev[0])
