"""Compatibility checks between a draft and its target: each a :class:`Finding` with a one-line reason.

The checks are pure functions over :class:`~specops.resolve.models.ModelView` s, the profile and the
backend's capabilities: vocab size (equal, or within the backend's ``draft_vocab_tolerance`` with the same
token text), hidden size, EAGLE-3 aux layer ids, the draft's trained context against the served one, draft
TP, tokenizer identity, MTP layers, which target a head was trained for, that the draft really is what the
method needs, backend and engine-version support, and weight memory. Errors refuse the launch; warnings
are printed; infos explain what was (not) compared.

:func:`~specops.resolve.resolver.check_loaded` runs them for ``specops validate --resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass

from specops.backends.base import Backend
from specops.methods import NEEDS_DRAFT, Method
from specops.resolve.catalog import Catalog, CatalogEntry
from specops.resolve.detect import HEAD_METHODS, looks_like_full_model, same_model
from specops.resolve.ggufinfo import compare_vocab
from specops.resolve.memory import ModelSize, engine_drafts, estimate, local_size, size_of_view, twin_problems

DRAFT = ("speculative", "draft")
METHOD = ("speculative", "method")


@dataclass(frozen=True)
class Finding:
    """One check's result. ``severity``: error (refuses the launch), warning (printed), info."""

    severity: str
    check: str
    message: str
    path: tuple = DRAFT

    def to_dict(self) -> dict:
        return {
            "severity": self.severity,
            "check": self.check,
            "message": self.message,
            "field": ".".join(str(p) for p in self.path),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        path = tuple(int(p) if p.isdigit() else p for p in str(d.get("field") or "speculative.draft").split("."))
        return cls(d["severity"], d.get("check", ""), d["message"], path)


def backend_findings(method: Method, profile, backend_obj) -> list[Finding]:
    """The method must be one the backend runs, in the engine version the profile pins."""
    out: list[Finding] = []
    if method in (Method.NONE, Method.AUTO):
        return out
    if backend_obj is not None and method not in backend_obj.methods:
        out.append(Finding("error", "backend", backend_obj.unsupported_method_text(method), METHOD))
        return out
    version = profile.engine.version
    if not version or backend_obj is None:
        return out
    problem = backend_obj.method_problem(method, version, cpu=profile.gpus.devices == [])
    if problem:
        out.append(Finding("error", "backend", problem, METHOD))
    return out


def compat_findings(
    method: Method,
    draft,
    target,
    profile,
    *,
    catalog: Catalog,
    backend_obj=None,
    entry: CatalogEntry | None = None,
    explicit: bool = False,
) -> list[Finding]:
    """All checks for running ``draft`` (a ModelView, None for MTP / n-gram) with ``target``."""
    out = backend_findings(method, profile, backend_obj)
    be = backend_obj if backend_obj is not None else _unknown_backend(profile.backend)
    if method is Method.MTP:
        out += _mtp(target)
    if method in NEEDS_DRAFT and draft is not None:
        out += _fetch(draft, entry, explicit)
        if draft.fatal is None:
            out += _method(method, draft, profile)
            out += _identity(method, draft, target, catalog)
            out += _vocab(method, draft, target, profile, be)
            out += _hidden(method, draft, target)
            out += _aux_layers(method, draft, target)
            out += _context(method, draft, target, profile, entry)
            out += _tokenizer(method, draft, target)
            out += _gguf(method, draft, profile, be)
    out += _tp(method, profile)
    if method is not Method.NONE and (draft is None or draft.fatal is None):
        out += _memory(method, draft, target, profile, be)
    return out


def _unknown_backend(name: str) -> Backend:
    """A backend with the safe defaults, for a profile whose backend is not installed."""
    be = Backend()
    be.name = name
    return be


# ------------------------------------------------------------------------------------------- checks


def _fetch(draft, entry, explicit) -> list[Finding]:
    fatal = draft.fatal
    if fatal is not None:
        return [Finding("error", "hub", str(fatal))]
    out = []
    if draft.errors:
        err = draft.errors[0]
        known = draft.facts_source != "none" or draft.config is not None
        sev = "warning" if (known or entry is not None or explicit) else "error"
        if err.kind == "offline" and known:
            where = "its config.json in the HF cache" if draft.config is not None else draft.facts_source
            return [Finding("info", "hub", f"offline: {draft.ref} checked against {where}")]
        if err.kind == "offline" and not known:
            msg = (
                f"offline: {draft.ref} is not in the lock, the HF cache or the catalog's facts, so it cannot be "
                f"checked; run `specops lock` online once (or `hf download {draft.ref} config.json`)"
            )
        else:
            what = f"checked against {draft.facts_source}" if known else "its facts are unknown"
            msg = f"{draft.ref} not verified against the Hub ({err}); {what}"
        out.append(Finding(sev, "hub", msg))
    return out


def _method(method, draft, profile) -> list[Finding]:
    detected, why = draft.method, draft.method_why
    from_config = why.startswith("config:")
    if from_config and detected is not None and detected is not method:
        if method is Method.EAGLE and detected is Method.EAGLE3:
            return [Finding("error", "method", f"{draft.ref} is an EAGLE-3 head ({why}); set method: eagle3", METHOD)]
        return [Finding("error", "method", f"{draft.ref} is a {detected} draft ({why}), not {method}", METHOD)]
    if method in (Method.EAGLE, Method.EAGLE3) and looks_like_full_model(draft.config):
        return [
            Finding(
                "error",
                "method",
                f"{draft.ref} looks like a complete model ({draft.facts.layers} layers, "
                f"no EAGLE markers), not an EAGLE head; use method: draft_model",
                METHOD,
            )
        ]
    if method is Method.EAGLE and detected is None and draft.config is not None:
        return [
            Finding(
                "info",
                "method",
                "EAGLE-1 heads carry no marker in config.json; specops sends method=eagle "
                "explicitly so vLLM does not guess from the repo name",
            )
        ]
    return []


def _identity(method, draft, target, catalog) -> list[Finding]:
    """Which target the head was trained for: verifier / Medusa base beat the card's base_model."""
    if method not in HEAD_METHODS or not draft.declared:
        return []
    accepted = _target_names(target, catalog)
    matches = lambda name: any(same_model(name, t, catalog.aliases) for t in accepted)  # noqa: E731
    strong = [d for d in draft.declared if d.source != "card base_model"]
    cards = [d for d in draft.declared if d.source == "card base_model"]
    out = []
    if strong:
        best = strong[0]
        if not matches(best.target):
            return [
                Finding(
                    "error", "identity", f"{draft.ref} was trained for {best.target} ({best.source}), not {target.ref}"
                )
            ]
        for c in cards:
            if not matches(c.target):
                out.append(
                    Finding(
                        "info",
                        "identity",
                        f"the model card's base_model names {c.target}, but the "
                        f"{best.source} names {best.target}: trusting the {best.source}",
                    )
                )
        return out
    if cards and not any(matches(c.target) for c in cards):
        return [
            Finding(
                "warning",
                "identity",
                f"{draft.ref}'s model card names {cards[0].target} as its base "
                f"model, not {target.ref} (cards are sometimes wrong; the config has no verifier)",
            )
        ]
    return out


def _target_names(target, catalog) -> list[str]:
    names = [target.ref]
    facts = catalog.facts(target.ref)
    if facts and facts.of:
        names.append(facts.of)
    if target.meta and target.meta.card_data:
        base = target.meta.card_data.get("base_model")
        names += (
            [base]
            if isinstance(base, str)
            else [b for b in base if isinstance(b, str)]
            if isinstance(base, list)
            else []
        )
    return names


#: The option specops sets for a draft model whose vocabulary differs, where the engine has it.
HETERO_VOCAB = "use_heterogeneous_vocab"
#: The check name of that finding: :func:`specops.resolve.prelaunch.resolve_for_launch` applies the options.
HETERO_CHECK = "vocab-mapped"
HETERO_SEVERITY = "warning"


def _vocab(method, draft, target, profile, be) -> list[Finding]:
    dv, tv = draft.facts.vocab, target.facts.vocab
    tolerance = be.draft_vocab_tolerance if method is Method.DRAFT_MODEL else 0
    if tolerance:
        return _vocab_within(tolerance, draft, target, be.engine_name)
    if dv is None or tv is None:
        return [Finding("info", "vocab", "vocab not checked: " + _unknown(dv, tv))]
    out = []
    if dv != tv:
        hetero = be.heterogeneous_vocab(profile.engine.version) if method is Method.DRAFT_MODEL else None
        if profile.speculative.options.get(HETERO_VOCAB) and method is Method.DRAFT_MODEL:
            out.append(
                Finding(
                    "warning", "vocab", f"vocab_size differs ({dv} draft vs {tv} target); allowed by {HETERO_VOCAB}"
                )
            )
        elif hetero:
            on = f"vLLM {profile.engine.version}" if profile.engine.version else "an engine version that has it"
            out.append(
                Finding(
                    HETERO_SEVERITY,
                    HETERO_CHECK,
                    f"vocab_size differs ({dv} draft vs {tv} target): launched with "
                    f"{', '.join(f'{k}: {str(v).lower()}' for k, v in hetero.items())} on {on} "
                    "(the draft's tokens are mapped to the target's; the draft samples greedily)",
                )
            )
        else:
            what = "the head's" if method in HEAD_METHODS else "draft"
            out.append(
                Finding(
                    "error",
                    "vocab",
                    f"{what} vocab_size {dv} != target's {tv}: {be.engine_name} needs equal vocabularies"
                    + (
                        f" ({profile.engine.version})"
                        if method is Method.DRAFT_MODEL and profile.engine.version
                        else ""
                    ),
                )
            )
    dvs = draft.facts.draft_vocab
    if method is Method.EAGLE3 and dvs is not None and dvs > tv:
        out.append(Finding("error", "vocab", f"draft_vocab_size {dvs} exceeds the target's vocab_size {tv}"))
    return out


def _vocab_within(tolerance: int, draft, target, engine: str) -> list[Finding]:
    """A draft model on an engine that allows vocab sizes ``tolerance`` apart: the GGUF token text when both
    files are local, else the sizes."""
    dv, tv = draft.facts.vocab, target.facts.vocab
    if draft.gguf_vocab is not None and target.gguf_vocab is not None:
        issues = compare_vocab(target.gguf_vocab, draft.gguf_vocab)
        if issues:
            return [Finding(sev, "vocab", msg) for sev, msg in issues]
        return [
            Finding(
                "info",
                "vocab",
                f"GGUF vocabularies compatible for {engine} "
                f"({draft.gguf_vocab.size} vs {target.gguf_vocab.size} tokens, same token text from id 5)",
            )
        ]
    if dv is None or tv is None:
        return [Finding("info", "vocab", "vocab not checked: " + _unknown(dv, tv))]
    diff = abs(dv - tv)
    if diff > tolerance:
        return [
            Finding(
                "error",
                "vocab",
                f"vocab sizes {dv} (draft) and {tv} (target) are {diff} apart; {engine} allows at most {tolerance}",
            )
        ]
    if diff:
        return [
            Finding(
                "info",
                "vocab",
                f"vocab sizes {dv} and {tv} differ by {diff}: {engine} accepts up to "
                f"{tolerance} (token text is compared when the GGUF files are local)",
            )
        ]
    return []


def _unknown(dv, tv) -> str:
    missing = [w for w, v in (("draft", dv), ("target", tv)) if v is None]
    return f"{' and '.join(missing)} vocab_size unknown"


def _hidden(method, draft, target) -> list[Finding]:
    if method not in HEAD_METHODS:
        return []
    th = target.facts.hidden
    dh = draft.facts.target_hidden or draft.facts.hidden
    if dh is None or th is None:
        return [
            Finding(
                "info",
                "hidden",
                "hidden size not checked: " + ("draft" if dh is None else "target") + " hidden_size unknown",
            )
        ]
    if dh != th:
        field = (
            "target_hidden_size"
            if draft.facts.target_hidden
            else ("emb_dim" if method is Method.MLP_SPECULATOR else "hidden_size")
        )
        return [
            Finding(
                "error",
                "hidden",
                f"the head's {field} {dh} != target hidden_size {th}: it was trained on another model's hidden states",
            )
        ]
    return []


def _aux_layers(method, draft, target) -> list[Finding]:
    ids = draft.facts.aux_layer_ids
    if method is not Method.EAGLE3 or not ids:
        return []
    n = target.facts.layers
    if n is None:
        return [Finding("info", "aux_layers", "EAGLE-3 aux layer ids not checked: target num_hidden_layers unknown")]
    bad = [i for i in ids if i >= n or i < 0]
    if bad:
        return [
            Finding(
                "error",
                "aux_layers",
                f"EAGLE-3 aux hidden-state layer ids {list(ids)} include "
                f"{', '.join(map(str, bad))}, but the target has {n} layers",
            )
        ]
    return []


def _context(method, draft, target, profile, entry) -> list[Finding]:
    served = profile.model.max_model_len or target.facts.context
    trained = draft.facts.context or (entry.context if entry else None)
    if served is None or trained is None:
        return []
    cap = profile.speculative.draft_max_model_len
    if trained >= served or (cap is not None and cap <= trained):
        return []
    path = ("model", "max_model_len") if profile.model.max_model_len else DRAFT
    kind = (
        "EAGLE heads often slow down or fail past their trained length"
        if method in (Method.EAGLE, Method.EAGLE3)
        else "acceptance drops past it"
    )
    served_what = "max_model_len" if profile.model.max_model_len else "the target's context"
    return [
        Finding(
            "warning",
            "context",
            f"draft context {trained} < served context {served} ({served_what}): "
            f"{kind}; lower model.max_model_len or set speculative.draft_max_model_len",
            path,
        )
    ]


def _tp(method, profile) -> list[Finding]:
    dtp, tp = profile.speculative.draft_tensor_parallel_size, profile.gpus.tensor_parallel_size
    if method in NEEDS_DRAFT and dtp is not None and dtp not in (1, tp):
        return [
            Finding(
                "error",
                "tp",
                f"draft_tensor_parallel_size {dtp} must be 1 or the target's tensor_parallel_size {tp}",
                ("speculative", "draft_tensor_parallel_size"),
            )
        ]
    return []


def _tokenizer(method, draft, target) -> list[Finding]:
    if method is not Method.DRAFT_MODEL:
        return []
    if draft.tokenizer and target.tokenizer:
        if draft.tokenizer == target.tokenizer:
            return [Finding("info", "tokenizer", "tokenizer identical to the target's (same tokenizer file hash)")]
        return [
            Finding(
                "warning",
                "tokenizer",
                f"tokenizer differs from the target's ({_short(draft.tokenizer)} vs "
                f"{_short(target.tokenizer)}): token ids may not line up even with equal vocab sizes",
            )
        ]
    if draft.tokenizer_family and target.tokenizer_family:
        if draft.tokenizer_family != target.tokenizer_family:
            return [
                Finding(
                    "warning",
                    "tokenizer",
                    f"tokenizer families differ ({draft.tokenizer_family} vs "
                    f"{target.tokenizer_family}, from the catalog)",
                )
            ]
        return [Finding("info", "tokenizer", f"same tokenizer family ({draft.tokenizer_family}, from the catalog)")]
    return [
        Finding(
            "info",
            "tokenizer",
            "tokenizer identity not checked: no tokenizer hash for "
            + ("the draft" if not draft.tokenizer else "the target"),
        )
    ]


def _short(digest: str) -> str:
    kind, _, h = digest.partition(":")
    return f"{kind}:{h[:10]}"


def _gguf(method, draft, profile, be) -> list[Finding]:
    out = []
    if be.model_format == "gguf":
        if draft.kind == "hub" and not draft.gguf_file:
            out.append(
                Finding(
                    "error",
                    "gguf",
                    f"{be.engine_name} needs a GGUF draft: {draft.ref}: "
                    f"{draft.gguf_why or 'the repo has no .gguf file'}",
                )
            )
        elif draft.gguf_why and "not in the repo" in draft.gguf_why:
            out.append(
                Finding(
                    "warning",
                    "gguf",
                    f"{draft.ref}: {draft.gguf_why}; using {draft.gguf_file}",
                    ("speculative", "draft_quantization"),
                )
            )
    elif draft.kind == "local-gguf" or draft.gguf_file:
        out.append(
            Finding(
                "error",
                "gguf",
                f"{draft.ref} is a GGUF draft; {profile.backend} needs a Hugging Face repo or directory",
            )
        )
    return out


def _mtp_keys(target) -> str:
    if target.facts_source == "GGUF metadata":
        return "GGUF metadata has no <arch>.nextn_predict_layers"
    return "config.json has no num_nextn_predict_layers / mtp_num_hidden_layers"


def _mtp(target) -> list[Finding]:
    n = target.facts.mtp_layers
    if n:
        return [Finding("info", "mtp", f"target has {n} MTP layer(s)", METHOD)]
    if target.facts_source == "none":
        return [Finding("warning", "mtp", f"MTP layers not checked: {target.ref}'s config is unknown", METHOD)]
    return [
        Finding(
            "error",
            "mtp",
            f"{target.ref} has no MTP layers (its {_mtp_keys(target)}); pick another method",
            METHOD,
        )
    ]


def _memory(method, draft, target, profile, be) -> list[Finding]:
    est = estimate(
        profile,
        target.weights,
        draft.weights if draft is not None else None,
        has_draft=method in NEEDS_DRAFT,
        parallel_layout=be.parallel_layout,
    )
    if est.per_gpu_bytes is None:
        return []
    if est.over_budget:
        return [
            Finding(
                "warning",
                "memory",
                f"{est.line()}: over the gpus.memory_gb budget before any KV cache",
                ("gpus", "memory_gb"),
            )
        ]
    return [Finding("info", "memory", est.line(), ("gpus", "memory_gb"))]


def twin_memory(
    profile,
    target: ModelSize | None,
    drafts: dict[str, ModelSize | None],
    *,
    budget: int | None = None,
    budget_from: str = "",
) -> list[Finding]:
    """The memory fit extended to twins (:func:`~specops.resolve.memory.twin_problems`) as findings: an error,
    located at the field to change, for each engine or set of engines that does not fit; an info line when they
    do; nothing without twins or sizes."""
    fit, problems = twin_problems(profile, target, drafts, budget=budget, budget_from=budget_from)
    if fit is None:
        return []
    if problems:
        return [Finding("error", "memory", message, path) for path, message in problems]
    return [Finding("info", "memory", fit.line(), ("routing", "twins"))]


def resolved_twin_memory(res, *, budget: int | None = None, budget_from: str = "") -> list[Finding]:
    """:func:`twin_memory` with the sizes the resolver found (the Hub's metadata, the chosen GGUF), else local
    files'; kept apart from the draft's findings: a twin that does not fit is no reason to refuse the draft."""
    profile = res.profile
    if not profile.routing.twins:
        return []
    target = size_of_view(res.target) or local_size(profile.model.id)
    choice = res.choice
    drafts = {}
    for ref in engine_drafts(profile):
        view = choice.view if choice is not None and choice.draft == ref else None
        drafts[ref] = size_of_view(view) or local_size(ref)
    return twin_memory(profile, target, drafts, budget=budget, budget_from=budget_from)
