"""``specops doctor``: the machine: specops itself, the engines, the GPUs, the profile's ports, the state folder."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from specops import __version__
from specops.doctor.base import ERROR, OK, WARNING, Check, Context, one_line
from specops.errors import SpecopsError


def check_specops(ctx: Context) -> list[Check]:
    return [Check("specops", OK, f"specops {__version__} on Python {sys.version.split()[0]} ({sys.executable})")]


# ------------------------------------------------------------------------------------------ engines


def _no_profile(devices) -> Any:
    """What engine discovery reads of a profile, for looking without one."""
    return SimpleNamespace(
        engine=SimpleNamespace(python=None, executable=None, version=None), gpus=SimpleNamespace(devices=devices)
    )


def _describe(backend, info) -> str:
    """The engine's version, and its flag generation where it has one (llama-server)."""
    gen = backend.flag_generation(info)
    return f"{info.version}" + (f" (flag generation {gen})" if gen else "")


def check_engines(ctx: Context) -> list[Check]:
    if ctx.profile_path is not None and ctx.loaded is None:
        return []
    if ctx.loaded is not None:
        return [_profile_engine(ctx)]
    out = []
    from specops.backends.devengines import DEV_ENGINE, dev_engines

    found_any = False
    for name, backend in sorted(ctx.registry.backends.items()):
        # a profile that names GPUs: what a production profile finds (the dev engines are listed apart)
        found = backend.search(_no_profile([0]))
        if found is None:  # no discovery of its own to show
            continue
        label = f"engine {name}"
        where, looked = found
        looked = [line for line in looked if not line.startswith(DEV_ENGINE)]  # listed apart, below
        if where is None:
            out.append(
                Check(
                    label,
                    WARNING,
                    f"not found ({'; '.join(looked)})",
                    _fix_of(backend.install_hint) + " — or ignore this if you do not use " + _display(backend),
                )
            )
        else:
            found_any = True
            out.append(_probed(label, backend, where, looked, _with_program(backend, Path(where)))[0])
    for name, backend in sorted(ctx.registry.backends.items()):
        for program in dev_engines(backend.dev_engine_pattern) if backend.dev_engine_pattern else []:
            try:
                info = backend.engine_info(_with_program(backend, program), probe=True)
                version = _describe(backend, info)
            except SpecopsError as exc:
                version = f"unusable: {one_line(str(exc), 200)}"
            out.append(
                Check(
                    f"engine {name}",
                    OK,
                    f"{DEV_ENGINE} {program.parent.parent}: {version}; used only for CPU profiles "
                    "(gpus.devices unset or []) and tests",
                )
            )
            found_any = True
    if not found_any:
        for c in out:
            c.level = ERROR
    return out


def _with_program(backend, program: Path) -> Any:
    """A profile without one whose engine setting (``engine.python`` or ``engine.executable``) is ``program``."""
    ns = _no_profile([])
    setattr(ns.engine, backend.engine_setting.removeprefix("engine."), str(program))
    return ns


def _display(backend) -> str:
    return getattr(backend, "display_name", "") or backend.name


def _fix_of(hint: str) -> str:
    return hint.split(": ", 1)[1] if ": " in hint else hint


def _probed(label: str, backend, where: str, looked: list[str], probe_with) -> tuple[Check, Any]:
    """Probe the engine discovery found (``probe_with``: a profile without a pinned version)."""
    try:
        info = backend.engine_info(probe_with, probe=True)
    except SpecopsError as exc:
        check = Check(
            label, ERROR, f"found {where} but it does not work: {one_line(str(exc))}", _fix_of(backend.install_hint)
        )
        return check, None
    return Check(
        label, OK, f"{_display(backend)} {_describe(backend, info)} at {where}", details=[f"found by: {looked[-1]}"]
    ), info


def _profile_engine(ctx: Context) -> Check:
    from specops.backends.devengines import DEV_ENGINE

    p = ctx.loaded.profile
    backend = ctx.registry.backend(p.backend)
    label = "engine"
    found = backend.search(p)
    if found is None:  # a backend without discovery to show (e.g. a plugin's): it finds its engine itself
        try:
            info = backend.engine_info(p, probe=True)
        except SpecopsError as exc:
            return Check(label, ERROR, one_line(str(exc)), _fix_of(getattr(backend, "install_hint", "")))
        return Check(label, OK, f"{_display(backend)} {_describe(backend, info)} ({info.source})")
    where, looked = found
    pinned = p.engine.version
    if where is None:
        what = f"{_display(backend)} not found ({'; '.join(looked)})"
        if pinned:
            what += f": `render` works for the pinned {pinned}, but `up` cannot start an engine"
        return Check(label, ERROR, what, _fix_of(backend.install_hint))
    unpinned = p.model_copy(update={"engine": p.engine.model_copy(update={"version": None})}) if pinned else p
    check, info = _probed(label, backend, where, looked, unpinned)
    if info is not None and looked[-1].startswith(DEV_ENGINE) and p.gpus.devices is None and ctx.nvidia()[0]:
        check.level = WARNING
        check.fix = (
            "this machine has GPUs, but the profile leaves gpus.devices unset, so it counts as a CPU profile and "
            "gets specops' CPU development engine: install the engine for your GPUs (or set engine.python / "
            "engine.executable) and set gpus.devices"
        )
    if info is None or not pinned:
        return check
    if not (p.engine.python or p.engine.executable):
        # for a pinned version `up` runs the bare program name from PATH: is it there?
        program = backend.program
        if program and shutil.which(program) is None:
            return Check(
                label,
                ERROR,
                f"engine.version {pinned} is pinned, so `up` runs `{program}` from PATH, and there is none "
                f"(discovery found {_display(backend)} {_describe(backend, info)} at {where})",
                f"set {backend.engine_setting} to the engine you mean (e.g. {where}), or put `{program}` on PATH",
                check.details,
            )
    if not backend.pin_matches(pinned, info):
        check.level = WARNING
        check.fix = (
            f"the profile renders for engine.version {pinned}, not for the installed {info.version}: "
            "install that version, or remove engine.version to follow the installed engine"
        )
    return check


# --------------------------------------------------------------------------------------------- GPUs


def check_gpus(ctx: Context) -> list[Check]:
    p = ctx.loaded.profile if ctx.loaded is not None else None
    devices = p.gpus.devices if p is not None else None
    gpus, how = ctx.nvidia()
    ctx.gpus = gpus
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    details = []
    if cvd is not None:
        details.append(
            f"CUDA_VISIBLE_DEVICES={cvd!r} in this environment"
            + (" (the profile's gpus.devices replaces it for the engine)" if devices else "")
        )
    if gpus is None:
        summary = f"CPU only: {how}"
        if devices:
            return [
                Check(
                    "gpus",
                    WARNING,
                    f"{summary}, but the profile uses GPUs {devices}",
                    "install the NVIDIA driver (nvidia-smi) or check the GPUs with your vendor's tool; "
                    "for a CPU run set gpus.devices: []",
                    details,
                )
            ]
        return [Check("gpus", OK, summary, details=details)]
    if not gpus:
        return [Check("gpus", ERROR if devices else OK, f"{how} lists no GPU", details=details)]
    listed = ", ".join(f"{g['index']}: {g['name']} ({g['memory_mib'] / 1024:.0f} GiB)" for g in gpus)
    if cvd is not None and not devices and cvd.strip() in ("", "-1"):
        return [
            Check(
                "gpus",
                WARNING,
                f"{len(gpus)} GPU(s) ({listed}), hidden from the engine by CUDA_VISIBLE_DEVICES={cvd!r}",
                "unset CUDA_VISIBLE_DEVICES, or set gpus.devices in the profile",
                details,
            )
        ]
    if devices:
        missing = [d for d in devices if d not in {g["index"] for g in gpus}]
        if missing:
            return [
                Check(
                    "gpus",
                    ERROR,
                    f"the profile uses GPUs {devices}, but {how} lists only {listed}",
                    f"set gpus.devices to indices that exist (missing: {missing})",
                    details,
                )
            ]
        busy = [g for g in gpus if g["index"] in devices and g["used_mib"] > 0.5 * g["memory_mib"]]
        if busy:
            return [
                Check(
                    "gpus",
                    WARNING,
                    f"GPUs {devices} of {listed}; "
                    + ", ".join(f"GPU {g['index']} has {g['used_mib'] / 1024:.0f} GiB in use" for g in busy),
                    "another process holds that memory (`nvidia-smi`); the engine may not fit next to it",
                    details,
                )
            ]
    return [Check("gpus", OK, f"{len(gpus)} GPU(s): {listed}", details=details)]


# -------------------------------------------------------------------------------------------- ports


def check_ports(ctx: Context) -> list[Check]:
    if ctx.loaded is None:
        return []
    p = ctx.loaded.profile
    wanted = [("server.port", p.server.port)]
    if p.proxy.enabled and p.proxy.engine_port:
        wanted.append(("proxy.engine_port", p.proxy.engine_port))
    if p.proxy.enabled and p.proxy.admin_port:
        wanted.append(("proxy.admin_port", p.proxy.admin_port))
    running = _running_instance(p)
    out = []
    for field_name, port in wanted:
        problem = _bind_problem(port)
        label = f"port {port}"
        if problem is None:
            note = "" if p.server.host in ("127.0.0.1", "localhost", "::1") else " (bind tested on 127.0.0.1 only)"
            out.append(Check(label, OK, f"{field_name} {port} is free{note}"))
        elif problem == "in use" and running:
            out.append(Check(label, OK, f"{field_name} {port} is in use by the running instance {p.name}"))
        elif problem == "in use":
            out.append(
                Check(
                    label,
                    ERROR,
                    f"{field_name} {port} is in use by another program",
                    f"stop that program (`ss -ltnp 'sport = :{port}'` shows it) or change {field_name}",
                )
            )
        else:
            out.append(
                Check(
                    label,
                    ERROR,
                    f"{field_name} {port}: {problem}",
                    f"change {field_name}, or run as a user that may bind it",
                )
            )
    return out


def _bind_problem(port: int) -> str | None:
    """None when ``port`` can be bound on loopback now; "in use"; or why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            if exc.errno == errno.EACCES:
                return "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
            return exc.strerror or str(exc)
    return None


def _running_instance(p) -> bool:
    from specops.run.identity import owner_problem
    from specops.run.instance import InstancePaths, StateError, read_state

    try:
        st = read_state(InstancePaths.for_profile(p.name, p.supervisor.state_dir))
    except (StateError, SpecopsError, OSError):
        return False
    return bool(st) and owner_problem(st) is None and st.get("state") not in ("stopped", "fatal")


# -------------------------------------------------------------------------------------------- state


def check_state(ctx: Context) -> list[Check]:
    from specops.paths import state_dir

    setting = ctx.loaded.profile.supervisor.state_dir if ctx.loaded is not None else None
    where = state_dir(setting)
    origin = "supervisor.state_dir" if setting else "$SPECOPS_STATE" if os.environ.get("SPECOPS_STATE") else "default"
    if not where.exists():
        parent = where
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
            return [Check("state", OK, f"{where} ({origin}) does not exist yet; `up` creates it with mode 0700")]
        return [
            Check(
                "state",
                ERROR,
                f"{where} ({origin}) does not exist and {parent} is not writable",
                "create it (`mkdir -m 700 -p DIR`) as the user that runs specops, or set SPECOPS_STATE",
            )
        ]
    try:
        st = os.stat(where)
    except OSError as exc:
        return [Check("state", ERROR, f"{where}: {exc.strerror or exc}", "fix its permissions or set SPECOPS_STATE")]
    if not stat.S_ISDIR(st.st_mode):
        return [Check("state", ERROR, f"{where} ({origin}) is not a directory", "remove it, or set SPECOPS_STATE")]
    if st.st_uid != os.geteuid():
        return [
            Check(
                "state",
                ERROR,
                f"{where} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): specops refuses to keep state there",
                "run specops as that user, or point SPECOPS_STATE (or supervisor.state_dir) at a folder of yours",
            )
        ]
    try:
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".doctor.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return [Check("state", ERROR, f"{where} is not writable: {exc.strerror or exc}", f"`chmod u+rwx {where}`")]
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return [
            Check(
                "state",
                WARNING,
                f"{where} ({origin}) is writable but has mode {mode:04o}: other users can read state and logs",
                f"`chmod 700 {where}`",
            )
        ]
    return [Check("state", OK, f"{where} ({origin}): writable, mode {mode:04o}")]
