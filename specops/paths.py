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


def state_dir_origin(profile_setting: str | None = None) -> str:
    """Where :func:`state_dir` took the folder from, for messages."""
    if profile_setting:
        return "supervisor.state_dir or --state-dir"
    return "$SPECOPS_STATE" if os.environ.get("SPECOPS_STATE") else "the default"


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def trust_problem(path: Path, what: str = "state folder") -> str | None:
    """Why the existing folder ``path`` cannot be trusted with state, or None (also when it does not exist).

    A state file names the process `specops down` signals, so only a folder nobody else can write is
    trusted: owned by this user, not writable by group or others."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot use the {what} {path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"the {what} {path} is not a directory"
    facts = f"owner {_owner_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_uid != os.geteuid():
        return (
            f"the {what} {path} belongs to another user ({facts}; this is {_owner_name(os.geteuid())}): "
            f"refusing to use it, since whoever owns it decides what its state files say"
        )
    if st.st_mode & 0o022:
        return (
            f"the {what} {path} is writable by group or others ({facts}): refusing to use it, since anyone who "
            f"may write it could forge a state file; `chmod go-w {path}`, or use a folder of your own"
        )
    return None


def checked_state_dir(profile_setting: str | None = None) -> Path:
    """:func:`state_dir`, refused (SpecopsError naming it, its owner and mode) when it exists but another
    user owns it or group or others may write it. A missing one is fine: ``up`` creates it 0700."""
    path = state_dir(profile_setting)
    problem = trust_problem(path)
    if problem:
        raise SpecopsError(f"{problem} (set by {state_dir_origin(profile_setting)})")
    return path


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


#: Version of the real models' folder (their pins live in :mod:`specops.devenv.realmodels`).
REAL_MODELS_VERSION = "real-v1"


def real_models_dir() -> Path:
    return models_dir() / REAL_MODELS_VERSION


def builtin_env() -> dict[str, str]:
    """Variables every profile may use without setting them (the environment overrides them)."""
    return {
        "SPECOPS_CACHE": str(cache_dir()),
        "SPECOPS_MODELS": str(tiny_models_dir()),
        "SPECOPS_REAL_MODELS": str(real_models_dir()),
    }
