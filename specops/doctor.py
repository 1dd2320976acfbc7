"""``specops doctor``: check the machine (and a profile) and say what to fix, one line per finding.

Each check gives a :class:`Check`: ``ok``, ``warning`` (works, but not as you may think) or ``error``
(``specops up`` would fail, or the profile is wrong), what was found, and one line of what to do. Nothing
here starts an engine or binds a port beyond a loopback bind test; the Hub is asked one small question
(unless offline), Prometheus one ``/-/ready``. A check that fails in an unforeseen way becomes an error
row naming the check, never a traceback.

The checks, in order: specops itself; the profile (validation); the engines (where each was found, its
version and llama-server flag generation, and how discovery searched: ``engine.python``,
``engine.executable``, PATH, specops' CPU development engines); the GPUs the engine would see
(``nvidia-smi``, ``CUDA_VISIBLE_DEVICES``); the profile's ports; the state folder; the Hub (or offline
mode), the HF cache and token; Prometheus for ``promql`` profiles; then for a profile the lock, the
resolution and compatibility checks, the render, and the memory fit.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from specops import __version__
from specops.errors import ProfileError, SpecopsError

OK, WARNING, ERROR = "ok", "warning", "error"
LEVELS = (OK, WARNING, ERROR)
#: How long an outside program (nvidia-smi, an engine's --version) may take.
TOOL_TIMEOUT_S = 15.0


@dataclass
class Check:
    """One finding: ``level`` ok | warning | error, what was found (``summary``), what to do (``fix``)."""

    name: str
    level: str
    summary: str
    fix: str = ""
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "level": self.level,
            "summary": self.summary,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    profile: str | None = None

    @property
    def errors(self) -> int:
        return sum(c.level == ERROR for c in self.checks)

    @property
    def warnings(self) -> int:
        return sum(c.level == WARNING for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "profile": self.profile,
            "errors": self.errors,
            "warnings": self.warnings,
            "checks": [c.to_dict() for c in self.checks],
        }

    def lines(self) -> list[str]:
        out = [f"specops doctor{f' {self.profile}' if self.profile else ''}"]
        width = max((len(c.name) for c in self.checks), default=8)
        for c in self.checks:
            out.append(f"  {c.level:<7}  {c.name:<{width}}  {c.summary}")
            pad = " " * (2 + 7 + 2 + width + 2)
            out += [f"{pad}{d}" for d in c.details]
            if c.fix:
                out.append(f"{pad}fix: {c.fix}")
        n_err, n_warn = self.errors, self.warnings
        out.append(
            f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}"
            + ("" if n_err else ": nothing blocks `specops up`" if self.profile else "")
        )
        return out


@dataclass
class _Context:
    """What the checks share: the loaded profile (None without one or when it did not load), settings."""

    registry: Any
    offline: bool
    profile_path: str | None = None
    loaded: Any = None
    gpus: list[dict] | None = None  # what nvidia-smi listed
    _smi: tuple[list[dict] | None, str] | None = None

    def nvidia(self) -> tuple[list[dict] | None, str]:
        """nvidia-smi's answer, asked once."""
        if self._smi is None:
            self._smi = _nvidia_smi()
        return self._smi

    hub_ok: bool = False
    resolved: Any = None  # the LoadedProfile after resolution
    resolution: Any = None


def run_doctor(profile_path: str | None, *, offline: bool = False, registry=None) -> Report:
    """Every check, for the machine and (when given) one profile."""
    if registry is None:
        from specops.plugins import get_registry

        registry = get_registry()
    from specops.doctor_hub import _hf_cache, _hf_token, _hub, _prometheus
    from specops.doctor_profile import _lock, _memory, _render, _resolve

    ctx = _Context(registry=registry, offline=offline, profile_path=profile_path)
    report = Report(profile=profile_path)
    steps: list[tuple[str, Callable[[_Context], list[Check]]]] = [
        ("specops", _specops),
        ("profile", _profile),
        ("engine", _engines),
        ("gpus", _gpus),
        ("ports", _ports),
        ("state", _state),
        ("hub", _hub),
        ("hf-cache", _hf_cache),
        ("hf-token", _hf_token),
        ("prometheus", _prometheus),
        ("lock", _lock),
        ("resolve", _resolve),
        ("render", _render),
        ("memory", _memory),
    ]
    for name, step in steps:
        try:
            report.checks += step(ctx)
        except Exception as exc:  # a check must never end the report: say which one broke, and go on
            report.checks.append(
                Check(name, ERROR, f"doctor could not check this: {type(exc).__name__}: {_one_line(str(exc))}")
            )
    return report


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------ specops


def _specops(ctx: _Context) -> list[Check]:
    return [Check("specops", OK, f"specops {__version__} on Python {sys.version.split()[0]} ({sys.executable})")]


def _profile(ctx: _Context) -> list[Check]:
    if ctx.profile_path is None:
        return []
    from specops.config.profile import load_profile

    try:
        ctx.loaded = load_profile(ctx.profile_path, registry=ctx.registry)
    except ProfileError as exc:
        problems = [str(p) for p in exc.problems]
        return [
            Check(
                "profile",
                ERROR,
                f"does not validate: {_one_line(problems[0])}",
                "fix the field named above (`specops validate` lists every problem); "
                "the profile checks below are skipped",
                [_one_line(p) for p in problems[1:8]],
            )
        ]
    except SpecopsError as exc:
        return [Check("profile", ERROR, f"cannot load: {_one_line(str(exc))}", "the profile checks below are skipped")]
    p = ctx.loaded.profile
    layout = (
        "CPU only" if p.gpus.devices == [] else f"GPUs {p.gpus.devices}" if p.gpus.devices else "GPUs: engine default"
    )
    return [Check("profile", OK, f"{p.name}: {p.backend}, method {p.speculative.method.value}, {layout}")]


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


def _engines(ctx: _Context) -> list[Check]:
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
                version = f"unusable: {_one_line(str(exc), 200)}"
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
            label, ERROR, f"found {where} but it does not work: {_one_line(str(exc))}", _fix_of(backend.install_hint)
        )
        return check, None
    return Check(
        label, OK, f"{_display(backend)} {_describe(backend, info)} at {where}", details=[f"found by: {looked[-1]}"]
    ), info


def _profile_engine(ctx: _Context) -> Check:
    from specops.backends.devengines import DEV_ENGINE

    p = ctx.loaded.profile
    backend = ctx.registry.backend(p.backend)
    label = "engine"
    found = backend.search(p)
    if found is None:  # a backend without discovery to show (e.g. a plugin's): it finds its engine itself
        try:
            info = backend.engine_info(p, probe=True)
        except SpecopsError as exc:
            return Check(label, ERROR, _one_line(str(exc)), _fix_of(getattr(backend, "install_hint", "")))
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


def _nvidia_smi() -> tuple[list[dict] | None, str]:
    """GPUs nvidia-smi lists (None when it is missing or fails) and what happened, in words."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "no nvidia-smi on PATH"
    query = "--query-gpu=index,name,memory.total,memory.used"
    try:
        res = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{exe} did not run: {type(exc).__name__}"
    if res.returncode != 0:
        first = (res.stderr or res.stdout).strip().splitlines()
        return None, f"{exe} failed (exit {res.returncode}): {_one_line(first[0] if first else '', 200)}"
    gpus = []
    for line in res.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        try:
            total, used = float(parts[2]), float(parts[3])
        except ValueError:
            total = used = float("nan")
        gpus.append({"index": int(parts[0]), "name": parts[1][:100], "memory_mib": total, "used_mib": used})
    return gpus, exe


def _gpus(ctx: _Context) -> list[Check]:
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


def _ports(ctx: _Context) -> list[Check]:
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


def _state(ctx: _Context) -> list[Check]:
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
