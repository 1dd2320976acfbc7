"""Live spot checks: while a deployment serves, a few greedy answers compared with a reference without speculation.

A certificate (:mod:`specops.perf.certify`) proves losslessness before serving; an engine upgrade, a new
draft or a numerics change on other hardware can break it later. A :class:`SpotChecker` repeats the
comparison in production, opt-in and rate-limited: every ``every`` seconds it sends ``sample`` greedy probe
requests, one at a time, to the live deployment (speculation on, through its public URL like any client)
and the same requests to a *reference* — an instance of the same model with speculation off (the chain's
``none`` step run as a second instance, or a canary) — and compares them token by token with
:func:`specops.perf.certify.compare_outputs` (same tolerance rule). Each check is recorded as a
``spot_check`` event (and each divergence as a ``spot_divergence`` event with both continuations) in the
deployment's ``events.jsonl``, and counted in Prometheus metrics:

- ``specops_spot_check_requests_total{result="identical|tolerated|diverged|failed"}``
- ``specops_spot_checks_total``, ``specops_spot_check_last_divergence_timestamp_seconds``

The probes are the checker's own requests: client requests are never copied, delayed or changed. Their
prompts come from a prompt set (built-in or the user's JSONL of representative traffic), always greedy.
The engines specops knows cannot turn speculation off for a single request (llama-server 0.3.36 ignores a
per-request ``speculative.n_max: 0``), so the reference must be a second instance.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from specops.errors import SpecopsError
from specops.perf.certify import Endpoint, compare_outputs, generate, lossless_summary
from specops.perf.workload import Prompt

#: Spot checks never run more often than this (seconds), whatever ``every`` says.
MIN_EVERY = 10.0


@dataclass
class SpotConfig:
    every: float = 600.0  # seconds between checks (at least MIN_EVERY)
    sample: int = 2  # greedy probe requests per check
    max_tokens: int = 32
    tolerance: float = 0.0
    chat: bool = False  # /v1/chat/completions (the model's template) instead of /v1/completions
    timeout: float = 120.0

    def check(self) -> None:
        if self.every < MIN_EVERY:
            raise SpecopsError(f"spot checks run at most every {MIN_EVERY:g}s (rate limit), got {self.every:g}s")
        if self.sample < 1 or self.max_tokens < 1:
            raise SpecopsError("spot checks need --sample >= 1 and --max-tokens >= 1")
        if not self.tolerance >= 0:
            raise SpecopsError("--tolerance must be >= 0 (nats)")


class SpotMetrics:
    """The spot-check counters in a Prometheus registry (specops' own, or a fresh one)."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "specops_spot_check_requests",
            "Greedy probe requests compared with the reference without speculation, by result",
            ["result"],
            registry=self.registry,
        )
        self.checks = Counter("specops_spot_checks", "Spot checks run", registry=self.registry)
        self.last_divergence = Gauge(
            "specops_spot_check_last_divergence_timestamp_seconds",
            "When a spot check last saw a divergence (0: never)",
            registry=self.registry,
        )
        for result in ("identical", "tolerated", "diverged", "failed"):
            self.requests.labels(result=result)

    def record(self, comparisons: list[dict]) -> None:
        self.checks.inc()
        for c in comparisons:
            self.requests.labels(result=c["status"]).inc()
        if any(c["status"] == "diverged" for c in comparisons):
            self.last_divergence.set(time.time())


async def model_name_of(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The first model id an OpenAI-compatible server lists at ``/v1/models``."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise SpecopsError(f"{url}: HTTP {resp.status}")
                data = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        raise SpecopsError(f"cannot list the models of {base_url}: {type(exc).__name__}: {exc}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise SpecopsError(f"{url} lists no model")
    return str(models[0]["id"])


class SpotChecker:
    """Compares ``live`` (speculation on) with ``reference`` (off) on a few greedy probes per check."""

    def __init__(
        self,
        live: Endpoint,
        reference: Endpoint,
        prompts: list[Prompt],
        cfg: SpotConfig,
        *,
        events=None,
        metrics: SpotMetrics | None = None,
        say: Callable[[str], None] = lambda m: None,
    ):
        cfg.check()
        if not prompts:
            raise SpecopsError("spot checks need at least one prompt")
        self.live, self.reference, self.cfg = live, reference, cfg
        self.prompts = [Prompt(p.text, cfg.max_tokens, 0.0, p.set) for p in prompts]
        self.events, self.metrics, self.say = events, metrics or SpotMetrics(), say
        self._next = 0
        self.results: list[dict] = []

    def _pick(self) -> list[Prompt]:
        picked = [self.prompts[(self._next + i) % len(self.prompts)] for i in range(self.cfg.sample)]
        self._next = (self._next + self.cfg.sample) % len(self.prompts)
        return picked

    async def check_once(self) -> dict:
        """One check: each probe sent to the live deployment, then to the reference; compared; recorded."""
        import aiohttp

        comparisons = []
        connector = aiohttp.TCPConnector(limit=2, force_close=True)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            for prompt in self._pick():
                kw = dict(chat=self.cfg.chat, temperature=0.0, logprobs=True, timeout=self.cfg.timeout)
                live = await generate(session, self.live, prompt, **kw)
                ref = await generate(session, self.reference, prompt, **kw)
                comparisons.append(compare_outputs(live, ref, self.cfg.tolerance))
        summary = lossless_summary(comparisons, self.cfg.tolerance)
        self.metrics.record(comparisons)
        record = {k: summary[k] for k in ("verdict", "requests", "identical", "tolerated", "diverged", "failed")}
        record.update(live=self.live.base_url, reference=self.reference.base_url, tolerance_nats=self.cfg.tolerance)
        if self.events is not None:
            self.events.emit("spot_check", **record)
            for d in summary["divergences"]:
                if d["status"] == "diverged":
                    self.events.emit("spot_divergence", **d)
        self.results.append(summary)
        self.say(
            f"spot check: {summary['verdict']}: {summary['identical']} identical, {summary['tolerated']} tolerated, "
            f"{summary['diverged']} diverged, {summary['failed']} failed"
        )
        for d in summary["divergences"]:
            if d["status"] == "diverged":
                self.say(
                    f"  diverged in {d['set']} at {d['unit']} {d['position']}: live {d['spec_continuation']!r} "
                    f"vs reference {d['base_continuation']!r}"
                )
        return summary

    async def run(self, stop: asyncio.Event | None = None, checks: int | None = None) -> list[dict]:
        """Check every ``cfg.every`` seconds until ``stop`` is set or ``checks`` checks ran."""
        stop = stop or asyncio.Event()
        done = 0
        while not stop.is_set() and (checks is None or done < checks):
            await self.check_once()
            done += 1
            if checks is not None and done >= checks:
                break
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.every)
            except asyncio.TimeoutError:
                pass
        return self.results
