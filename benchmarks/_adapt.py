"""What the adapt-drift benchmarks share: the run's folder, stages kept so a rerun resumes, one launch measured.

``bench_adapt_drift.py`` (llama.cpp) and ``bench_adapt_eagle3_drift.py`` (vLLM, EAGLE-3) both import it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path


def work_folder(work: Path, fresh: bool) -> Path:
    """The run's folder (emptied first with ``fresh``), with specops' state kept in it unless SPECOPS_STATE says."""
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SPECOPS_STATE", str(work / "state"))
    return work


def stage(work: Path, name: str, fn):
    """A stage's result, computed once and kept in ``work`` (so a rerun resumes after the last finished one)."""
    path = work / f"stage-{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    value = fn()
    value = {"value": value, "seconds": round(time.monotonic() - t0, 1)}
    path.write_text(json.dumps(value, indent=1))
    return value


async def measure_runs(loaded, draft: str | None, prompts, runs: int) -> dict:
    """One launch: a warm-up, then the prompts ``runs`` times at one client; acceptance over all runs (greedy:
    the same tokens each run), tokens/s per run. ``draft`` None: the target alone (speculation off)."""
    from specops.perf.launch import launched, without_speculation
    from specops.perf.workload import run_workload
    from specops.plugins import get_registry

    if draft is None:
        prof = without_speculation(loaded.profile)
    else:
        prof = loaded.profile.model_copy(
            update={"speculative": loaded.profile.speculative.model_copy(update={"draft": draft})}
        )
    rates, errors = [], 0
    async with launched(loaded, get_registry(), profile=prof) as eng:
        await run_workload(eng.base_url, eng.model_name, prompts[:2], concurrency=1, api_key=eng.api_key)
        before = await eng.settled_counters()
        for _ in range(runs):
            res = await run_workload(eng.base_url, eng.model_name, prompts, concurrency=1, api_key=eng.api_key)
            rates.append(round(res.tokens_per_s, 1))
            errors += len(res.errors)
        stats = await eng.acceptance_since(before) if draft is not None else None
    out = {"tokens_per_s_median": statistics.median(rates), "tokens_per_s_runs": rates, "errors": errors}
    if stats is not None:
        out |= {
            "acceptance": None if stats.acceptance is None else round(stats.acceptance, 3),
            "mean_acceptance_length": None
            if stats.mean_acceptance_length is None
            else round(stats.mean_acceptance_length, 3),
            "per_position": [round(x, 3) for x in (stats.per_position or [])],
        }
    return out
