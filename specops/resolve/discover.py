"""Finding candidate drafts for a target: the catalog first, then the Hub.

Hub discovery uses only metadata: ``list_models(filter="base_model:<target>")`` for repos whose card names
the target, name searches for eagle / speculator / medusa / accelerator repos that name the target's
family and size, and a same-author, same-family search for small draft models. A Hub failure ends Hub
discovery with one note; the catalog's candidates remain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specops.methods import Method
from specops.resolve.catalog import Catalog, CatalogEntry
from specops.resolve.check import Finding
from specops.resolve.detect import (
    TRUST,
    detect_method,
    name_info,
    names_match,
    same_family_smaller,
    same_model,
    short_name,
)
from specops.resolve.hub import Hub, RepoMeta
from specops.resolve.huberrors import HubError

#: Name searches per method ("eagle" also finds eagle3 repos).
SEARCHES = {
    Method.EAGLE3: ("eagle", "speculator"),
    Method.EAGLE: ("eagle",),
    Method.MEDUSA: ("medusa",),
    Method.MLP_SPECULATOR: ("accelerator", "speculator"),
    Method.DFLASH: ("dflash",),
    Method.DSPARK: ("dspark",),
}


@dataclass
class Candidate:
    """One way to run speculation for the target, how it was found, and what the checks said."""

    method: Method
    draft: str | None
    signals: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    entry: CatalogEntry | None = None
    file: str | None = None
    revision: str | None = None
    findings: list[Finding] = field(default_factory=list)
    verdict: str = "unchecked"  # ok | warning | refused | unchecked
    note: str = ""  # why unchecked
    view: object = None  # the draft's ModelView once evaluated

    @property
    def trust(self) -> int:
        return min((TRUST.get(s, 9) for s in self.signals), default=9)

    @property
    def key(self) -> tuple:
        return (self.method, (self.draft or "").lower())

    @property
    def caveats(self) -> list[str]:
        return list(self.entry.caveats) if self.entry else []

    def add_signal(self, signal: str) -> None:
        if signal not in self.signals:
            self.signals.append(signal)
        self.signals.sort(key=lambda s: TRUST.get(s, 9))

    def why(self, *, popularity: bool = True) -> str:
        parts = ", ".join(self.signals) or "?"
        if popularity and (self.downloads or self.likes):
            parts += f"; {_count(self.downloads)} downloads, {_count(self.likes)} likes"
        return parts

    @property
    def reason(self) -> str:
        for sev in ("error", "warning"):
            for f in self.findings:
                if f.severity == sev:
                    return f.message
        if self.verdict == "unchecked":
            return self.note or "not checked"
        return "passes all checks"

    def to_dict(self, *, popularity: bool = True) -> dict:
        return {
            "method": self.method.value,
            "draft": self.draft,
            "file": self.file,
            "revision": self.revision,
            "verdict": self.verdict,
            "reason": self.reason,
            "why": self.why(popularity=popularity),
            "signals": list(self.signals),
            **({"downloads": self.downloads, "likes": self.likes} if popularity else {}),
            "caveats": self.caveats,
            "findings": [f.to_dict() for f in self.findings],
        }


def _count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1000:
        return f"{n / 1e3:.1f}k"
    return str(n)


class _Pool:
    def __init__(self):
        self.items: dict[tuple, Candidate] = {}

    def add(
        self,
        method: Method,
        draft: str | None,
        signal: str,
        *,
        meta: RepoMeta | None = None,
        entry: CatalogEntry | None = None,
    ) -> Candidate:
        key = (method, (draft or "").lower())
        c = self.items.get(key)
        if c is None:
            c = self.items[key] = Candidate(method, draft)
        c.add_signal(signal)
        if meta is not None:
            c.downloads, c.likes = max(c.downloads, meta.downloads), max(c.likes, meta.likes)
        if entry is not None and c.entry is None:
            c.entry = entry
        return c


def family_search(target_id: str) -> tuple[str | None, str | None]:
    """(author, search string) for same-family models: ``meta-llama``, ``Llama-3``; ``Qwen``, ``Qwen3``."""
    if "/" not in target_id:
        return None, None
    author, name = target_id.split("/", 1)
    m = re.match(r"^(.*?)[-_](\d+(?:\.\d+)?|\d+x\d+)[bB](?![a-zA-Z])", name)
    prefix = m.group(1) if m else None
    if not prefix:
        return author, None
    if name_info(target_id).family == "llama":
        prefix = re.sub(r"(\d)\.\d+$", r"\1", prefix)  # Llama 3.2 drafts serve Llama 3.1 / 3.3 targets
    return author, prefix


def discover(
    target,
    profile,
    methods: list[Method],
    *,
    hub: Hub,
    catalog: Catalog,
    notes: list[str],
    use_hub: bool = True,
    gguf: bool | None = None,
) -> list[Candidate]:
    """Candidates for ``target`` (a ModelView) among ``methods``, unranked.

    ``gguf``: whether the backend loads GGUF files (its ``model_format``); None: the profile's backend's.
    """
    pool = _Pool()
    tid = target.ref
    if gguf is None:
        from specops.plugins import get_registry

        gguf = getattr(get_registry().backends.get(profile.backend), "model_format", "hf") == "gguf"
    for e in catalog.for_target(tid):
        if e.method in methods:
            pool.add(e.method, e.draft_repo, "catalog", entry=e)
    if Method.MTP in methods and target.facts.mtp_layers:
        pool.add(Method.MTP, None, "target config")
    if Method.NGRAM in methods:
        pool.add(Method.NGRAM, None, "built-in")
    if use_hub and not target.is_local and hub.down is None and not hub.offline:
        try:
            _hub_discovery(pool, target, methods, hub, catalog, gguf)
        except HubError as exc:
            notes.append(
                f"Hub discovery stopped: {exc}; candidates come from the catalog"
                + (" and what was found before" if pool.items else "")
            )
    return list(pool.items.values())


def _hub_discovery(pool: _Pool, target, methods, hub: Hub, catalog: Catalog, gguf: bool) -> None:
    tid = target.ref
    head_methods = [m for m in methods if m in SEARCHES]
    if head_methods:
        for meta in hub.list_models(filter=f"base_model:{tid}"):
            method, why = detect_method(meta.config, meta.id)
            if method in head_methods and _fits_backend(meta, gguf):
                pool.add(method, meta.id, "base_model tag", meta=meta)
        terms: list[str] = []
        for m in head_methods:
            terms += [t for t in SEARCHES[m] if t not in terms]
        for term in terms:
            for meta in hub.list_models(search=term):
                method, why = detect_method(meta.config, meta.id)
                if method not in head_methods or not _fits_backend(meta, gguf):
                    continue
                card_base = _card_bases(meta)
                if any(same_model(b, tid, catalog.aliases) for b in card_base):
                    pool.add(method, meta.id, "card base_model", meta=meta)
                elif names_match(tid, meta.id):
                    pool.add(method, meta.id, "name", meta=meta)
    if Method.DRAFT_MODEL in methods:
        author, prefix = family_search(tid)
        if author and prefix:
            for meta in hub.list_models(author=author, search=prefix):
                info = name_info(meta.id)
                if meta.id.lower() == tid.lower() or not _fits_backend(meta, gguf):
                    continue
                if info.quantized and not gguf:
                    continue
                if same_family_smaller(tid, meta.id):
                    pool.add(Method.DRAFT_MODEL, meta.id, "same family", meta=meta)


def _card_bases(meta: RepoMeta) -> list[str]:
    base = (meta.card_data or {}).get("base_model")
    return (
        [base] if isinstance(base, str) else [b for b in base if isinstance(b, str)] if isinstance(base, list) else []
    )


def _fits_backend(meta: RepoMeta, gguf: bool) -> bool:
    """A GGUF backend (llama.cpp) needs GGUF repos; the others (vLLM) need non-GGUF ones."""
    is_gguf = "gguf" in (meta.tags or []) or short_name(meta.id).lower().endswith("gguf")
    return is_gguf if gguf else not is_gguf
