"""From a validated profile to the exact command line, and the printed forms of that plan.

Rendering is deterministic: the same profile and engine version give byte-identical output, so a GitOps
diff of ``specops render`` shows exactly what a merge would change on the servers.
"""
from __future__ import annotations

import json

from .backends.base import EngineInfo, LaunchPlan, RenderError
from .errors import ProfileError
from .profile import LoadedProfile

FORMATS = ("shell", "json", "args")


def plan(loaded: LoadedProfile, registry, *, engine: EngineInfo | None = None, backend_version: str | None = None,
         probe: bool = True, host: str | None = None, port: int | None = None) -> LaunchPlan:
    """Render ``loaded`` for its backend; render errors come back located in the profile."""
    backend = registry.backend(loaded.profile.backend)
    if engine is None:
        engine = backend.engine_info(loaded.profile, backend_version, probe=probe)
    try:
        return backend.render(loaded.profile, engine, host=host, port=port)
    except RenderError as exc:
        raise ProfileError([loaded.problem(exc.path, str(exc))]) from None


def format_plan(p: LaunchPlan, fmt: str) -> str:
    """``shell``: one paste-able line; ``json``: argv, env and URLs; ``args``: one argument per line."""
    if fmt == "shell":
        return p.shell() + "\n"
    if fmt == "json":
        return json.dumps(p.to_dict(), indent=2) + "\n"
    if fmt == "args":
        d = p.to_dict()
        lines = [f"{k}={v}" for k, v in d["env"].items()] + d["argv"]
        return "\n".join(lines) + "\n"
    raise ValueError(f"unknown format {fmt!r}")
