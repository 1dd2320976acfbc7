"""Live windows for the goodput policy's tests: what the watcher hands the policy on each tick."""

from __future__ import annotations

from specops.watch.window import NO_DATA, OK, WindowStats

#: A tick with nothing to read (no request ended): the policy decides from load and the surface alone.
IDLE = WindowStats(NO_DATA, window_s=20.0, reason="idle")


def window(tau: float, *, k: int = 4, drafts: bool = True) -> WindowStats:
    """A full 20 s window of the running draft at ``k`` with mean acceptance length ``tau`` (100 drafts).

    ``drafts=False``: the window llama-server's per-request timings give, drafted and accepted tokens with
    no count of drafts, so no mean acceptance length either."""
    return WindowStats(
        OK,
        window_s=20.0,
        start=0.0,
        end=20.0,
        acceptance=(tau - 1) / k,
        mean_acceptance_length=tau if drafts else None,
        draft_tokens=100 * k,
        accepted=round(100 * (tau - 1)),
        drafts=100 if drafts else None,
        full=True,
    )


class Events:
    """An event log kept in memory (the decider's, the fleet coordinator's): ``lines`` holds each
    ``(kind, fields)`` it was told."""

    def __init__(self):
        self.lines: list[tuple[str, dict]] = []

    def emit(self, kind, **kw):
        self.lines.append((kind, kw))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.lines]
