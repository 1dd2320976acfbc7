"""Losslessness: one greedy answer (text, tokens, top log-probabilities in either shape engines send) and the
token-by-token comparison of the same request with and without speculation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specops.perf.workload import RequestResult

#: Divergences kept in the certificate (all are counted).
KEEP_DIVERGENCES = 5
#: Tokens of each continuation shown after a divergence.
SHOW_TOKENS = 12


@dataclass
class Generation:
    """One request's answer: timing and counts (as a workload result), the text and the tokens."""

    result: RequestResult
    text: str = ""
    tokens: list = field(default_factory=list)  # token ids where the engine gives them, else token texts
    texts: list[str] = field(default_factory=list)  # token texts (for showing a divergence)
    top: list[dict] = field(default_factory=list)  # per position: token (id or text) -> logprob
    by_id: bool = False


def _parse_logprobs(choice: dict, gen: Generation) -> None:
    """Tokens and top log-probabilities from either shape engines answer in.

    ``logprobs.content`` (chat, and llama-server's completions): a list of ``{id?, token, logprob,
    top_logprobs: [{id?, token, logprob}]}``; the legacy completions shape (vLLM): ``{tokens, token_logprobs,
    top_logprobs: [{token: logprob}]}``; ``token_ids`` on the choice (vLLM ``return_token_ids``).
    """
    lp = choice.get("logprobs")
    ids = choice.get("token_ids")
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):
        content = [c for c in lp["content"] if isinstance(c, dict)]
        gen.texts = [str(c.get("token", "")) for c in content]
        if content and all(isinstance(c.get("id"), int) for c in content):
            gen.tokens, gen.by_id = [c["id"] for c in content], True
        else:
            gen.tokens = list(gen.texts)
        for c in content:
            top = {}
            for t in c.get("top_logprobs") or ():
                key = t.get("id") if gen.by_id and isinstance(t.get("id"), int) else t.get("token")
                if key is not None and isinstance(t.get("logprob"), (int, float)):
                    top[key] = float(t["logprob"])
            gen.top.append(top)
    elif isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        gen.texts = [str(t) for t in lp["tokens"]]
        gen.tokens = list(gen.texts)
        gen.top = [
            {k: float(v) for k, v in (d or {}).items() if isinstance(v, (int, float))}
            for d in lp.get("top_logprobs") or []
        ]
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        if not gen.by_id:  # ids are better keys for the comparison; top log-probs stay keyed by text
            gen.tokens, gen.by_id = list(ids), True
            gen.top = [{("text", k): v for k, v in d.items()} for d in gen.top]


def compare_outputs(spec: Generation, base: Generation, tolerance: float = 0.0) -> dict:
    """Token-by-token comparison of the same greedy request with speculation (``spec``) and without (``base``).

    ``status``: ``identical``; ``tolerated`` (the first differing token was a near tie in the baseline:
    ``margin`` = logprob of the baseline's token − logprob of the speculative token ≤ ``tolerance``);
    ``diverged``; ``failed`` (a request failed). The comparison uses token ids when both sides have them,
    else token texts, else the text itself.
    """
    out: dict[str, Any] = {"set": base.result.set}
    if not (spec.result.ok and base.result.ok):
        out.update(status="failed", error=spec.result.error or base.result.error)
        return out
    if spec.by_id == base.by_id and spec.tokens and base.tokens:
        a, b, unit = spec.tokens, base.tokens, "token"
    else:
        a, b, unit = list(spec.text), list(base.text), "character"
    pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if pos is None and len(a) == len(b):
        out.update(status="identical", tokens=len(b), unit=unit)
        return out
    if pos is None:  # one is a prefix of the other: it stopped earlier
        pos = min(len(a), len(b))
    margin = _margin(spec, base, pos) if unit == "token" else None
    status = "tolerated" if margin is not None and margin <= tolerance and tolerance > 0 else "diverged"
    out.update(
        status=status,
        unit=unit,
        position=pos,
        tokens=len(b),
        margin=margin,
        spec_token=_shown(spec, pos, unit),
        base_token=_shown(base, pos, unit),
        common_prefix=_join(base, 0, pos, unit)[-80:],
        spec_continuation=_join(spec, pos, pos + SHOW_TOKENS, unit),
        base_continuation=_join(base, pos, pos + SHOW_TOKENS, unit),
        spec_finish=spec.result.finish_reason,
        base_finish=base.result.finish_reason,
    )
    if unit == "token" and spec.by_id:  # ids say where without the text (what live spot checks record)
        out.update(spec_token_id=_at(spec.tokens, pos), base_token_id=_at(base.tokens, pos))
    return out


def _at(items: list, pos: int):
    return items[pos] if pos < len(items) else None  # None: this side stopped here


def _margin(spec: Generation, base: Generation, pos: int) -> float | None:
    """How much likelier the baseline's token was than the speculative one at ``pos`` (nats), from the
    baseline's top log-probabilities; None when either token is missing there (a clear divergence)."""
    if pos >= len(base.top) or pos >= len(spec.tokens) or pos >= len(base.tokens):
        return None
    top = base.top[pos]

    def key(gen: Generation) -> Any:
        if top and all(isinstance(k, tuple) for k in top):  # keyed by text while tokens are ids
            return ("text", gen.texts[pos] if pos < len(gen.texts) else None)
        return gen.tokens[pos]

    mine, theirs = top.get(key(base)), top.get(key(spec))
    if mine is None or theirs is None:
        return None
    return round(max(0.0, mine - theirs), 6)


def _shown(gen: Generation, pos: int, unit: str) -> str | None:
    if unit == "token":
        return gen.texts[pos] if pos < len(gen.texts) else None  # None: this side stopped here
    return gen.text[pos] if pos < len(gen.text) else None


def _join(gen: Generation, start: int, end: int, unit: str) -> str:
    if unit == "token" and gen.texts:
        return "".join(gen.texts[start:end])
    return gen.text[start:end]


def lossless_summary(comparisons: list[dict], tolerance: float) -> dict:
    """The losslessness verdict over every compared request."""
    counts = {s: sum(c["status"] == s for c in comparisons) for s in ("identical", "tolerated", "diverged", "failed")}
    if counts["diverged"] or counts["failed"]:
        verdict = "diverged" if counts["diverged"] else "incomplete"
    elif counts["tolerated"]:
        verdict = "within-tolerance"
    else:
        verdict = "exact"
    bad = [c for c in comparisons if c["status"] in ("diverged", "tolerated", "failed")]
    margins = [c["margin"] for c in comparisons if c.get("margin") is not None]
    return {
        "verdict": verdict,
        "lossless": verdict in ("exact", "within-tolerance"),
        "requests": len(comparisons),
        **counts,
        "tolerance_nats": tolerance,
        "largest_margin_nats": max(margins) if margins else None,
        "compared_by": sorted({c.get("unit") for c in comparisons if c.get("unit")}),
        "divergences": bad[:KEEP_DIVERGENCES],
    }
