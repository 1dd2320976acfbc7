"""Resolve a profile's draft: lock → catalog + Hub discovery → checks → choice → a profile with no ``auto``.

The pipeline: load the target (Hub metadata, config.json, or the cache / catalog when offline); list the
candidates (discover.py) and rank them (auto.py); check the best ones (check.py) and pick the first that
passes. A fresh lock file short-cuts all of it (no Hub call); a stale one is reported and resolution runs
afresh. The result explains itself: every candidate with its verdict and reason, every note about the
Hub, the cache or the lock.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specops.backends import DEFAULT_BACKEND
from specops.backends.versions import Version
from specops.errors import ProfileError, SpecopsError
from specops.methods import NEEDS_DRAFT, Method
from specops.resolve.auto import choose, methods_for, sort_key
from specops.resolve.catalog import FORMATS, Catalog, CatalogEntry, format_evidence, load_catalog
from specops.resolve.check import Finding, backend_findings, compat_findings, resolved_twin_memory
from specops.resolve.discover import Candidate, discover
from specops.resolve.hub import Hub
from specops.resolve.lock import apply_lock, lock_path, read_lock, stale_reason
from specops.resolve.memory import MemoryEstimate, estimate
from specops.resolve.models import ModelView, load_model

#: How many candidates are checked against the Hub (each costs ~3 small requests).
MAX_CHECKED = 6


@dataclass
class Resolution:
    """What resolution decided, and why."""

    profile: object  # the Profile with method/draft filled in
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    choice: Candidate | None = None
    target: ModelView | None = None
    memory: MemoryEstimate | None = None
    from_lock: bool = False
    lock_file: str | None = None
    catalog_version: str = ""
    requested: Method = Method.AUTO

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_dict(self) -> dict:
        spec = self.profile.speculative
        return {
            "target": self.target.summary() if self.target else None,
            "backend": self.profile.backend,
            "requested_method": self.requested.value,
            "resolved": {
                "method": spec.method.value,
                "draft": spec.draft,
                "draft_revision": spec.draft_revision,
                "draft_file": spec.draft_file,
                "model_revision": self.profile.model.revision,
            },
            "choice": self.choice.to_dict() if self.choice else None,
            "candidates": [
                dict(
                    rank=i + 1,
                    **c.to_dict(),
                    **({"catalog": catalog_dict(c.entry, self.profile.backend)} if c.entry else {}),
                )
                for i, c in enumerate(self.candidates)
            ],
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
            "memory": self.memory.to_dict() if self.memory else None,
            "from_lock": self.from_lock,
            "lock_file": self.lock_file,
        }


def _backend(profile):
    from specops.plugins import get_registry

    return get_registry().backends.get(profile.backend)


def _gguf(backend_obj) -> bool:
    """Whether the backend loads GGUF files (so targets and drafts are looked up as GGUF repos/files)."""
    return getattr(backend_obj, "model_format", "hf") == "gguf"


def resolve_profile(
    loaded,
    *,
    offline: bool = False,
    use_lock: bool = True,
    verify: bool = False,
    raise_errors: bool = True,
    hub: Hub | None = None,
    progress: Callable[[str], None] | None = None,
) -> Resolution:
    """Resolve ``loaded`` (a LoadedProfile). With a fresh lock (and ``verify`` false) no Hub call is made.

    Raises :class:`ProfileError` (located at the offending field) when the result has errors, unless
    ``raise_errors`` is false. ``offline`` (or ``HF_HUB_OFFLINE=1``) uses only the lock, the HF cache and the
    catalog.
    """
    profile = loaded.profile
    notes: list[str] = []
    lock_file = lock_path(loaded.path)
    lock = None
    if use_lock and lock_file.is_file():
        lock = read_lock(lock_file)
        stale = stale_reason(lock, profile)
        if stale is None:
            pinned = apply_lock(profile, lock)
            note = f"using {lock_file.name}: {_lock_line(lock)}"
            if not verify:
                res = _from_lock(pinned, lock, note, str(lock_file))
                return _finish(res, loaded, raise_errors)
            res = resolve(pinned, offline=offline, hub=hub, progress=progress, explicit_revisions=True)
            res.notes.insert(0, note)
            res.from_lock, res.lock_file = True, str(lock_file)
            return _finish(res, loaded, raise_errors)
        notes.append(
            f"lock is stale: {stale}; resolving afresh (run `specops lock {loaded.path}` to update {lock_file.name})"
        )
    res = resolve(profile, offline=offline, hub=hub, progress=progress)
    res.notes = notes + res.notes
    return _finish(res, loaded, raise_errors)


def check_loaded(loaded, *, offline: bool = False) -> list[Finding]:
    """The resolver's errors and warnings for a loaded profile (``specops validate --resolve``).

    Resolves ``auto`` the way ``render`` would (a fresh lock is verified against the Hub / cache, a stale
    one is reported), and never raises for a failed check: errors come back as findings.
    """
    res = resolve_profile(loaded, offline=offline, use_lock=True, verify=True, raise_errors=False)
    notes = [Finding("warning", "lock", n, ("speculative",)) for n in res.notes if n.startswith("lock is stale")]
    return notes + [f for f in res.findings + resolved_twin_memory(res) if f.severity in ("error", "warning")]


def _lock_line(lock: dict) -> str:
    s = lock["speculative"]
    rev = (s.get("draft_revision") or "")[:10]
    what = s["method"] + (f" {s['draft']}" if s.get("draft") else "") + (f"@{rev}" if rev else "")
    return what + (f" ({s['draft_file']})" if s.get("draft_file") else "")


def _from_lock(profile, lock: dict, note: str, lock_file: str) -> Resolution:
    locked_spec = (lock.get("inputs") or {}).get("speculative") or {}
    try:
        requested = Method(locked_spec.get("method", Method.NONE.value))
    except ValueError:
        requested = Method.NONE
    res = Resolution(
        profile=profile,
        notes=[note],
        from_lock=True,
        lock_file=lock_file,
        catalog_version=str(lock.get("catalog_version", "")),
        requested=requested,
    )
    res.findings = [Finding.from_dict(f) for f in lock.get("findings") or []]
    for alt in lock.get("alternatives") or []:
        try:
            c = Candidate(
                Method(alt["method"]),
                alt.get("draft"),
                signals=[s.strip() for s in str(alt.get("why", "")).split(",") if s.strip()],
            )
        except (KeyError, ValueError):
            continue
        c.verdict, c.note = alt.get("verdict", "unchecked"), alt.get("reason", "")
        res.candidates.append(c)
        s = lock["speculative"]
        if res.choice is None and c.method.value == s["method"] and c.draft == s.get("draft"):
            res.choice = c
    return res


def _finish(res: Resolution, loaded, raise_errors: bool) -> Resolution:
    if raise_errors and res.errors:
        raise ProfileError([loaded.problem(f.path, f.message) for f in res.errors])
    return res


def resolve(
    profile,
    *,
    offline: bool = False,
    hub: Hub | None = None,
    catalog: Catalog | None = None,
    progress: Callable[[str], None] | None = None,
    explicit_revisions: bool = False,
    max_checked: int = MAX_CHECKED,
) -> Resolution:
    """Resolve a :class:`~specops.config.profile.Profile` (no lock handling, never raises for failed checks)."""
    hub = hub or Hub(offline=offline or None, progress=progress)
    if offline:
        hub.offline = True
    catalog = catalog or load_catalog()
    backend_obj = _backend(profile)
    spec = profile.speculative
    requested = spec.method
    res = Resolution(profile=profile, catalog_version=catalog.version, requested=requested)
    if hub.offline:
        res.notes.append("offline: using only the lock, the HF cache and the catalog")

    if requested in (Method.NONE, Method.NGRAM, Method.SUFFIX) and spec.draft in (None, "auto"):
        res.findings = backend_findings(requested, profile, backend_obj)
        return res

    gguf = _gguf(backend_obj)
    target = load_model(
        profile.model.id,
        hub=hub,
        catalog=catalog,
        revision=profile.model.revision,
        gguf=gguf,
        quant=profile.model.quantization,
        file=profile.model.file,
    )
    res.target = target
    _target_notes(res, target, hub)
    if target.fatal is not None:
        res.findings.append(Finding("error", "hub", f"target: {target.fatal}", ("model", "id")))
        return res

    if requested is Method.MTP or (requested in NEEDS_DRAFT and spec.draft not in (None, "auto")):
        return _resolve_named(res, profile, target, catalog, hub, backend_obj, explicit_revisions)
    return _resolve_discovered(res, profile, target, catalog, hub, backend_obj, gguf, max_checked)


def _resolve_named(
    res: Resolution, profile, target: ModelView, catalog: Catalog, hub: Hub, backend_obj, explicit_revisions: bool
) -> Resolution:
    """The draft the profile names (or MTP): checked on its own, chosen when the checks pass."""
    cand = _explicit(profile, target, catalog, hub, backend_obj, explicit_revisions)
    res.candidates = [cand]
    res.findings = list(cand.findings)
    if cand.verdict in ("ok", "warning"):
        res.choice = cand
        res.profile = _with_choice(profile, cand, keep_revision=True)
        res.memory = _memory_of(profile, target, cand)
    return res


def _resolve_discovered(
    res: Resolution, profile, target: ModelView, catalog: Catalog, hub: Hub, backend_obj, gguf: bool, max_checked: int
) -> Resolution:
    """``auto`` or a method without a named draft: discover candidates, check the best-ranked, choose one."""
    requested = res.requested
    methods = methods_for(requested, backend_obj.methods if backend_obj else None)
    candidates = discover(target, profile, methods, hub=hub, catalog=catalog, notes=res.notes, gguf=gguf)
    res.notes.extend(w for w in hub.warnings if w not in res.notes)  # Hub answers left out as unusable
    _check_ranked(candidates, profile, target, catalog, hub, backend_obj, requested, max_checked)
    res.candidates = candidates
    res.choice = choose(candidates, requested)
    if res.choice is None:
        res.findings.append(_no_draft_finding(candidates, profile, target, requested))
        res.notes.extend(_sibling_notes(catalog, target, requested, candidates))
        return res
    res.findings = list(res.choice.findings)
    res.profile = _with_choice(profile, res.choice, keep_revision=False)
    res.memory = _memory_of(profile, target, res.choice)
    return res


def _check_ranked(
    candidates: list[Candidate],
    profile,
    target: ModelView,
    catalog: Catalog,
    hub: Hub,
    backend_obj,
    requested: Method,
    max_checked: int,
) -> None:
    """Check candidates best-ranked first: ``max_checked`` of them, more (up to twice) only while none passed;
    then rank them again by what the checks found (in place)."""
    candidates.sort(key=lambda c: sort_key(c, requested))
    checked = 0
    for c in candidates:
        if checked >= max_checked and choose(candidates, requested) is not None:
            c.note = "not checked: a better-ranked candidate passed"
            continue
        if checked >= 2 * max_checked:
            c.note = f"not checked (only the {2 * max_checked} best are checked)"
            continue
        _evaluate(c, profile, target, catalog, hub, backend_obj, explicit=False)
        checked += 1
    candidates.sort(key=lambda c: sort_key(c, requested))


def _no_draft_finding(candidates: list[Candidate], profile, target: ModelView, requested: Method) -> Finding:
    tried = (
        "; ".join(f"{c.method} {c.draft or ''}".strip() + f" {c.verdict}: {c.reason}" for c in candidates[:3])
        or "none found"
    )
    what = "any method" if requested is Method.AUTO else f"method {requested}"
    return Finding(
        "error",
        "resolve",
        f"no draft for {target.ref} passes the checks for {what} on {profile.backend} (candidates: {tried})",
        ("speculative", "draft" if requested in NEEDS_DRAFT else "method"),
    )


def _sibling_notes(catalog: Catalog, target: ModelView, requested: Method, candidates: list[Candidate]) -> list[str]:
    """When nothing passed: catalog drafts of the requested method published for another target with the same
    shape (tokenizer family, hidden size, layers), named as such and not offered: they were not trained for it."""
    mine = catalog.facts(target.ref)
    if mine is None or not (mine.tokenizer and mine.hidden and mine.layers):
        return []
    tried = {(c.method, (c.draft or "").lower()) for c in candidates}
    out = []
    for e in catalog.entries:
        if requested not in (Method.AUTO, e.method) or e.draft_repo is None or (e.method, e.draft.lower()) in tried:
            continue
        if any(catalog.canonical(t).lower() == catalog.canonical(target.ref).lower() for t in e.targets):
            continue
        theirs = catalog.facts(e.target)
        if theirs is not None and (theirs.tokenizer, theirs.hidden, theirs.layers) == (
            mine.tokenizer,
            mine.hidden,
            mine.layers,
        ):
            out.append(
                f"the catalog has {e.method} {e.draft} for {e.target} (same tokenizer and shape as {target.ref}); "
                f"it was trained for that model, not this one: name it explicitly to try it ({e.source})"
            )
    return out


def _target_notes(res: Resolution, target: ModelView, hub: Hub) -> None:
    for err in target.errors:
        if err.hub_is_down and not hub.offline:
            res.notes.append(f"{err}; falling back to the HF cache and the catalog")
        elif err.kind not in ("offline",) and err is not target.fatal:
            res.notes.append(f"target: {err}")
    res.notes.extend(target.notes)
    if target.facts_source == "none" and target.fatal is None:
        res.notes.append(
            f"target {target.ref}: no config facts (not on the Hub, in the cache or in the catalog): "
            f"vocab/hidden/MTP checks cannot run"
        )


def _explicit(profile, target, catalog, hub, backend_obj, explicit_revisions) -> Candidate:
    spec = profile.speculative
    method = spec.method
    draft = None if method is Method.MTP else spec.draft
    c = Candidate(method, draft, signals=["profile"])
    entry = catalog.pair(target.ref, draft, method)
    if entry is not None:
        c.entry = entry
        c.add_signal("catalog")
    _evaluate(c, profile, target, catalog, hub, backend_obj, explicit=True)
    return c


def _evaluate(c: Candidate, profile, target, catalog, hub, backend_obj, *, explicit: bool) -> None:
    spec = profile.speculative
    view = None
    if c.method in NEEDS_DRAFT and c.draft:
        view = load_model(
            c.draft,
            hub=hub,
            catalog=catalog,
            revision=spec.draft_revision if explicit else None,
            gguf=_gguf(backend_obj),
            quant=spec.draft_quantization,
            file=spec.draft_file if explicit else None,
            tokenizer=c.method is Method.DRAFT_MODEL,
        )
        c.view, c.revision, c.file = view, view.revision, view.gguf_file
        if c.entry is None:
            c.entry = catalog.pair(target.ref, c.draft, c.method)
        for d in view.declared:
            if d.source != "card base_model" and _same_target(d.target, target, catalog):
                c.add_signal(d.source)
        if view.meta is not None:
            c.downloads, c.likes = max(c.downloads, view.meta.downloads), max(c.likes, view.meta.likes)
    c.findings = compat_findings(
        c.method, view, target, profile, catalog=catalog, backend_obj=backend_obj, entry=c.entry, explicit=explicit
    )
    if c.entry is not None:
        c.findings += catalog_findings(c.entry, profile)
    sev = {f.severity for f in c.findings}
    c.verdict = "refused" if "error" in sev else "warning" if "warning" in sev else "ok"


def catalog_findings(entry: CatalogEntry, profile) -> list[Finding]:
    """What the catalog entry says about running it on the profile's backend and pinned engine version."""
    out: list[Finding] = []
    backend = profile.backend
    if not entry.backends:
        fmt = FORMATS.get(entry.format or "")
        what = fmt.what if fmt else "its format"
        out.append(
            Finding(
                "warning",
                "catalog",
                f"no engine specops renders for loads this draft as published ({what})"
                + (f": {entry.caveats[0]}" if entry.caveats else ""),
            )
        )
    elif backend not in entry.backends:
        out.append(Finding("info", "catalog", f"the catalog lists this pair for {', '.join(entry.backends)}"))
    need = entry.min_version_for(backend)
    if need:
        engine = getattr(profile, "engine", None)
        pinned = getattr(engine, "version", None)
        try:
            old = pinned is not None and Version(str(pinned)) < Version(need)
        except ValueError:  # a llama.cpp flag generation or build name: not comparable
            pinned, old = None, False
        if old:
            out.append(
                Finding(
                    "error",
                    "catalog",
                    f"{entry.draft} needs {backend} >= {need} (catalog min_version; {entry.source}); "
                    f"the profile pins {pinned}",
                    ("engine", "version"),
                )
            )
        elif pinned is None:
            out.append(
                Finding(
                    "warning",
                    "catalog",
                    f"{entry.draft} needs {backend} >= {need} (catalog min_version); no engine.version is pinned, "
                    f"so the installed engine decides",
                    ("engine", "version"),
                )
            )
    return out


def catalog_dict(entry: CatalogEntry, backend: str | None = None) -> dict:
    """The catalog's word on a candidate, for ``--json`` (its evidence on ``backend``, the engine asked for)."""
    return {
        "source": entry.source,
        "format": entry.format,
        "known": entry.known,
        "evidence": format_evidence(entry, engine=backend),
        "backends": list(entry.backends),
        "min_version": dict(entry.min_version),
    }


def catalog_line(entry: CatalogEntry) -> str:
    """How a catalog pair is known, for printing: its source and the measured evidence for its format."""
    return f"{entry.source} — {format_evidence(entry)}"


def _same_target(name: str, target, catalog) -> bool:
    from specops.resolve.detect import same_model

    return same_model(name, target.ref, catalog.aliases)


def _with_choice(profile, c: Candidate, *, keep_revision: bool):
    spec = profile.speculative
    needs = c.method in NEEDS_DRAFT
    update = {
        "method": c.method,
        "draft": c.draft if needs else None,
        "draft_revision": (spec.draft_revision if keep_revision and spec.draft_revision else c.revision)
        if needs
        else None,
        "draft_file": (spec.draft_file or c.file) if needs and _gguf(_backend(profile)) else None,
    }
    return profile.model_copy(update={"speculative": spec.model_copy(update=update)})


def _memory_of(profile, target: ModelView, c: Candidate) -> MemoryEstimate | None:
    draft_w = c.view.weights if c.view is not None else None
    if target.weights is None and draft_w is None:
        return None
    return estimate(profile, target.weights, draft_w, has_draft=c.method in NEEDS_DRAFT)


def synthetic_profile(
    target: str,
    *,
    backend: str = DEFAULT_BACKEND,
    method: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    quant: str | None = None,
    memory_gb: float | None = None,
    engine_version: str | None = None,
):
    """A minimal profile for ``specops resolve TARGET``."""
    from pydantic import ValidationError

    from specops.config.profile import Profile

    m = Method(method)
    data = {
        "name": "resolve",
        "backend": backend,
        "model": {"id": target, **({"max_model_len": max_model_len} if max_model_len else {})},
        "speculative": {
            "method": m.value,
            **({"draft": "auto"} if m in NEEDS_DRAFT else {}),
            **({"draft_quantization": quant} if quant else {}),
        },
        "gpus": {
            **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}),
            **({"memory_gb": memory_gb} if memory_gb else {}),
        },
    }
    if engine_version:
        data["engine"] = {"version": engine_version}
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise SpecopsError(f"cannot resolve {target!r}: {exc.errors()[0]['msg']}") from None


def lock_profile(
    loaded, *, offline: bool = False, progress: Callable[[str], None] | None = None, hub: Hub | None = None
) -> tuple[Path, Resolution]:
    """Resolve ``loaded`` afresh and write its lock file next to it; raises on errors."""
    from specops.resolve.lock import build_lock, write_lock

    res = resolve_profile(loaded, offline=offline, use_lock=False, hub=hub, progress=progress)
    spec = res.profile.speculative
    if spec.draft and not spec.draft_revision and not Path(spec.draft).expanduser().exists():
        res.findings.append(
            Finding(
                "warning",
                "lock",
                f"no commit pinned for {spec.draft} (the Hub and the HF cache "
                f"did not give one); run `specops lock` online to pin it",
            )
        )
    path = lock_path(loaded.path)
    lock = build_lock(loaded.path, loaded.profile, res)
    try:  # a `specops tune` record stays while it still describes the locked method and draft
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        old = {}
    if (
        isinstance(old, dict)
        and old.get("tune")
        and all((old.get("speculative") or {}).get(k) == lock["speculative"][k] for k in ("method", "draft"))
    ):
        lock["tune"] = old["tune"]
    write_lock(path, lock)
    res.lock_file = str(path)
    return path, res
