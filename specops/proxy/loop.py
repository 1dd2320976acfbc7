"""The event loop the proxy runs on: uvloop when it is installed, else asyncio's own."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable

__all__ = ["loop_factory", "run_event_loop"]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (a faster loop for the proxy), else None (asyncio's own).

    ``SPECOPS_UVLOOP=0`` in the environment keeps asyncio's loop.
    """
    if os.environ.get("SPECOPS_UVLOOP", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_event_loop(main):
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    factory = loop_factory()
    if factory is None:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    import uvloop  # pragma: no cover - Python 3.10

    return uvloop.run(main)
