"""Where specops keeps things: a cache for engines and models, a state folder for running instances."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from specops.errors import SpecopsError


def cache_dir() -> Path:
    """Engine venvs, the llama-server build, generated models (``$SPECOPS_CACHE``, else ~/.cache/specops)."""
    env = os.environ.get("SPECOPS_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specops"


def state_dir(profile_setting: str | None = None) -> Path:
    """State files and logs of running instances (profile ``supervisor.state_dir``, ``$SPECOPS_STATE``,
    else ~/.local/state/specops)."""
    if profile_setting:
        return Path(profile_setting).expanduser()
    env = os.environ.get("SPECOPS_STATE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "specops"


def private_dir(path: Path, tighten: bool = False) -> Path:
    """Create ``path`` (and any missing folder above it) with mode 0700; return it.

    An existing folder must belong to this user (SpecopsError otherwise: specops writes no state into a
    folder someone else controls). With ``tighten``, an existing one of ours that others may read
    (made by an older specops) is set to 0700: only for folders specops owns, such as
    ``<state_dir>/<name>``, never for a state_dir a profile names (which might be shared)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise SpecopsError(f"cannot create {d}: {exc.strerror or exc}") from None
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SpecopsError(f"cannot use {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SpecopsError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise SpecopsError(f"{path} belongs to another user (uid {st.st_uid}); refusing to keep state in it")
    if tighten and st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
    return path


def engines_dir() -> Path:
    return cache_dir() / "engines"


def models_dir() -> Path:
    return cache_dir() / "models"


#: Version of the generated tiny models; bump when the generators' output changes.
TINY_MODELS_VERSION = "v1"


def tiny_models_dir() -> Path:
    return models_dir() / TINY_MODELS_VERSION


def builtin_env() -> dict[str, str]:
    """Variables every profile may use without setting them (the environment overrides them)."""
    return {"SPECOPS_CACHE": str(cache_dir()), "SPECOPS_MODELS": str(tiny_models_dir())}
