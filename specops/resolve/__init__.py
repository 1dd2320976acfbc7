"""Resolve the draft for a target: catalog, Hub discovery, compatibility checks, ``auto``, lock files.

Public API::

    resolve_profile(loaded, *, offline=False, use_lock=True) -> Resolution   # render / up / lock
    check_loaded(loaded, *, offline=False) -> list[Finding]                   # validate --resolve
    resolve(profile, ...) -> Resolution                                       # a Profile, no lock
    lock_profile(loaded, *, offline=False) -> (path, Resolution)              # specops lock

Importing this package is cheap: ``huggingface_hub`` and ``gguf`` load only when a resolution needs them.
"""

from __future__ import annotations

import importlib

#: public name -> the submodule that defines it; imported on first use (PEP 562), so ``render`` reading
#: ``specops.resolve.lock.lock_path`` does not load the resolver, the checks and the Hub discovery.
_EXPORTS = {
    "Candidate": "discover",
    "Finding": "check",
    "HubError": "huberrors",
    "Resolution": "resolver",
    "check_loaded": "resolver",
    "lock_path": "lock",
    "lock_profile": "resolver",
    "resolve": "resolver",
    "resolve_profile": "resolver",
    "synthetic_profile": "resolver",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Candidate",
    "Finding",
    "HubError",
    "Resolution",
    "check_loaded",
    "lock_path",
    "lock_profile",
    "resolve",
    "resolve_profile",
    "synthetic_profile",
]
