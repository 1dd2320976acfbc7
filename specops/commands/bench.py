"""``specops bench``: speculation on vs off on the profile's engine, per prompt set and concurrency."""

from __future__ import annotations

import sys
import time

import click

from specops.commands._common import duration_param, echo_json, json_option, load, profile_argument, version_param
from specops.perf.bench_flags import FlagThresholds


def _levels(ctx, param, value):
    try:
        levels = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers such as 1,2,4,8, got {value!r}") from None
    if not levels or any(x < 1 for x in levels):
        raise click.BadParameter("concurrency levels must be integers >= 1")
    return levels


class _Bar:
    """click's progress bar on stderr, one per engine launch."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = None
        self.label = None

    def start(self, label, total):
        self.label = None
        if self.quiet:
            return
        if not total:  # duration-bound cells: no known length, a line per cell instead
            click.echo(label, err=True)
            return
        self.bar = click.progressbar(
            length=total, label=label, file=sys.stderr, show_pos=True, show_eta=False, width=28
        )
        self.bar.__enter__()

    def advance(self, label):
        if self.bar is not None:
            self.bar.label = label
            self.bar.update(1)
        elif not self.quiet and label != self.label:
            click.echo(f"  {label}", err=True)
        self.label = label

    def finish(self):
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


BENCH_HELP = """Measure PROFILE's engine with speculation and without, side by side.

Launches the engine as the profile says and again with method none (same engine, same model), in
one run, alternating, and sends every prompt set at every concurrency level to each. Reports output
tokens/s, TTFT, inter-token latency, acceptance and mean acceptance length, and the speedup
(tokens/s ratio) per level and per prompt set: results.json, summary.md and PNG plots.

The overall speedup is the median of the cells' speedups, printed from two rounds on. A cell is
flagged when other processes kept the cores busy (--busy-cores), a request stalled (--stall-after),
its rounds disagree (--max-spread), or each client sent one request at speeds that differ by more than
--max-spread (one wave: the slowest request sets the wall; send -n of twice the concurrency or more).

\b
The built-in sets exercise where speculation helps and where it hurts:
  code       code completion (greedy)          summarize  output copies the input (greedy)
  chat       open questions (temperature 0.7)  creative   high temperature (1.3)
  extraction edits, quotes and copies of the input (greedy): where prompt-lookup (n-gram) drafts pay

\b
Examples:
  specops bench examples/llamacpp-cpu-draft.yaml -c 1,2,4 -n 8
  specops bench profiles/llama31-8b-eagle3.yaml -p code,my-traffic.jsonl --rounds 3
"""


@click.command(help=BENCH_HELP)
@profile_argument
@click.option(
    "-p",
    "--prompts",
    "prompt_sets",
    default="code,summarize,chat,creative,extraction",
    show_default=True,
    help="Comma-separated built-in prompt sets (code, summarize, chat, creative, extraction) and/or JSONL files "
    '(one {"prompt", "max_tokens", "temperature", "set"} per line).',
)
@click.option(
    "-c",
    "--concurrency",
    default="1,2,4,8",
    show_default=True,
    callback=_levels,
    help="Concurrency levels (concurrent client requests).",
)
@click.option(
    "-n", "--requests", type=int, help="Requests per cell (set × level × on/off). Default: max(8, 2 × concurrency)."
)
@click.option(
    "--duration",
    callback=duration_param,
    metavar="DURATION",
    help="Run each cell this long instead of a request count (e.g. 30s).",
)
@click.option("--max-tokens", type=int, help="Override every prompt's max_tokens.")
@click.option(
    "--rounds",
    type=int,
    default=2,
    show_default=True,
    help="Launch both engines this many times, alternating which goes first; medians over rounds. "
    "With 1: per-cell numbers but no overall speedup.",
)
@click.option("--warmup", type=int, default=2, show_default=True, help="Unmeasured requests after each launch.")
@click.option(
    "--step",
    type=int,
    default=0,
    show_default=True,
    help="Chain step to bench against no speculation (0: the profile's method).",
)
@click.option(
    "--interleave",
    is_flag=True,
    help="Run both engines at once and alternate cell by cell (drift "
    "hits both equally; needs memory for two engines: on a GPU lower gpus.memory_utilization).",
)
@click.option("--ignore-eos", is_flag=True, help="Ask the engine to ignore end-of-sequence (fixed output lengths).")
@click.option(
    "--draft-cost",
    type=float,
    help="c for the model speedup column (default: the profile's fallback.draft_cost_ratio, else the probed one: "
    "0 for prompt lookup, a draft model's step over the target's; else 0.05).",
)
@click.option(
    "--busy-cores",
    type=float,
    default=FlagThresholds.busy_cores,
    show_default=True,
    help="Flag a cell when processes other than the bench and its engines kept more than this many cores "
    "busy during it (from /proc/stat and /proc/PID/stat).",
)
@click.option(
    "--max-spread",
    type=float,
    default=FlagThresholds.max_spread,
    show_default=True,
    help="Flag a cell whose rounds differ by more than this factor (max/min of tokens/s or of median TPOT), "
    "or one wave of requests whose TPOTs do (p90/median).",
)
@click.option(
    "--stall-after",
    callback=duration_param,
    metavar="DURATION",
    default=f"{FlagThresholds.stall_s:g}s",
    show_default=True,
    help="Flag a cell when a streamed request got no token for this long after its first.",
)
@click.option("--backend-version", metavar="VERSION", callback=version_param, help="Expect this engine version.")
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Where results.json, summary.md and the plots go (default: ./specops-bench/<name>-<time>).",
)
@click.option(
    "--probe-verify",
    is_flag=True,
    help="Only probe the verification cost: time the target's decode step, its speculative steps with "
    "prompt-lookup drafts of fixed sizes (short launches, at one request and at server.parallel) and a draft "
    "model's own step; store the curve for advise/init/tune/bench, print it (no bench).",
)
@click.option(
    "--no-probe",
    is_flag=True,
    help="Never probe the verification cost during the bench: the model column uses a stored curve as it is, "
    "without one it assumes verifying k+1 tokens costs one step, and says so (the probe adds a few launches).",
)
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output on stderr.")
@json_option
def bench(
    profile,
    prompt_sets,
    concurrency,
    requests,
    duration,
    max_tokens,
    rounds,
    warmup,
    step,
    interleave,
    ignore_eos,
    draft_cost,
    busy_cores,
    max_spread,
    stall_after,
    backend_version,
    out_dir,
    probe_verify,
    no_probe,
    no_plots,
    quiet,
    as_json,
):
    from specops.perf.bench import BenchConfig, run_bench_blocking
    from specops.perf.bench_report import write_outputs
    from specops.perf.plots import plots_missing
    from specops.plugins import get_registry

    loaded = load(profile)
    if probe_verify:
        _probe_verify(loaded, backend_version, quiet, as_json)
        return
    name = loaded.profile.name
    no_plots_why = None if no_plots else plots_missing()
    if no_plots_why:  # before the run, which takes minutes: the user may want to install it first
        click.echo(f"warning: {no_plots_why}", err=True)
    out = out_dir or f"specops-bench/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    from pathlib import Path

    cfg = BenchConfig(
        prompt_sets=[x for x in prompt_sets.split(",") if x.strip()],
        concurrency=concurrency,
        requests=requests,
        duration=duration,
        max_tokens=max_tokens,
        rounds=rounds,
        warmup=warmup,
        step_index=step,
        interleave=interleave,
        probe=not no_probe,
        ignore_eos=ignore_eos,
        draft_cost=draft_cost,
        backend_version=backend_version,
        log_dir=Path(out),
        flags=FlagThresholds(busy_cores=busy_cores, max_spread=max_spread, stall_s=stall_after),
    )
    say = (lambda m: None) if quiet else (lambda m: click.echo(f"specops: {m}", err=True))
    report = run_bench_blocking(loaded, get_registry(), cfg, say=say, progress=_Bar(quiet))
    written = write_outputs(report, out, plots=not no_plots)
    report["files"] = {k: str(v) for k, v in written.items()}
    if as_json:
        echo_json(report)
        return
    _echo_summary(report, written, no_plots_why)


def _probe_verify(loaded, backend_version: str | None, quiet: bool, as_json: bool) -> None:
    """``--probe-verify``: the verification-cost curve of the profile's engine and model on this machine."""
    from specops.perf.verifycost import format_curve
    from specops.perf.verifyprobe import probe_launched
    from specops.plugins import get_registry

    say = (lambda m: None) if quiet else (lambda m: click.echo(f"specops: {m}", err=True))
    record, path = probe_launched(loaded, get_registry(), backend_version, say=say)
    if as_json:
        echo_json({**record, "file": str(path)})
        return
    click.echo(format_curve(record), nl=False)
    click.echo(f"wrote {path}")


def _echo_summary(report: dict, written: dict, no_plots_why: str | None = None) -> None:
    """summary.md as written, the files, and warnings on stderr when requests failed or plots are missing."""
    from pathlib import Path

    click.echo(Path(written["markdown"]).read_text(encoding="utf-8"), nl=False)
    click.echo("")
    for path in written.values():
        click.echo(f"wrote {path}")
    if report["errors"]:
        click.echo(f"warning: {report['errors']} requests failed; see results.json (first_error per cell)", err=True)
    if report["flagged_cells"]:
        click.echo(
            f"warning: {report['flagged_cells']} of {len(report['speedup'])} cells flagged (busy machine, stalled "
            "request or disagreeing rounds): see Flags in summary.md",
            err=True,
        )
    if report["overall"]["no_headline"]:
        click.echo(f"note: no overall speedup: {report['overall']['no_headline']}", err=True)
    if no_plots_why:
        click.echo(f"warning: {no_plots_why}", err=True)
