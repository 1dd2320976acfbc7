"""Before every launch (``up``, ``bench``, ``tune``, ``certify``): what no method can fix, then the resolution.

:func:`check_before_launch` refuses a launch that would fail whatever the speculative method: the target
model is missing or unreadable, an address the launch binds is taken (naming the process that holds it,
read from /proc), not allowed or not of this machine, the twins beside the primary do not fit in memory. It raises :class:`CannotLaunch`, and the command stops
at once with one line per problem: falling back to another method would only fail the same way.

:func:`resolve_for_launch` applies the resolver (method/draft ``auto``, the lock file, the compatibility
checks) and says whether the checks refused the primary draft. ``specops up`` then starts at the next
method of the chain; a measurement refuses to run it. A refused *target* is no draft problem: it raises
:class:`CannotLaunch` too.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Iterable
from typing import NamedTuple

from specops.config.profile import LoadedProfile
from specops.errors import Problem, ProfileError
from specops.methods import Method

#: Fields whose problems no method of the chain can fix (the target model).
TARGET_FIELDS = frozenset({"model.id", "model.revision", "model.file"})


class CannotLaunch(ProfileError):
    """A launch fails whatever the method (the target model is missing, the port is taken): stop, do not fall
    back. Each problem is located at the profile field it is about when there is one."""


class Address(NamedTuple):
    """An address a launch binds, and the profile field that sets it (None: chosen by specops)."""

    host: str
    port: int
    field: tuple[str, ...] | None = None


def check_before_launch(loaded: LoadedProfile, addresses: Iterable[Address] = (), *, twins: bool = False) -> None:
    """Raise :class:`CannotLaunch` when the target model cannot be read, an address in ``addresses`` cannot be
    bound, or (``twins``: the launch starts the profile's twins too) the engines do not fit in memory; return
    quietly otherwise. Reads the file system and /proc only (no network, no engine)."""
    problems: list[Problem] = []
    target = target_problem(loaded.profile.model.id)
    if target is not None:
        problems.append(loaded.problem(("model", "id"), target))
    elif twins:
        from specops.resolve.memory import local_twin_problems

        problems += [loaded.problem(path, msg) for path, msg in local_twin_problems(loaded.profile, at_launch=True)]
    for address in addresses:
        why = address_problem(address.host, address.port)
        if why is None:
            continue
        if address.field is None:
            problems.append(Problem(None, "", why))
        else:
            name = ".".join(address.field)
            problems.append(loaded.problem(address.field, f"{why}; stop it or choose another {name}"))
    if problems:
        raise CannotLaunch(problems)


def target_problem(model_id: str) -> str | None:
    """Why the target model, when it is a local path, cannot be loaded (missing, unreadable); None when it
    can, or is a Hub repo (the resolver reads the Hub)."""
    from specops.resolve.models import is_local_ref

    if not is_local_ref(model_id):
        return None
    path = os.path.expanduser(model_id)
    if not os.path.exists(path):
        kind = "file" if model_id.endswith(".gguf") else "file or directory"
        return f"{model_id}: no such {kind}; no method can run without the target model"
    if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
        return f"{model_id}: permission denied (not readable by this user); no method can run without it"
    return None


def address_problem(host: str, port: int) -> str | None:
    """Why an engine cannot bind ``host:port`` now (taken, and by whom; not allowed; not an address of this
    machine), else None. Port 0 (any free port) is never a problem."""
    if not port:
        return None
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot bind {where}: {exc.strerror or exc} (not a host name or address of this machine)"
    family, _, _, _, sockaddr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # as servers do: a connection of a stopped engine lingering in TIME_WAIT does not count
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            from specops.resolve.ports import port_holder

            holder = port_holder(port)
            return f"{where} is already in use by " + (holder or "another process (this user cannot see which)")
        if exc.errno == errno.EACCES:
            return f"cannot bind {where}: permission denied (ports below 1024 need privileges)"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"cannot bind {where}: {host} is not an address of this machine"
        return f"cannot bind {where}: {exc.strerror or exc}"
    return None


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
    a draft that cannot work. A refused target raises :class:`CannotLaunch` (no method runs without it). With ``checks: warn`` the findings are printed and the engine decides.
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
        target = [p for p in exc.problems if p.field in TARGET_FIELDS]
        if target:  # no method runs without its target: nothing to fall back to
            raise CannotLaunch(target) from None
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
