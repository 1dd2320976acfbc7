"""The front proxy: a stable public address in front of an engine that specops restarts and switches.

The modules, in the order a request meets them:

- :mod:`~specops.proxy.server`: :class:`Proxy`: lifecycle, switch control (hold, drain, release,
  upstream_failed), status;
- :mod:`~specops.proxy.states`: the proxy's states and the allowed changes between them;
- :mod:`~specops.proxy.options`: the settings (:class:`ProxyOptions`), checked once, with their defaults;
- :mod:`~specops.proxy.limits`: what the public port accepts (connection cap, header/body deadlines,
  body sizes, buffered bytes, the API key) and the rate-limited rejection log;
- :mod:`~specops.proxy.bodies`: request bodies, read within their limits and held against the buffer budget;
- :mod:`~specops.proxy.dispatch`: a request's way through: admin routes, the wait queue, retries,
  reconnects, recovery of a failed engine;
- :mod:`~specops.proxy.forward`: one exchange with the engine: request headers, the upstream URL, streaming,
  SSE error events, llama.cpp timings;
- :mod:`~specops.proxy.errors`: exceptions, JSON error bodies, one-line log text;
- :mod:`~specops.proxy.metrics`: the Prometheus collector; :mod:`~specops.proxy.loop`: uvloop or asyncio.
"""

from .dispatch import ADMIN_PREFIX
from .limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_CONNECTIONS,
)
from .loop import loop_factory, run_event_loop
from .server import DrainResult, Proxy
from .states import TRANSITIONS, IllegalTransition, ProxyState

__all__ = [
    "ADMIN_PREFIX",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_MAX_BODY_SIZE",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "TRANSITIONS",
    "DrainResult",
    "IllegalTransition",
    "Proxy",
    "ProxyState",
    "loop_factory",
    "run_event_loop",
]
