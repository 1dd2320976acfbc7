"""What goes wrong on the way, and how it is said: the proxy's exceptions, its JSON error bodies, and
exceptions and client-sent text squeezed into one safe log line."""

from __future__ import annotations

import json

__all__ = ["Broken", "ClientError", "Rejected", "Unstarted", "brief", "describe", "error_body", "shown"]


class ClientError(Exception):
    """A request the proxy refuses on its own (bad target, no key, too large, too slow, no room)."""

    def __init__(self, status: int, kind: str, message: str, close: bool = False, counter: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.close = close  # the body was not read: do not keep the connection
        self.counter = counter or kind


class Rejected(Exception):
    """No engine for a waiting request: ``kind`` is ``stopped``, ``queue_full`` or ``queue_timeout`` (503)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Unstarted(Exception):
    """The upstream failed before the client received anything: the request may be retried.

    ``stale``: the failure looks like a pooled connection the engine had just closed (disconnected or
    unwritable before a response, as opposed to a refused connection, a timeout or a cut).
    """

    def __init__(self, reason: str, stale: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.stale = stale


class Broken(Exception):
    """A started stream lost its engine and may be continued on another (:mod:`specops.proxy.resume`).

    ``stream``: the :class:`~specops.proxy.resume.Resumable`; ``cause``: ``engine`` (the connection broke or ended
    before ``[DONE]``), ``drain`` (cut by a drain or ``upstream_failed``) or ``refused`` (the engine answered a
    continuation with an error: not tried again).
    """

    def __init__(self, reason: str, stream, cause: str):
        super().__init__(reason)
        self.reason = reason
        self.stream = stream
        self.cause = cause


def error_body(status: int, kind: str, message: str) -> bytes:
    """The OpenAI-style JSON error document every rejection (and a broken stream's last event) carries."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, separators=(",", ":")
    ).encode()


def shown(text: str | None, limit: int = 120) -> str:
    """Client-sent text for a log line: one line, printable, bounded."""
    if text is None:
        return "-"
    out = ascii(text[:limit])[1:-1]
    return out + "..." if len(text) > limit else out


def brief(exc: BaseException) -> str:
    """An exception in one short line: its type and the first line of its message (aiohttp's parse errors
    add the offending request line and a caret below it)."""
    text = getattr(exc, "message", None)
    if not isinstance(text, str):
        text = str(exc)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first.rstrip(':')}" if first else type(exc).__name__


def describe(exc: BaseException) -> str:
    """An exception as ``Type: message`` (or just its type)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
