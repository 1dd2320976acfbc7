"""The report of a ``specops bench`` run: speedups summarized from the measured cells, and the files a
person reads (``results.json``, ``summary.md``, the PNG plots of :mod:`specops.perf.plots`).

Every speedup is a ratio of tokens/s, the speculative side over the baseline, same engine and model, one
run; kept apart from the running (:mod:`specops.perf.bench`) so a report can be re-summarized or re-written
without an engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specops.methods import Method
from specops.perf.bench_flags import FlagThresholds, cell_flags
from specops.perf.plots import plot
from specops.perf.stats import median, present
from specops.perf.verifycost import STEPS, curve_of, draft_ratio, idle_measured, step_ms
from specops.speedup import DEFAULT_DRAFT_COST, VerifyCost, cost_basis, speedup_from_length, workload_speedup

SPEC, BASE = "spec", "base"

# ---------------------------------------------------------------------------------------------------
# summarizing


def summarize(cells: list[dict], meta: dict) -> dict:
    """Speedups from the cells: per (set, level), per level (all sets), per set (all levels).

    Every cell's speedup is a ratio of tokens/s: the median over rounds of the speculative cell's tokens/s
    over the median of the baseline's. Aggregates (per level, per set, overall) add tokens and wall time
    first for their tokens/s, but their speedup is the median of their cells' speedups: a ratio of summed
    tokens lets one stalled cell carry it. The overall speedup needs two rounds or more (one round cannot tell
    a busy machine or a stall from the engine). Each cell carries its flags (:mod:`specops.perf.bench_flags`).
    """
    model = _Model.of(meta)
    meta = {**meta, "model_basis": model.basis()}
    sets = list(dict.fromkeys(cell["set"] for cell in cells))
    levels = sorted({cell["concurrency"] for cell in cells})
    rows = [
        _speedup_row(
            [x for x in cells if x["set"] == s and x["concurrency"] == lv], s, lv, model, _prefill_ms(cells, s)
        )
        for s in sets
        for lv in levels
    ]
    thresholds = FlagThresholds.from_dict(meta.get("settings", {}).get("flag_thresholds"))
    for row in rows:
        row["flags"] = cell_flags(
            [x for x in cells if x["set"] == row["set"] and x["concurrency"] == row["concurrency"]], thresholds
        )
    by_level = [
        {
            "concurrency": lv,
            **_aggregate([x for x in cells if x["concurrency"] == lv]),
            **_median_speedup([r for r in rows if r["concurrency"] == lv]),
        }
        for lv in levels
    ]
    by_set = [
        {
            "set": s,
            **_aggregate([x for x in cells if x["set"] == s]),
            **_median_speedup([r for r in rows if r["set"] == s]),
            "speedup_by_concurrency": {str(r["concurrency"]): r["speedup"] for r in rows if r["set"] == s},
        }
        for s in sets
    ]
    errors = sum(x["errors"] for x in cells)
    return {
        **meta,
        "cells": cells,
        "speedup": rows,
        "by_concurrency": by_level,
        "by_set": by_set,
        "overall": {**_aggregate(cells), **_headline(rows, len({x["round"] for x in cells}))},
        "flagged_cells": sum(1 for r in rows if r["flags"]),
        "errors": errors,
    }


#: Why a one-round report has no overall speedup.
ONE_ROUND = (
    "one round is not a measurement: a cell measured once cannot tell a busy machine or a stalled request "
    "from the engine; run --rounds 2 or more for an overall speedup"
)


def _median_speedup(rows: list[dict]) -> dict:
    """The median of the rows' speedups, with how many cells it covers and their range."""
    speedups = present(r["speedup"] for r in rows)
    return {
        "speedup": median(speedups),
        "speedup_cells": len(speedups),
        "speedup_range": [min(speedups), max(speedups)] if speedups else None,
    }


def _headline(rows: list[dict], rounds: int) -> dict:
    """The overall speedup (the median of every cell's), or None and why when fewer than two rounds ran."""
    if rounds < 2:
        return {"speedup": None, "speedup_cells": 0, "speedup_range": None, "no_headline": ONE_ROUND}
    return {**_median_speedup(rows), "no_headline": None}


def _ratio(a, b):
    return a / b if a is not None and b else None


def _of_mode(cells: list[dict], mode: str) -> list[dict]:
    return [x for x in cells if x["mode"] == mode]


def _counted(spec: list[dict]) -> dict:
    """What the speculative cells generated and drafted, added over rounds."""
    return {
        "tokens": sum(x.get("output_tokens") or 0 for x in spec),
        "requests": sum(x.get("ok") or 0 for x in spec),
        "drafts": sum(x.get("drafts") or 0 for x in spec),
        "accepted": sum(x.get("accepted") or 0 for x in spec),
    }


def _drafting(cells: list[dict]) -> dict:
    """Acceptance, mean acceptance length and mean draft length from the speculative cells' counters."""
    spec = _of_mode(cells, SPEC)
    drafted = sum(x.get("draft_tokens") or 0 for x in spec)
    accepted = sum(x.get("accepted") or 0 for x in spec)
    drafts = sum(x.get("drafts") or 0 for x in spec)
    return {
        "acceptance": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "mean_draft_length": drafted / drafts if drafts else None,
    }


@dataclass(frozen=True)
class _Model:
    """What the model column prices a cell with: the verification-cost record the bench probed (or found stored;
    None: c_verify ≡ 1), c as given (``--draft-cost``, the profile's ``fallback.draft_cost_ratio``) else measured,
    and the batch the engine decodes at a concurrency (at most ``server.parallel`` requests at once)."""

    record: dict | None
    given_c: float | None
    method: str | None
    draft: str | None
    parallel: int | None

    @classmethod
    def of(cls, meta: dict) -> _Model:
        record = meta.get("verify_cost")
        try:
            record = record if isinstance(record, dict) and record.get("relative") and curve_of(record) else None
        except ValueError:
            record = None
        profile = meta.get("profile") or {}
        return cls(
            record,
            (meta.get("settings") or {}).get("draft_cost_ratio"),
            profile.get("method"),
            profile.get("draft"),
            profile.get("parallel"),
        )

    def batch(self, level: int) -> int:
        return min(level, self.parallel) if self.parallel else level

    def curve(self, level: int) -> VerifyCost | None:
        return None if self.record is None else curve_of(self.record, self.batch(level))

    def draft_cost(self, level: int) -> tuple[float, str]:
        """c at ``level`` and where it came from."""
        if self.given_c is not None:
            return self.given_c, "given"
        if self.record is not None and self.record.get("probe") == STEPS:
            if self.method in (Method.NGRAM.value, Method.SUFFIX.value):
                return 0.0, "in the measured steps (prompt lookup)"
            measured = draft_ratio(self.record, self.draft, self.batch(level))
            if measured is not None:
                return measured, "measured (a decode step of the draft or of a draft of its shape)"
        return DEFAULT_DRAFT_COST, "assumed (the default; not measured)"

    def basis(self) -> str:
        c, how = self.draft_cost(1)
        idle = "at the draftless step measured" if self.curve(1) and idle_measured(self.record) else "at one step"
        whole = f" whole requests (prompt passes, steps without a draft {idle});" if self._step_ms(1) else ""
        return f"{cost_basis(self.curve(1))};{whole} c {how}"

    def _step_ms(self, level: int) -> float | None:
        return None if self.record is None else step_ms(self.record, self.batch(level))

    def predict(self, counters: dict, level: int, prefill_ms: float | None) -> dict:
        """The model's speedup for a row's measured counters: the whole workload where the probed step time
        prices its prompt passes (:func:`workload_speedup`), else its drafting steps only."""
        c, _ = self.draft_cost(level)
        mal, k, curve, t = (
            counters["mean_acceptance_length"],
            counters["mean_draft_length"],
            self.curve(level),
            self._step_ms(level),
        )
        if curve is not None and t and prefill_ms is not None and counters["drafts"]:
            model = workload_speedup(
                counters["tokens"], counters["requests"], counters["drafts"], counters["accepted"], k, c, curve,
                batch=self.batch(level), prefill_steps=prefill_ms / t,
                draft_prefill=0.0 if self.method in (Method.NGRAM.value, Method.SUFFIX.value) else c,
            )  # fmt: skip
        else:
            model = speedup_from_length(max(mal, 1.0), k, c, curve)
        return {"model_speedup": model, "model_batch": self.batch(level), "model_draft_cost": c}


def _prefill_ms(cells: list[dict], set_name: str) -> float | None:
    """A prompt pass of ``set_name`` without speculation: the median time to first token at its lowest
    concurrency (where no request waits for another's)."""
    base = [x for x in _of_mode(cells, BASE) if x["set"] == set_name and x.get("ttft_ms")]
    if not base:
        return None
    low = min(x["concurrency"] for x in base)
    return median([x["ttft_ms"]["median"] for x in base if x["concurrency"] == low])


def _speedup_row(cells: list[dict], set_name: str, level: int, model: _Model, prefill_ms: float | None = None) -> dict:
    """One (set, level): medians over rounds on each side, and their ratio; beside them the model's prediction
    from the measured mean acceptance and draft lengths, with the probed verification cost when there is one."""

    sp, bs = _of_mode(cells, SPEC), _of_mode(cells, BASE)
    spec_tps = median([x["tokens_per_s"] for x in sp])
    base_tps = median([x["tokens_per_s"] for x in bs])
    drafting = _drafting(cells)
    mal, draft_len = drafting["mean_acceptance_length"], drafting["mean_draft_length"]
    predicted = {"model_speedup": None}
    if mal is not None and draft_len is not None:
        counters = {**drafting, **_counted(sp)}
        predicted = model.predict(counters, level, prefill_ms)
    row = {
        "set": set_name,
        "concurrency": level,
        "spec_tokens_per_s": spec_tps,
        "base_tokens_per_s": base_tps,
        "speedup": _ratio(spec_tps, base_tps),
        **drafting,
        **predicted,
    }
    for name in ("ttft", "itl", "tpot"):
        row[f"spec_{name}_ms"] = median([x[f"{name}_ms"]["median"] for x in sp])
        row[f"base_{name}_ms"] = median([x[f"{name}_ms"]["median"] for x in bs])
    row["errors"] = sum(x["errors"] for x in sp + bs)
    return row


def _aggregate(selected: list[dict]) -> dict:
    """Tokens/s on each side over all ``selected`` cells (tokens and wall time added first), and drafting."""
    tps = {}
    for mode in (SPEC, BASE):
        mine = _of_mode(selected, mode)
        tokens = sum(x["output_tokens"] for x in mine)
        wall = sum(x["wall_s"] for x in mine)
        tps[mode] = tokens / wall if wall > 0 else None
    drafting = _drafting(selected)
    return {
        "spec_tokens_per_s": tps[SPEC],
        "base_tokens_per_s": tps[BASE],
        "acceptance": drafting["acceptance"],
        "mean_acceptance_length": drafting["mean_acceptance_length"],
        "mean_draft_length": drafting["mean_draft_length"],
    }


# ---------------------------------------------------------------------------------------------------
# writing


def _f(v, fmt="{:.2f}", none="–"):
    return none if v is None else fmt.format(v)


def markdown(report: dict, plots: list[str] | None = None) -> str:
    """The summary a person reads: settings, per-set tables, per-level totals, plots."""
    lines = _md_header(report) + _md_overall(report) + _md_by_set(report) + _md_details(report) + _md_flags(report)
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(x).stem}]({Path(x).name})" for x in plots] + [""]
    return "\n".join(lines)


def _md_header(report: dict) -> list[str]:
    """The title and what was measured: profile, engine, machine, workload, and what speedup means."""
    p, e, m, s = report["profile"], report["engine"], report["machine"], report["settings"]
    return [
        f"# specops bench: {p['name']}",
        "",
        f"- profile `{p['path']}`: {p['backend']} {e['version']}, model `{p['model']}`, "
        f"method **{p['method']}**{_md_drafts(report)} vs no speculation",
        f"- machine: {m['cpu'] or 'unknown CPU'}, {m['cores']} cores"
        + (f", {m['memory_gib']} GiB" if m.get("memory_gib") else "")
        + f"; {m['platform']}",
        f"- prompt sets {', '.join(s['prompt_sets'])}; concurrency {', '.join(map(str, s['concurrency']))}; "
        + _md_per_cell(s)
        + f"; {s['rounds']} round(s), "
        + ("both engines up at once, cells alternating" if s.get("interleave") else "launches alternating")
        + "; medians over rounds",
        f"- speedup = tokens/s with speculation ÷ tokens/s without, same engine and model, one run; "
        f"model speedup = measured mean acceptance length / (k·c + c_verify(k+1)), k the measured mean draft "
        f"length, c the draft's cost, {report.get('model_basis') or cost_basis(None)}",
        "",
    ]


def _md_drafts(report: dict) -> str:
    """How long the drafts are as the engine runs them (what its backend says, never a k it ignores), and
    the mean it drafted (Δdrafted / Δdrafts) where the engine counts drafts."""
    length, measured = report["profile"].get("draft_length"), report["overall"].get("mean_draft_length")
    if not length:
        return f" (k={report['profile'].get('k')})"
    return f", drafts {length['text']}" + (f", measured mean {measured:.1f} tokens per draft," if measured else "")


def _md_per_cell(s: dict) -> str:
    """How much traffic each cell got: requests, seconds, or the default request count."""
    if s["requests_per_cell"]:
        return f"{s['requests_per_cell']} requests per cell"
    if s["duration_per_cell"]:
        return f"{s['duration_per_cell']:g}s per cell"
    return "max(8, 2×concurrency) requests per cell"


def _md_overall(report: dict) -> list[str]:
    """The lines to read first: the overall speedup (the median of the cells'; none after one round, and
    why), tokens/s on and off, acceptance, failures, and how many cells are flagged."""
    o = report["overall"]
    totals = (
        f"{_f(o['spec_tokens_per_s'], '{:.1f}')} vs {_f(o['base_tokens_per_s'], '{:.1f}')} output tokens/s "
        f"over all cells, acceptance {_f(o['acceptance'], '{:.3f}')}, "
        f"mean acceptance length {_f(o['mean_acceptance_length'])}"
    )
    if o.get("no_headline") or o["speedup"] is None:
        lines = [f"No overall speedup: {o.get('no_headline') or 'no cell has one'}. ({totals})"]
    else:
        lo, hi = o["speedup_range"]
        basis = f"the median of {o['speedup_cells']} cells' speedups ({lo:.2f}x to {hi:.2f}x)"
        basis = basis if o["speedup_cells"] > 1 else "the speedup of the one cell"
        lines = [f"**Overall: {_f(o['speedup'])}x**, {basis}; {totals}"]
    lines[0] += f"; **{report['errors']} failed requests**" if report["errors"] else ""
    flagged = report.get("flagged_cells")
    if flagged:
        kinds = sorted({f["kind"] for r in report["speedup"] for f in r.get("flags", [])})
        lines += ["", f"**{flagged} of {len(report['speedup'])} cells flagged** ({', '.join(kinds)}): see Flags"]
    return lines + [""]


def _md_by_set(report: dict) -> list[str]:
    """Speedup per prompt set (rows) and concurrency (columns), with a row for all sets together."""
    levels, o = report["settings"]["concurrency"], report["overall"]
    lines = [
        "## Speedup by prompt set and concurrency",
        "",
        "| set | " + " | ".join(f"c={c}" for c in levels) + " | acceptance | mean acc. length |",
        "|---|" + "---|" * len(levels) + "---|---|",
    ]
    flagged = {(r["set"], r["concurrency"]) for r in report["speedup"] if r.get("flags")}
    for bs in report["by_set"]:
        vals = [bs["speedup_by_concurrency"].get(str(c)) for c in levels]
        marks = [" ⚠" if (bs["set"], c) in flagged else "" for c in levels]
        lines.append(
            f"| {bs['set']} | "
            + " | ".join(_f(v, "{:.2f}x") + mark for v, mark in zip(vals, marks))
            + f" | {_f(bs['acceptance'], '{:.3f}')} | {_f(bs['mean_acceptance_length'])} |"
        )
    lines.append(
        "| **all** | "
        + " | ".join(_f(r["speedup"], "**{:.2f}x**") for r in report["by_concurrency"])
        + f" | {_f(o['acceptance'], '{:.3f}')} | {_f(o['mean_acceptance_length'])} |"
    )
    return lines


def _md_details(report: dict) -> list[str]:
    """Every (set, concurrency) cell: tokens/s off and on, speedup, the model's, acceptance, latencies."""
    lines = [
        "",
        "## Details",
        "",
        "| set | c | tok/s off | tok/s on | speedup | model | acceptance | acc. length | drafted per draft "
        "| TTFT ms off/on | TPOT ms off/on | ITL ms off/on | errors | flags |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["speedup"]:
        lines.append(
            f"| {r['set']} | {r['concurrency']} | {_f(r['base_tokens_per_s'], '{:.1f}')} | "
            f"{_f(r['spec_tokens_per_s'], '{:.1f}')} | {_f(r['speedup'], '{:.2f}x')} | "
            f"{_f(r['model_speedup'], '{:.2f}x')} | {_f(r['acceptance'], '{:.3f}')} | "
            f"{_f(r['mean_acceptance_length'])} | {_f(r.get('mean_draft_length'), '{:.1f}')} | "
            f"{_f(r['base_ttft_ms'], '{:.1f}')}/{_f(r['spec_ttft_ms'], '{:.1f}')} | "
            f"{_f(r['base_tpot_ms'], '{:.2f}')}/{_f(r['spec_tpot_ms'], '{:.2f}')} | "
            f"{_f(r['base_itl_ms'], '{:.2f}')}/{_f(r['spec_itl_ms'], '{:.2f}')} | {r['errors']} | "
            f"{', '.join(dict.fromkeys(f['kind'] for f in r.get('flags', []))) or '–'} |"
        )
    return lines + [
        "",
        "ITL is per streamed chunk (speculation delivers accepted tokens in bursts); TPOT is "
        "(latency − TTFT) / (tokens − 1).",
        "",
    ]


def _md_flags(report: dict) -> list[str]:
    """Every flag of every cell, with the thresholds it was judged by (none: nothing to say)."""
    rows = [r for r in report["speedup"] if r.get("flags")]
    if not rows:
        return []
    t = FlagThresholds.from_dict(report["settings"].get("flag_thresholds"))
    lines = [
        "## Flags",
        "",
        f"A flagged cell's speedup may measure something besides the engine: busy = other processes kept more "
        f"than {t.busy_cores:g} cores busy (--busy-cores); stalled = a streamed request got no token for "
        f"{t.stall_s:g}s (--stall-after); rounds-disagree = one side's rounds differ by more than "
        f"{t.max_spread:g}x (--max-spread); one-wave = each client sent one request and their speeds differ by "
        f"more than {t.max_spread:g}x, so the wall is the slowest request's.",
        "",
    ]
    for r in rows:
        for f in r["flags"]:
            side = "with speculation" if f["mode"] == SPEC else "without speculation"
            rounds = "every round" if f["round"] is None else f"round {f['round']}"
            lines.append(f"- {r['set']} c={r['concurrency']}, {side}, {rounds}: {f['kind']}: {f['text']}")
    return lines + [""]


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
            report.setdefault("notes", []).append(
                "plots skipped: matplotlib is not installed (pip install 'specops[plots]')"
            )
    for png in pngs:
        written[png.stem] = png
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    written["json"] = out / "results.json"
    (out / "summary.md").write_text(markdown(report, [str(p) for p in pngs]), encoding="utf-8")
    written["markdown"] = out / "summary.md"
    return written
