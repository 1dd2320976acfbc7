"""The curated draft catalog shipped with specops (``specops/data/catalog.yaml``).

It ranks first among candidates, works offline, and its model facts let the checks run without the Hub.
``SPECOPS_CATALOG`` may name extra catalog files (``os.pathsep``-separated) whose entries come first, so a
platform team can add its own trained drafts without forking specops.

Each entry names its draft's ``format`` (one of :data:`FORMATS`, the catalog's ``formats:`` section) and says how the pair is ``known``: read in
its ``source`` only, or also through the format's tiny checkpoint speculating on a real engine, which
:func:`format_evidence` looks up in the measured support matrix (``specops/data/support_matrix.json``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import yaml

from specops.backends.measured import Cell
from specops.backends.measured import cells as measured_cells
from specops.backends.versions import Version
from specops.errors import SpecopsError
from specops.methods import Method
from specops.resolve.detect import ConfigFacts

SELF = "self"
#: How a pair is known: ``documented`` (read in its source only) or ``tiny-format`` (also: the support matrix
#: measured the draft's format speculating on an engine the entry lists, with a tiny generated checkpoint).
KNOWN = ("documented", "tiny-format")
#: Matrix outcomes that say nothing about what the engine does with a format.
UNMEASURED = ("not-measured", "rendered-refused")


@dataclass(frozen=True)
class DraftFormat:
    """A draft checkpoint layout, and the support-matrix cells whose tiny checkpoint stands for it."""

    name: str
    method: Method
    what: str
    #: engine → text the matrix cell's ``format`` starts with (case-insensitive); none: never measured
    cells: tuple[tuple[str, str], ...] = ()
    #: what a speculating tiny checkpoint does not show (printed with the measurement)
    caveat: str = ""


#: The keys a ``formats:`` item may have.
FORMAT_KEYS = {"method", "what", "cells", "caveat"}


def _draft_formats(raw, origin: str) -> dict[str, DraftFormat]:
    """The ``formats:`` section of a catalog file: format name → :class:`DraftFormat`, in file order."""
    if not isinstance(raw, dict):
        raise SpecopsError(f"{origin}: formats must map a format name to its method, what, cells and caveat")
    out: dict[str, DraftFormat] = {}
    for name, item in raw.items():
        where = f"{origin}: formats.{name}"
        if not isinstance(item, dict) or not item.get("method") or not item.get("what"):
            raise SpecopsError(f"{where}: a draft format needs a method and what it is")
        unknown = set(item) - FORMAT_KEYS
        if unknown:
            raise SpecopsError(f"{where}: unknown format keys {', '.join(sorted(unknown))}")
        try:
            method = Method(item["method"])
        except ValueError:
            raise SpecopsError(f"{where}: unknown method {item['method']!r}") from None
        cells = item.get("cells") or {}
        if not isinstance(cells, dict):
            raise SpecopsError(f"{where}: cells must map an engine to the start of its matrix cells' format")
        out[str(name)] = DraftFormat(
            str(name),
            method,
            str(item["what"]),
            tuple((str(engine), str(prefix)) for engine, prefix in cells.items()),
            str(item.get("caveat") or ""),
        )
    return out


class _ShippedFormats(Mapping[str, DraftFormat]):
    """The shipped catalog's ``formats:`` section, read on first use (importing this module parses no YAML)."""

    def _table(self) -> dict[str, DraftFormat]:
        return _shipped_formats()

    def __getitem__(self, name: str) -> DraftFormat:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"FORMATS({', '.join(self)})"


#: Draft checkpoint layouts by name: the ``formats:`` section of ``specops/data/catalog.yaml`` (only the
#: shipped catalog's; entries of ``SPECOPS_CATALOG`` files name one of these).
FORMATS: Mapping[str, DraftFormat] = _ShippedFormats()


def _engine_name(engine: str) -> str:
    """How messages name ``engine`` (the registered backend's :attr:`engine_name`, else ``engine`` itself)."""
    from specops.plugins import get_registry

    backend = get_registry().backends.get(engine)
    return getattr(backend, "engine_name", engine) if backend is not None else engine


def measurements(fmt: DraftFormat, cells: Iterable[Cell] | None = None) -> list[Cell]:
    """The support-matrix cells measured with ``fmt``'s tiny checkpoint (``cells``: default the shipped
    matrix, :func:`specops.backends.measured.cells`), in matrix order."""
    return [
        c
        for c in (measured_cells() if cells is None else cells)
        for engine, prefix in fmt.cells
        if c.engine == engine and c.method == fmt.method.value and c.format.lower().startswith(prefix.lower())
    ]


def format_evidence(entry: CatalogEntry, cells: Iterable[Cell] | None = None, engine: str | None = None) -> str:
    """One line on how ``entry`` is known: its format's tiny checkpoint as measured on the entry's engines
    (``cells``: the support matrix's; default the shipped one), or "documented only". With ``engine`` (the
    backend a resolution asked for) the line speaks of that engine only, and says so when the catalog lists
    the pair for other engines, so a vLLM resolution never reads as a llama.cpp measurement."""
    fmt = FORMATS.get(entry.format or "")
    if fmt is None:
        return "documented only (no draft format named)"
    if engine is not None and entry.backends and engine not in entry.backends:
        return _elsewhere_evidence(entry, fmt, engine, measured_cells() if cells is None else tuple(cells))
    if engine is not None:
        entry = replace(entry, backends=(engine,)) if entry.backends else entry

    def where(ms: list[Cell], outcome: bool = False) -> str:
        return ", ".join(
            f"{_engine_name(m.engine)} {m.version}"
            + (f": {m.outcome}" + (f" ({m.level} level)" if m.level else "") if outcome else "")
            for m in ms
        )

    engines = entry.backends or tuple(e for e, _ in fmt.cells)
    cells = measured_cells() if cells is None else tuple(cells)
    #: launched on the engine (specops refusing to render, or a cell never run, measures nothing)
    found = [m for m in measurements(fmt, cells) if m.engine in engines and m.outcome not in UNMEASURED]
    good = [m for m in found if m.speculating]
    caveat = f"; {fmt.caveat}" if fmt.caveat else ""
    if good and entry.backends:
        bad = [m for m in found if not m.speculating]
        return (
            f"format {fmt.name} measured speculating on {where(good)} (tiny checkpoint: {good[0].format})"
            + (f"; not on {where(bad, True)}" if bad else "")
            + caveat
        )
    if good:
        return (
            f"documented only: no engine specops renders for loads it as published (a tiny {fmt.name} checkpoint "
            f"did speculate on {where(good)}{caveat})"
        )
    if found:
        return f"documented only; format {fmt.name} measured not speculating ({where(found, True)}, tiny checkpoint)"
    named = ", ".join(_engine_name(e) for e in engines)
    return f"documented only (format {fmt.name} not measured on {named or 'any engine'})"


def _elsewhere_evidence(entry: CatalogEntry, fmt: DraftFormat, engine: str, cells: tuple[Cell, ...]) -> str:
    """How a pair listed for other engines is known on ``engine``: not documented there, and what the matrix
    measured of its format on ``engine`` (the engine a resolution asked for)."""
    asked = _engine_name(engine)
    listed = ", ".join(_engine_name(e) for e in entry.backends)
    found = [m for m in measurements(fmt, cells) if m.engine == engine and m.outcome not in UNMEASURED]
    good = [m for m in found if m.speculating]
    head = f"not documented on {asked} (the catalog lists the pair for {listed})"
    if good:
        versions = ", ".join(f"{asked} {m.version}" for m in good)
        return f"{head}; format {fmt.name} measured speculating on {versions} (tiny checkpoint: {good[0].format})"
    if found:
        return f"{head}; format {fmt.name} measured not speculating on {asked}"
    return f"{head}; format {fmt.name} not measured on {asked}"


def measured_speculating(entry: CatalogEntry, cells: Iterable[Cell] | None = None) -> list[Cell]:
    """The matrix cells where ``entry``'s format speculated on one of the engines the entry lists."""
    fmt = FORMATS.get(entry.format or "")
    if fmt is None:
        return []
    return [m for m in measurements(fmt, cells) if m.engine in entry.backends and m.speculating]


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
    format: str | None = None  # a key of FORMATS
    known: str = "documented"  # one of KNOWN
    #: engine → the oldest version that runs this draft as published (e.g. ``{vllm: 0.19.0}``)
    min_version: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,) + self.also

    @property
    def draft_repo(self) -> str | None:
        return None if self.draft == SELF else self.draft

    def min_version_for(self, backend: str) -> str | None:
        v = self.min_version.get(backend)
        return str(v) if v else None

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


KEYS = {
    "target",
    "draft",
    "method",
    "backends",
    "source",
    "also",
    "context",
    "files",
    "caveats",
    "format",
    "known",
    "min_version",
}


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
    unknown = set(raw) - KEYS
    if unknown:
        raise SpecopsError(f"{where}: unknown catalog keys {', '.join(sorted(unknown))}")
    fmt = raw.get("format")
    if fmt is not None:
        if fmt not in FORMATS:
            raise SpecopsError(f"{where}: unknown draft format {fmt!r} (known: {', '.join(FORMATS)})")
        if FORMATS[fmt].method is not method:
            raise SpecopsError(f"{where}: format {fmt} is a {FORMATS[fmt].method} draft, not {method}")
    known = str(raw.get("known", "documented"))
    if known not in KNOWN:
        raise SpecopsError(f"{where}: known must be one of {', '.join(KNOWN)}, not {known!r}")
    min_version = raw.get("min_version") or {}
    if not isinstance(min_version, dict):
        raise SpecopsError(f"{where}: min_version must map an engine to a version, e.g. {{vllm: 0.19.0}}")
    for engine, v in min_version.items():
        try:
            Version(str(v))
        except ValueError:
            raise SpecopsError(f"{where}: min_version.{engine}: not a version: {v!r}") from None
    # backends: [] says no engine specops renders for loads the draft as published (kept, not defaulted)
    backends = raw["backends"] if "backends" in raw and raw["backends"] is not None else default_backends
    return CatalogEntry(
        target=str(raw["target"]),
        draft=str(raw["draft"]),
        method=method,
        backends=tuple(str(b) for b in backends),
        source=str(raw["source"]),
        also=tuple(raw.get("also") or ()),
        context=raw.get("context"),
        files=dict(raw.get("files") or {}),
        caveats=tuple(raw.get("caveats") or ()),
        format=str(fmt) if fmt is not None else None,
        known=known,
        min_version={str(k): str(v) for k, v in min_version.items()},
    )


def _yaml(text: str, origin: str) -> dict:
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SpecopsError(f"{origin}: not valid YAML: {exc}") from None


SHIPPED = "specops/data/catalog.yaml"


@functools.lru_cache(maxsize=1)
def _shipped_data() -> dict:
    """The shipped catalog file, parsed once (its entries and its ``formats:`` section both come from it)."""
    return _yaml(resources.files("specops").joinpath("data/catalog.yaml").read_text(encoding="utf-8"), SHIPPED)


@functools.lru_cache(maxsize=1)
def _shipped_formats() -> dict[str, DraftFormat]:
    return _draft_formats(_shipped_data().get("formats") or {}, SHIPPED)


def parse_catalog(text: str, origin: str, default_backends: tuple[str, ...] = ()) -> Catalog:
    """A catalog file; entries without ``backends`` get its ``default_backends`` (else ``default_backends``)."""
    return _catalog(_yaml(text, origin), origin, default_backends)


def _catalog(data: dict, origin: str, default_backends: tuple[str, ...] = ()) -> Catalog:
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
    base = _catalog(_shipped_data(), SHIPPED)
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
