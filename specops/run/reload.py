"""Reloading the profile of a running ``specops up`` without restarting it (SIGHUP, or the file changed).

GitOps deployments change a profile by replacing a file: a Kubernetes ConfigMap volume swaps its
``..data`` symlink, so an inotify watch on the file itself misses the change. :class:`ProfileReloader`
therefore polls: every ``interval`` it hashes the contents of the profile, its ``extends`` bases and its
lock file (following symlinks); SIGHUP asks for the same check at once.

A changed file is loaded with the same loader and rules as ``specops validate`` and resolved like a start
(``resolve_for_launch``). Then either

- it is **applied**: the caller's ``apply`` hands it to the supervisor, which switches to it the zero-loss
  way (hold the proxy, drain, restart the engine with the new primary step, release);
- it is **rejected**: specops keeps running the old config, logs the located error (file:line:column,
  field), emits a ``reload-rejected`` event, counts it and shows it in ``specops status`` until the file
  is valid again (or back to the running content). Fields that only a restart of ``specops up`` can
  change (:data:`RESTART_FIELDS`) are rejected the same way, saying so;
- or it is **unchanged** (same bytes, or only comments and layout changed): nothing happens.

A file that does not load is reported one poll later (a half-written file gets a chance to complete), and
each distinct content is reported once.

The files are read as the loader reads profiles (:func:`specops.config.yamlsource.read_text`: regular files
of at most 1 MiB, opened without blocking), so a symlink to a huge file costs no memory and a FIFO at the
lock's path cannot hang a check. The checks run in a daemon thread, and :meth:`ProfileReloader.stop` waits
for a running one at most :data:`STOP_TIMEOUT` seconds: a file system that does not answer cannot keep
``specops up`` from stopping.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.config.profile import LoadedProfile, load_profile
from specops.config.yamlsource import read_text
from specops.errors import Problem, ProfileError, SpecopsError
from specops.resolve.lock import lock_path
from specops.resolve.prelaunch import resolve_for_launch

__all__ = ["RESTART_FIELDS", "Outcome", "ProfileReloader", "ReloadMetrics", "changed_fields", "fingerprint"]

#: Fields a running ``specops up`` cannot take over: the address it serves, its proxy, its identity and state,
#: the engine it probed at start, the fleet coordination and the spot checker it built at start. A change to
#: one of them is rejected until ``specops up`` is restarted.
RESTART_FIELDS: tuple[tuple[str, ...], ...] = (
    ("name",),
    ("backend",),
    ("server", "host"),
    ("server", "port"),
    ("server", "api_key"),
    ("proxy",),
    ("supervisor", "state_dir"),
    ("engine", "version"),
    ("engine", "executable"),
    ("engine", "python"),
    ("deploy", "max_switching"),
    ("deploy", "coordination"),
    ("deploy", "coordination_dir"),
    ("deploy", "lease_duration"),
    ("certify",),
)

#: The shortest poll interval (a smaller one is raised to it).
MIN_INTERVAL = 0.2
#: Seconds :meth:`ProfileReloader.stop` waits for a check that is running (then it leaves it behind).
STOP_TIMEOUT = 5.0


def _read(path: str) -> tuple[str | None, list[Problem]]:
    """(text, []) of a file read with the loader's bounds, or (None, why not: located at the file)."""
    try:
        return read_text(Path(path), path), []
    except ProfileError as exc:
        return None, list(exc.problems)


def fingerprint(paths: list[str]) -> str:
    """sha256 over the contents of ``paths`` (symlinks followed; a file that cannot be read as a profile is
    read, missing, too large, not a regular file, counts by why)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(os.fsencode(p) + b"\0")
        text, why = _read(p)
        h.update(
            hashlib.sha256(text.encode("utf-8")).digest() if text is not None else "; ".join(map(str, why)).encode()
        )
    return h.hexdigest()


def lock_problems(path: str) -> list[Problem]:
    """Why the lock at ``path`` cannot be read as profiles are ([]: it can, or there is none), checked before
    resolving reads it."""
    return _read(path)[1] if os.path.lexists(path) else []


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread (not the loop's executor, whose threads the interpreter waits for at
    exit): a check stuck on a file cannot keep the process from ending."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():  # cancelled: stop() stopped waiting
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:  # handed to the awaiting task
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="specops-reload-check", daemon=True).start()
    return await done


def _dump(loaded: LoadedProfile) -> dict:
    return loaded.profile.model_dump(mode="json")


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths whose values differ between two profile dumps (values are never shown: they may be secret)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += changed_fields(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if old == new else [prefix or "(profile)"]


@dataclass
class Outcome:
    """What one check did: ``applied``, ``rejected``, ``unchanged`` or ``pending`` (try again at the next poll)."""

    result: str
    message: str = ""
    changes: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


@dataclass
class _Step:
    """What a check found (in a thread), for the event loop to act on: ``report`` an outcome, ``revert`` (the
    file is back to the running content), ``same`` (a comment-only edit) or ``apply`` a changed profile."""

    kind: str
    sha: str
    outcome: Outcome | None = None
    loaded: LoadedProfile | None = None
    resolved: LoadedProfile | None = None
    changes: list[str] = field(default_factory=list)


class ReloadMetrics:
    """``specops_profile_reload_total{result}`` and ``specops_profile_reload_failed`` on specops' /metrics."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.total = Counter(
            "specops_profile_reload",
            "Profile reloads by result: applied, rejected (the old config keeps running), unchanged",
            ["result"],
            registry=registry,
        )
        self.failed = Gauge(
            "specops_profile_reload_failed",
            "1 while the profile on disk differs from the running one because it was rejected",
            registry=registry,
        )
        for result in ("applied", "rejected", "unchanged"):
            self.total.labels(result)


class ProfileReloader:
    """Watches ``running`` (the profile as written) and reloads it; see the module docstring.

    ``apply(resolved, changes) -> bool | str`` hands a valid profile to the supervisor (False: it cannot take it
    now, e.g. during a switch: the next poll tries again; a string: taken, and what happens instead of a restart); it raises SpecopsError when the profile cannot run (it
    does not render, its policy cannot be built). ``on_status(snapshot)`` runs after every report.
    """

    def __init__(
        self,
        running: LoadedProfile,
        resolved: LoadedProfile,
        *,
        apply: Callable[[LoadedProfile, list[str]], bool | str],
        events: Any,
        say: Callable[[str], None],
        offline: bool = False,
        registry: Any = None,
        metrics: ReloadMetrics | None = None,
        on_status: Callable[[dict], None] | None = None,
        interval: float = 2.0,
        load: Callable[[str], LoadedProfile] | None = None,
    ):
        self.path = running.path
        self.running = running
        self.resolved = resolved
        self.apply = apply
        self.events = events
        self.say = say
        self.offline = offline
        self.metrics = metrics
        self.on_status = on_status or (lambda snapshot: None)
        self.interval = max(float(interval), MIN_INTERVAL)
        self._load = load or (lambda path: load_profile(path, registry=registry))
        self.files = self._files(running)
        self.running_sha = fingerprint(self.files)
        self.applied = 0
        self.rejected: dict | None = None  # the last rejection, while the file on disk is still that content
        self._reported: str | None = None  # the content last reported (applied, rejected or unchanged)
        self._waited: str | None = None  # a content that failed to load once: reported at the next poll
        self._wake = asyncio.Event()
        self._forced = False
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._previous: tuple[LoadedProfile, LoadedProfile, str] | None = None  # before the last applied reload

    def _files(self, loaded: LoadedProfile) -> list[str]:
        files = [self.path, *(f for f in loaded.document.files if f != self.path)]
        return [*files, str(lock_path(self.path))]

    def snapshot(self) -> dict:
        """For the state file and ``specops status``: the running content's hash, reloads, the last rejection."""
        return {
            "path": os.path.abspath(self.path),
            "running_sha256": self.running_sha,
            "applied": self.applied,
            "rejected": self.rejected,
        }

    def rolled_back(self, why: str, cause: str = "the reloaded profile's engine did not start") -> None:
        """The applied profile's engine did not start (or its new draft was refused live, ``cause`` says) and
        the previous one runs again: report it as rejected (the file on disk stays what it is, reported once)."""
        if self._previous is None:
            return
        self.running, self.resolved, sha = self._previous
        self._previous = None
        reported, self.running_sha = self._reported, sha
        self._report(
            Outcome("rejected", f"{self.path}: {cause} ({why}); running the old config"),
            reported or fingerprint(self.files),
        )

    # ------------------------------------------------------------------ triggers
    def trigger(self) -> None:
        """SIGHUP: check now, and report a file that does not load without waiting for another poll."""
        self._forced = True
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop polling; a check still running after ``timeout`` seconds is left behind (its thread is a daemon)."""
        self._stopping.set()
        self._wake.set()
        if self._task is None:
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            self.say(f"warning: a profile reload check still runs after {timeout:g}s (a file that does not answer?)")
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass
            if self._stopping.is_set():
                break
            self._wake.clear()
            forced, self._forced = self._forced, False
            try:
                await self.check_async(forced=forced)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must never take the serving instance down
                self.say(f"warning: profile reload check failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ one check
    def check(self, forced: bool = False) -> Outcome | None:
        """Look at the files once; None when there is nothing new to report."""
        return self._conclude(self._prepare(forced))

    async def check_async(self, forced: bool = False) -> Outcome | None:
        """:meth:`check` with the file reads, validation and resolution (which may ask the Hub) in a thread, so
        the proxy's event loop never waits on them; applying and reporting stay on the loop."""
        return self._conclude(await _off_loop(self._prepare, forced))

    def _prepare(self, forced: bool) -> _Step | None:
        """Everything that reads or resolves, changing nothing that the loop reads."""
        sha = fingerprint(self.files)
        if sha == self.running_sha:
            if self.rejected is not None:  # the file went back to what runs
                return _Step("revert", sha)
            return _Step("report", sha, Outcome("unchanged", "the profile is the running one")) if forced else None
        if sha == self._reported and not forced:
            return None
        try:
            loaded = self._load(self.path)
        except SpecopsError as exc:
            if not forced and self._waited != sha:  # perhaps half-written: look again at the next poll
                self._waited = sha
                return _Step("report", sha, Outcome("pending", "does not load yet"))
            problems = list(exc.problems) if isinstance(exc, ProfileError) else []
            return _Step("report", sha, Outcome("rejected", str(exc), problems=problems))
        self.files = self._files(loaded)
        sha = fingerprint(self.files)  # the bases may have changed the list of files
        problems = self._restart_problems(loaded)
        problems += lock_problems(self.files[-1])
        if problems:
            return _Step("report", sha, Outcome("rejected", "\n".join(str(p) for p in problems), problems=problems))
        try:
            resolved, refused = resolve_for_launch(loaded, self.offline, self.say)
        except SpecopsError as exc:  # resolving failed (e.g. the Hub cannot be reached)
            return _Step("report", sha, Outcome("rejected", str(exc), problems=list(getattr(exc, "problems", []))))
        if refused:
            return _Step("report", sha, Outcome("rejected", f"the draft was refused: {refused}"))
        changes = changed_fields(_dump(self.resolved), _dump(resolved))
        return _Step("apply" if changes else "same", sha, None, loaded, resolved, changes)

    def _conclude(self, step: _Step | None) -> Outcome | None:
        """Apply and report what :meth:`_prepare` found (on the event loop)."""
        if step is None:
            return None
        if step.kind == "revert":
            self.say(f"profile {self.path} is back to the running config")
            self._reported = None
            self._clear_rejection()
            return None
        if step.kind == "report":
            assert step.outcome is not None
            return self._report(step.outcome, step.sha)
        assert step.loaded is not None and step.resolved is not None
        if step.kind == "same":
            self._accept(step.loaded, step.resolved, step.sha)
            return self._report(Outcome("unchanged", "only comments or layout changed"), step.sha)
        try:
            taken = self.apply(step.resolved, step.changes)
        except SpecopsError as exc:
            problems = list(exc.problems) if isinstance(exc, ProfileError) else []
            return self._report(Outcome("rejected", str(exc), problems=problems), step.sha)
        if not taken:
            return Outcome(
                "pending",
                "the supervisor is busy (starting or switching) or waits for a fleet switch slot; trying again",
            )
        self._previous = (self.running, self.resolved, self.running_sha)
        self._accept(step.loaded, step.resolved, step.sha)
        self.applied += 1
        how = taken if isinstance(taken, str) else "restarting the engine with the new profile"
        return self._report(Outcome("applied", how, step.changes), step.sha)

    def _restart_problems(self, loaded: LoadedProfile) -> list[Problem]:
        old, new = _dump(self.running), _dump(loaded)
        out = []
        for path in RESTART_FIELDS:
            if _get(old, path) != _get(new, path):
                name = ".".join(path)
                out.append(
                    loaded.problem(
                        path,
                        f"{name} changed: a running specops up cannot take this change; it keeps running the "
                        f"old config until it is restarted",
                    )
                )
        return out

    def _accept(self, loaded: LoadedProfile, resolved: LoadedProfile, sha: str) -> None:
        self.running, self.resolved = loaded, resolved
        self.running_sha = sha
        self._clear_rejection()

    def _clear_rejection(self) -> None:
        self.rejected = None
        self._waited = None
        if self.metrics is not None:
            self.metrics.failed.set(0)
        self.on_status(self.snapshot())

    def _report(self, out: Outcome, sha: str) -> Outcome:
        if out.result == "pending":
            return out
        self._reported = sha
        if self.metrics is not None:
            self.metrics.total.labels(out.result).inc()
        if out.result == "rejected":
            self.rejected = {
                "message": out.message,
                "problems": [p.to_dict() for p in out.problems],
                "sha256": sha,
            }
            if self.metrics is not None:
                self.metrics.failed.set(1)
            self.events.emit(
                "reload-rejected",
                profile=os.path.abspath(self.path),
                message=out.message,
                problems=self.rejected["problems"],
            )
            self.say(f"profile reload rejected, keeping the running config: {out.message}")
        elif out.result == "applied":
            self.events.emit("reload", profile=os.path.abspath(self.path), changes=out.changes)
            self.say(f"profile reloaded ({', '.join(out.changes[:12])}): {out.message}")
        else:
            self.events.emit("reload-unchanged", profile=os.path.abspath(self.path), reason=out.message)
            self.say(f"profile reload: nothing to change ({out.message})")
        self.on_status(self.snapshot())
        return out
