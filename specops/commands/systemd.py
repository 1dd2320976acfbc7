"""``specops systemd``: a systemd unit that runs ``specops up PROFILE`` as a service.

The unit follows how ``specops up`` itself stops (:mod:`specops.serve.up`, :mod:`specops.run.supervise`,
:mod:`specops.run.process`, :meth:`specops.proxy.Proxy.drain`):

- SIGTERM (or SIGINT) makes specops stop: a switch in progress finishes its drain (``proxy.drain_timeout``,
  then the cut requests get up to 5 s to unwind) and its engine stop; then the engine's process group gets
  SIGTERM, SIGKILL after ``supervisor.stop_timeout``, and specops waits up to ``stop_timeout`` more (then
  SIGKILL again, 5 s) until no process of the group is left; the watcher's last read (``monitor.timeout``)
  and the proxy's two servers (1 s each) close; exit code 0.
- So the unit has ``KillMode=mixed`` (systemd's SIGTERM goes to specops alone, which stops its engine's
  group in order; the final SIGKILL reaches everything left in the unit's cgroup, the engine's own
  session included) and a ``TimeoutStopSec`` above that worst case.
- Exit code 1 means no method of the fallback chain could run (or a profile error): ``Restart=on-failure``
  restarts it, bounded by the start limit. A crashing engine is restarted by specops itself.
- ``specops up`` reloads its profile on SIGHUP (and when the file changes): ``ExecReload`` sends SIGHUP, so
  ``systemctl reload`` applies a profile change through the same zero-loss switch, or keeps the running config
  and says why (``specops status``). Changing the address, the proxy, the name or the engine takes
  ``systemctl restart``.
- Secrets never enter the unit: specops reads the profile's ``${VAR}`` values from its environment, which
  systemd fills from ``EnvironmentFile=`` (a root-owned 0600 file). The unit names the variables, never
  their values.
"""

from __future__ import annotations

import math
import os
import pwd
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from specops import __version__
from specops.commands._common import load, profile_argument
from specops.config.profile import LoadedProfile
from specops.errors import SpecopsError

__all__ = ["StopBudget", "render_unit", "stop_budget", "systemd"]

#: seconds :meth:`specops.proxy.Proxy.drain` gives cut requests to unwind after the drain timeout
CUT_UNWIND_S = 5.0
#: seconds :meth:`specops.run.process.EngineProcess.stop` waits after its second SIGKILL to the group
KILL_AGAIN_S = 5.0
#: the proxy's public and admin servers close with ``shutdown_timeout=1.0`` each
PROXY_SHUTDOWN_S = 2.0
#: what TimeoutStopSec adds to the computed worst case (Python's own exit, the state file, the journal)
MARGIN_S = 15.0
#: the start limit: this many starts within the interval, then systemd leaves the unit failed
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 600
RESTART_SEC = 30

_UNSAFE_PATH = re.compile(r"[\x00-\x1f\x7f]")
_ENV_FILE = re.compile(r"^(/|%h/)[^\s%\x00-\x1f\x7f]+$")


@dataclass(frozen=True)
class StopBudget:
    """The longest a ``systemctl stop`` of ``specops up`` takes, by part, in seconds."""

    drain: float  # proxy.drain_timeout (a switch in progress finishes its drain)
    cut_unwind: float
    engine_term: float  # supervisor.stop_timeout: SIGTERM → SIGKILL of the engine's group
    engine_workers: float  # supervisor.stop_timeout again: workers left in the group, then SIGKILL
    kill_again: float
    last_read: float  # monitor.timeout: the watcher's last read
    proxy_close: float

    @property
    def total(self) -> float:
        return (
            self.drain
            + self.cut_unwind
            + self.engine_term
            + self.engine_workers
            + self.kill_again
            + self.last_read
            + self.proxy_close
        )

    @property
    def timeout_stop_sec(self) -> int:
        """``TimeoutStopSec``: the worst case plus :data:`MARGIN_S`, whole seconds."""
        return math.ceil(self.total + MARGIN_S)


def stop_budget(profile) -> StopBudget:
    """The stop budget of ``profile`` (a validated :class:`~specops.config.sections.Profile`)."""
    proxy = profile.proxy.enabled
    stop = float(profile.supervisor.stop_timeout)
    return StopBudget(
        drain=float(profile.proxy.drain_timeout) if proxy else 0.0,
        cut_unwind=CUT_UNWIND_S if proxy else 0.0,
        engine_term=stop,
        engine_workers=stop,
        kill_again=KILL_AGAIN_S,
        last_read=float(profile.monitor.timeout),
        proxy_close=PROXY_SHUTDOWN_S if proxy else 0.0,
    )


def exec_arg(arg: str) -> str:
    """One ``ExecStart=`` word: ``%`` and ``$`` escaped (systemd specifiers and variables), quoted when needed."""
    if _UNSAFE_PATH.search(arg):
        raise SpecopsError(f"{arg!r} has a control character; systemd cannot run it")
    text = arg.replace("%", "%%").replace("$", "$$")
    if re.search(r"[\s\"'\\;]", text) or not text:
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def default_specops() -> str:
    """The absolute path of this specops' console script (beside this interpreter, else on PATH)."""
    here = Path(os.path.abspath(sys.executable)).parent / "specops"  # not resolved: a venv's python is a link
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("specops")
    if found:
        return os.path.abspath(found)
    raise SpecopsError("cannot find the specops program beside this Python or on PATH; pass --specops PATH")


def _fmt_s(seconds: float) -> str:
    return f"{seconds:g}s"


def _profile_variables(loaded: LoadedProfile) -> list[str]:
    """The environment variables the profile took values from (public ones such as HOME excluded)."""
    names: set[str] = set()
    for text in loaded.document.env_texts:
        names.update(name for _s, _e, name in text.spans)
    return sorted(names)


def render_unit(
    loaded: LoadedProfile,
    *,
    specops: str,
    user_unit: bool = False,
    run_as: str | None = None,
    env_file: str | None = None,
) -> str:
    """The unit's text for ``loaded`` (deterministic: the same inputs give the same bytes)."""
    profile = loaded.profile
    name = profile.name
    if not os.path.isabs(specops):
        raise SpecopsError(f"--specops must be an absolute path, not {specops!r}")
    profile_path = os.path.abspath(loaded.path)
    env_file = env_file or (f"%h/.config/specops/{name}.env" if user_unit else f"/etc/specops/{name}.env")
    if not _ENV_FILE.match(env_file):
        raise SpecopsError(f"--env-file must be an absolute path (or %h/...) without spaces or %, not {env_file!r}")
    _refuse_relative_paths(profile)
    variables = _profile_variables(loaded)
    budget = stop_budget(profile)
    unit_name = f"specops-{name}.service"
    b = budget
    lines = [
        f"# {unit_name}: generated by `specops systemd` (specops {__version__}); regenerate it after a change",
        "# to the profile's proxy.drain_timeout, supervisor.stop_timeout or monitor.timeout.",
        "#",
        "# Secrets are not in this file. specops reads the profile's ${VAR}s (and the engine its HF_TOKEN) from",
        "# its environment, which systemd fills from the EnvironmentFile below: NAME=value lines, mode 0600:",
    ]
    if user_unit:
        lines.append(f"#   install -D -m 600 /dev/null {env_file.replace('%h', '~')}")
    else:
        lines.append(f"#   sudo install -D -m 600 -o root -g root /dev/null {env_file}")
    if variables:
        lines.append(
            f"# The profile reads: {', '.join(variables)} (required: the unit does not start without the file)."
        )
    else:
        lines.append("# The profile reads no variable from the environment (the file is optional).")
    lines += [
        "#",
        "# Stopping: KillMode=mixed sends SIGTERM to specops alone; specops finishes a switch's drain, stops the",
        "# engine's process group itself (SIGTERM, SIGKILL after supervisor.stop_timeout) and exits 0. Worst case:",
        f"#   drain {_fmt_s(b.drain)} + cut {_fmt_s(b.cut_unwind)} + engine stop {_fmt_s(b.engine_term)}"
        f" + its workers {_fmt_s(b.engine_workers)} + SIGKILL {_fmt_s(b.kill_again)}"
        f" + last read {_fmt_s(b.last_read)} + proxy {_fmt_s(b.proxy_close)} = {_fmt_s(b.total)};",
        f"#   TimeoutStopSec adds {_fmt_s(MARGIN_S)}, then systemd SIGKILLs everything left in the unit.",
        "# Reload: `systemctl reload` sends SIGHUP; specops applies the changed profile with a zero-loss engine restart,",
        "#   or keeps the running config and shows why in `specops status` (server address, proxy, name, engine:",
        "#   `systemctl restart`).",
    ]
    if profile.engine.executable is None and profile.engine.python is None:
        lines.append(
            "# The profile pins no engine.python/engine.executable: the engine is searched on systemd's PATH"
            " (not your shell's)."
        )
    if user_unit:
        lines.append("# A user unit runs only while you are logged in, unless: loginctl enable-linger $USER")
    lines += ["", "[Unit]", f"Description=specops {name}: {profile.backend} with speculative decoding"]
    if not user_unit:
        lines += ["After=network-online.target", "Wants=network-online.target"]
    lines += [
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=exec",
    ]
    if not user_unit and run_as:
        lines.append(f"User={run_as}")
    lines += [
        f"ExecStart={exec_arg(specops)} up {exec_arg(profile_path)}",
        f"EnvironmentFile={'' if variables else '-'}{env_file}",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={budget.timeout_stop_sec}",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        "NoNewPrivileges=yes",
        f"SyslogIdentifier=specops-{name}",
        "",
        "[Install]",
        f"WantedBy={'default.target' if user_unit else 'multi-user.target'}",
    ]
    text = "\n".join(lines) + "\n"
    _refuse_secret_values(loaded, text)
    return text


def _refuse_relative_paths(profile) -> None:
    """A service starts in ``/``: a model or draft given as a relative local path would not be found there."""
    from specops.resolve.models import is_local_ref

    for field, ref in (("model.id", profile.model.id), ("speculative.draft", profile.speculative.draft)):
        if ref and ref != "auto" and is_local_ref(ref) and not os.path.isabs(os.path.expanduser(ref)):
            raise SpecopsError(
                f"{field} {ref!r} is a relative path, and a systemd service runs in /: "
                "write an absolute path (or one under ${SPECOPS_MODELS})"
            )


def _refuse_secret_values(loaded: LoadedProfile, text: str) -> None:
    """Never write a unit that holds a value the profile took from the environment (6+ characters)."""
    for env_text in loaded.document.env_texts:
        for (_start, _end, var), value in zip(env_text.spans, env_text.values):
            if len(value) >= 6 and value in text:
                raise SpecopsError(f"the unit would contain the value of ${{{var}}} (in a path?); refusing to write it")


def _current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        raise SpecopsError("this user has no name in the password database; pass --run-as NAME") from None


@click.command()
@profile_argument
@click.option("--user", "user_unit", is_flag=True, help="A user unit (systemctl --user), not a system one.")
@click.option(
    "--run-as",
    metavar="NAME",
    help="System unit: the user that runs specops (User=). Default: the user running this command.",
)
@click.option(
    "--env-file",
    metavar="PATH",
    help="Where systemd reads the secrets from (EnvironmentFile=). Default: /etc/specops/NAME.env "
    "(--user: ~/.config/specops/NAME.env).",
)
@click.option("--specops", "specops_path", metavar="PATH", help="The specops program to run (default: this one).")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, writable=True), help="Write the unit here (default: stdout)."
)
def systemd(profile, user_unit, run_as, env_file, specops_path, output):
    """Print a systemd unit that runs `specops up PROFILE` as a service.

    ExecStart holds absolute paths (this specops, the profile); KillMode=mixed lets specops stop its
    engine's process group itself; TimeoutStopSec exceeds the profile's proxy.drain_timeout plus
    twice supervisor.stop_timeout (the worst case is spelled out in the unit); Restart=on-failure.
    Secrets never enter the unit: put them in the EnvironmentFile (mode 0600). ExecReload sends SIGHUP:
    `systemctl reload` applies a profile change without restarting specops (see `specops up --help`).

    \b
    Examples:
      specops systemd profiles/llama31-8b-eagle3.yaml -o /etc/systemd/system/specops-llama31-8b-eagle3.service
      specops systemd examples/llamacpp-cpu-draft.yaml --user -o ~/.config/systemd/user/specops-llamacpp-cpu-draft.service
    """
    loaded = load(profile)
    if run_as is not None and not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}\$?", run_as, flags=re.IGNORECASE):
        raise click.BadParameter(f"{run_as!r} is not a user name", param_hint="--run-as")
    if user_unit and run_as is not None:
        raise click.BadParameter("a user unit runs as its user; --run-as is for system units", param_hint="--run-as")
    text = render_unit(
        loaded,
        specops=os.path.abspath(specops_path) if specops_path else default_specops(),
        user_unit=user_unit,
        run_as=None if user_unit else (run_as or _current_user()),
        env_file=env_file,
    )
    if not user_unit and (run_as or _current_user()) == "root":
        click.echo("note: the unit runs specops and its engine as root; --run-as NAME names another user", err=True)
    if output is None:
        click.echo(text, nl=False)
        return
    _write(Path(output), text)
    unit = f"specops-{loaded.profile.name}.service"
    ctl = "systemctl --user" if user_unit else "sudo systemctl"
    click.echo(f"wrote {output}; then: {ctl} daemon-reload && {ctl} enable --now {unit}", err=True)


def _write(path: Path, text: str) -> None:
    """Write ``path`` whole (a temporary file renamed over it), mode 0644: a unit holds no secret."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SpecopsError(f"cannot write {path}: {exc.strerror or exc}") from None
