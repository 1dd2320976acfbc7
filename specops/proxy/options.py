"""What a :class:`~specops.proxy.server.Proxy` can be told: its wait queue, retries and drain, the admin
port, the engine connection, and the client-facing limits (:mod:`specops.proxy.limits`).

Every field is a keyword of ``Proxy(host, port, ...)``; :meth:`Proxy.from_profile` fills them from the
profile's ``proxy`` and ``server`` sections. Bad values are refused when the proxy is made, not when the
first request meets them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_SEND_TIMEOUT,
)


@dataclass(frozen=True)
class ProxyOptions:
    """The proxy's settings (the runtime hooks, such as ``on_timings``, are passed to Proxy apart)."""

    queue_size: int
    queue_timeout: float
    drain_timeout: float
    retry_unstarted: bool = True
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    retry_after: float | None = None
    connect_timeout: float = 5.0
    read_timeout: float | None = None
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    buffer_limit: int = 1024 * 1024
    health_path: str = "/health"
    recover_interval: float = 1.0
    events_kept: int = 100
    api_key: str | None = None
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    send_timeout: float | None = DEFAULT_SEND_TIMEOUT  # a client that reads nothing this long is cut (None: never)
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    log_rejects_per_s: float = 5.0

    def __post_init__(self) -> None:
        if self.queue_size < 0:
            raise ValueError("queue_size must be >= 0")
        if self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ValueError("header_timeout and body_timeout must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1 (or None: no cap)")
        if self.max_body_size < 0 or self.max_buffered_bytes < 0:
            raise ValueError("max_body_size and max_buffered_bytes must be >= 0")
        if self.send_timeout is not None and self.send_timeout <= 0:
            raise ValueError("send_timeout must be > 0 (or None: no deadline)")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be >= 1024")
