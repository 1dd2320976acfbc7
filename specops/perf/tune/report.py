"""How ``specops tune`` shows what it measured: the table, the plot (tokens/s against k), the profile comment."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from specops.perf.tune.results import TuneResult
from specops.perf.tune.settings import Setting


def format_table(result: TuneResult) -> str:
    """The final table: one row per setting, tokens/s median (rounds) per concurrency, acceptance, status."""
    ref = result.reference()
    head = ["", "setting"] + [f"c={c} tok/s" for c in result.levels] + ["accept", "mean len"]
    if ref:
        head.append(f"vs {ref[0]}")
    head.append("status")
    order = sorted(result.results, key=lambda r: (r.median(result.primary) is None, -(r.median(result.primary) or 0)))
    rows = [_row(result, r, ref) for r in order]
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head) - 1)]
    lines = []
    for row in [head] + rows:
        lines.append(
            "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            + "  "
            + str(row[-1])
        )
    lines.insert(1, "-" * len(lines[0]))
    lines.append(
        f"(tokens/s: median of rounds (number of rounds); * chosen: best median at concurrency {result.primary})"
    )
    return "\n".join(x.rstrip() for x in lines)


def _row(result: TuneResult, r, ref: tuple[str, float] | None) -> list[str]:
    """The table cells of one setting's result ``r``."""
    win = result.winner
    mark = "*" if win is not None and r is win else ""
    label = r.setting.label + (" (now)" if r.setting == result.current else "")
    cells = [mark, label]
    for c in result.levels:
        m = r.median(c)
        cells.append(f"{m:.1f} ({r.rounds(c)})" if m is not None else "-")
    lr = r.levels.get(result.primary)
    cells.append(f"{lr.acceptance:.2f}" if lr and lr.acceptance is not None else "-")
    cells.append(f"{lr.mean_acceptance_length:.2f}" if lr and lr.mean_acceptance_length is not None else "-")
    if ref:
        m = r.median(result.primary)
        cells.append(f"{m / ref[1]:.2f}x" if m is not None else "-")
    cells.append(r.status + (f": {r.reason}" if r.reason and r.status != "measured" else ""))
    return cells


def plot(result: TuneResult, path: str | Path, title: str = "") -> Path | None:
    """A PNG of tokens/s against k per method and concurrency; settings without k as dashed lines.

    Returns None when matplotlib is not installed (``pip install specops[plots]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    series, flat = _plot_data(result)
    _draw(ax, result, series, flat, plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"]))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(title or "specops tune", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_data(result: TuneResult) -> tuple[dict[tuple, list[tuple[int, float]]], list[tuple[str, int, float]]]:
    """Points per (method name, concurrency) for settings with k, and (label, concurrency, median) for the rest."""
    series: dict[tuple, list[tuple[int, float]]] = {}
    flat: list[tuple[str, int, float]] = []
    for r in result.results:
        for c in result.levels:
            m = r.median(c)
            if m is None or r.rounds(c) < result.min_rounds:
                continue
            s = r.setting
            if s.k is None:
                flat.append((s.label, c, m))
            else:
                name = s.method.value + (f" n={s.ngram_min}..{s.ngram_max}" if s.ngram_min is not None else "")
                series.setdefault((name, c), []).append((s.k, m))
    return series, flat


def _draw(ax, result: TuneResult, series, flat, colors) -> None:
    """The lines (one colour per method, one style per concurrency), the flat ones, and the winner's star."""
    styles = ["-o", "--s", ":^", "-.d"]
    names = sorted({name for name, _ in series})
    for (name, c), pts in sorted(series.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            styles[result.levels.index(c) % len(styles)],
            color=colors[names.index(name) % len(colors)],
            label=f"{name} (c={c})",
        )
    for label, c, m in flat:
        ax.axhline(m, linestyle="--", linewidth=1, color="grey" if label == "none" else None, label=f"{label} (c={c})")
    w = result.winner
    if w is not None and w.setting.k is not None:
        ax.plot(
            [w.setting.k],
            [w.median(result.primary)],
            "*",
            markersize=16,
            color="gold",
            markeredgecolor="black",
            label="chosen",
            zorder=5,
        )


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def comment_line(result: TuneResult, date: str, record_name: str) -> str:
    """The one-line comment written above the changed setting: what won, by how much, where the record is."""
    w = result.winner
    assert w is not None
    c = result.primary
    others = [r for r in result.eligible() if r is not w][:3]

    def short(s: Setting) -> str:  # "k=4" beside a winner of the same method
        return s.label.split(" ", 1)[1] if (s.method is w.setting.method and s.k is not None) else s.label

    lr = w.levels.get(c)
    acc = ""
    if lr and lr.acceptance is not None:
        acc = f", acceptance {lr.acceptance:.2f}"
        if lr.mean_acceptance_length is not None:
            acc += f", mean length {lr.mean_acceptance_length:.2f}"
    vs = ", ".join(f"{short(r.setting)} {r.median(c):.1f}" for r in others)
    return (
        f"specops tune {date}: {w.setting.label} best at concurrency {c}, {w.median(c):.1f} tok/s median"
        + (f" (vs {vs})" if vs else "")
        + f"{acc}; record {record_name}"
    )
