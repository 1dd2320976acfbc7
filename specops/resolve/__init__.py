"""Resolve the draft for a target: catalog, Hub discovery, compatibility checks, ``auto``, lock files.

Public API::

    resolve_profile(loaded, *, offline=False, use_lock=True) -> Resolution   # render / up / lock
    check.check_loaded(loaded, *, offline=False) -> list[Finding]             # validate --resolve
    resolve(profile, ...) -> Resolution                                       # a Profile, no lock
    lock_profile(loaded, *, offline=False) -> (path, Resolution)              # specops lock

Importing this package is cheap: ``huggingface_hub`` and ``gguf`` load only when a resolution needs them.
"""

from __future__ import annotations

from specops.resolve.check import Finding, check_loaded
from specops.resolve.discover import Candidate
from specops.resolve.huberrors import HubError
from specops.resolve.lock import lock_path
from specops.resolve.resolver import Resolution, lock_profile, resolve, resolve_profile, synthetic_profile

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
