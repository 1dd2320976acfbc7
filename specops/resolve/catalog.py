"""The curated draft catalog shipped with specops (``specops/data/catalog.yaml``).

It ranks first among candidates, works offline, and its model facts let the checks run without the Hub.
``SPECOPS_CATALOG`` may name extra catalog files (``os.pathsep``-separated) whose entries come first, so a
platform team can add its own trained drafts without forking specops.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from specops.errors import SpecopsError
from specops.methods import Method
from specops.resolve.detect import ConfigFacts

SELF = "self"


@dataclass(frozen=True)
class CatalogEntry:
    """One published (target → draft) pair."""

    target: str
    draft: str  # a repo id, or "self" for MTP
    method: Method
    backends: tuple[str, ...]
    source: str
    also: tuple[str, ...] = ()
    context: int | None = None
    files: dict = field(default_factory=dict, hash=False, compare=False)
    caveats: tuple[str, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,) + self.also

    @property
    def draft_repo(self) -> str | None:
        return None if self.draft == SELF else self.draft

    def file_for(self, quant: str) -> str | None:
        for q, f in self.files.items():
            if q.upper() == quant.upper():
                return f
        return None


@dataclass(frozen=True)
class ModelFacts:
    """Published facts of one repo (config.json values, parameter count, tokenizer family)."""

    vocab: int | None = None
    hidden: int | None = None
    layers: int | None = None
    context: int | None = None
    mtp: int | None = None
    params: float | None = None  # billions
    tokenizer: str | None = None
    of: str | None = None  # a GGUF repo: the HF model it converts

    def config_facts(self) -> ConfigFacts:
        return ConfigFacts(
            vocab=self.vocab, hidden=self.hidden, layers=self.layers, context=self.context, mtp_layers=self.mtp
        )


class Catalog:
    def __init__(
        self,
        entries: list[CatalogEntry],
        models: dict[str, ModelFacts],
        aliases: dict[str, str],
        version: str = "1",
        default_backends: tuple[str, ...] = (),
    ):
        self.entries = entries
        self.models = {k.lower(): v for k, v in models.items()}
        self.aliases = {k.lower(): v for k, v in aliases.items()}
        self.version = version
        #: ``backends`` of an entry that names none (the shipped catalog's ``default_backends``).
        self.default_backends = default_backends

    def canonical(self, repo: str) -> str:
        return self.aliases.get(repo.lower(), repo)

    def _same(self, a: str, b: str) -> bool:
        return self.canonical(a).lower() == self.canonical(b).lower()

    def for_target(self, target: str) -> list[CatalogEntry]:
        """Entries whose target (or ``also``) is ``target``, in catalog order."""
        return [e for e in self.entries if any(self._same(t, target) for t in e.targets)]

    def for_draft(self, draft: str) -> list[CatalogEntry]:
        return [e for e in self.entries if e.draft_repo and self._same(e.draft_repo, draft)]

    def pair(self, target: str, draft: str | None, method: Method | None = None) -> CatalogEntry | None:
        for e in self.for_target(target):
            if (
                draft is None and e.draft_repo is None or draft and e.draft_repo and self._same(e.draft_repo, draft)
            ) and (method is None or e.method is method):
                return e
        return None

    def facts(self, repo: str) -> ModelFacts | None:
        f = self.models.get(self.canonical(repo).lower())
        if f is not None and f.of and all(getattr(f, n) is None for n in ("vocab", "hidden", "layers")):
            base = self.models.get(f.of.lower())
            if base is not None:
                return ModelFacts(**{**base.__dict__, "of": f.of})
        return f


def _entry(raw: dict, where: str, default_backends: tuple[str, ...] = ()) -> CatalogEntry:
    if not isinstance(raw, dict):
        raise SpecopsError(f"{where}: a catalog entry must be a mapping")
    missing = [k for k in ("target", "draft", "method", "source") if not raw.get(k)]
    if missing:
        raise SpecopsError(f"{where}: catalog entry lacks {', '.join(missing)}")
    try:
        method = Method(raw["method"])
    except ValueError:
        raise SpecopsError(f"{where}: unknown method {raw['method']!r}") from None
    if method in (Method.AUTO, Method.NONE, Method.NGRAM, Method.SUFFIX):
        raise SpecopsError(f"{where}: method {method} has no draft to catalog")
    if (method is Method.MTP) != (raw["draft"] == SELF):
        raise SpecopsError(f"{where}: MTP entries (and only they) use draft: self")
    unknown = set(raw) - {"target", "draft", "method", "backends", "source", "also", "context", "files", "caveats"}
    if unknown:
        raise SpecopsError(f"{where}: unknown catalog keys {', '.join(sorted(unknown))}")
    return CatalogEntry(
        target=str(raw["target"]),
        draft=str(raw["draft"]),
        method=method,
        backends=tuple(raw.get("backends") or default_backends),
        source=str(raw["source"]),
        also=tuple(raw.get("also") or ()),
        context=raw.get("context"),
        files=dict(raw.get("files") or {}),
        caveats=tuple(raw.get("caveats") or ()),
    )


def parse_catalog(text: str, origin: str, default_backends: tuple[str, ...] = ()) -> Catalog:
    """A catalog file; entries without ``backends`` get its ``default_backends`` (else ``default_backends``)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SpecopsError(f"{origin}: not valid YAML: {exc}") from None
    default_backends = tuple(str(b) for b in data.get("default_backends") or default_backends)
    entries = [
        _entry(raw, f"{origin}: entries[{i}]", default_backends) for i, raw in enumerate(data.get("entries") or [])
    ]
    models = {}
    for repo, raw in (data.get("models") or {}).items():
        try:
            models[str(repo)] = ModelFacts(**(raw or {}))
        except TypeError as exc:
            raise SpecopsError(f"{origin}: models.{repo}: {exc}") from None
    return Catalog(
        entries,
        models,
        {str(k): str(v) for k, v in (data.get("aliases") or {}).items()},
        str(data.get("version", "1")),
        default_backends,
    )


@functools.lru_cache(maxsize=4)
def _load(extra: str) -> Catalog:
    text = resources.files("specops").joinpath("data/catalog.yaml").read_text(encoding="utf-8")
    base = parse_catalog(text, "specops/data/catalog.yaml")
    for path in [p for p in extra.split(os.pathsep) if p]:
        try:
            more = parse_catalog(Path(path).expanduser().read_text(encoding="utf-8"), path, base.default_backends)
        except OSError as exc:
            raise SpecopsError(f"SPECOPS_CATALOG: cannot read {path}: {exc.strerror}") from None
        base = Catalog(
            more.entries + base.entries,
            {**base.models, **more.models},
            {**base.aliases, **more.aliases},
            base.version,
            base.default_backends,
        )
    return base


def load_catalog() -> Catalog:
    """The shipped catalog, extended by the files in ``SPECOPS_CATALOG`` (cached per value)."""
    return _load(os.environ.get("SPECOPS_CATALOG", ""))
