"""The proxy's own Prometheus metrics (``/specops/metrics``), read from its plain counters at scrape time,
so counting costs the hot path nothing but a dict increment."""

from __future__ import annotations

import bisect
from typing import Any

from .states import ProxyState

__all__ = ["LatencyHistogram", "ProxyCollector", "metrics_text"]

#: Upper bounds (seconds) of :class:`LatencyHistogram`'s buckets: 0.5 ms to 5 min, about 1.5x apart.
LATENCY_BUCKETS = tuple(round(0.0005 * 1.5**i, 6) for i in range(34))


class LatencyHistogram:
    """Request durations in fixed buckets: an observation is one bisect and one increment (it runs per request),
    the Prometheus histogram and the quantiles of ``specops status`` are read from it at scrape time."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated inside its bucket as Prometheus' ``histogram_quantile`` does (None:
        nothing observed)."""
        if not self.count:
            return None
        rank, seen = q * self.count, 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                low = LATENCY_BUCKETS[i - 1] if i else 0.0
                high = LATENCY_BUCKETS[i] if i < len(LATENCY_BUCKETS) else LATENCY_BUCKETS[-1]
                return low + (high - low) * max(0.0, rank - seen) / n
            seen += n
        return LATENCY_BUCKETS[-1]

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last: what a Prometheus histogram family takes."""
        out, total = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


def metrics_text(proxy: Any) -> bytes:  # proxy: the :class:`~specops.proxy.server.Proxy` (which imports this module)
    """The Prometheus text exposition: ``proxy.metrics_registry`` (if any), then the proxy's own metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    own = CollectorRegistry(auto_describe=False)
    own.register(ProxyCollector(proxy))
    out = generate_latest(own)
    if proxy.metrics_registry is not None:
        out = generate_latest(proxy.metrics_registry) + out
    return out


def _counter(name, doc, value, labels=None):
    from prometheus_client.core import CounterMetricFamily

    m = CounterMetricFamily(name, doc, labels=list(labels) if labels else None)
    if labels:
        for lv, v in value:
            m.add_metric(lv, v)
    else:
        m.add_metric([], value)
    return m


def _gauge(name, doc, value):
    from prometheus_client.core import GaugeMetricFamily

    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


class ProxyCollector:
    """prometheus_client collector reading the proxy's plain counters at scrape time (no hot-path cost)."""

    def __init__(self, proxy: Any):
        self.proxy = proxy

    def collect(self):
        p = self.proxy
        st = p.stats()
        yield from self._traffic(p, st)
        yield from self._refusals(st)
        yield from self._engine(st)
        yield from self._state(p, st)

    @staticmethod
    def _traffic(p: Any, st: dict):
        yield _counter(
            "specops_proxy_requests", "Requests received on the public port (admin excluded).", st["requests"]
        )
        yield _counter("specops_proxy_completed", "Requests answered by an engine (any status).", st["completed"])
        yield _gauge("specops_proxy_in_flight", "Requests being forwarded to an engine now.", st["in_flight"])
        yield _gauge("specops_proxy_queue_depth", "Requests waiting for an engine now.", st["queue_depth"])
        yield _gauge("specops_proxy_queue_capacity", "Most requests that may wait (queue_size).", p.queue_size)
        yield _counter("specops_proxy_waited_requests", "Requests that waited in the queue.", st["waited"])
        yield _gauge(
            "specops_proxy_longest_wait_seconds", "Longest time a request waited in the queue.", p._wait_longest
        )
        yield _counter("specops_proxy_wait_seconds", "Time spent waiting in the queue, summed.", p._wait_total)

    @staticmethod
    def _refusals(c: dict):
        yield _counter(
            "specops_proxy_rejected",
            "Requests answered 503 by the proxy.",
            [
                (["queue_full"], c["rejected_queue_full"]),
                (["queue_timeout"], c["rejected_queue_timeout"]),
                (["stopped"], c["rejected_stopped"]),
                (["buffer_full"], c["rejected_buffer_full"]),
                (["connections"], c["rejected_connections"]),
            ],
            labels=["reason"],
        )
        yield _counter(
            "specops_proxy_refused",
            "Client requests the proxy refused itself (4xx).",
            [
                ([k], c["rejected_" + k])
                for k in (
                    "bad_target",
                    "method",
                    "unauthorized",
                    "too_large",
                    "body_timeout",
                    "malformed",
                    "header_size",
                )
            ],
            labels=["reason"],
        )
        yield _gauge(
            "specops_proxy_buffered_bytes",
            "Request bodies, buffered answers and unfinished request headers held now.",
            c["buffered_bytes"],
        )
        yield _gauge(
            "specops_proxy_header_bytes", "Header bytes of requests still arriving, held now.", c["header_bytes"]
        )
        yield _counter(
            "specops_proxy_cut_slow_clients",
            "Clients cut because they read nothing of their answer for proxy.send_timeout.",
            c["cut_slow_clients"],
        )
        yield _gauge("specops_proxy_connections", "Open client connections on the public port.", c["connections"])

    @staticmethod
    def _engine(c: dict):
        yield _counter(
            "specops_proxy_retried_requests", "Requests retried after the engine failed before answering.", c["retried"]
        )
        yield _counter("specops_proxy_retried_ok", "Retried requests that then got an answer.", c["retried_ok"])
        yield _counter(
            "specops_proxy_reconnects",
            "Requests resent at once because a pooled engine connection "
            "had been closed by the engine (not counted as retries).",
            c["reconnects"],
        )
        yield _counter(
            "specops_proxy_upstream_errors",
            "Requests answered 502/503 because the engine failed (after the retry).",
            c["upstream_errors"],
        )
        yield _counter(
            "specops_proxy_broken_streams",
            "Started responses that could not complete.",
            [(["engine"], c["broken_streams"]), (["drain"], c["cut_streams"])],
            labels=["cause"],
        )
        yield _counter(
            "specops_proxy_continued_streams",
            "Started streams whose engine failed, completed on a live engine from the text already sent.",
            c["continued_streams"],
        )
        yield _counter(
            "specops_proxy_stream_continuations",
            "Continuation requests sent for started streams whose engine failed.",
            c["stream_continuations"],
        )
        yield _counter(
            "specops_proxy_uncontinued_streams",
            "Started streams whose engine failed that could not be continued (ended with an error event), by why.",
            [([r], c["uncontinued_" + r]) for r in ("options", "not_kept", "no_engine", "refused", "limit")],
            labels=["reason"],
        )
        yield _counter(
            "specops_proxy_client_disconnects",
            "Clients that went away before their response completed (the engine request was cancelled).",
            c["client_disconnects"],
        )
        yield _counter(
            "specops_proxy_timings_draft_tokens",
            "llama.cpp draft tokens seen in response timings.",
            c["timings_draft_n"],
        )
        yield _counter(
            "specops_proxy_timings_accepted_tokens",
            "llama.cpp accepted draft tokens seen in response timings.",
            c["timings_draft_n_accepted"],
        )

    @staticmethod
    def _state(p: Any, st: dict):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("specops_proxy_state", "1 for the proxy's current state.", labels=["state"])
        for s in ProxyState:
            g.add_metric([s.value], 1.0 if p.state is s else 0.0)
        yield g
        yield _gauge(
            "specops_proxy_upstream_generation", "How many engines the proxy has pointed at.", st["generation"] or 0
        )
