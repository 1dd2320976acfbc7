"""The proxy's states, and which changes between them are allowed.

The supervisor switches engines through four calls on the proxy::

    proxy.hold()                        # new requests wait in a bounded queue        (→ held)
    result = await proxy.drain(t)       # in-flight requests on the old engine finish (or are cut at t)
    ... stop the old engine, start the new one, wait until it is healthy ...
    proxy.release(new_base_url)         # queued requests go to the new engine        (→ serving)

The states, as ``specops status`` and ``/specops/metrics`` show them (the ``.value`` strings), and the
changes allowed between them::

    from      to
    idle      serving (set_upstream / release), held (hold), down (upstream_failed), stopped
    serving   held (hold), down (upstream_failed, or the engine stopped accepting connections), stopped
    held      serving (release), down (upstream_failed), stopped
    down      serving (release, or the same engine answers its health check again), held (hold), stopped
    stopped   nothing (stop is final)

Requests are forwarded only in ``serving``; in ``idle``, ``held`` and ``down`` they wait in the queue
(bounded by ``queue_size`` and ``queue_timeout``); in ``stopped`` they get 503. Only the changes in
:data:`TRANSITIONS` are allowed; any other raises :class:`IllegalTransition` (a bug in the caller, never
a client's doing). Entering a state it is already in is no change and always allowed (a ``release`` while
serving points at a new engine and stays ``serving``).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["TRANSITIONS", "WAITING_STATES", "IllegalTransition", "ProxyState", "check_transition"]


class ProxyState(str, Enum):
    """Where the proxy stands with its engine (the values are what status and metrics show)."""

    IDLE = "idle"  # no engine yet: requests queue
    SERVING = "serving"  # requests are forwarded to the engine
    HELD = "held"  # a switch is in progress: requests queue
    DOWN = "down"  # the engine failed: requests queue until an engine is released (or it recovers)
    STOPPED = "stopped"  # the proxy is shutting down: requests get 503

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


_S = ProxyState

#: Every allowed state change (a "change" to the same state is no change and always allowed).
TRANSITIONS: dict[ProxyState, frozenset[ProxyState]] = {
    _S.IDLE: frozenset({_S.SERVING, _S.HELD, _S.DOWN, _S.STOPPED}),
    _S.SERVING: frozenset({_S.HELD, _S.DOWN, _S.STOPPED}),
    _S.HELD: frozenset({_S.SERVING, _S.DOWN, _S.STOPPED}),
    _S.DOWN: frozenset({_S.SERVING, _S.HELD, _S.STOPPED}),
    _S.STOPPED: frozenset(),
}

#: The states in which requests wait in the queue (and ``held_for_s`` counts).
WAITING_STATES = frozenset({_S.IDLE, _S.HELD, _S.DOWN})


class IllegalTransition(RuntimeError):
    """A state change :data:`TRANSITIONS` does not allow (a bug in the caller, never a client's doing)."""

    def __init__(self, current: ProxyState, wanted: ProxyState):
        super().__init__(f"illegal proxy transition {current} → {wanted}")
        self.current, self.wanted = current, wanted


def check_transition(current: ProxyState, wanted: ProxyState) -> None:
    """Raise :class:`IllegalTransition` unless the proxy may go from ``current`` to ``wanted``."""
    if wanted is not current and wanted not in TRANSITIONS[current]:
        raise IllegalTransition(current, wanted)
