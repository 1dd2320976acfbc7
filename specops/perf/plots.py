"""The PNG plots of a ``specops bench`` report: speedup vs concurrency per prompt set, acceptance per prompt
set, and tokens/s with and without speculation. Needs matplotlib (``pip install 'specops[plots]'``)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

RED = "#d62728"


@dataclass
class _Look:
    """What every plot of one report shares: the axis values, a colour per prompt set, the subtitle."""

    plt: object
    report: dict
    levels: list[int]
    sets: list[str]
    color: dict[str, str]
    subtitle: str

    def rows(self, set_name: str) -> list[dict]:
        return [r for r in self.report["speedup"] if r["set"] == set_name]


def plots_missing() -> str | None:
    """Why this Python cannot draw the plots (matplotlib does not import), with how to get them; None when it can."""
    try:
        import matplotlib  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install: either way, no plots
        why = "is not installed" if isinstance(exc, ImportError) else f"does not import ({type(exc).__name__})"
        return (
            f"matplotlib {why}, so no PNG plots: `{sys.executable} -m pip install 'specops[plots]'` "
            "(from a checkout: `pip install -e '.[plots]'`), or pass --no-plots"
        )
    return None


def plot(report: dict, out_dir: Path) -> list[Path]:
    """PNG plots: speedup vs concurrency per set, acceptance per set, tokens/s on vs off. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    p, e = report["profile"], report["engine"]
    sets = [b["set"] for b in report["by_set"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    look = _Look(
        plt,
        report,
        report["settings"]["concurrency"],
        sets,
        {s: colors[i % len(colors)] for i, s in enumerate(sets)},
        f"{p['name']} · {p['backend']} {e['version']} · {p['method']} "
        + (f"drafts {p['draft_length']['length']}" if p.get("draft_length") else f"k={p['k']}")
        + " vs none",
    )
    return [
        _save(plt, _speedup_figure(look), out_dir / "speedup.png"),
        _save(plt, _acceptance_figure(look), out_dir / "acceptance.png"),
        _save(plt, _throughput_figure(look), out_dir / "throughput.png"),
    ]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _log2_levels(ax, levels: list[int]) -> None:
    """The concurrency axis: log 2, a tick at every level measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(x) for x in levels])


# ---------------------------------------------------------------------------------------------------
# 1. speedup vs concurrency


def _speedup_figure(look: _Look):
    fig, ax = look.plt.subplots(figsize=(9, 5), dpi=120)
    top = 1.0
    ends = []
    for s in look.sets:
        pts = [(r["concurrency"], r["speedup"]) for r in look.rows(s) if r["speedup"]]
        if not pts:
            continue
        xs, ys = zip(*pts)
        top = max(top, *ys)
        ax.plot(xs, ys, marker="o", lw=2, color=look.color[s], label=s)
        ends.append([ys[-1], ys[-1], xs[-1], look.color[s]])
    ymax = max(1.5, top * 1.15)
    _end_labels(ax, ends, gap=0.045 * ymax)
    levels = look.levels
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.axhspan(0, 1.0, color=RED, alpha=0.06)
    ax.text(levels[0], 0.97, "slower than no speculation", va="top", fontsize=8, color=RED)
    _log2_levels(ax, levels)
    ax.set_xlim(levels[0] / 1.15, levels[-1] * 1.35)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup (tokens/s on ÷ off)")
    ax.set_title(f"Speculative decoding speedup vs concurrency\n{look.subtitle}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(title="prompt set", frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _end_labels(ax, ends: list[list], gap: float) -> None:
    """Each line's last value beside its end; ``ends`` holds [value, y, x, colour]. Labels never overlap."""
    ends.sort(key=lambda e: e[0])
    for i in range(1, len(ends)):
        ends[i][1] = max(ends[i][1], ends[i - 1][1] + gap)
    for value, y, x, col in ends:
        ax.text(x * 1.06, y, f"{value:.2f}x", va="center", fontsize=9, color=col)


# ---------------------------------------------------------------------------------------------------
# 2. acceptance per set (bars per concurrency level), mean acceptance length on top


def _acceptance_figure(look: _Look):
    fig, ax = look.plt.subplots(figsize=(8, 5), dpi=120)
    levels, sets = look.levels, look.sets
    width = 0.8 / max(1, len(levels))
    shades = look.plt.cm.Blues([0.4 + 0.5 * i / max(1, len(levels) - 1) for i in range(len(levels))])
    for j, lv in enumerate(levels):
        _acceptance_bars(ax, look, j, lv, width=width, shade=shades[j])
    thr = look.report["profile"].get("min_acceptance")
    if thr is not None:
        ax.axhline(thr, color=RED, lw=1, ls="--")
        ax.text(
            len(sets) - 0.5, thr + 0.01, f"fallback threshold {thr:g}", ha="right", va="bottom", fontsize=8, color=RED
        )
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("acceptance rate (accepted ÷ drafted)")
    ax.set_title(f"Draft acceptance per prompt set (numbers: mean acceptance length)\n{look.subtitle}", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="concurrency", frameon=False, ncol=min(4, len(levels)), loc="upper right")
    return fig


def _acceptance_bars(ax, look: _Look, j: int, level: int, *, width: float, shade) -> None:
    """One bar per prompt set at concurrency ``level`` (the ``j``-th), labelled with its mean acceptance length."""
    xs, ys, labels = [], [], []
    for i, s in enumerate(look.sets):
        r = next((r for r in look.rows(s) if r["concurrency"] == level), None)
        if r and r["acceptance"] is not None:
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(r["acceptance"])
            labels.append(r["mean_acceptance_length"])
    bars = ax.bar(xs, ys, width=width * 0.95, color=shade, label=f"c={level}")
    for b, mal in zip(bars, labels):
        if mal is not None:
            ax.text(
                b.get_x() + b.get_width() / 2, b.get_height() + 0.01, f"{mal:.1f}", ha="center", va="bottom", fontsize=7
            )


# ---------------------------------------------------------------------------------------------------
# 3. tokens/s on vs off, one panel per set


def _throughput_figure(look: _Look):
    n = len(look.sets)
    cols = min(n, 4)
    rows_n = math.ceil(n / cols)
    fig, axes = look.plt.subplots(rows_n, cols, figsize=(3.2 * cols + 0.8, 3.0 * rows_n + 0.8), dpi=120, squeeze=False)
    for i, s in enumerate(look.sets):
        _throughput_panel(axes[i // cols][i % cols], look, s, first_in_row=i % cols == 0)
    for j in range(n, rows_n * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"Throughput with and without speculation\n{look.subtitle}", fontsize=11)
    return fig


def _throughput_panel(ax, look: _Look, set_name: str, *, first_in_row: bool) -> None:
    rs = look.rows(set_name)
    ax.plot(
        [r["concurrency"] for r in rs],
        [r["base_tokens_per_s"] or 0 for r in rs],
        marker="s",
        color="gray",
        lw=2,
        label="off",
    )
    ax.plot(
        [r["concurrency"] for r in rs],
        [r["spec_tokens_per_s"] or 0 for r in rs],
        marker="o",
        color=look.color[set_name],
        lw=2,
        label="on",
    )
    _log2_levels(ax, look.levels)
    ax.set_ylim(bottom=0)
    ax.set_title(set_name)
    ax.grid(alpha=0.3)
    if first_in_row:
        ax.set_ylabel("output tokens/s")
    ax.set_xlabel("concurrent requests")
    ax.legend(frameon=False, fontsize=8)
