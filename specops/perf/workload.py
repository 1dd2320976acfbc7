"""Client workloads against an OpenAI-compatible ``/v1/completions`` endpoint, measured the way users feel them.

A workload is a list of :class:`Prompt` (text, max_tokens, temperature, the set it belongs to) sent by
``concurrency`` clients at once, each taking the next prompt (cycling) until ``requests`` have been sent or
``duration`` seconds have passed. Each request streams (SSE) so that the time to the first token (TTFT)
and the gaps between streamed chunks (inter-token latency, ITL) are measured; output tokens are counted
from the engine's ``usage`` (vLLM sends it in a last chunk when asked with ``stream_options``; llama-server
puts ``usage`` and ``timings`` in its final chunk), never estimated from text.

Built-in prompt sets (``specops/data/prompts/<set>.jsonl``) cover the cases where speculation helps and
where it hurts:

=============  ===============================================================  ==================
``code``       code completion: predictable continuations                        temperature 0
``summarize``  summarisation / RAG: the answer copies the input (n-gram wins)      temperature 0
``chat``       open chat questions                                               temperature 0.7
``creative``   high-temperature creative writing: drafts are rarely accepted     temperature 1.3
=============  ===============================================================  ==================

A user file is JSON Lines: one object per line with ``prompt`` (or ``text``) and optional ``max_tokens``,
``temperature`` and ``set``.

Speculation makes tokens arrive in bursts (several accepted tokens in one chunk), so ITL here is per
*chunk*; :attr:`RequestResult.tpot` (time per output token after the first) is the per-token figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specops.errors import SpecopsError
from specops.perf.stats import median, percentile

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"
#: The built-in prompt sets, in the order reports show them.
BUILTIN_SETS = ("code", "summarize", "chat", "creative", "extraction")
DEFAULT_MAX_TOKENS = 128
#: Per-request timeout (seconds): a request that takes longer counts as an error.
DEFAULT_TIMEOUT = 600.0


@dataclass(frozen=True)
class Prompt:
    """One request of a workload."""

    text: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    set: str = "custom"


def builtin_sets() -> tuple[str, ...]:
    return BUILTIN_SETS


def load_prompts(name_or_path: str | Path) -> list[Prompt]:
    """A built-in set by name (``code``, ``summarize``, ``chat``, ``creative``, ``extraction``) or a JSONL file.

    Each line: ``{"prompt": "...", "max_tokens": 128, "temperature": 0.0, "set": "name"}`` (``text`` may
    stand for ``prompt``; ``set`` defaults to the set name or the file's stem). Blank lines and lines
    starting with ``#`` are skipped. Raises :class:`SpecopsError` naming file:line for a bad line.
    """
    name = str(name_or_path)
    if name in BUILTIN_SETS and not Path(name).exists():
        path, default_set = PROMPTS_DIR / f"{name}.jsonl", name
    else:
        path = Path(name).expanduser()
        default_set = path.stem
        if not path.is_file():
            raise SpecopsError(f"no prompt set {name!r}: use one of {', '.join(BUILTIN_SETS)} or a .jsonl file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecopsError(f"cannot read prompts from {path}: {exc}") from None
    prompts = []
    for no, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{no}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SpecopsError(f"{where}: not JSON ({exc})") from None
        prompts.append(_prompt_from(row, default_set, where))
    if not prompts:
        raise SpecopsError(f"{path}: no prompts")
    return prompts


def _prompt_from(row: Any, default_set: str, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise SpecopsError(f'{where}: expected an object with a "prompt", got {type(row).__name__}')
    unknown = sorted(set(row) - {"prompt", "text", "max_tokens", "temperature", "set"})
    if unknown:
        raise SpecopsError(
            f"{where}: unknown key(s) {', '.join(unknown)} (allowed: prompt, max_tokens, temperature, set)"
        )
    text = row.get("prompt", row.get("text"))
    if not isinstance(text, str) or not text:
        raise SpecopsError(f'{where}: "prompt" must be a non-empty string')
    max_tokens = row.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SpecopsError(f'{where}: "max_tokens" must be an integer >= 1, got {max_tokens!r}')
    temperature = row.get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 5:
        raise SpecopsError(f'{where}: "temperature" must be a number within [0, 5], got {temperature!r}')
    set_name = row.get("set", default_set)
    if not isinstance(set_name, str) or not set_name:
        raise SpecopsError(f'{where}: "set" must be a non-empty string')
    return Prompt(text, max_tokens, float(temperature), set_name)


# ---------------------------------------------------------------------------------------------------
# results


@dataclass
class RequestResult:
    """One request: what was asked, when, what came back."""

    set: str
    ok: bool
    start: float  # monotonic seconds
    end: float
    output_tokens: int = 0
    prompt_tokens: int | None = None
    ttft: float | None = None  # seconds to the first streamed text (None: no text came)
    itl: list[float] = field(default_factory=list)  # seconds between streamed text chunks
    chunks: int = 0
    draft_tokens: int | None = None  # llama-server timings.draft_n (None: not reported)
    accepted: int | None = None  # llama-server timings.draft_n_accepted
    finish_reason: str | None = None
    usage_reported: bool = False
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (latency − TTFT) / (tokens − 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["latency"] = self.latency
        d["tpot"] = self.tpot
        return d


@dataclass
class WorkloadResult:
    """A workload run: every request, and the numbers derived from them."""

    concurrency: int
    requests: list[RequestResult]
    wall_s: float

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    @property
    def errors(self) -> list[RequestResult]:
        return [r for r in self.requests if not r.ok]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens of successful requests per second of wall time (first send to last answer)."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.ok if r.ttft is not None]

    @property
    def itls(self) -> list[float]:
        return [x for r in self.ok for x in r.itl]

    @property
    def tpots(self) -> list[float]:
        return [r.tpot for r in self.ok if r.tpot is not None]

    @property
    def ttft_median(self) -> float | None:
        return median(self.ttfts)

    @property
    def ttft_p90(self) -> float | None:
        return percentile(self.ttfts, 90)

    @property
    def itl_median(self) -> float | None:
        return median(self.itls)

    @property
    def itl_p90(self) -> float | None:
        return percentile(self.itls, 90)

    @property
    def tpot_median(self) -> float | None:
        return median(self.tpots)

    @property
    def draft_tokens(self) -> int | None:
        """Drafted tokens the responses reported (llama-server ``timings``); None when none did."""
        vals = [r.draft_tokens for r in self.ok if r.draft_tokens is not None]
        return sum(vals) if vals else None

    @property
    def accepted(self) -> int | None:
        vals = [r.accepted for r in self.ok if r.accepted is not None]
        return sum(vals) if vals else None

    @property
    def acceptance(self) -> float | None:
        """accepted / drafted from per-response timings; None when the engine reported none (or drafted 0)."""
        d, a = self.draft_tokens, self.accepted
        return a / d if d and a is not None else None

    def by_set(self) -> dict[str, WorkloadResult]:
        """The requests of each prompt set (wall time shared: use for latency, not for tokens/s)."""
        out: dict[str, list[RequestResult]] = {}
        for r in self.requests:
            out.setdefault(r.set, []).append(r)
        return {k: WorkloadResult(self.concurrency, v, self.wall_s) for k, v in out.items()}

    def summary(self) -> dict:
        """The derived numbers (seconds as milliseconds for latencies), JSON-ready."""
        ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
        first_error = next((r.error for r in self.errors), None)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "ok": len(self.ok),
            "errors": len(self.errors),
            "first_error": first_error,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "ttft_ms": {"median": ms(self.ttft_median), "p90": ms(self.ttft_p90)},
            "itl_ms": {"median": ms(self.itl_median), "p90": ms(self.itl_p90)},
            "tpot_ms": {"median": ms(self.tpot_median), "p90": ms(percentile(self.tpots, 90))},
            "response_draft_tokens": self.draft_tokens,
            "response_accepted": self.accepted,
            "response_acceptance": self.acceptance,
        }


# ---------------------------------------------------------------------------------------------------
# running

ProgressCallback = Callable[[int, "int | None"], None]


async def run_workload(
    base_url: str,
    model_name: str,
    prompts: Sequence[Prompt],
    *,
    concurrency: int,
    requests: int | None = None,
    duration: float | None = None,
    stream: bool = True,
    api_key: str | None = None,
    on_progress: ProgressCallback | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    extra_body: dict | None = None,
    session=None,
) -> WorkloadResult:
    """Send ``prompts`` (cycling) from ``concurrency`` clients to ``base_url``/v1/completions.

    Stops starting requests once ``requests`` were sent or ``duration`` seconds passed (requests in flight
    finish); with neither, every prompt is sent once. ``on_progress(done, total)`` is called after each
    request (``total`` None for a duration-bound run). ``extra_body`` is merged into every request (e.g.
    ``{"ignore_eos": True}`` or a ``seed``). Failures are recorded per request, never raised.
    """
    requests = _requests_to_send(prompts, concurrency, requests, duration)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    results: list[RequestResult] = []
    t_start = time.monotonic()
    turns = _Turns(requests, t_start + duration if duration is not None else None)

    async def worker(sess) -> None:
        while (i := turns.next()) is not None:
            prompt = prompts[i % len(prompts)]
            results.append(await _one_request(sess, url, headers, model_name, prompt, stream, timeout, extra_body))
            _tell_progress(on_progress, len(results), requests)

    async with _client_session(session, concurrency) as sess:
        await asyncio.gather(*(worker(sess) for _ in range(concurrency)))
    if results:
        wall = max(r.end for r in results) - min(r.start for r in results)
    else:
        wall = time.monotonic() - t_start
    results.sort(key=lambda r: r.start)
    return WorkloadResult(concurrency, results, wall)


def _requests_to_send(
    prompts: Sequence[Prompt], concurrency: int, requests: int | None, duration: float | None
) -> int | None:
    """``requests`` checked (ValueError), or every prompt once when neither it nor ``duration`` is given."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not prompts:
        raise ValueError("no prompts")
    if requests is None and duration is None:
        requests = len(prompts)
    if requests is not None and requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    return requests


class _Turns:
    """Hands the clients the index of the next request to send, until ``requests`` were handed out or the
    ``deadline`` (monotonic seconds) passed; then None."""

    def __init__(self, requests: int | None, deadline: float | None):
        self.requests, self.deadline = requests, deadline
        self.counter = itertools.count()

    def next(self) -> int | None:
        i = next(self.counter)
        if self.requests is not None and i >= self.requests:
            return None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return None
        return i


def _tell_progress(on_progress: ProgressCallback | None, done: int, total: int | None) -> None:
    if on_progress is not None:
        try:
            on_progress(done, total)
        except Exception:  # a progress display must never break the measurement
            pass


@contextlib.asynccontextmanager
async def _client_session(session, concurrency: int):
    """``session`` when given (left open), else one of our own, closed on exit."""
    if session is not None:
        yield session
        return
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 2, force_close=True)  # engines drop idle keep-alives
    own = aiohttp.ClientSession(connector=connector, trust_env=False)  # loopback: no proxies
    try:
        yield own
    finally:
        await own.close()


def _body(model_name: str, prompt: Prompt, stream: bool, extra: dict | None) -> dict:
    body: dict[str, Any] = {
        "model": model_name,
        "prompt": prompt.text,
        "max_tokens": prompt.max_tokens,
        "temperature": prompt.temperature,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if extra:
        body.update(extra)
    return body


async def _one_request(
    session, url: str, headers: dict, model_name: str, prompt: Prompt, stream: bool, timeout: float, extra: dict | None
) -> RequestResult:
    import aiohttp

    body = _body(model_name, prompt, stream, extra)
    start = time.monotonic()
    res = RequestResult(set=prompt.set, ok=False, start=start, end=start)
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                res.error = f"HTTP {resp.status}: {text.strip()}"
            elif stream:
                await _read_stream(resp, res, start)
            else:
                data = await resp.json(content_type=None)
                res.ttft = time.monotonic() - start
                _take_final(data, res)
                choices = data.get("choices") or [{}]
                res.finish_reason = choices[0].get("finish_reason")
                res.chunks = 1
                res.ok = True
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g}s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.end = time.monotonic()
    if res.ok and not res.usage_reported:
        res.output_tokens = res.chunks  # no usage: one token per chunk is the best lower-bound guess
    return res


async def sse_payloads(content) -> AsyncIterator[bytes]:
    """The payload of each ``data:`` line of an SSE answer (``[DONE]`` included) as it completes; ``content``
    is an aiohttp response's body, which yields lines (a line longer than its buffer comes in parts)."""
    buf = b""
    async for raw in content:
        buf += raw
        if not buf.endswith(b"\n"):
            continue
        line, buf = buf.strip(), b""
        if line.startswith(b"data:"):
            yield line[5:].strip()


async def _read_stream(resp, res: RequestResult, start: float) -> None:
    last_text_at: float | None = None
    done = False
    async for payload in sse_payloads(resp.content):
        if payload == b"[DONE]":
            done = True
            break
        try:
            chunk = json.loads(payload)
        except ValueError:
            res.error = f"bad SSE chunk: {payload[:120]!r}"
            return
        if "error" in chunk:
            res.error = f"engine error in stream: {str(chunk['error'])[:200]}"
            return
        now = time.monotonic()
        for choice in chunk.get("choices") or ():
            if choice.get("text"):
                if last_text_at is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last_text_at)
                last_text_at = now
                res.chunks += 1
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
        _take_final(chunk, res)
    if not done and res.finish_reason is None:
        res.error = "stream ended before [DONE]"
        return
    res.ok = True


def _take_final(data: dict, res: RequestResult) -> None:
    """``usage`` (token counts) and llama-server ``timings`` (draft counts) when the chunk carries them."""
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        res.output_tokens = int(usage["completion_tokens"])
        res.prompt_tokens = usage.get("prompt_tokens")
        res.usage_reported = True
    timings = data.get("timings")
    if isinstance(timings, dict) and "draft_n" in timings:
        res.draft_tokens = int(timings["draft_n"])
        res.accepted = int(timings.get("draft_n_accepted", 0))


#: Warm-up requests generate at most this many tokens: enough to run every kernel once.
WARMUP_MAX_TOKENS = 16


async def warm_up(
    engine, prompts: list[Prompt], *, concurrency: int = 1, requests: int | None = None, extra_body: dict | None = None
) -> None:
    """Short requests before measuring, so first-request costs (allocation, compilation) are not measured.

    ``engine`` is a launched engine (``base_url``, ``model_name``, ``api_key``); raises when a request fails.
    """
    short = [Prompt(p.text, min(p.max_tokens, WARMUP_MAX_TOKENS), p.temperature, p.set) for p in prompts]
    res = await run_workload(
        engine.base_url,
        engine.model_name,
        short,
        concurrency=concurrency,
        requests=len(short) if requests is None else requests,
        api_key=engine.api_key,
        extra_body=extra_body,
    )
    if not res.ok:
        raise SpecopsError(f"warm-up requests to {engine.base_url} failed: {res.errors[0].error}")


# ---------------------------------------------------------------------------------------------------
# fitting a workload to the deployment: each prompt and its max_tokens within the context one request gets

#: Characters per token assumed when no tokenizer answers (low, so an estimate trims rather than overflows).
CHARS_PER_TOKEN_ESTIMATE = 2.5
#: Tokens kept free in each request's context (special tokens, the engine's own bookkeeping).
CONTEXT_MARGIN = 8
#: The output never gets less than this share of the context when max_tokens has to shrink.
MIN_OUTPUT_SHARE = 0.25


def estimate_tokens(text: str) -> int:
    """A conservative token count without a tokenizer (more tokens than most tokenizers give)."""
    return max(1, int(len(text) / CHARS_PER_TOKEN_ESTIMATE) + 1)


@dataclass
class Fit:
    """What :func:`fit_prompts` did: the prompts, and one line per change (empty: everything fitted)."""

    prompts: list[Prompt]
    notes: list[str]
    context: int
    counted_by: str


async def fit_prompts(
    prompts: Sequence[Prompt],
    context: int,
    count: Callable[[str], Any] | None = None,
    *,
    counted_by: str = "an estimate",
) -> Fit:
    """Each prompt trimmed (its beginning dropped: continuations need the end) so that prompt + ``max_tokens``
    fits ``context`` tokens (less :data:`CONTEXT_MARGIN`); ``max_tokens`` shrinks to fit first only when it alone
    would take more than 1 − :data:`MIN_OUTPUT_SHARE` of the context. ``count(text)`` returns the token count
    (a coroutine function or a plain one; None → the estimate). Raises SpecopsError when the context is too
    small for any request."""
    room = context - CONTEXT_MARGIN
    if room < 8:
        raise SpecopsError(f"{context} tokens per request leave no room for a prompt and an answer")

    async def n_tokens(text: str) -> int:
        if count is None:
            return estimate_tokens(text)
        got = count(text)
        got = (await got) if asyncio.iscoroutine(got) else got
        return estimate_tokens(text) if got is None else int(got)

    out: list[Prompt] = []
    trimmed: dict[str, list[tuple[int, int]]] = {}
    capped: dict[str, int] = {}
    for p in prompts:
        max_tokens = min(p.max_tokens, max(1, int(room * (1 - MIN_OUTPUT_SHARE))))
        if max_tokens < p.max_tokens:
            capped[p.set] = max_tokens
        n = await n_tokens(p.text)
        text, before = p.text, n
        while n + max_tokens > room and text:
            keep = max(1, int(len(text) * (room - max_tokens) / n * 0.95))
            text = text[-keep:] if keep < len(text) else text[1:]
            n = await n_tokens(text)
        if not text:
            raise SpecopsError(f"a prompt of set {p.set} does not fit {context} tokens per request even when empty")
        if text != p.text:
            trimmed.setdefault(p.set, []).append((before, n))
        out.append(Prompt(text, max_tokens, p.temperature, p.set))
    notes = [f"max_tokens of set {s} lowered to {m} to fit {context} tokens per request" for s, m in capped.items()]
    for s, pairs in trimmed.items():
        total = sum(1 for p in prompts if p.set == s)
        sizes = ", ".join(f"{a} → {b}" for a, b in pairs[:4]) + (", ..." if len(pairs) > 4 else "")
        notes.append(
            f"{len(pairs)} of {total} {s} prompt(s) trimmed from the start to fit {context} tokens per request "
            f"with their max_tokens (tokens, counted by {counted_by}: {sizes})"
        )
    return Fit(out, notes, context, counted_by)


async def engine_context(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> int | None:
    """The context one request gets, as the running engine reports it: ``/props`` (llama-server: the slot's
    ``n_ctx``) or ``/v1/models`` (vLLM: ``max_model_len``); None when neither says."""
    data = await _get_json(base_url, "/props", api_key, timeout)
    if isinstance(data, dict):
        gen = data.get("default_generation_settings")
        n = gen.get("n_ctx") if isinstance(gen, dict) else None
        if isinstance(n, int) and n > 0:
            return n
    data = await _get_json(base_url, "/v1/models", api_key, timeout)
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        for m in data["data"]:
            n = m.get("max_model_len") if isinstance(m, dict) else None
            if isinstance(n, int) and n > 0:
                return n
    return None


def engine_tokenizer(base_url: str, model_name: str, api_key: str | None = None, timeout: float = 5.0):
    """``count(text)``: tokens of ``text`` by the engine's own ``/tokenize`` endpoint (vLLM: ``count``;
    llama-server: the ``tokens`` list), or None when it does not answer."""

    async def count(text: str) -> int | None:
        body = {"model": model_name, "prompt": text, "content": text}
        data = await _post_json(base_url, "/tokenize", body, api_key, timeout)
        if not isinstance(data, dict):
            return None
        if isinstance(data.get("count"), int):
            return data["count"]
        toks = data.get("tokens")
        return len(toks) if isinstance(toks, list) else None

    return count


@dataclass
class FittedWorkload:
    """What :func:`fit_workload` did to named prompt sets: the sets, one line per change, the context they fit."""

    sets: dict[str, list[Prompt]]
    notes: list[str]
    context: int
    counted_by: str


async def fit_workload(engines, sets: Mapping[str, Sequence[Prompt]], fallback_context: int | None = None):
    """Fit built-in workloads to the deployment they run against: the one fitting ``bench``, ``tune``,
    ``certify`` and spot checks use, so no measurement request is refused for its length.

    ``engines`` (one, or several that get the same prompts, e.g. a deployment and its reference): each has
    ``base_url``, ``model_name`` and ``api_key``. The context is the smallest one a request gets on any of them
    (:func:`engine_context`; else ``fallback_context``); tokens are counted by the first engine whose
    ``/tokenize`` answers (else :func:`estimate_tokens`). Each set is fitted by :func:`fit_prompts`."""
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    contexts = [await engine_context(e.base_url, getattr(e, "api_key", None)) for e in engines]
    known = [c for c in contexts if c]
    context = min(known) if known else fallback_context
    if context is None:
        return FittedWorkload({k: list(v) for k, v in sets.items()}, [], 0, "")
    count, counted_by = None, "an estimate"
    first = next((p for ps in sets.values() for p in ps), None)
    for e in engines if first is not None else ():
        candidate = engine_tokenizer(e.base_url, e.model_name, getattr(e, "api_key", None))
        if await candidate(first.text) is not None:
            count, counted_by = candidate, "the engine's /tokenize"
            break
    out: dict[str, list[Prompt]] = {}
    notes: list[str] = []
    for name, prompts in sets.items():
        fit = await fit_prompts(prompts, context, count, counted_by=counted_by)
        out[name] = fit.prompts
        notes.extend(fit.notes)
    return FittedWorkload(out, notes, context, counted_by)


async def fit_to_engine(engine, prompts: Sequence[Prompt], fallback_context: int | None = None) -> Fit:
    """:func:`fit_workload` for one prompt list on one running engine (``base_url``, ``model_name``,
    ``api_key``): its reported context per request (else ``fallback_context``) and its tokenizer (else the
    estimate)."""
    fitted = await fit_workload([engine], {"prompts": prompts}, fallback_context)
    return Fit(fitted.sets["prompts"], fitted.notes, fitted.context, fitted.counted_by)


async def _get_json(base_url: str, path: str, api_key: str | None, timeout: float):
    return await _request_json("GET", base_url, path, None, api_key, timeout)


async def _post_json(base_url: str, path: str, body: dict, api_key: str | None, timeout: float):
    return await _request_json("POST", base_url, path, body, api_key, timeout)


async def _request_json(method: str, base_url: str, path: str, body, api_key: str | None, timeout: float):
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(trust_env=False) as sess:
            async with sess.request(
                method,
                base_url.rstrip("/") + path,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
        return None
