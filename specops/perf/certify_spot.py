"""Live spot checks: while a deployment serves, a few greedy answers compared with a reference without speculation.

A certificate (:mod:`specops.perf.certify`) proves losslessness before serving; an engine upgrade, a new
draft or a numerics change on other hardware can break it later. A :class:`SpotChecker` repeats the
comparison in production, opt-in and rate-limited (at most every ``every`` seconds, ``sample`` requests a
check). The *reference* is an instance of the same model with speculation off (the chain's ``none`` step
run as a second instance, or a canary). Two sources of greedy requests:

- ``live``: the clients' own greedy, non-streamed requests, kept by the proxy's bounded
  :class:`~specops.proxy.sample.LiveSampler`; each is replayed against the reference (same body, its model
  name, at most ``max_tokens`` tokens) and the reference's answer is compared with the one the client got —
  token by token when both carry token ids/log-probabilities, else character by character. The live
  deployment gets no extra request.
- ``probes``: greedy prompts from a prompt set sent to the deployment (through its public URL, marked so
  the sampler skips them) and to the reference.

Comparisons use :func:`specops.perf.certify.compare_outputs` (same tolerance rule). A check runs only when
``gate()`` allows it (``specops up``: the proxy serving, not holding for a switch, and at most
``max_in_flight`` client requests in flight or waiting); a check that finds the deployment busy for its
whole interval is skipped and recorded. Each check is a ``spot_check`` event (each divergence a
``spot_divergence`` event: where, by position and token ids) in the deployment's ``events.jsonl``, and
Prometheus metrics:

- ``specops_spot_check_requests_total{result="identical|tolerated|diverged|failed"}``
- ``specops_spot_checks_total``, ``specops_spot_check_last_divergence_timestamp_seconds``
- ``specops_spot_checks_skipped_total{reason="held|busy"}``

No text of a request or an answer (:data:`TEXT_FIELDS`: the shared prefix, both continuations, the
differing tokens, a reference's error body) goes into the status (``/specops/status``, which answers
without a key when no ``api_key``/``admin_port`` is set), the events, the metrics or the printed lines: a
live check compares one client's answer, and those are read by others. Only with
``certify.spot_check.keep_text`` does it go, with the divergence's ``id``, to :data:`TEXT_FILE` (mode 0600)
in the instance's state folder.

Client requests are never delayed or changed. Why a second instance, not the chain's ``none`` step on the
same engine during an idle period: reaching it means restarting the engine, which holds client requests
for the restart; and the engines specops knows cannot turn speculation off for a single request
(llama-server 0.3.36 ignores a per-request ``speculative.n_max: 0``: it drafts as much as without it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.config.spotcheck import MIN_EVERY
from specops.errors import SpecopsError
from specops.perf.certify import Endpoint, compare_outputs, generate, lossless_summary
from specops.perf.certify_compare import Generation, _parse_logprobs
from specops.perf.workload import Prompt, RequestResult, _take_final
from specops.proxy.sample import PROBE_HEADER, Sample
from specops.urls import redact_url

__all__ = [
    "MIN_EVERY",
    "TEXT_FIELDS",
    "TEXT_FILE",
    "SpotChecker",
    "SpotConfig",
    "SpotMetrics",
    "model_name_of",
    "proxy_gate",
    "without_text",
]

#: While a due check waits for an idle moment, the gate is asked this often (seconds).
GATE_POLL = 1.0

#: ``gate()`` answers None (go) or (reason label, why in words).
Gate = Callable[[], "tuple[str, str] | None"]

#: Fields of a comparison that hold text of a request or its answers (a client's, in a live check).
TEXT_FIELDS = ("spec_token", "base_token", "common_prefix", "spec_continuation", "base_continuation", "error_detail")
#: Where the text of divergences goes when ``certify.spot_check.keep_text`` is on (the instance's folder).
TEXT_FILE = "spot-divergences.jsonl"


def without_text(comparison: dict) -> dict:
    """A comparison as status, events, metrics and printed lines carry it: positions and token ids, no text."""
    return {k: v for k, v in comparison.items() if k not in TEXT_FIELDS}


@dataclass
class SpotConfig:
    every: float = 600.0  # seconds between checks (at least MIN_EVERY)
    sample: int = 2  # requests per check
    max_tokens: int = 32
    tolerance: float = 0.0
    chat: bool = False  # probes: /v1/chat/completions (the model's template) instead of /v1/completions
    timeout: float = 120.0
    source: str = "probes"  # live | probes | both

    def check(self) -> None:
        if self.every < MIN_EVERY:
            raise SpecopsError(f"spot checks run at most every {MIN_EVERY:g}s (rate limit), got {self.every:g}s")
        if self.sample < 1 or self.max_tokens < 1:
            raise SpecopsError("spot checks need --sample >= 1 and --max-tokens >= 1")
        if not self.tolerance >= 0:
            raise SpecopsError("--tolerance must be >= 0 (nats)")
        if self.source not in ("live", "probes", "both"):
            raise SpecopsError(f"spot check source must be live, probes or both, not {self.source!r}")

    @property
    def probes(self) -> bool:
        return self.source in ("probes", "both")

    @property
    def live(self) -> bool:
        return self.source in ("live", "both")


class SpotMetrics:
    """The spot-check counters in a Prometheus registry (specops' own, or a fresh one)."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "specops_spot_check_requests",
            "Greedy requests compared with the reference without speculation, by result",
            ["result"],
            registry=self.registry,
        )
        self.checks = Counter("specops_spot_checks", "Spot checks run", registry=self.registry)
        self.skipped = Counter(
            "specops_spot_checks_skipped",
            "Spot checks skipped: the proxy held requests for a switch (held) or was busy for a whole interval",
            ["reason"],
            registry=self.registry,
        )
        self.last_divergence = Gauge(
            "specops_spot_check_last_divergence_timestamp_seconds",
            "When a spot check last saw a divergence (0: never)",
            registry=self.registry,
        )
        for result in ("identical", "tolerated", "diverged", "failed"):
            self.requests.labels(result=result)
        for reason in ("held", "busy"):
            self.skipped.labels(reason=reason)

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
                    raise SpecopsError(f"{redact_url(url)}: HTTP {resp.status}")
                data = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        raise SpecopsError(f"cannot list the models of {redact_url(base_url)}: {type(exc).__name__}: {exc}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise SpecopsError(f"{redact_url(url)} lists no model")
    return str(models[0]["id"])


def proxy_gate(proxy, max_in_flight: int) -> Gate:
    """``specops up``'s gate: check only while the proxy serves (not held for a switch or a restart) and
    at most ``max_in_flight`` client requests are in flight or waiting."""

    def gate() -> tuple[str, str] | None:
        stats = proxy.stats()
        if stats["state"] != "serving":
            return "held", f"the proxy is {stats['state']} (a switch or a restart)"
        load = stats["in_flight"] + stats["queue_depth"]
        if load > max_in_flight:
            return "busy", f"{load} client requests in flight or waiting (max_in_flight {max_in_flight})"
        return None

    return gate


@dataclass(frozen=True)
class _Probe(Endpoint):
    """The live deployment as the probes reach it: marked, so the proxy's sampler does not keep them."""

    @property
    def auth_headers(self) -> dict[str, str]:
        return {**super().auth_headers, PROBE_HEADER: "1"}


def answer_of(data: Any, chat: bool, label: str) -> Generation:
    """A non-streamed completions answer (parsed JSON) as a :class:`Generation` (text, tokens, log-probs)."""
    now = time.monotonic()
    gen = Generation(RequestResult(set=label, ok=False, start=now, end=now))
    choice = (data.get("choices") or [None])[0] if isinstance(data, dict) else None
    if not isinstance(choice, dict):
        gen.result.error = "the answer has no choice"
        return gen
    gen.text = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
    gen.result.finish_reason = choice.get("finish_reason")
    _take_final(data, gen.result)
    _parse_logprobs(choice, gen)
    gen.result.ok = True
    return gen


def _trim(gen: Generation, tokens: int, chars: int) -> None:
    """Cut the client's answer to what the capped replay could produce (its first tokens / characters)."""
    gen.tokens, gen.texts, gen.top = gen.tokens[:tokens], gen.texts[:tokens], gen.top[:tokens]
    gen.text = gen.text[:chars]


class SpotChecker:
    """Compares the deployment (speculation on) with ``reference`` (off) on a few greedy requests per check."""

    def __init__(
        self,
        live: Endpoint | None,
        reference: Endpoint,
        prompts: list[Prompt],
        cfg: SpotConfig,
        *,
        events=None,
        metrics: SpotMetrics | None = None,
        say: Callable[[str], None] = lambda m: None,
        sampler=None,
        gate: Gate | None = None,
        on_check: Callable[[], None] = lambda: None,
        text_file: Path | None = None,
    ):
        """``text_file``: where the text of each divergence goes (opt-in; None: nowhere, see the module)."""
        cfg.check()
        if cfg.probes and (not prompts or live is None):
            raise SpecopsError("spot checks with probes need at least one prompt and the deployment's URL")
        if cfg.live and sampler is None:
            raise SpecopsError("spot checks of live requests need the proxy (proxy.enabled: true)")
        self.live = _Probe(live.base_url, live.model_name, live.api_key) if live is not None else None
        self.reference, self.cfg = reference, cfg
        self.prompts = [Prompt(p.text, cfg.max_tokens, 0.0, p.set) for p in prompts]
        self._fitted = False  # the probes are fitted to the deployment and the reference before the first one
        self.events, self.metrics, self.say = events, metrics or SpotMetrics(), say
        self.sampler, self.gate, self.on_check = sampler, gate, on_check  # on_check: after each check or skip
        self.text_file = Path(text_file) if text_file is not None else None
        self._next = 0
        self.results: list[dict] = []
        self.last: dict | None = None
        self.last_divergence: dict | None = None
        self.last_skip: dict | None = None
        self.skipped = 0

    async def _fit(self) -> None:
        """The probes fitted (once) to the smaller context of the deployment and the reference, so a probe is
        never refused for its length (:func:`specops.perf.workload.fit_workload`, as bench and certify do)."""
        from specops.perf.workload import fit_workload

        assert self.live is not None
        fit = await fit_workload([self.live, self.reference], {"probes": self.prompts})
        self.prompts, self._fitted = fit.sets["probes"], True
        for note in fit.notes:
            self.say(f"spot checks: {note}")

    def _pick(self) -> list[Prompt]:
        picked = [self.prompts[(self._next + i) % len(self.prompts)] for i in range(self.cfg.sample)]
        self._next = (self._next + self.cfg.sample) % len(self.prompts)
        return picked

    async def _probe(self, session, prompt: Prompt) -> dict:
        assert self.live is not None
        kw = dict(chat=self.cfg.chat, temperature=0.0, logprobs=True, timeout=self.cfg.timeout)
        live = await generate(session, self.live, prompt, **kw)
        ref = await generate(session, self.reference, prompt, **kw)
        return dict(compare_outputs(live, ref, self.cfg.tolerance), source="probe")

    async def _replay(self, session, sample: Sample) -> dict:
        """One live request: its body sent to the reference (capped), the answer compared with the client's."""
        import aiohttp

        chat = sample.path == "/v1/chat/completions"
        client = answer_of(json.loads(sample.answer), chat, "live")
        body = json.loads(sample.body)
        asked = next((body[k] for k in ("max_tokens", "max_completion_tokens", "n_predict") if k in body), None)
        asked = asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else None
        cap = min(asked, self.cfg.max_tokens) if asked else self.cfg.max_tokens
        for k in ("max_completion_tokens", "n_predict", "stream_options"):
            body.pop(k, None)
        body.update(model=self.reference.model_name, stream=False, max_tokens=cap)
        url = self.reference.base_url.rstrip("/") + sample.path
        detail = ""
        start = time.monotonic()
        ref = Generation(RequestResult(set="live", ok=False, start=start, end=start))
        try:
            async with session.post(
                url,
                json=body,
                headers={"Content-Type": "application/json", **self.reference.auth_headers},
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout),
            ) as resp:
                if resp.status != 200:  # its body may quote the request: text, kept apart
                    ref.result.error = f"reference: HTTP {resp.status}"
                    detail = (await resp.text())[:300].strip()
                else:
                    ref = answer_of(await resp.json(content_type=None), chat, "live")
        except asyncio.TimeoutError:
            ref.result.error = f"reference: timed out after {self.cfg.timeout:g}s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            ref.result.error = f"reference: {type(exc).__name__}: {exc}"[:300]
        if ref.result.ok and ref.result.finish_reason == "length" and (asked is None or cap < asked):
            _trim(client, len(ref.tokens), len(ref.text))  # the replay was capped: compare its first tokens
        out = compare_outputs(client, ref, self.cfg.tolerance)
        if detail and out["status"] == "failed":
            out["error_detail"] = detail
        return dict(out, source="live", path=sample.path, age_s=round(time.time() - sample.at, 3))

    async def check_once(self) -> dict:
        """One check: the live sample replayed and/or the probes sent; compared; recorded."""
        import aiohttp

        comparisons = []
        samples = self.sampler.take(self.cfg.sample) if self.cfg.live else []
        connector = aiohttp.TCPConnector(limit=2, force_close=True)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            for sample in samples:
                comparisons.append(await self._replay(session, sample))
            if self.cfg.probes:
                if not self._fitted:
                    await self._fit()
                for prompt in self._pick():
                    comparisons.append(await self._probe(session, prompt))
        if not comparisons:  # no greedy request since the last check: nothing compared, nothing recorded
            return {"t": round(time.time(), 3), "verdict": "no-sample", "requests": 0}
        comparisons = self._keep_text(comparisons)
        summary = lossless_summary(comparisons, self.cfg.tolerance)
        self.metrics.record(comparisons)
        record = {k: summary[k] for k in ("verdict", "requests", "identical", "tolerated", "diverged", "failed")}
        record.update(
            compared_by=summary["compared_by"],
            source=self.cfg.source,
            live=len(samples),
            reference=redact_url(self.reference.base_url),
            tolerance_nats=self.cfg.tolerance,
        )
        if self.events is not None:
            self.events.emit("spot_check", **record)
            for d in comparisons:
                if d["status"] == "diverged":
                    self.events.emit("spot_divergence", **d)
        self.results.append(summary)
        self.last = {"t": round(time.time(), 3), **record}
        diverged = [d for d in comparisons if d["status"] == "diverged"]
        if diverged:
            self.last_divergence = {"t": self.last["t"], **diverged[0]}
        self.say(
            f"spot check: {summary['verdict']}: {summary['identical']} identical, {summary['tolerated']} tolerated, "
            f"{summary['diverged']} diverged, {summary['failed']} failed"
        )
        for d in diverged:
            ids = f": token id {d['spec_token_id']} vs reference {d['base_token_id']}" if "spec_token_id" in d else ""
            where = f" (text: {self.text_file}, id {d['id']})" if self.text_file is not None else ""
            self.say(f"  diverged ({d['source']}) at {d['unit']} {d['position']}{ids}{where}")
        return summary

    def _keep_text(self, comparisons: list[dict]) -> list[dict]:
        """``comparisons`` without their text (:func:`without_text`); each that had some gets an ``id``, and
        with ``text_file`` its text goes there under that id (0600; never anywhere else)."""
        out, texts = [], []
        for c in comparisons:
            text = {k: c[k] for k in TEXT_FIELDS if k in c}
            c = without_text(c)
            if text:
                c["id"] = uuid.uuid4().hex[:12]
                texts.append({"ts": round(time.time(), 3), "id": c["id"], "source": c.get("source"), **text})
            out.append(c)
        if self.text_file is not None and texts:
            from specops.run.instance import open_log

            try:
                with open_log(self.text_file, encoding="utf-8") as f:
                    f.write("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts))
            except OSError as exc:  # a full disk must not end the checks; the counts are recorded anyway
                self.say(f"spot check: cannot write {self.text_file}: {exc.strerror or exc}")
        return out

    async def _wait_until_allowed(self, stop: asyncio.Event) -> bool:
        """Wait (at most ``every``) for the gate to let a check through; False: skipped (and recorded)."""
        if self.gate is None:
            return True
        loop = asyncio.get_running_loop()
        until = loop.time() + self.cfg.every
        why = self.gate()
        while why is not None and not stop.is_set():
            if loop.time() >= until:
                self.skipped += 1
                self.metrics.skipped.labels(reason=why[0]).inc()
                self.last_skip = {"t": round(time.time(), 3), "reason": why[0], "why": why[1]}
                if self.events is not None:
                    self.events.emit("spot_check_skipped", reason=why[0], why=why[1])
                self.say(f"spot check skipped: {why[1]} for the whole interval")
                self.on_check()
                return False
            try:
                await asyncio.wait_for(stop.wait(), GATE_POLL)
            except asyncio.TimeoutError:
                pass
            why = self.gate()
        return not stop.is_set()

    async def run(self, stop: asyncio.Event | None = None, checks: int | None = None, first_wait: bool = False) -> list:
        """Check every ``cfg.every`` seconds until ``stop`` is set or ``checks`` checks ran (``first_wait``:
        wait one interval before the first, so live requests can be collected)."""
        stop = stop or asyncio.Event()
        done = 0
        wait = first_wait
        while not stop.is_set() and (checks is None or done < checks):
            if wait:
                try:
                    await asyncio.wait_for(stop.wait(), self.cfg.every)
                    break
                except asyncio.TimeoutError:
                    pass
            wait = True
            if not await self._wait_until_allowed(stop):
                continue
            if stop.is_set():
                break
            try:
                if (await self.check_once())["requests"]:
                    self.on_check()
            except Exception as exc:  # a check must never take the deployment down
                self.say(f"spot check failed: {type(exc).__name__}: {exc}")
                self.last = {"t": round(time.time(), 3), "verdict": "error", "error": f"{type(exc).__name__}: {exc}"}
            done += 1
        return self.results

    def snapshot(self) -> dict:
        """The state document's ``spot_check`` block."""
        return {
            "spot_check": {
                "reference": redact_url(self.reference.base_url),
                "source": self.cfg.source,
                "every_s": self.cfg.every,
                "checks": len(self.results),
                "skipped": self.skipped,
                "last": self.last,
                "last_divergence": self.last_divergence,
                "last_skip": self.last_skip,
                "sampler": self.sampler.snapshot() if self.sampler is not None else None,
                "text_file": str(self.text_file) if self.text_file is not None else None,
            }
        }


class LiveSpotChecks:
    """``specops up``'s spot checks, built from the profile's ``certify.spot_check``: a background task that
    finds the reference's model name (retrying while it is not up yet), then runs a :class:`SpotChecker`
    with the proxy's sampler and gate. Its own HTTP sessions; it never touches a client request."""

    def __init__(self, profile, backend, proxy, public_url: str, *, events, registry, say, on_check, env=None):
        import os

        from specops.perf.certify import load_sets

        spot = profile.certify.spot_check
        env = os.environ if env is None else env
        key = None
        if spot.api_key_env:
            key = env.get(spot.api_key_env)
            if not key:
                raise SpecopsError(
                    f"certify.spot_check.api_key_env: the environment variable {spot.api_key_env} is not set"
                )
        if proxy is None:
            raise SpecopsError("certify.spot_check needs the proxy (proxy.enabled: true): its idle gate and sampler")
        if spot.reference.rstrip("/") == public_url.rstrip("/"):
            raise SpecopsError("certify.spot_check.reference is this deployment itself: name a second instance")
        chat = False
        prompts: list[Prompt] = []
        if spot.source != "live":
            from specops.perf.certify_file import chat_template

            chat = chat_template(profile, backend).sha256 is not None
            prompts = [p for ps in load_sets(list(spot.prompts)).values() for p in ps]
        self.cfg = SpotConfig(
            every=spot.every,
            sample=spot.sample,
            max_tokens=spot.max_tokens,
            tolerance=spot.tolerance,
            chat=chat,
            source=spot.source,
        )
        self.cfg.check()
        self.reference_url, self.reference_key = spot.reference.rstrip("/"), key
        events_path = getattr(events, "path", None)
        self.text_file = Path(events_path).parent / TEXT_FILE if spot.keep_text and events_path else None
        self.public_url, self.public_key = public_url, profile.server.api_key
        self.prompts, self.proxy, self.events, self.say, self.on_check = prompts, proxy, events, say, on_check
        self.gate = proxy_gate(proxy, spot.max_in_flight)
        self.metrics = SpotMetrics(registry)
        self.checker: SpotChecker | None = None
        self.problem: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            except Exception as exc:  # noqa: BLE001 - stopping must not fail the shutdown
                self.say(f"spot checks ended with {type(exc).__name__}: {exc}")

    async def _model(self, url: str, key: str | None) -> str | None:
        """The model name at ``url``, retried every ``GATE_POLL * 5`` s until it answers or stop."""
        while not self._stop.is_set():
            try:
                return await model_name_of(url, key)
            except SpecopsError as exc:
                if self.problem != str(exc):
                    self.problem = str(exc)
                    self.say(f"spot checks wait: {exc}")
            try:
                await asyncio.wait_for(self._stop.wait(), GATE_POLL * 5)
            except asyncio.TimeoutError:
                pass
        return None

    async def _run(self) -> None:
        ref_name = await self._model(self.reference_url, self.reference_key)
        if ref_name is None:
            return
        live = None
        if self.cfg.probes:
            live_name = await self._model(self.public_url, self.public_key)
            if live_name is None:
                return
            live = Endpoint(self.public_url, live_name, self.public_key)
        self.problem = None
        self.checker = SpotChecker(
            live,
            Endpoint(self.reference_url, ref_name, self.reference_key),
            self.prompts,
            self.cfg,
            events=self.events,
            metrics=self.metrics,
            say=self.say,
            sampler=self.proxy.sampler,
            gate=self.gate,
            on_check=self.on_check,
            text_file=self.text_file,
        )
        self.say(
            f"spot checks: {self.cfg.source} greedy requests vs {redact_url(self.reference_url)} "
            f"({ref_name}), {self.cfg.sample} every {self.cfg.every:g}s"
        )
        await self.checker.run(self._stop, first_wait=True)

    def snapshot(self) -> dict:
        if self.checker is not None:
            return self.checker.snapshot()
        return {
            "spot_check": {
                "reference": redact_url(self.reference_url),
                "source": self.cfg.source,
                "checks": 0,
                "waiting": self.problem or "starting",
            }
        }
