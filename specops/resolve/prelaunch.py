"""The profile an engine is launched with: the one resolution step before every launch (``up``, ``bench``, ``tune``).

:func:`resolve_for_launch` applies the resolver (method/draft ``auto``, the lock file, the compatibility
checks) and says whether the checks refused the primary draft. ``specops up`` then starts at the next
method of the chain; a measurement refuses to run it.
"""

from __future__ import annotations

from collections.abc import Callable

from specops.config.profile import LoadedProfile
from specops.errors import ProfileError
from specops.methods import Method


def needs_resolution(loaded: LoadedProfile) -> bool:
    """True when the profile leaves something for the resolver to choose (method or draft ``auto``)."""
    spec = loaded.profile.speculative
    return spec.method is Method.AUTO or spec.draft == "auto"


def resolve_for_launch(
    loaded: LoadedProfile, offline: bool, say: Callable[[str], None], *, only_auto: bool = False
) -> tuple[LoadedProfile, str | None]:
    """Apply the resolver (draft/method ``auto``, the lock file, the compatibility checks).

    Returns the profile to launch and, when the checks refuse the primary draft (``checks: enforce``),
    why: the caller then starts at the next method of the chain (or refuses to launch) instead of launching
    a draft that cannot work. With ``checks: warn`` the findings are printed and the engine decides.
    ``only_auto``: a profile with nothing ``auto`` passes unchanged, without reading a lock file or
    running a check (what a measurement of an already-resolved setting wants).
    """
    if only_auto and not needs_resolution(loaded):
        return loaded, None
    from specops.resolve import resolve_profile

    enforce = loaded.profile.speculative.checks == "enforce"
    try:
        resolution = resolve_profile(loaded, offline=offline, raise_errors=enforce)
    except ProfileError as exc:
        return loaded, "; ".join(p.message for p in exc.problems)
    for note in resolution.notes:
        say(note)
    for finding in resolution.findings:
        if finding.severity in ("warning", "error"):
            say(f"{finding.severity}: {finding.message}")
    profile = _with_mapped_vocab(resolution.profile, resolution.findings)
    if profile is loaded.profile:
        return loaded, None
    return LoadedProfile(profile, loaded.document, loaded.path), None


def _with_mapped_vocab(profile, findings):
    """The profile with the engine's heterogeneous-vocabulary options set when the checks found a draft model
    whose vocabulary differs and the engine can map it (see :data:`specops.resolve.check.HETERO_CHECK`)."""
    from specops.plugins import get_registry
    from specops.resolve.check import HETERO_CHECK

    if not any(f.check == HETERO_CHECK for f in findings):
        return profile
    options = get_registry().backend(profile.backend).heterogeneous_vocab(profile.engine.version) or {}
    spec = profile.speculative
    if all(spec.options.get(k) == v for k, v in options.items()):
        return profile
    return profile.model_copy(update={"speculative": spec.model_copy(update={"options": {**spec.options, **options}})})
