"""Everything the checks need to know about one model (target or draft), from wherever it can be had.

Sources, in order: a local path (directory with config.json, or a .gguf file); the Hub (model_info with
``expand``, then config.json — a few KB — and paths-info for tokenizer hashes and weight sizes); the local
HF cache (offline, or when the Hub is down); the catalog's published facts. What came from where is kept,
so every check can say what it compared.

A repo whose Hub answer or config.json cannot be trusted (unsafe file names, a config.json over
:data:`~specops.resolve.hub.MAX_JSON_BYTES`, not JSON, or with fields of the wrong type) gets an ``invalid``
error: it is fatal, so a draft is refused with that reason and a target fails resolution, never a crash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from specops.methods import Method
from specops.reponames import UnsafeName, check_repo_file, is_repo_id, is_safe_repo_file
from specops.resolve.catalog import Catalog
from specops.resolve.detect import (
    ConfigFacts,
    Declared,
    config_problems,
    declared_targets,
    detect_method,
    facts_from_config,
)
from specops.resolve.ggufinfo import DEFAULT_QUANT, GGUFVocab, pick_file, quant_of, read_gguf, split_parts
from specops.resolve.hub import (
    MAX_JSON_BYTES,
    TOKENIZER_FILES,
    BadFile,
    FileMeta,
    Hub,
    RepoMeta,
    file_digest,
    load_json,
)
from specops.resolve.huberrors import HubError
from specops.resolve.memory import WEIGHT_SUFFIXES, Weights, from_files, from_params, from_safetensors


@dataclass
class ModelView:
    ref: str
    kind: str  # hub | local-dir | local-gguf
    revision: str | None = None  # commit sha when known
    meta: RepoMeta | None = None
    config: dict | None = None
    facts: ConfigFacts = field(default_factory=ConfigFacts)
    facts_source: str = "none"
    tokenizer: str | None = None  # digest of tokenizer.json (or tokenizer.model)
    tokenizer_family: str | None = None  # from the catalog
    weights: Weights | None = None
    gguf_file: str | None = None
    gguf_why: str | None = None
    gguf_vocab: GGUFVocab | None = None
    declared: list[Declared] = field(default_factory=list)
    method: Method | None = None
    method_why: str = ""
    errors: list[HubError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def is_local(self) -> bool:
        return self.kind != "hub"

    @property
    def fatal(self) -> HubError | None:
        """A failure that makes the repo unusable (not found, gated, bad revision), if any."""
        for e in self.errors:
            if e.kind in ("not_found", "gated", "revision", "unauthorized", "invalid"):
                return e
        return None

    def summary(self) -> dict:
        f = self.facts
        return {
            "id": self.ref,
            "revision": self.revision,
            "file": self.gguf_file,
            "facts_from": self.facts_source,
            "vocab_size": f.vocab,
            "hidden_size": f.hidden,
            "layers": f.layers,
            "context": f.context,
            "mtp_layers": f.mtp_layers,
        }


def is_local_ref(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref.endswith(".gguf") or os.path.exists(os.path.expanduser(ref))


def load_model(
    ref: str,
    *,
    hub: Hub,
    catalog: Catalog,
    revision: str | None = None,
    gguf: bool = False,
    quant: str | None = None,
    file: str | None = None,
    tokenizer: bool = True,
) -> ModelView:
    """A :class:`ModelView` of ``ref``. ``gguf``: llama.cpp wants a .gguf file (``file``, else one picked
    for ``quant``). Hub failures are recorded in ``errors``, never raised."""
    if is_local_ref(ref):
        return _load_local(ref, catalog)
    view = ModelView(ref, "hub")
    if file is not None:
        try:
            check_repo_file(file, "GGUF file name")
        except UnsafeName as exc:
            view.errors.append(HubError("invalid", f"{ref}: {exc}", ref))
            return view
    try:
        view.meta = hub.model_info(ref, revision)
        view.revision = view.meta.sha
    except HubError as exc:
        view.errors.append(exc)
        view.revision = hub.cached_sha(ref, revision)
        if view.revision:
            view.notes.append(f"{ref}: using the HF cache at {view.revision[:10]}")
    if view.fatal and view.fatal.kind in ("not_found", "revision", "invalid"):
        return view
    files = view.meta.files if view.meta and view.meta.siblings is not None else hub.cached_files(ref, view.revision)
    entry_files = {}
    for e in catalog.for_draft(ref):
        entry_files.update({k: v for k, v in (e.files or {}).items() if is_safe_repo_file(v)})
    wants_gguf = gguf or file is not None or any(f.endswith(".gguf") for f in files)

    if wants_gguf:
        _load_gguf_repo(view, hub, catalog, files, entry_files, quant, file)
    else:
        _load_hf_repo(view, hub, files, tokenizer, revision)
    if wants_gguf:
        sized_quant = quant_of(view.gguf_file) if view.gguf_file else (quant or DEFAULT_QUANT)
    else:
        sized_quant = None
    _fill_from_catalog(view, catalog, sized_quant)
    view.declared = declared_targets(view.config, view.meta.card_data if view.meta else None)
    view.method, view.method_why = detect_method(view.config or (view.meta.config if view.meta else None), ref)
    return view


def _read_config(view: ModelView, path: Path, what: str) -> dict | None:
    """config.json at ``path`` when it is usable; else an ``invalid`` error on the view (with the reason)."""
    try:
        config = load_json(path, max_bytes=MAX_JSON_BYTES, what=what)
    except BadFile as exc:
        view.errors.append(HubError("invalid", f"{exc}", view.ref))
        return None
    problems = config_problems(config)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        view.errors.append(HubError("invalid", f"{what} is malformed: {problems[0]}{more}", view.ref))
        return None
    return config


def _fill_from_catalog(view: ModelView, catalog: Catalog, quant: str | None = None) -> None:
    facts = catalog.facts(view.ref)
    if facts is None:
        return
    before = view.facts
    view.facts = view.facts.merged(facts.config_facts())
    if view.facts != before:
        view.facts_source = "catalog" if view.facts_source == "none" else view.facts_source + " + catalog"
    view.tokenizer_family = view.tokenizer_family or facts.tokenizer
    if view.weights is None:
        view.weights = from_params(facts.params, quant)


def _load_hf_repo(view: ModelView, hub: Hub, files: list[str], tokenizer: bool, revision: str | None) -> None:
    # downloads ask for the revision the profile names (a branch keeps refs/<branch> in the HF cache, so the
    # cache serves it offline later); metadata calls use the commit model_info resolved it to
    ref, sha = view.ref, view.revision
    st = from_safetensors(view.meta.safetensors if view.meta else None)
    want = [f for f in TOKENIZER_FILES if f in files][:1] if tokenizer else []
    weight_files = [] if st else [f for f in files if f.endswith(WEIGHT_SUFFIXES)]
    has_config = "config.json" in files
    info: dict[str, FileMeta] = {}
    info_error: HubError | None = None
    if want or weight_files or (has_config and not hub.offline and hub.down is None):
        # one paths-info call: tokenizer hash, weight sizes, and config.json's size before it is downloaded
        try:
            info = hub.paths_info(ref, (["config.json"] if has_config else []) + want + weight_files, sha)
        except HubError as exc:
            info_error = exc
    if (not files or has_config) and not _download_config(view, hub, info, revision):
        return
    if view.config is not None:
        view.facts = facts_from_config(view.config)
        view.facts_source = "config.json"
    if info_error is not None:
        exc = info_error
        if not exc.hub_is_down or not view.errors:
            view.errors.append(exc)
        for name in want:  # offline / Hub down: hash the cached file instead
            cached = hub.cached(ref, name, revision)
            if cached is not None:
                view.tokenizer = file_digest(cached)
    for name in want:
        if name in info and info[name].digest:
            view.tokenizer = info[name].digest
    view.weights = st or from_files({k: v.size for k, v in info.items()})


def _download_config(view: ModelView, hub: Hub, info: dict[str, FileMeta], revision: str | None) -> bool:
    """config.json into ``view.config`` (its size checked first when the Hub stated it); False when the repo
    is unusable and loading stops (oversized, or an ``invalid`` file)."""
    ref = view.ref
    size = info["config.json"].size if "config.json" in info else None
    if size is not None and size > MAX_JSON_BYTES:
        view.errors.append(
            HubError(
                "invalid",
                f"{ref}/config.json is {size} bytes on the Hub; specops reads "
                f"at most {MAX_JSON_BYTES} bytes ({MAX_JSON_BYTES // 1024} KiB): not "
                f"downloaded",
                ref,
            )
        )
        return False
    try:
        path = hub.download(ref, "config.json", revision)
    except HubError as exc:
        if exc.kind != "entry" and not (exc.hub_is_down and view.errors):
            view.errors.append(exc)
        if exc.kind == "invalid":
            return False
    else:
        view.config = _read_config(view, path, f"{ref}/config.json")
        if view.config is None:
            return False
    return True


def _load_gguf_repo(
    view: ModelView,
    hub: Hub,
    catalog: Catalog,
    files: list[str],
    entry_files: dict,
    quant: str | None,
    file: str | None,
) -> None:
    ref, sha = view.ref, view.revision
    _pick_gguf(view, files, entry_files, quant, file)
    if view.meta and view.meta.gguf:
        g = view.meta.gguf
        ctx = g.get("context_length")
        view.facts = ConfigFacts(
            context=ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None
        )
        view.facts_source = "Hub gguf metadata"
    if view.gguf_file:
        cached = hub.cached(ref, view.gguf_file, sha)
        if cached is not None:
            _apply_gguf(view, cached)
        else:
            view.notes.append(
                f"{ref}/{view.gguf_file} is not local: vocab facts from "
                f"{'the catalog or ' if catalog.facts(ref) else ''}the base model's config.json"
            )
        if view.weights is None:
            _size_gguf(view, hub, files)
    if view.gguf_vocab is None and catalog.facts(ref) is None and view.meta and view.meta.card_data:
        _base_model_facts(view, hub, view.meta.card_data)


def _pick_gguf(view: ModelView, files: list[str], entry_files: dict, quant: str | None, file: str | None) -> None:
    """The .gguf file: the one the profile names, else one picked for ``quant`` from the repo (or catalog)."""
    if file:
        view.gguf_file, view.gguf_why = file, "named in the profile"
    elif files:
        view.gguf_file, view.gguf_why = pick_file(files, quant)
    else:
        view.gguf_file, view.gguf_why = pick_file(list(entry_files.values()), quant)
        if view.gguf_file:
            view.gguf_why += " (file list from the catalog)"


def _size_gguf(view: ModelView, hub: Hub, files: list[str]) -> None:
    """The weights' size from the Hub's sizes of the chosen file (all its split parts, or none)."""
    parts = split_parts(view.gguf_file, files)
    try:
        info = hub.paths_info(view.ref, parts, view.revision)
        sizes = [info[p].size for p in parts if p in info and info[p].size]
        if sizes and len(sizes) == len(parts):
            what = "file size" if len(parts) == 1 else f"file sizes ({len(parts)} split parts)"
            view.weights = Weights(sum(sizes), what)
    except HubError as exc:
        if not exc.hub_is_down or not view.errors:
            view.errors.append(exc)


def _base_model_facts(view: ModelView, hub: Hub, card_data: dict) -> None:
    """Vocab facts for a GGUF repo from the config.json of the base model its card names."""
    base = card_data.get("base_model")
    base = base[0] if isinstance(base, list) and base else base
    if isinstance(base, str) and base and not is_repo_id(base):
        view.notes.append(f"base model named by the card is not a Hub repo id ({base[:100]!r}); not read")
    elif isinstance(base, str) and base:
        cfg = None
        try:
            cfg = load_json(hub.download(base, "config.json"), what=f"{base}/config.json")
            problems = config_problems(cfg)
            if problems:
                view.notes.append(f"base model {base}: config.json is malformed ({problems[0]}); not used")
                cfg = None
        except (HubError, BadFile) as exc:
            view.notes.append(f"base model {base}: {exc}")
        if cfg:
            view.facts = view.facts.merged(facts_from_config(cfg))
            view.facts_source = f"config.json of the base model {base}"


def _apply_gguf(view: ModelView, path: Path) -> None:
    try:
        v = read_gguf(path)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is reported, not raised
        view.notes.append(f"{path}: cannot read GGUF metadata ({type(exc).__name__}: {exc})")
        return
    view.gguf_vocab = v
    view.facts = ConfigFacts(
        vocab=v.size, hidden=v.hidden, layers=v.layers, context=v.context, model_type=v.arch, mtp_layers=v.mtp_layers
    ).merged(view.facts)
    view.facts_source = "GGUF metadata"
    try:
        view.weights = Weights(Path(path).stat().st_size, "file size")
    except OSError:
        pass


def _load_local(ref: str, catalog: Catalog) -> ModelView:
    path = Path(os.path.expanduser(ref))
    if path.suffix == ".gguf" or path.is_file():
        view = ModelView(ref, "local-gguf", gguf_file=path.name, gguf_why="local file")
        if not path.is_file():
            view.errors.append(HubError("not_found", f"{ref}: no such file", ref))
            return view
        _apply_gguf(view, path)
        view.method_why = "local GGUF file"
        return view
    view = ModelView(ref, "local-dir")
    if not path.is_dir():
        view.errors.append(HubError("not_found", f"{ref}: no such directory", ref))
        return view
    if (path / "config.json").is_file():
        view.config = _read_config(view, path / "config.json", str(path / "config.json"))
    if view.config is not None:
        view.facts = facts_from_config(view.config)
        view.facts_source = "config.json"
    for name in TOKENIZER_FILES:
        if (path / name).is_file():
            view.tokenizer = file_digest(path / name)
            break
    sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)}
    view.weights = from_files(sizes)
    view.declared = declared_targets(view.config, None)
    view.method, view.method_why = detect_method(view.config, ref)
    return view
