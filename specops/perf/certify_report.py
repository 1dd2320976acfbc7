"""What ``specops certify`` prints and plots from a certificate."""

from __future__ import annotations

from pathlib import Path


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def drafts_text(settings: dict) -> str:
    """The method and its draft length as the engine ran it (``ngram, drafts up to 12``), never a k it ignored;
    certificates written before the draft length was recorded say ``k=K``."""
    length = settings.get("draft_length")
    if length:
        return f"{settings['method']}, drafts {length['length']}"
    return f"{settings['method']} k={settings['k']}" if settings.get("k") is not None else settings["method"]


def summary_text(cert: dict) -> str:
    """What a person reads: identity, losslessness, acceptance per set and position, tokens/s, findings."""
    ident, eng, s, lo = cert["identity"], cert["engine"], cert["settings"], cert["lossless"]
    lines = [
        f"certificate for {cert['profile']}: {eng['backend']} {eng['version']}, {drafts_text(s)}, "
        f"target {ident['target']} ({ident['target_revision'] or 'no revision'})"
        + (f", draft {ident['draft']} ({ident['draft_revision'] or 'no revision'})" if ident.get("draft") else ""),
        f"chat template: {cert['endpoint_note']}"
        + (f" [{ident['chat_template_sha256']}]" if ident.get("chat_template_sha256") else ""),
        "",
    ]
    tol = f" (tolerance {lo['tolerance_nats']:g} nats)" if lo["tolerance_nats"] else ""
    lines.append(
        f"lossless: {lo['verdict'].upper()}{tol}: {lo['identical']} identical, {lo['tolerated']} tolerated, "
        f"{lo['diverged']} diverged, {lo['failed']} failed of {lo['requests']} greedy requests "
        f"(compared by {', '.join(lo['compared_by']) or '-'})"
    )
    for d in lo["divergences"]:
        if d["status"] == "failed":
            lines.append(f"  {d['set']}: failed: {d.get('error')}")
            continue
        margin = (
            f", margin {d['margin']:.4g} nats"
            if d.get("margin") is not None
            else ", not in the baseline's top log-probs"
        )
        lines += [
            f"  {d['set']}: {d['status']} at {d['unit']} {d['position']}{margin}: after {d['common_prefix'][-40:]!r}",
            f"    with speculation: {d['spec_continuation']!r}",
            f"    without:          {d['base_continuation']!r}",
        ]
    levels = list(cert["throughput"])
    lines += [
        "",
        "| set | temp | acceptance | mean acc. length | per position | greedy acc. | "
        + " | ".join(f"c={lv} on/off tok/s" for lv in levels)
        + " |",
    ]
    lines.append("|---" * (6 + len(levels)) + "|")
    for name, r in cert["sets"].items():
        per = " ".join(f"{x:.2f}" for x in (r.get("per_position") or [])) or "-"
        cells = []
        for lv in levels:
            sp = r["speedup"][lv]
            cells.append(
                f"{_f(sp['spec_tokens_per_s'], '.1f')}/{_f(sp['base_tokens_per_s'], '.1f')} ({_f(sp['speedup'], '.2f')}x)"
            )
        temp = r["temperature"] if isinstance(r["temperature"], list) else f"{r['temperature']:g}"
        lines.append(
            f"| {name} | {temp} | {_f(r.get('acceptance'))} | {_f(r.get('mean_acceptance_length'), '.2f')} | {per} | "
            f"{_f(r['greedy'].get('acceptance'))} | " + " | ".join(cells) + " |"
        )
    tp = " · ".join(
        f"c={lv}: {_f(t['spec_tokens_per_s'], '.1f')} vs {_f(t['base_tokens_per_s'], '.1f')} tok/s ({_f(t['speedup'], '.2f')}x)"
        for lv, t in cert["throughput"].items()
    )
    lines += ["", f"tokens/s with vs without speculation: {tp}"]
    v = cert["verdict"]
    lines.append("")
    lines.append(
        f"CERTIFIED: lossless, speculating, greedy acceptance {v['greedy_acceptance']:.3f}"
        if v["certified"]
        else "NOT CERTIFIED"
    )
    lines += [f"  - {f}" for f in v["findings"]]
    return "\n".join(lines) + "\n"


def plot_certificate(cert: dict, out_dir: Path) -> list[Path]:
    """PNG: acceptance per draft position for each prompt set, with the fallback threshold. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in cert["sets"].items():
        per = r.get("per_position") or []
        if per:
            ax.plot(range(1, len(per) + 1), per, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted per draft")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance per position")
    ax.legend(fontsize=8)
    names = list(cert["sets"])
    levels = list(cert["throughput"])
    width = 0.8 / max(1, len(levels))
    for j, lv in enumerate(levels):
        vals = [cert["sets"][n]["speedup"][lv]["speedup"] or 0 for n in names]
        bx.bar([i + j * width for i in range(len(names))], vals, width, label=f"c={lv}")
    bx.axhline(1.0, color="#d62728", lw=1)
    bx.set_xticks([i + width * (len(levels) - 1) / 2 for i in range(len(names))], names)
    bx.set_ylabel("tokens/s on ÷ off")
    bx.set_title("speedup")
    bx.legend(fontsize=8)
    eng, s = cert["engine"], cert["settings"]
    fig.suptitle(
        f"{cert['profile']} · {eng['backend']} {eng['version']} · {drafts_text(s)} · lossless: {cert['lossless']['verdict']}"
    )
    fig.tight_layout()
    path = out_dir / "certificate.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]
