"""``specops tune``: sweep the speculative settings on the real engine and write the best into the profile."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import click

from specops.commands._common import duration_param, echo_json, json_option, load, profile_argument, version_param


def _parsed_by(parse):
    """A click callback: ``parse(value)``, its SpecopsError shown as a bad parameter (None stays None)."""

    def callback(ctx, param, value):
        if value is None:
            return None
        from specops.errors import SpecopsError

        try:
            return parse(value)
        except SpecopsError as exc:
            raise click.BadParameter(str(exc)) from None

    return callback


def _parse_ks(value):
    from specops.perf.tune import parse_ints

    return parse_ints(value, "--k")


def _parse_pairs(value):
    from specops.perf.tune import parse_pairs

    return parse_pairs(value)


class _Progress:
    """A progress bar on stderr against the time budget, redrawn in place on a terminal (one line per
    round elsewhere, so CI logs stay readable)."""

    WIDTH = 24

    def __init__(self, budget_s: float, quiet: bool):
        self.budget = budget_s
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.what = ""
        self.drawn = False

    def __call__(self, kind: str, **kw) -> None:
        if self.quiet:
            return
        if kind == "setting":
            self.what = f"{kw['index'] + 1}/{kw['total']} {kw['setting'].label}: starting"
            self._draw()
        elif kind == "ready":
            self.what = self.what.split(":")[0] + f": ready in {kw['seconds']:.1f}s, warming up"
            self._draw()
        elif kind == "round":
            self.what = (
                self.what.split(":")[0] + f": c={kw['level']} round {kw['round']}/{kw['rounds']} "
                f"{kw['tokens_per_s']:.1f} tok/s"
            )
            self._draw()
        elif kind in ("done", "skipped"):
            r = kw["result"]
            med = r.median(next(iter(r.levels), 0)) if r.levels else None
            msg = (
                f"{r.setting.label}: {r.status}"
                + (f" ({med:.1f} tok/s)" if med else "")
                + (f" - {r.reason}" if r.reason and r.status != "measured" else "")
            )
            self._line(msg)

    def _bar(self) -> str:
        el = time.monotonic() - self.t0
        frac = min(1.0, el / self.budget) if self.budget else 1.0
        n = int(frac * self.WIDTH)
        mmss = lambda s: f"{int(s) // 60}:{int(s) % 60:02d}"  # noqa: E731
        return f"[{'#' * n}{'.' * (self.WIDTH - n)}] {mmss(el)}/{mmss(self.budget)}"

    def _draw(self) -> None:
        text = f"{self._bar()}  {self.what}"
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + text[:160])
            self.drawn = True
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def _line(self, msg: str) -> None:
        if self.tty and self.drawn:
            sys.stderr.write("\r\x1b[2K")
        sys.stderr.write(f"specops: {msg}\n")
        sys.stderr.flush()
        self.drawn = False

    def close(self) -> None:
        if self.tty and self.drawn and not self.quiet:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


TUNE_HELP = """Find the best speculative settings for PROFILE on its real engine, and write them back.

Sweeps what matters for the profile's method (k; vLLM n-gram min/max; llama.cpp n-gram type; with
--methods also the method), one engine start per setting, at the concurrency the profile serves
(server.parallel) and at 1. Each setting is warmed up and measured in rounds (output tokens/s,
acceptance, mean acceptance length); a setting clearly worse than the best so far stops early; all
within --budget. Prints a table, writes a PNG (tokens/s against k), then writes the best setting into
PROFILE (comments and key order kept; the overlay when it `extends` a base) with a dated comment, and
every number into <profile>.tune.json (or into the lock file when a fresh one exists).

\b
Examples:
  specops tune examples/llamacpp-cpu-draft.yaml --k 1,2,4 --budget 2m
  specops tune profiles/gitops/prod/llama31-8b-chat.yaml -w code,traffic.jsonl --dry-run
  specops tune profile.yaml --methods draft_model,ngram,none --budget 30m
"""


@click.command(help=TUNE_HELP)
@profile_argument
@click.option(
    "-w",
    "--workload",
    metavar="SETS",
    help="Built-in prompt sets (code, summarize, chat, creative, extraction) "
    "and/or JSONL files, comma-separated. Default: all four built-in sets.",
)
@click.option(
    "--budget",
    default="10m",
    show_default=True,
    callback=duration_param,
    metavar="DURATION",
    help="Time for the whole sweep, engine starts included (e.g. 90s, 10m, 1h).",
)
@click.option(
    "-k",
    "--k",
    "k_values",
    callback=_parsed_by(_parse_ks),
    metavar="LIST",
    help="Draft tokens per step to try, e.g. 1,2,4 or 1-6. Default: 1,2,3,4,6,8 and the profile's k.",
)
@click.option(
    "--methods",
    metavar="LIST",
    help="Also sweep other methods: `chain` (the fallback chain), "
    "`fitting` (what the resolver finds fitting, plus ngram and none), or names such as "
    "draft_model,ngram,none. Default: the profile's method only.",
)
@click.option(
    "--ngram",
    "ngram_pairs",
    callback=_parsed_by(_parse_pairs),
    metavar="PAIRS",
    help="vLLM n-gram prompt_lookup min:max pairs to try, e.g. 1:3,2:5 (default: the profile's).",
)
@click.option(
    "--ngram-types", metavar="LIST", help="llama.cpp n-gram drafters to try (default: every type the build knows)."
)
@click.option(
    "-c",
    "--concurrency",
    metavar="LIST",
    help="Concurrency levels; the first decides. Default: server.parallel (what the profile serves), then 1.",
)
@click.option(
    "--rounds",
    "max_rounds",
    type=click.IntRange(1),
    default=7,
    show_default=True,
    help="Most measured rounds per setting and concurrency (fewer when the budget is short).",
)
@click.option(
    "--min-rounds",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Rounds before a setting counts (and may be stopped early as clearly worse).",
)
@click.option(
    "--margin",
    type=click.FloatRange(0, 0.9),
    default=0.05,
    show_default=True,
    help="Clearly worse: even the best round is this fraction below the best median so far.",
)
@click.option("-n", "--requests", type=click.IntRange(1), help="Requests per round (default: max(4, 2 × concurrency)).")
@click.option("--max-tokens", type=click.IntRange(1), help="Cap every prompt's max_tokens (shorter rounds).")
@click.option("--ignore-eos", is_flag=True, help="Ask the engine to ignore end-of-sequence (fixed output lengths).")
@click.option("--dry-run", is_flag=True, help="Measure, then print the change as a diff; write nothing.")
@click.option(
    "--per-batch-size",
    "apply_per_batch",
    is_flag=True,
    help="Also write speculative.per_batch_size (vLLM): per batch size the k with the most measured tokens/s, "
    "0 where no speculation is faster.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Where the PNG goes (default: <profile>.tune.png beside the profile; with --dry-run only when given).",
)
@click.option("--no-plot", is_flag=True, help="No PNG.")
@click.option("--backend-version", metavar="VERSION", callback=version_param, help="Expect this engine version.")
@click.option("--offline", is_flag=True, help="Resolve drafts without the Hub (lock, HF cache, catalog).")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
def tune(profile, dry_run, apply_per_batch, plot_path, no_plot, quiet, as_json, **sweep):
    """The options in ``sweep`` go into TuneConfig; the rest decide what is written and shown."""
    from specops.errors import SpecopsError
    from specops.perf.tune import prepare, write_back
    from specops.plugins import get_registry

    registry = get_registry()
    loaded = load(profile)
    say = (lambda m: None) if quiet else (lambda m: click.echo(f"specops: {m}", err=True))
    cfg = _tune_config(**sweep)
    plan = prepare(loaded, registry, cfg)
    _announce(plan, cfg.budget_s, say)
    result = _sweep(loaded, registry, plan, cfg, quiet)

    p = plan.resolved
    per_batch = result.per_batch_size(p.backend, plan.engine.version, p.server.parallel)
    outcome = write_back(
        loaded,
        p,
        result,
        registry,
        engine=plan.engine,
        workload=plan.workload,
        dry_run=dry_run,
        per_batch=per_batch,
        apply_per_batch=apply_per_batch,
    )
    png = None
    if not no_plot and (plot_path or not dry_run):
        png = _plot(result, plan, Path(plot_path) if plot_path else None, profile, say)

    if as_json:
        echo_json(_json_report(outcome, png))
        return
    _echo_best(result, plan)
    if per_batch:
        click.echo(
            f"proposal: speculative.per_batch_size: {per_batch['value']}  ({per_batch['why']})"
            + ("" if apply_per_batch else "; write it with --per-batch-size")
        )
    _echo_written(outcome, dry_run, png)
    if not result.eligible():
        raise SpecopsError("no setting measured")


def _tune_config(
    workload,
    budget,
    k_values,
    methods,
    ngram_pairs,
    ngram_types,
    concurrency,
    max_rounds,
    min_rounds,
    margin,
    requests,
    max_tokens,
    ignore_eos,
    backend_version,
    offline,
):
    """The sweep's options as a TuneConfig (--ngram-types split, --rounds at least --min-rounds)."""
    from specops.perf.tune import TuneConfig

    return TuneConfig(
        workload=workload,
        max_tokens=max_tokens,
        budget_s=budget,
        k_values=k_values,
        methods=methods,
        ngram_pairs=ngram_pairs,
        ngram_types=[x.strip() for x in ngram_types.split(",") if x.strip()] if ngram_types else None,
        concurrency=concurrency,
        min_rounds=min_rounds,
        max_rounds=max(max_rounds, min_rounds),
        margin=margin,
        requests_per_round=requests,
        backend_version=backend_version,
        offline=offline,
        ignore_eos=ignore_eos,
    )


def _json_report(outcome, png: Path | None) -> dict:
    """What --json prints: where things went, what changed, and the whole record."""
    return {
        "profile": str(outcome.profile_path),
        "record_file": str(outcome.record_path),
        "written": outcome.written,
        "changes": outcome.changes,
        "notes": outcome.notes,
        "plot": str(png) if png else None,
        "profile_diff": outcome.profile_diff,
        "record": outcome.record,
    }


def _announce(plan, budget: float, say) -> None:
    """What the sweep will try, before it starts: notes, settings, concurrency, workload, budget."""
    for note in plan.notes:
        say(note)
    p = plan.resolved
    say(
        f"{p.name}: {p.backend} {plan.engine.version}; {len(plan.settings)} settings "
        f"({', '.join(s.label for s in plan.settings)}) at concurrency {', '.join(map(str, plan.levels))}; "
        f"workload {', '.join(plan.workload['sets'])}; budget {click.style(_fmt(budget), bold=True)}"
    )


def _sweep(loaded, registry, plan, cfg, quiet: bool):
    """Run the sweep with the progress bar; the engine's output goes to <state_dir>/tune/<name>.engine.log."""
    from specops.paths import state_dir
    from specops.perf.tune import run_sweep

    p = plan.resolved
    progress = _Progress(cfg.budget_s, quiet)
    log_path = state_dir(p.supervisor.state_dir) / "tune" / f"{p.name}.engine.log"
    try:
        return asyncio.run(run_sweep(loaded, registry, plan, cfg, on_event=progress, log_path=log_path))
    finally:
        progress.close()


def _plot(result, plan, plot_path: Path | None, profile: str, say) -> Path | None:
    """The PNG of tokens/s against the settings (None, said, without matplotlib)."""
    from specops.perf.tune import plot as draw
    from specops.perf.tune import tune_plot_path

    p = plan.resolved
    target = plot_path or tune_plot_path(profile)
    png = draw(
        result,
        target,
        title=f"{p.name}: {p.backend} {plan.engine.version.split(' ')[0]}, "
        f"concurrency {', '.join(map(str, plan.levels))}",
    )
    if png is None:
        say("no plot: matplotlib is not installed (pip install 'specops[plots]')")
    return png


def _echo_best(result, plan) -> None:
    """The table, the best setting at each concurrency, and a hint when the grid may be too narrow."""
    from specops.perf.tune import format_table

    click.echo(format_table(result))
    w = result.winner
    click.echo("")
    click.echo(f"best at concurrency {result.primary}: {w.setting.label} ({w.median(result.primary):.1f} tok/s)")
    for c in result.levels[1:]:
        b = result.best_at(c)
        if b is not None:
            click.echo(f"best at concurrency {c}: {b.setting.label} ({b.median(c):.1f} tok/s)")
    edge = _grid_edge(result, plan.settings)
    if edge:
        click.echo(f"note: {edge}")


def _echo_written(outcome, dry_run: bool, png: Path | None) -> None:
    """What was written (or, with --dry-run, would be): the profile change, the record, the plot."""
    for note in outcome.notes:
        click.echo(f"note: {note}")
    if dry_run:
        click.echo("")
        click.echo("dry run: nothing written. The change would be:")
        click.echo(outcome.profile_diff or f"(no change to {outcome.profile_path.name})", nl=not outcome.profile_diff)
        click.echo(f"and the record would go to {outcome.record_path}")
    else:
        if outcome.changes:
            click.echo(f"wrote {outcome.profile_path}: {'; '.join(outcome.changes)}")
        click.echo(f"wrote {outcome.record_path}")
    if png:
        click.echo(f"wrote {png}")


def _grid_edge(result, settings) -> str | None:
    """A hint when the best k is the largest one tried: the curve may still be rising past it."""
    w = result.winner
    if w is None or w.setting.k is None:
        return None
    ks = sorted({s.k for s in settings if s.method is w.setting.method and s.k is not None})
    if len(ks) > 1 and w.setting.k == ks[-1]:
        k = ks[-1]
        more = ",".join(str(x) for x in (k, k + max(1, k // 4), k + max(2, k // 2), 2 * k))
        return f"the best k is the largest tried ({k}); a larger k may be faster still: try --k {more}"
    return None


def _fmt(seconds: float) -> str:
    from specops.config.durations import format_duration

    return format_duration(seconds)
