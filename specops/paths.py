"""Where specops keeps things: a cache for engines and models, a state folder for running instances."""
from __future__ import annotations

import os
from pathlib import Path


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
