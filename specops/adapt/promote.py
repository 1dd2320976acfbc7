"""``specops adapt promote``: the new draft against the current one on held-out traffic, then into the profile.

Both drafts serve the held-out examples (never trained on) on the real engine, one after the other, launched
as ``bench`` and ``certify`` launch (:func:`specops.perf.launch.launched`), at one client with greedy decoding:
acceptance, mean acceptance length, acceptance per position, tokens/s. The new draft is written into the
profile only when its mean acceptance length beats the current one's by ``margin`` (relative); the profile is
edited as ``tune`` edits it (:mod:`specops.config.yamledit`: comments kept, a diff printed, ``--dry-run``),
and the comparison is kept beside it as a certificate (``<profile>.adapt.json``, 0600).

Before acceptance counts, the new draft must be lossless: the greedy answers to the first ``lossless``
held-out prompts with the new draft must be the target's own (the target alone, speculation off), token by
token as ``certify`` compares them. Greedy speculation cannot change the output, so a draft that changes it
reveals a broken engine or a wrongly written file, and no acceptance figure makes up for that.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from specops.errors import SpecopsError

#: The comment specops writes above the draft (replaced, never stacked, when promote runs again).
ADAPT_COMMENT = re.compile(r"^[ \t]*# specops adapt \d{4}-\d\d-\d\d\b.*(?:\n|$)", re.M)
DEFAULT_MARGIN = 0.05
#: Held-out prompts whose greedy answers with the new draft are compared with the target's own.
DEFAULT_LOSSLESS = 4


@dataclass
class DraftFigures:
    draft: str
    acceptance: float | None
    mean_acceptance_length: float | None
    per_position: list | None
    tokens_per_s: float
    requests: int
    errors: int
    generations: list = field(default_factory=list, repr=False)  # greedy answers for the lossless check

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "generations"}


def heldout_prompts(path: Path, max_tokens: int, limit: int):
    from specops.perf.workload import Prompt

    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecopsError(f"{path}: cannot read the held-out examples: {exc.strerror or exc}") from None
    # split on "\n" only: the lines are JSON written with ensure_ascii=False, so a prompt may hold U+2028 or
    # U+0085, which str.splitlines() splits on too
    lines = text.split("\n")
    if not lines[-1]:
        lines.pop()  # after the newline that ends the last line
    for number, line in enumerate(lines, start=1):
        try:
            prompts.append(Prompt(json.loads(line)["prompt"], max_tokens=max_tokens, temperature=0.0, set="heldout"))
        except (ValueError, KeyError, TypeError):
            raise SpecopsError(f"{path}:{number}: not a held-out example written by `specops adapt train`") from None
    if not prompts:
        raise SpecopsError(f"{path}: no held-out example (capture more traffic: one prompt in ten is held out)")
    return prompts[:limit]


async def measure(loaded, registry, draft: str, prompts, lossless: int = 0) -> DraftFigures:
    """One draft on the real engine: the held-out prompts once, at one client, greedy; then the first
    ``lossless`` of them again with their tokens kept (after the counters, so they do not count)."""
    from specops.perf.certify import generate_all
    from specops.perf.launch import launched
    from specops.perf.workload import run_workload

    spec = loaded.profile.speculative.model_copy(update={"draft": draft})
    prof = loaded.profile.model_copy(update={"speculative": spec})
    gens: list = []
    async with launched(loaded, registry, profile=prof) as eng:
        await run_workload(eng.base_url, eng.model_name, prompts[:2], concurrency=1, api_key=eng.api_key)  # warm-up
        before = await eng.settled_counters()
        result = await run_workload(eng.base_url, eng.model_name, prompts, concurrency=1, api_key=eng.api_key)
        stats = await eng.acceptance_since(before)
        if lossless:
            gens, _ = await generate_all(eng, prompts[:lossless], concurrency=1, chat=False, logprobs=True)
    return DraftFigures(
        draft,
        getattr(stats, "acceptance", None),
        getattr(stats, "mean_acceptance_length", None),
        list(getattr(stats, "per_position", None) or []) or None,
        result.tokens_per_s,
        len(result.requests),
        len(result.errors),
        gens,
    )


async def target_answers(loaded, registry, prompts) -> list:
    """The target's own greedy answers (speculation off) to ``prompts``, tokens and top log-probabilities kept."""
    from specops.perf.certify import generate_all
    from specops.perf.launch import launched, without_speculation

    async with launched(loaded, registry, profile=without_speculation(loaded.profile)) as eng:
        gens, _ = await generate_all(eng, prompts, concurrency=1, chat=False, logprobs=True)
    return gens


def lossless_check(new: list, base: list, tolerance: float = 0.0) -> dict:
    """The new draft's greedy answers against the target's own, request by request (``certify``'s comparison)."""
    from specops.perf.certify_compare import compare_outputs, lossless_summary

    return lossless_summary([compare_outputs(n, b, tolerance) for n, b in zip(new, base, strict=True)], tolerance)


def compare(current: DraftFigures, new: DraftFigures, margin: float, lossless: dict | None = None) -> dict:
    """The verdict: never a draft whose greedy answers differ from the target's (``lossless``, from
    :func:`lossless_check`); otherwise promote only when its mean acceptance length beats the current one's by
    ``margin``."""
    cur, nxt = current.mean_acceptance_length, new.mean_acceptance_length
    if lossless is not None and not lossless["lossless"]:
        first = next(iter(lossless["divergences"]), {})
        where = ""
        if first.get("status") == "failed":
            where = f": a request failed ({first.get('error')})"
        elif first:
            where = (
                f": first at {first.get('unit', 'token')} {first.get('position')} "
                f"(draft {first.get('spec_token')!r}, target {first.get('base_token')!r})"
            )
        return {
            "promote": False,
            "reason": (
                f"not lossless: {lossless['diverged'] + lossless['failed']} of {lossless['requests']} held-out "
                f"greedy answers with the new draft differ from the target's own{where}; speculation must not "
                "change the output, so the engine or the written draft is broken"
            ),
        }
    if new.errors or nxt is None:
        return {"promote": False, "reason": "the new draft was not measured cleanly"}
    if cur is not None and nxt < cur * (1 + margin):
        return {
            "promote": False,
            "reason": f"mean acceptance length {nxt:.3f} does not beat the current draft's {cur:.3f} by {margin:.0%}",
        }
    base = f"{cur:.3f}" if cur is not None else "none"
    return {"promote": True, "reason": f"mean acceptance length {base} -> {nxt:.3f} (margin {margin:.0%})"}


def certificate_path(profile_path: str | Path) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + ".adapt.json")


def write_back(loaded, draft: str, certificate: dict, *, dry_run: bool) -> tuple[str, Path]:
    """The profile's ``speculative.draft`` set to ``draft`` (comments kept) and the certificate beside it;
    returns (diff, certificate path). The new text is validated before it replaces the file."""
    from specops.config import yamledit
    from specops.config.profile import load_profile

    path = Path(loaded.path)
    old = path.read_text(encoding="utf-8")
    date = time.strftime("%Y-%m-%d")
    comment = f"specops adapt {date}: draft trained on captured traffic; see {certificate_path(path).name}"
    new, _notes = yamledit.edit_yaml(
        old,
        {("speculative", "draft"): draft},
        base_data=yamledit.base_data_of(path),
        comment=comment,
        comment_at=("speculative", "draft"),
        replace=ADAPT_COMMENT,
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.adapt.tmp")
    tmp.write_text(new, encoding="utf-8")
    try:
        load_profile(tmp)
    finally:
        tmp.unlink(missing_ok=True)
    cert = certificate_path(path)
    if not dry_run:
        fd = os.open(cert, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(certificate, indent=1) + "\n")
        final = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        final.write_text(new, encoding="utf-8")
        os.chmod(final, path.stat().st_mode & 0o777)
        os.replace(final, path)
    return yamledit.unified_diff(old, new, path.name), cert


def run_compare(
    loaded,
    registry,
    new_draft: str,
    heldout: Path,
    *,
    max_tokens: int,
    limit: int,
    lossless: int = DEFAULT_LOSSLESS,
    tolerance: float = 0.0,
) -> tuple[DraftFigures, DraftFigures, dict | None]:
    """(current, new, the lossless check of the new draft: None when ``lossless`` is 0)."""
    prompts = heldout_prompts(heldout, max_tokens, limit)
    current = loaded.profile.speculative.draft
    if current is None:
        raise SpecopsError(f"{loaded.path}: speculative.draft is not set: nothing to compare the new draft with")

    async def run():
        new = await measure(loaded, registry, new_draft, prompts, lossless)
        check = None
        if lossless:
            base = await target_answers(loaded, registry, prompts[:lossless])
            check = lossless_check(new.generations, base, tolerance)
        return await measure(loaded, registry, current, prompts), new, check

    return asyncio.run(run())
