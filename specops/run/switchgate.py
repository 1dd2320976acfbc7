"""Fleet-safe switches: at most ``deploy.max_switching`` replicas of a deployment switch methods at once.

A switch takes a replica out of service for a while (hold, drain, stop, start); if every replica of a
deployment saw the same bad draft and switched together, the whole fleet would be out at once. So a replica
that the watcher tells to switch first takes one of ``max_switching`` *slots* shared by the fleet, switches
(its proxy holds requests, so its readiness probe fails and the Service routes around it), and gives the
slot back once the new engine is ready. With no slot free it waits, and says so (event, status, metrics).

A :class:`SwitchGate` is where the slots live; its calls block (files, HTTP) and run in a thread:

- :class:`DirectoryGate`: ``flock``'d slot files in a directory the replicas share (plain servers); the
  kernel drops the lock of a process that dies;
- :class:`specops.k8s.lease.LeaseGate`: Kubernetes Lease objects; an expired lease covers a dead holder.

:class:`FleetCoordinator` is the asynchronous side under ``specops up``: it asks the gate without blocking
the event loop, renews the slot while the switch runs and releases it when it ends. Watcher-driven
switches and profile reloads (:meth:`FleetCoordinator.admit`: a ConfigMap change reaches every pod at about
the same time) go through it; a fallback after the engine failed does not wait (the replica is down anyway).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from specops.run.events import EngineReady, State, StateChanged, SwitchOrder

__all__ = ["DirectoryGate", "FleetCoordinator", "GateError", "Slot", "SwitchGate"]


class GateError(Exception):
    """The gate could not be asked (API unreachable, forbidden, a file that cannot be opened)."""


@dataclass(frozen=True)
class Slot:
    """Slot ``index`` of the fleet's switch slots, by the name the gate knows it by (a Lease, a file)."""

    index: int
    name: str


class SwitchGate(Protocol):
    """Where the fleet's switch slots live. Every method blocks; :class:`FleetCoordinator` runs them in a thread."""

    kind: str  # "lease" or "directory": what ``specops status`` shows
    identity: str  # this replica, as the other replicas see it holding a slot
    slots: int  # max_switching

    def try_enter(self) -> tuple[Slot | None, list[str]]:
        """Take a free slot (one already ours counts as free); else None. Also: the holders seen."""
        ...

    def renew(self, slot: Slot) -> bool:
        """Keep ``slot`` ours; False when it is not ours any more."""
        ...

    def leave(self, slot: Slot) -> None:
        """Give ``slot`` back (nothing when it is not ours)."""
        ...

    def close(self) -> None: ...


class DirectoryGate:
    """Slots as files ``<directory>/<name>.switch-<i>.lock``: a slot is taken while a process holds its ``flock``.

    The holder writes its identity into the file, so the others can say whom they wait for. Use a local
    directory or one on a file system with working ``flock`` (NFSv4 does; some network file systems do not)."""

    kind = "directory"

    def __init__(self, directory: Path, name: str, slots: int, identity: str):
        self.directory = Path(directory)
        self.name = name
        self.slots = slots
        self.identity = identity
        self._held: dict[int, int] = {}  # slot index -> the fd holding its lock

    def path(self, index: int) -> Path:
        return self.directory / f"{self.name}.switch-{index}.lock"

    def try_enter(self) -> tuple[Slot | None, list[str]]:
        if self._held:  # already ours
            index = next(iter(self._held))
            return Slot(index, str(self.path(index))), []
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise GateError(f"cannot create {self.directory}: {exc.strerror or exc}") from None
        holders = []
        for index in range(self.slots):
            path = self.path(index)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise GateError(f"cannot open {path}: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holders.append(self._holder(path))
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, (self.identity + "\n").encode(), 0)
            self._held[index] = fd
            return Slot(index, str(path)), holders
        return None, holders

    @staticmethod
    def _holder(path: Path) -> str:
        try:
            return path.read_text(errors="replace").strip() or "?"
        except OSError:
            return "?"

    def renew(self, slot: Slot) -> bool:
        return slot.index in self._held  # a flock lasts as long as its holder

    def leave(self, slot: Slot) -> None:
        fd = self._held.pop(slot.index, None)
        if fd is not None:
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # closing the last descriptor releases the lock

    def close(self) -> None:
        for index in list(self._held):
            self.leave(Slot(index, ""))


class FleetCoordinator:
    """Gates the watcher's switches through ``gate``, without blocking the event loop.

    :meth:`want` takes the switch order the watcher decided and returns False (not executed now): a task
    takes a slot in the background, then hands the order to ``execute`` (the supervisor's
    ``request_switch``) and calls ``on_executed(order)``. While no slot is free it retries every
    ``retry_interval`` seconds (with jitter) and shows it: a ``switch-waiting`` event, :meth:`snapshot`'s
    ``fleet.waiting_since`` and the ``specops_switch_waiting`` gauge. An order the watcher has not repeated for
    ``stale_after`` seconds is dropped (the acceptance recovered, say). The slot is renewed while held and
    released when an engine becomes ready after the switch, or when the supervisor stops or gives up.
    """

    def __init__(
        self,
        gate: SwitchGate,
        *,
        execute: Callable[[SwitchOrder], bool],
        events: Any,
        say: Callable[[str], None],
        on_executed: Callable[[SwitchOrder], None] | None = None,
        registry: Any = None,
        retry_interval: float = 2.0,
        renew_interval: float = 10.0,
        call_timeout: float = 10.0,
        stale_after: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.gate = gate
        self.execute = execute
        self.events = events
        self.say = say
        self.on_executed = on_executed or (lambda order: None)
        self.retry_interval = retry_interval
        self.renew_interval = renew_interval
        self.call_timeout = call_timeout
        self.stale_after = stale_after
        self.clock = clock
        self.wall = wall
        self.slot: Slot | None = None
        self.switching = False
        self.holders: list[str] = []
        self.waiting_since: float | None = None
        self.error: str | None = None
        self._pending: tuple[SwitchOrder, float] | None = None
        self._held_at = 0.0
        self._acquiring: asyncio.Task | None = None
        self._renewing: asyncio.Task | None = None
        self._leaving: set[asyncio.Task] = set()
        self._parked: asyncio.Task | None = None  # a slot taken for admit(), until it asks again (or gives up)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specops-switchgate")
        self._gauges = _gauges(registry) if registry is not None else None

    # ------------------------------------------------------------------ the watcher's side
    def want(self, order: SwitchOrder) -> bool:
        """The watcher wants ``order`` executed: False now (it is executed once a slot is ours)."""
        if self.switching or self._parked is not None:  # a slot kept for a reload: that goes first
            return False
        self._pending = (order, self.clock())
        if self._acquiring is None:
            self._acquiring = asyncio.get_running_loop().create_task(self._acquire())
        return False

    def admit(self, what: str) -> bool:
        """A restart outside the watcher (``what``: a profile reload) asks for a slot without blocking: True once
        one is ours (the caller restarts now; the slot goes back when the engine is ready, or with
        :meth:`abandon`), False while one is being taken or waited for (ask again later)."""
        if self.switching:
            return False
        if self._parked is not None and self.slot is not None:
            self._parked.cancel()
            self._parked = None
            self.switching = True
            self._renewing = asyncio.get_running_loop().create_task(self._renew())
            self._show()
            return True
        if self._parked is None:
            self._pending = (_Admission(what), self.clock())
            if self._acquiring is None:
                self._acquiring = asyncio.get_running_loop().create_task(self._acquire())
        return False

    def abandon(self, why: str) -> None:
        """The admitted restart did not happen: the slot goes back."""
        if self.switching or self._parked is not None:
            self._release(why)

    async def _unpark(self) -> None:
        await asyncio.sleep(self.stale_after)  # admitted but never asked for again: give the slot back
        self._parked = None
        self._release("the restart it was taken for did not come")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self._pool, fn, *args), timeout=self.call_timeout)

    async def _acquire(self) -> None:
        try:
            while self._pending is not None:
                order, asked = self._pending
                if self.clock() - asked > self.stale_after:
                    self.events.emit("switch-wait-abandoned", to=order.decision.get("to"), waited_s=self._waited())
                    self.say("fleet: no longer waiting for a switch slot: the decision was not repeated")
                    self._pending = None
                    self._set_waiting(None)
                    return
                try:
                    slot, self.holders = await self._call(self.gate.try_enter)
                    self.error = None
                except (GateError, OSError, asyncio.TimeoutError) as exc:
                    slot = None
                    self._note_error(str(exc) or type(exc).__name__)
                if slot is not None:
                    self._pending = None
                    self._enter(slot, order)
                    return
                self._set_waiting(order)
                await asyncio.sleep(self.retry_interval * random.uniform(0.75, 1.25))
        finally:
            self._acquiring = None

    def _enter(self, slot: Slot, order: SwitchOrder) -> None:
        waited = self._waited()
        self._set_waiting(None)
        self.slot, self._held_at = slot, self.clock()
        self.events.emit("switch-slot", slot=slot.name, to=order.decision.get("to"), waited_s=waited)
        if isinstance(order, _Admission):  # kept for admit(), which asks again at its next poll
            self._parked = asyncio.get_running_loop().create_task(self._unpark())
            self._show()
            return
        if not self.execute(order):  # the supervisor cannot switch now (not ready any more)
            self._release("the supervisor could not switch")
            return
        self.switching = True
        self.on_executed(order)
        self._renewing = asyncio.get_running_loop().create_task(self._renew())
        self._show()

    async def _renew(self) -> None:
        while self.slot is not None:
            await asyncio.sleep(self.renew_interval)
            slot = self.slot
            if slot is None:
                return
            try:
                ours = await self._call(self.gate.renew, slot)
            except (GateError, OSError, asyncio.TimeoutError) as exc:
                self._note_error(str(exc) or type(exc).__name__)
                continue
            if not ours and self.slot is slot:
                self.events.emit("switch-slot-lost", slot=slot.name)
                self.say(f"fleet: lost switch slot {slot.name} (not renewed in time); the switch goes on")
                self.slot = None
                self._show()

    # ------------------------------------------------------------------ the supervisor's side
    def on_event(self, event: Any) -> None:
        """A supervisor listener: the switch ended when the next engine is ready, or when supervision ends."""
        if isinstance(event, EngineReady) and self.switching:
            self._release("ready")
        elif isinstance(event, StateChanged) and event.state in (State.STOPPED, State.FATAL):
            self._pending = None
            if self._acquiring is not None:
                self._acquiring.cancel()
            self._set_waiting(None)
            if self.slot is not None or self.switching:
                self._release(f"supervisor {event.state.value}")

    def _release(self, why: str) -> None:
        slot, self.slot, self.switching = self.slot, None, False
        if self._parked is not None:
            self._parked.cancel()
            self._parked = None
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None
        if slot is not None:
            self.events.emit("switch-released", slot=slot.name, held_s=round(self.clock() - self._held_at, 3), why=why)
            task = asyncio.get_running_loop().create_task(self._leave(slot))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        self._show()

    async def _leave(self, slot: Slot) -> None:
        try:
            await self._call(self.gate.leave, slot)
        except (GateError, OSError, asyncio.TimeoutError) as exc:
            self._note_error(f"could not release {slot.name}: {exc or type(exc).__name__}")

    async def close(self) -> None:
        """Give back what is held and stop the thread (tests; ``specops up`` releases on STOPPED)."""
        if self._acquiring is not None:
            self._acquiring.cancel()
        if self.slot is not None:
            self._release("closing")
        if self._leaving:
            await asyncio.gather(*self._leaving, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._pool, self.gate.close)
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------------ showing it
    def _waited(self) -> float:
        return round(self.wall() - self.waiting_since, 3) if self.waiting_since is not None else 0.0

    def _set_waiting(self, order: SwitchOrder | None) -> None:
        if order is not None and self.waiting_since is None:
            self.waiting_since = self.wall()
            self.events.emit(
                "switch-waiting", to=order.decision.get("to"), holders=list(self.holders), slots=self.gate.slots
            )
            who = ", ".join(self.holders) or "?"
            self.say(f"fleet: waiting for a switch slot ({self.gate.slots} held by {who})")
            if self._gauges is not None:
                self._gauges[2].inc()
        elif order is None:
            self.waiting_since = None
        self._show()

    def _note_error(self, message: str) -> None:
        if message != self.error:
            self.events.emit("fleet-error", coordination=self.gate.kind, message=message)
            self.say(f"fleet: {self.gate.kind} coordination: {message}")
        self.error = message

    def _show(self) -> None:
        if self._gauges is not None:
            self._gauges[0].set(1 if self.waiting_since is not None else 0)
            self._gauges[1].set(1 if self.slot is not None else 0)

    def snapshot(self) -> dict:
        """``fleet`` in the state file and ``/specops/status``: how this replica stands with the fleet's slots."""
        wanted = self._pending[0].decision.get("to") if self._pending is not None else None
        return {
            "fleet": {
                "coordination": self.gate.kind,
                "identity": self.gate.identity,
                "max_switching": self.gate.slots,
                "waiting_since": self.waiting_since,
                "wants": wanted,
                "slot": self.slot.name if self.slot is not None else None,
                "switching": self.switching,
                "holders": list(self.holders),
                "error": self.error,
            }
        }


@dataclass(frozen=True)
class _Admission:
    """What :meth:`FleetCoordinator.admit` waits for a slot for (shown as ``wants`` like a switch's target)."""

    what: str

    @property
    def decision(self) -> dict:
        return {"to": self.what}


def _gauges(registry: Any) -> tuple[Any, Any, Any]:
    from prometheus_client import Counter, Gauge

    return (
        Gauge("specops_switch_waiting", "1 while a decided switch waits for a fleet switch slot", registry=registry),
        Gauge("specops_switch_slot_held", "1 while this replica holds a fleet switch slot", registry=registry),
        Counter("specops_switch_slot_waits", "Switches that had to wait for a fleet switch slot", registry=registry),
    )
