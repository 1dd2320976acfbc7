"""``specops bench``: the profile's engine with speculation and without, side by side, on real prompts.

One run launches the same engine and model twice per round — once as the profile says (speculation on),
once with ``method: none`` — and sends the same workload to each: every prompt set at every concurrency
level. Rounds alternate the order (on/off, then off/on, ...) so that drift of the machine (thermal, other
load) does not favour one side; numbers per cell are medians over rounds. A cell's speedup is its
speculative tokens/s divided by its baseline tokens/s, nothing else.

Acceptance per cell comes from the engine's own counters read before and after the cell (Δaccepted /
Δdrafted, and the mean acceptance length 1 + Δaccepted / Δdrafts); llama-server's per-response ``timings``
are the fallback when its build has no counters.

Outputs (``write_outputs``): ``results.json`` (everything), ``summary.md`` (tables a person reads) and
PNG plots — speedup vs concurrency per prompt set, acceptance per prompt set, tokens/s on vs off.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specops import __version__
from specops.errors import SpecopsError
from specops.methods import Method
from specops.config.profile import LoadedProfile
from specops.speedup import DEFAULT_DRAFT_COST
from specops.perf.stats import median
from specops.perf.workload import BUILTIN_SETS, Prompt, load_prompts

SPEC, BASE = "spec", "base"
DEFAULT_LEVELS = (1, 2, 4, 8)


@dataclass
class BenchConfig:
    """What to run. ``requests`` is per cell (prompt set × concurrency × mode); default max(8, 2·c)."""

    prompt_sets: list[str] = field(default_factory=lambda: list(BUILTIN_SETS))
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    requests: int | None = None
    duration: float | None = None
    max_tokens: int | None = None
    rounds: int = 1
    warmup: int = 2
    step_index: int = 0
    ignore_eos: bool = False
    interleave: bool = False        # both engines at once, cells alternating (needs memory for two)
    draft_cost: float | None = None
    backend_version: str | None = None
    ready_timeout: float | None = None
    log_dir: Path | None = None

    def requests_for(self, level: int) -> int | None:
        if self.requests is not None:
            return self.requests
        return None if self.duration is not None else max(8, 2 * level)

    def check(self) -> None:
        if not self.prompt_sets:
            raise SpecopsError("no prompt sets to run")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise SpecopsError(f"concurrency levels must be integers >= 1, got {self.concurrency}")
        if self.rounds < 1:
            raise SpecopsError("--rounds must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise SpecopsError("--requests must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise SpecopsError("--duration must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SpecopsError("--max-tokens must be >= 1")


def load_sets(names: list[str], max_tokens: int | None = None) -> dict[str, list[Prompt]]:
    """Prompt sets by name or JSONL path, keyed by set name (a file's prompts may name several sets)."""
    out: dict[str, list[Prompt]] = {}
    for name in names:
        for p in load_prompts(name):
            if max_tokens is not None:
                p = Prompt(p.text, max_tokens, p.temperature, p.set)
            out.setdefault(p.set, []).append(p)
    return out


def machine() -> dict:
    """The machine the numbers were measured on (stated in every report)."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": cores, "memory_gib": mem, "platform": platform.platform(),
            "python": platform.python_version()}


# ---------------------------------------------------------------------------------------------------
# running

Say = Callable[[str], None]


class _Progress:
    """Adapter for a progress display: ``start(label, total)``, ``advance()``, ``finish()``."""

    def start(self, label: str, total: int | None) -> None: ...
    def advance(self, label: str) -> None: ...
    def finish(self) -> None: ...


async def run_bench(loaded: LoadedProfile, registry, cfg: BenchConfig, *, say: Say = lambda m: None,
                    progress: _Progress | None = None) -> dict:
    """Run the comparison and return the report (a JSON-ready dict; see :func:`summarize`)."""
    from specops.perf.launch import launched, profile_for_step, without_speculation

    cfg.check()
    progress = progress or _Progress()
    sets = load_sets(cfg.prompt_sets, cfg.max_tokens)
    spec_profile = profile_for_step(loaded.profile, cfg.step_index)
    if spec_profile.speculative.method is Method.NONE:
        raise SpecopsError(f"{loaded.path}: step {cfg.step_index} runs without speculation (method none): "
                           "nothing to compare; bench a profile whose method drafts")
    base_profile = without_speculation(spec_profile)
    backend = registry.backend(spec_profile.backend)
    engine = backend.engine_info(spec_profile, cfg.backend_version, probe=True)
    extra = {"ignore_eos": True} if cfg.ignore_eos else None
    levels = sorted(set(cfg.concurrency))
    cells: list[dict] = []
    launches: list[dict] = []
    started = time.time()
    per_engine_requests = sum((cfg.requests_for(c) or 0) for c in levels) * len(sets)

    def launch(mode: str, rnd: int):
        prof = spec_profile if mode == SPEC else base_profile
        what = f"{prof.speculative.method} k={prof.speculative.k}" if mode == SPEC else "no speculation"
        say(f"round {rnd + 1}/{cfg.rounds}: launching {prof.backend} {engine.version} with {what}")
        log_path = (cfg.log_dir / f"engine-{mode}-r{rnd + 1}.log") if cfg.log_dir else None
        return launched(loaded, registry, profile=prof, engine=engine, ready_timeout=cfg.ready_timeout,
                        log_path=log_path)

    async def ready(eng, mode: str, rnd: int) -> None:
        say(f"ready in {eng.ready_s:.1f}s on {eng.base_url}")
        launches.append({"mode": mode, "round": rnd + 1, "ready_s": round(eng.ready_s, 3),
                         "argv": [eng.plan.redact(a) for a in eng.plan.argv]})
        await _warmup(eng, sets, cfg, extra)

    async def cell(eng, mode: str, rnd: int, set_name: str, level: int) -> None:
        label = f"{mode} r{rnd + 1} {set_name} c={level}"
        out = await _run_cell(eng, sets[set_name], level, cfg, extra,
                              lambda done, total, label=label: progress.advance(label))
        cells.append({"set": set_name, "concurrency": level, "mode": mode, "round": rnd + 1, **out})
        if not eng.process.running:
            raise SpecopsError(f"the engine ({mode}) {eng.process.exit.describe()} during {set_name} at "
                               f"concurrency {level}; see its log in {cfg.log_dir or 'the output folder'}")

    for rnd in range(cfg.rounds):
        order = (SPEC, BASE) if rnd % 2 == 0 else (BASE, SPEC)
        if cfg.interleave:
            # both engines up at once; every cell runs on one and then the other, the order alternating
            async with launch(order[0], rnd) as first, launch(order[1], rnd) as second:
                engines = {order[0]: first, order[1]: second}
                for mode in order:
                    await ready(engines[mode], mode, rnd)
                progress.start(f"round {rnd + 1}: both engines", 2 * per_engine_requests or None)
                try:
                    i = 0
                    for set_name in sets:
                        for level in levels:
                            for mode in (order if i % 2 == 0 else order[::-1]):
                                await cell(engines[mode], mode, rnd, set_name, level)
                            i += 1
                finally:
                    progress.finish()
            continue
        for mode in order:
            async with launch(mode, rnd) as eng:
                await ready(eng, mode, rnd)
                progress.start(f"round {rnd + 1}: {mode}", per_engine_requests or None)
                try:
                    for set_name in sets:
                        for level in levels:
                            await cell(eng, mode, rnd, set_name, level)
                finally:
                    progress.finish()
    c = cfg.draft_cost
    if c is None:
        c = spec_profile.fallback.draft_cost_ratio
    if c is None:
        c = DEFAULT_DRAFT_COST
    return summarize(cells, {
        "specops_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
        "profile": {"name": spec_profile.name, "path": loaded.path, "backend": spec_profile.backend,
                    "model": spec_profile.model.id, "method": spec_profile.speculative.method.value,
                    "k": spec_profile.speculative.k, "draft": spec_profile.speculative.draft,
                    "parallel": spec_profile.server.parallel,
                    "min_acceptance": spec_profile.fallback.min_acceptance},
        "engine": {"backend": engine.backend, "version": engine.version, "source": engine.source},
        "settings": {"prompt_sets": list(sets), "concurrency": levels, "requests_per_cell": cfg.requests,
                     "duration_per_cell": cfg.duration, "max_tokens": cfg.max_tokens, "rounds": cfg.rounds,
                     "warmup": cfg.warmup, "ignore_eos": cfg.ignore_eos, "step": cfg.step_index,
                     "interleave": cfg.interleave,
                     "draft_cost_ratio": c},
        "launches": launches,
    })


async def _warmup(eng, sets: dict[str, list[Prompt]], cfg: BenchConfig, extra) -> None:
    """A few short requests before measuring: first-request costs (allocation, compilation) excluded."""
    from specops.perf.workload import run_workload

    if cfg.warmup < 1:
        return
    prompts = [Prompt(p.text, min(p.max_tokens, 16), p.temperature, p.set) for ps in sets.values() for p in ps[:1]]
    res = await run_workload(eng.base_url, eng.model_name, prompts, concurrency=1, requests=cfg.warmup,
                             api_key=eng.api_key, extra_body=extra)
    if not res.ok:
        raise SpecopsError(f"warm-up requests to {eng.base_url} failed: {res.errors[0].error}")


async def _run_cell(eng, prompts: list[Prompt], level: int, cfg: BenchConfig, extra, on_progress) -> dict:
    from specops.perf.workload import run_workload

    before = await eng.counters()
    res = await run_workload(eng.base_url, eng.model_name, prompts, concurrency=level,
                             requests=cfg.requests_for(level), duration=cfg.duration, api_key=eng.api_key,
                             on_progress=on_progress, extra_body=extra)
    stats = await eng.acceptance_since(before)
    out = res.summary()
    acceptance = mal = draft_len = None
    source = None
    if stats.status == "ok":
        acceptance, mal, draft_len = stats.acceptance, stats.mean_acceptance_length, stats.mean_draft_length
        source = "metrics"
        out.update(draft_tokens=stats.draft_tokens, accepted=stats.accepted, drafts=stats.drafts)
    elif res.acceptance is not None:
        acceptance, source = res.acceptance, "response-timings"
        out.update(draft_tokens=res.draft_tokens, accepted=res.accepted, drafts=None)
    out.update(acceptance=acceptance, mean_acceptance_length=mal, mean_draft_length=draft_len,
               acceptance_source=source)
    return out


# ---------------------------------------------------------------------------------------------------
# summarizing

def summarize(cells: list[dict], meta: dict) -> dict:
    """Speedups from the cells: per (set, level), per level (all sets), per set (all levels).

    Every speedup is a ratio of tokens/s: the median over rounds of the speculative cell's tokens/s over
    the median of the baseline's. Aggregates (per level, per set) add tokens and wall time first.
    """
    from specops.speedup import speedup_from_length

    c = meta.get("settings", {}).get("draft_cost_ratio")
    sets = list(dict.fromkeys(cell["set"] for cell in cells))
    levels = sorted({cell["concurrency"] for cell in cells})

    def pick(set_name, level, mode):
        return [x for x in cells if x["set"] == set_name and x["concurrency"] == level and x["mode"] == mode]

    def ratio(a, b):
        return a / b if a is not None and b else None

    rows = []
    for s in sets:
        for lv in levels:
            sp, bs = pick(s, lv, SPEC), pick(s, lv, BASE)
            spec_tps = median([x["tokens_per_s"] for x in sp])
            base_tps = median([x["tokens_per_s"] for x in bs])
            drafted = sum(x.get("draft_tokens") or 0 for x in sp)
            accepted = sum(x.get("accepted") or 0 for x in sp)
            drafts = sum(x.get("drafts") or 0 for x in sp)
            acceptance = accepted / drafted if drafted else None
            mal = 1 + accepted / drafts if drafts else None
            draft_len = drafted / drafts if drafts else None
            model = None
            if mal is not None and draft_len is not None and c is not None:
                model = speedup_from_length(max(mal, 1.0), draft_len, c)
            rows.append({
                "set": s, "concurrency": lv, "spec_tokens_per_s": spec_tps, "base_tokens_per_s": base_tps,
                "speedup": ratio(spec_tps, base_tps), "acceptance": acceptance, "mean_acceptance_length": mal,
                "mean_draft_length": draft_len, "model_speedup": model,
                "spec_ttft_ms": median([x["ttft_ms"]["median"] for x in sp]),
                "base_ttft_ms": median([x["ttft_ms"]["median"] for x in bs]),
                "spec_itl_ms": median([x["itl_ms"]["median"] for x in sp]),
                "base_itl_ms": median([x["itl_ms"]["median"] for x in bs]),
                "spec_tpot_ms": median([x["tpot_ms"]["median"] for x in sp]),
                "base_tpot_ms": median([x["tpot_ms"]["median"] for x in bs]),
                "errors": sum(x["errors"] for x in sp + bs),
            })

    def aggregate(selected: list[dict]) -> dict:
        out = {}
        for mode in (SPEC, BASE):
            mine = [x for x in selected if x["mode"] == mode]
            tokens = sum(x["output_tokens"] for x in mine)
            wall = sum(x["wall_s"] for x in mine)
            out[mode] = tokens / wall if wall > 0 else None
        drafted = sum(x.get("draft_tokens") or 0 for x in selected if x["mode"] == SPEC)
        accepted = sum(x.get("accepted") or 0 for x in selected if x["mode"] == SPEC)
        drafts = sum(x.get("drafts") or 0 for x in selected if x["mode"] == SPEC)
        return {"spec_tokens_per_s": out[SPEC], "base_tokens_per_s": out[BASE],
                "speedup": ratio(out[SPEC], out[BASE]),
                "acceptance": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None}

    by_level = [{"concurrency": lv, **aggregate([x for x in cells if x["concurrency"] == lv])} for lv in levels]
    by_set = [{"set": s, **aggregate([x for x in cells if x["set"] == s]),
               "speedup_by_concurrency": {str(r["concurrency"]): r["speedup"] for r in rows if r["set"] == s}}
              for s in sets]
    errors = sum(x["errors"] for x in cells)
    return {**meta, "cells": cells, "speedup": rows, "by_concurrency": by_level, "by_set": by_set,
            "overall": aggregate(cells), "errors": errors}


# ---------------------------------------------------------------------------------------------------
# writing

def _f(v, fmt="{:.2f}", none="–"):
    return none if v is None else fmt.format(v)


def markdown(report: dict, plots: list[str] | None = None) -> str:
    """The summary a person reads: settings, per-set tables, per-level totals, plots."""
    p, e, m, s = report["profile"], report["engine"], report["machine"], report["settings"]
    lines = [f"# specops bench: {p['name']}", "",
             f"- profile `{p['path']}`: {p['backend']} {e['version']}, model `{p['model']}`, "
             f"method **{p['method']}** (k={p['k']}) vs no speculation",
             f"- machine: {m['cpu'] or 'unknown CPU'}, {m['cores']} cores"
             + (f", {m['memory_gib']} GiB" if m.get("memory_gib") else "") + f"; {m['platform']}",
             f"- prompt sets {', '.join(s['prompt_sets'])}; concurrency {', '.join(map(str, s['concurrency']))}; "
             + (f"{s['requests_per_cell']} requests per cell" if s["requests_per_cell"]
                else (f"{s['duration_per_cell']:g}s per cell" if s["duration_per_cell"]
                      else "max(8, 2×concurrency) requests per cell"))
             + f"; {s['rounds']} round(s), "
             + ("both engines up at once, cells alternating" if s.get("interleave") else "launches alternating")
             + "; medians over rounds",
             f"- speedup = tokens/s with speculation ÷ tokens/s without, same engine and model, one run; "
             f"model speedup = measured mean acceptance length / (1 + k·c) with c = {s['draft_cost_ratio']}",
             ""]
    o = report["overall"]
    lines += [f"**Overall: {_f(o['speedup'])}x** ({_f(o['spec_tokens_per_s'], '{:.1f}')} vs "
              f"{_f(o['base_tokens_per_s'], '{:.1f}')} output tokens/s), acceptance {_f(o['acceptance'], '{:.3f}')}, "
              f"mean acceptance length {_f(o['mean_acceptance_length'])}"
              + (f"; **{report['errors']} failed requests**" if report["errors"] else ""), ""]
    lines += ["## Speedup by prompt set and concurrency", "",
              "| set | " + " | ".join(f"c={c}" for c in s["concurrency"]) + " | acceptance | mean acc. length |",
              "|---|" + "---|" * len(s["concurrency"]) + "---|---|"]
    for bs in report["by_set"]:
        vals = [bs["speedup_by_concurrency"].get(str(c)) for c in s["concurrency"]]
        lines.append(f"| {bs['set']} | " + " | ".join(_f(v, "{:.2f}x") for v in vals)
                     + f" | {_f(bs['acceptance'], '{:.3f}')} | {_f(bs['mean_acceptance_length'])} |")
    lines.append("| **all** | " + " | ".join(_f(r["speedup"], "**{:.2f}x**") for r in report["by_concurrency"])
                 + f" | {_f(o['acceptance'], '{:.3f}')} | {_f(o['mean_acceptance_length'])} |")
    lines += ["", "## Details", "",
              "| set | c | tok/s off | tok/s on | speedup | model | acceptance | acc. length | TTFT ms off/on "
              "| TPOT ms off/on | ITL ms off/on | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["speedup"]:
        lines.append(
            f"| {r['set']} | {r['concurrency']} | {_f(r['base_tokens_per_s'], '{:.1f}')} | "
            f"{_f(r['spec_tokens_per_s'], '{:.1f}')} | {_f(r['speedup'], '{:.2f}x')} | "
            f"{_f(r['model_speedup'], '{:.2f}x')} | {_f(r['acceptance'], '{:.3f}')} | "
            f"{_f(r['mean_acceptance_length'])} | {_f(r['base_ttft_ms'], '{:.1f}')}/{_f(r['spec_ttft_ms'], '{:.1f}')} | "
            f"{_f(r['base_tpot_ms'], '{:.2f}')}/{_f(r['spec_tpot_ms'], '{:.2f}')} | "
            f"{_f(r['base_itl_ms'], '{:.2f}')}/{_f(r['spec_itl_ms'], '{:.2f}')} | {r['errors']} |")
    lines += ["", "ITL is per streamed chunk (speculation delivers accepted tokens in bursts); TPOT is "
              "(latency − TTFT) / (tokens − 1).", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(x).stem}]({Path(x).name})" for x in plots] + [""]
    return "\n".join(lines)


def plot(report: dict, out_dir: Path) -> list[Path]:
    """PNG plots: speedup vs concurrency per set, acceptance per set, tokens/s on vs off. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    p, e = report["profile"], report["engine"]
    levels = report["settings"]["concurrency"]
    sets = [b["set"] for b in report["by_set"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {s: colors[i % len(colors)] for i, s in enumerate(sets)}
    subtitle = f"{p['name']} · {p['backend']} {e['version']} · {p['method']} k={p['k']} vs none"
    paths = []

    # 1. speedup vs concurrency
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    top = 1.0
    ends = []
    for s in sets:
        pts = [(r["concurrency"], r["speedup"]) for r in report["speedup"] if r["set"] == s and r["speedup"]]
        if not pts:
            continue
        xs, ys = zip(*pts)
        top = max(top, *ys)
        ax.plot(xs, ys, marker="o", lw=2, color=color[s], label=s)
        ends.append([ys[-1], ys[-1], xs[-1], color[s]])
    ymax = max(1.5, top * 1.15)
    gap = 0.045 * ymax
    ends.sort(key=lambda e: e[0])
    for i in range(1, len(ends)):  # end labels never on top of each other
        ends[i][1] = max(ends[i][1], ends[i - 1][1] + gap)
    for value, y, x, col in ends:
        ax.text(x * 1.06, y, f"{value:.2f}x", va="center", fontsize=9, color=col)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.axhspan(0, 1.0, color="#d62728", alpha=0.06)
    ax.text(levels[0], 0.97, "slower than no speculation", va="top", fontsize=8, color="#d62728")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(x) for x in levels])
    ax.set_xlim(levels[0] / 1.15, levels[-1] * 1.35)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup (tokens/s on ÷ off)")
    ax.set_title(f"Speculative decoding speedup vs concurrency\n{subtitle}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(title="prompt set", frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    # 2. acceptance per set (bars per concurrency level), mean acceptance length on top
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    width = 0.8 / max(1, len(levels))
    shades = plt.cm.Blues([0.4 + 0.5 * i / max(1, len(levels) - 1) for i in range(len(levels))])
    for j, lv in enumerate(levels):
        xs, ys, labels = [], [], []
        for i, s in enumerate(sets):
            r = next((r for r in report["speedup"] if r["set"] == s and r["concurrency"] == lv), None)
            if r and r["acceptance"] is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r["acceptance"])
                labels.append(r["mean_acceptance_length"])
        bars = ax.bar(xs, ys, width=width * 0.95, color=shades[j], label=f"c={lv}")
        for b, mal in zip(bars, labels):
            if mal is not None:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.01, f"{mal:.1f}", ha="center",
                        va="bottom", fontsize=7)
    thr = p.get("min_acceptance")
    if thr is not None:
        ax.axhline(thr, color="#d62728", lw=1, ls="--")
        ax.text(len(sets) - 0.5, thr + 0.01, f"fallback threshold {thr:g}", ha="right", va="bottom", fontsize=8,
                color="#d62728")
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("acceptance rate (accepted ÷ drafted)")
    ax.set_title(f"Draft acceptance per prompt set (numbers: mean acceptance length)\n{subtitle}", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="concurrency", frameon=False, ncol=min(4, len(levels)), loc="upper right")
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    # 3. tokens/s on vs off, one panel per set
    n = len(sets)
    cols = min(n, 4)
    rows_n = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols + 0.8, 3.0 * rows_n + 0.8), dpi=120, squeeze=False)
    for i, s in enumerate(sets):
        ax = axes[i // cols][i % cols]
        rs = [r for r in report["speedup"] if r["set"] == s]
        ax.plot([r["concurrency"] for r in rs], [r["base_tokens_per_s"] or 0 for r in rs], marker="s",
                color="gray", lw=2, label="off")
        ax.plot([r["concurrency"] for r in rs], [r["spec_tokens_per_s"] or 0 for r in rs], marker="o",
                color=color[s], lw=2, label="on")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(x) for x in levels])
        ax.set_ylim(bottom=0)
        ax.set_title(s)
        ax.grid(alpha=0.3)
        if i % cols == 0:
            ax.set_ylabel("output tokens/s")
        ax.set_xlabel("concurrent requests")
        ax.legend(frameon=False, fontsize=8)
    for j in range(n, rows_n * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"Throughput with and without speculation\n{subtitle}", fontsize=11)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def write_outputs(report: dict, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """results.json, summary.md and (when matplotlib is installed and ``plots``) the PNGs, in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    pngs: list[Path] = []
    if plots:
        try:
            pngs = plot(report, out)
        except ImportError:
            report.setdefault("notes", []).append("plots skipped: matplotlib is not installed "
                                                  "(pip install 'specops[plots]')")
    for png in pngs:
        written[png.stem] = png
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    written["json"] = out / "results.json"
    (out / "summary.md").write_text(markdown(report, [str(p) for p in pngs]), encoding="utf-8")
    written["markdown"] = out / "summary.md"
    return written


def run_bench_blocking(loaded: LoadedProfile, registry, cfg: BenchConfig, **kw) -> dict:
    return asyncio.run(run_bench(loaded, registry, cfg, **kw))
