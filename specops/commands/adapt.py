"""``specops adapt``: what the proxy captured, a draft trained on it, and that draft written into the profile."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from specops.commands._common import echo_json, json_option, load, profile_argument


@click.group()
def adapt():
    """Adapt the draft to the traffic: capture (profile `capture:`), train, evaluate, promote.

    \b
    Examples:
    specops adapt capture-stats PROFILE      # what the proxy kept, per request class
    specops adapt train PROFILE              # a new draft from the captured traffic
    specops adapt promote PROFILE DRAFT      # certify it against the current draft, then write it in
    """


def _folder(profile_path: str, from_path: str | None) -> Path:
    if from_path:
        return Path(from_path)
    from specops.proxy.capture import capture_dir

    return capture_dir(load(profile_path).profile)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@adapt.command("capture-stats")
@profile_argument
@click.option(
    "--from", "from_path", type=click.Path(path_type=str), help="A capture folder or file (default: the profile's)."
)
@json_option
def capture_stats(profile, from_path, as_json):
    """What the proxy captured for PROFILE: records, held-out share and text per class (every line checked).

    \b
    Examples:
      specops adapt capture-stats profiles/llama.yaml
      specops adapt capture-stats profiles/llama.yaml --from /var/lib/specops/capture --json
    """
    from specops.adapt.dataset import stats

    folder = _folder(profile, from_path)
    s = stats(folder)
    if as_json:
        echo_json({"folder": str(folder), **s.to_dict()})
        return
    click.echo(
        f"{folder}: {s.records} records in {s.files} files ({s.bytes} bytes), {_when(s.oldest)} .. {_when(s.newest)}"
    )
    if not s.classes:
        return
    click.echo(f"{'class':<24} {'records':>8} {'held out':>9} {'prompt chars':>13} {'output chars':>13}")
    for name, c in sorted(s.classes.items()):
        click.echo(f"{name[:24]:<24} {c.records:>8} {c.held_out:>9} {c.prompt_chars:>13} {c.output_chars:>13}")


@adapt.command("train")
@profile_argument
@click.option(
    "--from", "from_path", type=click.Path(path_type=str), help="A capture folder or file (default: the profile's)."
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=str),
    help="Work folder (default: `adapt/` beside the capture folder); the same folder resumes.",
)
@click.option("--steps", type=click.IntRange(1, 10_000_000), default=300, show_default=True)
@click.option("--lr", type=click.FloatRange(1e-7, 1.0), default=1e-3, show_default=True)
@click.option("--batch", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option(
    "--seq", type=click.IntRange(8, 1 << 20), default=256, show_default=True, help="Tokens per example at most."
)
@click.option(
    "--init",
    type=click.Choice(["auto", "target", "draft", "scratch"]),
    default="auto",
    show_default=True,
    help="Where the draft starts. auto/target: the target's own first --layers (its embeddings, blocks, norm "
    "and head, read from its GGUF), then distilled: it starts out computing most of what the target does; auto "
    "falls back to scratch when the target's blocks are not llama's. draft: fine-tune the current draft. "
    "scratch: random weights in the target's shape (--layers blocks).",
)
@click.option(
    "--layers",
    type=click.IntRange(1, 1000),
    default=1,
    show_default=True,
    help="Blocks of the new draft (llama.cpp: auto/target/scratch). vLLM draft_model: the draft's last blocks "
    "that are trained (the rest stay frozen, run once over the examples).",
)
@click.option("--class", "only_class", help="Train on one request class only.")
@click.option(
    "--min-agreement",
    type=click.FloatRange(0, 1),
    default=0.9,
    show_default=True,
    help="llama.cpp: refuse to train when the target, run by the trainer on the captured text, chooses fewer "
    "of the captured answers' tokens than this (the capture would not be what the engine saw). 0: no check.",
)
@click.option(
    "--answers",
    type=click.Choice(["target", "captured"]),
    default="target",
    show_default=True,
    help="vLLM (EAGLE-3): what follows each prompt in training. target: the target's greedy continuation, "
    "generated again by the trainer in token space (exact, but a full pass per token: slow for a large target on "
    "a CPU); captured: the captured answer, tokenized (what the engine answered, when its text round-trips).",
)
@click.option(
    "--head-intermediate",
    type=click.IntRange(16, 1 << 20),
    help="vLLM (EAGLE-3): the head's MLP width (default: the target's intermediate_size). A narrower head "
    "trains faster on a CPU and costs less per draft step.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--python",
    "python",
    type=click.Path(dir_okay=False, path_type=str),
    help="An interpreter with torch (default: $SPECOPS_TRAIN_PYTHON, else the vLLM venv's).",
)
@json_option
def train(
    profile,
    from_path,
    out,
    steps,
    lr,
    batch,
    seq,
    init,
    layers,
    only_class,
    min_agreement,
    answers,
    head_intermediate,
    seed,
    python,
    as_json,
):
    """Train a new draft for PROFILE on the captured traffic (llama.cpp: a GGUF draft for `-md`; vLLM: an
    EAGLE-3 head for method eagle3, the draft in service fine-tuned for method draft_model).

    \b
    By default the draft starts from the target's own first --layers (read from its GGUF) and is distilled on
    the target's greedy choices over the captured text; --init scratch trains from random weights instead.
    The held-out tenth of the capture (by prompt) is never trained on: `specops adapt promote` measures on it.
    An interrupted run resumes from its last checkpoint when run again with the same --out.

    \b
    Examples:
      specops adapt train profiles/llama.yaml
      specops adapt train profiles/llama.yaml --steps 600 --out adapt/run1 --class code
      specops adapt train profiles/vllm-pair.yaml --layers 4 --lr 2e-5 --steps 100   # a draft model, fine-tuned
    """
    import sys

    from specops.adapt.train import TrainOptions, progress_line, train_llamacpp
    from specops.errors import SpecopsError
    from specops.plugins import get_registry
    from specops.proxy.capture import capture_dir

    loaded = load(profile)
    prof = loaded.profile
    folder = Path(from_path) if from_path else capture_dir(prof)
    work = Path(out) if out else folder.parent / "adapt"
    hf = get_registry().backend(prof.backend).model_format != "gguf"
    if hf and str(prof.speculative.method) not in ("eagle3", "draft_model"):
        raise SpecopsError(
            f"{profile}: `specops adapt train` trains GGUF drafts (llama.cpp), EAGLE-3 heads and draft models (vLLM, "
            f"methods eagle3 and draft_model); backend {prof.backend!r} with method {prof.speculative.method} is not "
            "trained yet"
        )
    target = Path(prof.model.id)
    if not hf and not target.is_file():
        raise SpecopsError(f"{profile}: model.id {prof.model.id!r} is not a local GGUF file")
    draft = Path(prof.speculative.draft) if prof.speculative.draft else None
    opts = TrainOptions(
        steps=steps,
        lr=lr,
        batch=batch,
        seq=seq,
        seed=seed,
        layers=layers,
        init=init,
        only_class=only_class,
        min_agreement=min_agreement,
    )
    started = time.monotonic()

    def show(event):
        line = progress_line(event, started)
        if line and not as_json:
            click.echo(line, err=True)

    if hf and str(prof.speculative.method) == "draft_model":  # the draft in service, fine-tuned
        from specops.adapt.distill import train_vllm_draft

        outcome = train_vllm_draft(prof, folder, work, opts, python=_train_python(python), on_progress=show)
    elif hf:  # an EAGLE-3 head in the speculators layout, trained on the target's hidden states
        from specops.adapt.eagle3 import Eagle3Options, train_vllm_eagle3

        e3 = Eagle3Options(
            speculative_tokens=prof.speculative.num_speculative_tokens or 3,
            answers=answers,
            intermediate_size=head_intermediate,
        )
        outcome = train_vllm_eagle3(prof, folder, work, opts, python=_train_python(python), on_progress=show, e3=e3)
    else:
        outcome = train_llamacpp(target, draft, folder, work, opts, python=_train_python(python), on_progress=show)
    doc = {
        "draft": str(outcome.draft),
        "folder": str(outcome.folder),
        "init_from": outcome.init_from,
        "train_examples": outcome.train_examples,
        "heldout_examples": outcome.heldout_examples,
        "memory_estimate_bytes": outcome.memory_bytes,
        **outcome.result,
    }
    if as_json:
        echo_json(doc)
        return
    r = outcome.result
    click.echo(
        f"trained from {outcome.init_from} on {outcome.train_examples} examples ({outcome.heldout_examples} held out): "
        f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} in {r['steps']} steps, {r['seconds']}s"
    )
    if r.get("best_step") is not None:
        click.echo(
            f"held-out agreement {r['heldout_first_agreement']:.3f} -> {r['heldout_best_agreement']:.3f}: the draft "
            f"written is step {r['best_step']}'s"
            + (" (no step beat the draft as it came)" if r["best_step"] == 0 else "")
        )
    click.echo(f"draft: {outcome.draft}")
    click.echo(f"next: specops adapt promote {profile} {outcome.draft}", file=sys.stderr)


@adapt.command("promote")
@profile_argument
@click.argument("draft", type=click.Path(exists=True, path_type=str))  # a GGUF file, or a vLLM head's folder
@click.option(
    "--heldout",
    type=click.Path(dir_okay=False, path_type=str),
    help="Held-out examples (default: heldout.jsonl beside DRAFT).",
)
@click.option(
    "--margin",
    type=click.FloatRange(0, 10),
    default=0.05,
    show_default=True,
    help="The new draft's mean acceptance length must beat the current one's by this share.",
)
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option(
    "--limit", type=click.IntRange(1, 100_000), default=64, show_default=True, help="Held-out prompts measured at most."
)
@click.option(
    "--lossless",
    "lossless_n",
    type=click.IntRange(1, 1000),
    default=4,
    show_default=True,
    help="Held-out prompts whose greedy answers with DRAFT must equal the target's own (speculation off).",
)
@click.option(
    "--tolerance",
    type=click.FloatRange(0, 10),
    default=0.0,
    show_default=True,
    help="Accept a first differing token that was a near tie in the target's answer (nats), as `certify --tolerance`.",
)
@click.option("--dry-run", is_flag=True, help="Measure and print the diff; write nothing.")
@json_option
def promote(profile, draft, heldout, margin, max_tokens, limit, lossless_n, tolerance, dry_run, as_json):
    """Measure DRAFT against PROFILE's current draft on held-out traffic; write it in when it wins by --margin.

    \b
    DRAFT must be lossless first: the greedy answers to the first --lossless held-out prompts with DRAFT
    must be the target's own (speculation cannot change a greedy answer; a draft that does reveals a broken
    engine or file), compared token by token as `specops certify` does. Then its mean acceptance length
    must beat the current draft's by --margin.

    \b
    Examples:
      specops adapt promote profiles/llama.yaml adapt/draft.gguf --dry-run
      specops adapt promote profiles/llama.yaml adapt/draft.gguf --margin 0.1
      specops adapt promote profiles/vllm-eagle3.yaml adapt/head --dry-run   # an EAGLE-3 head's folder
    """
    from specops.adapt.promote import compare, run_compare, write_back
    from specops.errors import SpecopsError
    from specops.plugins import get_registry

    loaded = load(profile)
    new_draft = str(Path(draft).resolve())
    current, new, lossless = run_compare(
        loaded,
        get_registry(),
        new_draft,
        Path(heldout) if heldout else Path(draft).parent / "heldout.jsonl",
        max_tokens=max_tokens,
        limit=limit,
        lossless=lossless_n,
        tolerance=tolerance,
    )
    verdict = compare(current, new, margin, lossless)
    certificate = {
        "date": time.strftime("%Y-%m-%d"),
        "margin": margin,
        "current": current.to_dict(),
        "new": new.to_dict(),
        "lossless": lossless,
        **verdict,
    }
    diff = cert = None
    if verdict["promote"]:
        diff, cert = write_back(loaded, new_draft, certificate, dry_run=dry_run)
    if as_json:
        echo_json(
            {
                **certificate,
                "diff": diff,
                "certificate": str(cert) if cert else None,
                "written": bool(diff) and not dry_run,
            }
        )
    else:
        for name, f in (("current", current), ("new", new)):
            mal = "-" if f.mean_acceptance_length is None else f"{f.mean_acceptance_length:.3f}"
            acc = "-" if f.acceptance is None else f"{f.acceptance:.3f}"
            click.echo(
                f"{name:8} acceptance {acc}  mean acceptance length {mal}  {f.tokens_per_s:.1f} tok/s  ({f.draft})"
            )
        if lossless is not None:
            click.echo(
                f"lossless: {lossless['verdict']} ({lossless['identical']} of {lossless['requests']} greedy answers "
                "identical to the target's own)"
            )
        click.echo(verdict["reason"])
        if diff:
            click.echo(diff, nl=False)
            click.echo("(dry run: nothing written)" if dry_run else f"written; certificate: {cert}")
    if not verdict["promote"]:
        raise SpecopsError("not promoted: " + verdict["reason"])


def _train_python(explicit: str | None) -> Path:
    """The interpreter with torch: ``--python``, ``$SPECOPS_TRAIN_PYTHON``, else the vLLM venv's."""
    chosen = explicit or os.environ.get("SPECOPS_TRAIN_PYTHON")
    if chosen:
        return Path(chosen)
    from specops.devenv import engines
    from specops.errors import SpecopsError

    if not engines.vllm_ready():
        raise SpecopsError(
            "training needs torch: pass --python (an interpreter with torch and tokenizers), set "
            "SPECOPS_TRAIN_PYTHON, or run `specops engines setup vllm` (its venv has both)"
        )
    return engines.vllm_python()
