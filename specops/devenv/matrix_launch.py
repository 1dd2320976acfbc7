"""Launch one rendered engine command and classify what the engine did with speculation.

Ready, then a few greedy completions, then the speculative counters read from ``/metrics`` before and
after (``vllm:spec_decode_*``, ``llamacpp:spec_decode_*``). An engine that exits is told by the last line
of its output that names the error (:func:`last_error_line`).
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable

PROMPTS = (
    "the quick brown fox jumps over the lazy dog and the quick brown fox",
    "def return import class print self if else return import class",
    "hello world hello world hello world hello",
)
MAX_TOKENS = 96

Say = Callable[[str], None]


#: Lines that name an error but not its cause (vLLM's wrappers around the root cause).
_GENERIC = re.compile(
    r"Engine core initiali[sz]ation failed|See root cause above|Failed core proc|"
    r"initiali[sz]ation failed due to an exception in a background process|See stack trace for root cause|"
    r"EngineCore failed to start|RuntimeError: Engine process failed to start|"
    r"^\s*(Traceback|File \"|During handling|The above exception|raise\b|return\b)|"
    r"^[\s^~]+$|For further information visit|Exception in thread|^\s*\w+\(.*\)\s*$|"
    # llama-server's wrappers around the cause
    r"exiting due to|load_model: failed to|failed to create \w+ context$"
)
_ERRORISH = re.compile(
    r"Error\b|Error:|Exception\b|\bERROR\b|\berror\b|failed|not supported|unsupported|"
    r"requires|Value error|refus|cannot|can't|invalid|doesn't|does not|not found|missing|"
    r"unknown",
    re.I,
)
_PREFIX = re.compile(
    r"^(\(\w+ pid=\d+\)\s*)?((ERROR|WARNING|INFO|DEBUG)\s+\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\s+\[[^\]]*\]\s*)?"
    r"(\d+\.\d+\.\d+\.\d+ [EWI] )?"
)


_LONG_LIST = re.compile(r"(dict_keys\(|\[)([^\[\]()]{120,})(\]\)|\])")


def last_error_line(lines: Iterable[str]) -> str | None:
    """The last line of an engine's output that names the error (vLLM prefixes and wrappers stripped)."""
    best = None
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip()).strip()
        if not line or _GENERIC.search(line) or not _ERRORISH.search(line):
            continue
        best = line
    if not best:
        return None
    best = _LONG_LIST.sub(lambda m: f"{m.group(1)}{m.group(2)[:60].rstrip(', ')}, …{m.group(3)}", best)
    return best[:400]


def _http(url: str, body: dict | None = None, timeout: float = 120.0) -> str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def _counters(backend, metrics_url: str, model_name: str):
    try:
        text = _http(metrics_url, timeout=10)
    except (OSError, urllib.error.URLError):
        return None
    try:
        return backend.acceptance_counters(text, model_name)
    except ValueError:
        return None


async def run_engine(plan, backend, ready_timeout: float, say: Say) -> dict:
    """Launch ``plan``, wait, send completions, read counters, stop: the engine half of a cell."""
    from specops.run.start import EngineStart

    lines: list[str] = []

    def take(line: str) -> None:
        lines.append(line)
        if len(lines) > 4000:
            del lines[:1000]

    start = EngineStart(plan, on_line=take, launch_problem=backend.launch_problem)
    proc = start.process
    out: dict = {}
    try:
        result = await start.run(ready_timeout, interval=0.2)
        out["ready_s"] = round(result.seconds, 1)
        if not result.ready:
            out.update(await _not_ready(start, lines, ready_timeout))
            return out
        before = await asyncio.to_thread(_counters, backend, plan.metrics_url, plan.model_name)
        ok = await _send_prompts(plan, say)
        await asyncio.sleep(1.0)  # counters are published a step late
        after = await asyncio.to_thread(_counters, backend, plan.metrics_url, plan.model_name)
        problem = next((p for p in map(backend.launch_problem, lines) if p), None)
        out.update(_classify(before, after, ok, problem, lines))
        return out
    finally:
        try:
            await proc.stop(30)
        except BaseException:
            proc.kill_now()
            raise


async def _not_ready(start, lines: list[str], ready_timeout: float) -> dict:
    """Why the engine never became ready: it refused the draft, exited, or took too long."""
    proc = start.process
    if start.problems:
        return {"outcome": "started-without-speculation", "detail": start.problems[0]}
    if proc.exit is not None:
        await asyncio.sleep(0.3)  # let the reader drain the last lines
        detail = last_error_line(lines) or f"engine {proc.exit.describe()} (no error line)"
        return {"outcome": "engine-refused", "detail": detail, "ready_s": None}
    last = _PREFIX.sub("", lines[-1]).strip()[:200] if lines else "(none)"
    return {
        "outcome": "engine-timeout",
        "ready_s": None,
        "detail": f"not ready within {ready_timeout:.0f} s; last line: {last}",
    }


async def _send_prompts(plan, say: Say) -> int:
    """Send the greedy completions one after the other → how many succeeded."""
    ok = 0
    for prompt in PROMPTS:
        body = {"model": plan.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        try:
            await asyncio.to_thread(_http, plan.base_url + "/v1/completions", body)
            ok += 1
        except (OSError, urllib.error.URLError) as exc:
            say(f"    completion failed: {exc}")
    return ok


def _classify(before, after, ok: int, problem: str | None, lines: list[str]) -> dict:
    """The outcome of a ready engine from its counters before and after ``ok`` completions."""
    if ok == 0:
        return {
            "outcome": "engine-refused",
            "detail": f"ready, but every completion failed: {last_error_line(lines) or 'no error line'}",
        }
    d_tok = (after.draft_tokens - (before.draft_tokens if before else 0)) if after else 0
    if after is None or d_tok <= 0:
        why = problem or (
            "no speculative counters in /metrics"
            if after is None
            else f"the draft-token counter did not move over {ok} completions"
        )
        return {"outcome": "started-without-speculation", "detail": why}
    d_acc = after.accepted - (before.accepted if before else 0)
    base_drafts = before.drafts if before is not None and before.drafts is not None else 0
    d_drafts = after.drafts - base_drafts if after.drafts is not None else None
    return {
        "outcome": "speculating",
        "detail": f"{int(d_tok)} draft tokens, {int(d_acc)} accepted over {ok} completions",
        "acceptance": round(d_acc / d_tok, 4),
        "mean_acceptance_length": round(1 + d_acc / d_drafts, 3) if d_drafts else None,
        "draft_tokens": int(d_tok),
    }
