"""The front proxy (see :mod:`specops.proxy.server`)."""
from .server import (ADMIN_PREFIX, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_BODY_SIZE,
                     DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_CONNECTIONS, DrainResult, Proxy, _Generation,
                     _upstream_url, loop_factory, run_event_loop)

__all__ = ["ADMIN_PREFIX", "DrainResult", "Proxy", "loop_factory", "run_event_loop"]
