"""Writing the winner back: into the YAML file the user passed, and the record of every number beside it.

The profile is edited with :func:`specops.config.yamledit.edit_yaml` (comments, key order and quoting kept;
the overlay when it ``extends`` a base) with a ``# specops tune <date>: ...`` comment; the record goes into
``<profile>.tune.json``, or into the lock file under ``"tune"`` when a fresh lock exists (whose input digest
is refreshed, so it stays fresh). The new profile is validated and rendered before it replaces the old
one; ``dry_run`` shows the same change as a diff.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.config import yamledit
from specops.config.yamledit import base_data_of, unified_diff
from specops.errors import ProfileError, SpecopsError
from specops.methods import NEEDS_DRAFT, Method
from specops.perf.tune.changes import desired_changes, format_changes
from specops.perf.tune.report import comment_line, today
from specops.perf.tune.results import TuneResult, rounded
from specops.perf.tune.settings import Setting

__all__ = [
    "FIELD_ORDER",
    "RECORD_VERSION",
    "TUNE_COMMENT",
    "WriteOutcome",
    "base_data_of",
    "build_record",
    "draft_sha",
    "surface_record",
    "edit_yaml",
    "tune_plot_path",
    "tune_record_path",
    "unified_diff",
    "winner_profile",
    "write_back",
]

RECORD_VERSION = 1
#: A comment line specops wrote (replaced, never stacked, when tune runs again).
TUNE_COMMENT = re.compile(r"^[ \t]*# specops tune \d{4}-\d\d-\d\d\b.*(?:\n|$)", re.M)
#: The order fields are shown (and the comment is placed above the first changed one).
FIELD_ORDER = ("method", "draft", "draft_revision", "draft_file", "num_speculative_tokens", "ngram", "per_batch_size")


def edit_yaml(
    text: str,
    edits: dict[tuple, Any],
    *,
    base_data: dict | None = None,
    comment: str | None = None,
    comment_at: tuple | None = None,
) -> tuple[str, list[str]]:
    """:func:`specops.config.yamledit.edit_yaml` replacing an earlier ``# specops tune`` comment."""
    return yamledit.edit_yaml(
        text, edits, base_data=base_data, comment=comment, comment_at=comment_at, replace=TUNE_COMMENT
    )


def tune_record_path(profile_path: str | Path) -> Path:
    """``<profile stem>.tune.json`` beside the profile (like the lock file's ``.lock.json``)."""
    p = Path(profile_path)
    return p.with_name(p.stem + ".tune.json")


def tune_plot_path(profile_path: str | Path) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + ".tune.png")


@dataclass
class WriteOutcome:
    """What write_back did (or, with dry_run, would do)."""

    profile_path: Path
    profile_diff: str
    record_path: Path
    record_diff: str
    changes: list[str]
    notes: list[str]
    written: bool
    record: dict = field(default_factory=dict)


def build_record(
    result: TuneResult,
    *,
    profile_path: str,
    backend: str,
    engine_version: str | None,
    workload: dict,
    changes: dict[tuple, Any],
    date: str,
    per_batch: dict | None,
    written_to: str,
    written: Setting | None = None,
    surface: dict | None = None,
) -> dict:
    from specops import __version__

    return {
        "tune_version": RECORD_VERSION,
        "date": date,
        "generated_by": f"specops {__version__}",
        "profile": Path(profile_path).name,
        "written_to": written_to,
        "backend": backend,
        "engine_version": engine_version,
        "workload": workload,
        "chosen": result.winner.setting.to_dict() if result.winner else None,
        "chosen_tokens_per_s": rounded(result.winner.median(result.primary)) if result.winner else None,
        "written": (written or (result.winner.setting if result.winner else None)).to_dict()
        if (written or result.winner)
        else None,
        "changes": format_changes(changes),
        "per_batch_size_proposal": per_batch,
        **result.to_dict(),
        "surface": surface,
    }


#: Local draft files up to this size get a sha256 in the surface's record (bigger ones: their size and mtime).
DRAFT_HASH_LIMIT = 256 * 1024 * 1024


def draft_sha(profile) -> str | None:
    """What identifies the draft the surface was measured with: its pinned Hub revision, else the sha256 of a
    local draft file (up to :data:`DRAFT_HASH_LIMIT`); None without a draft."""
    spec = profile.speculative
    if spec.draft_revision:
        return spec.draft_revision
    if not spec.draft or spec.method not in NEEDS_DRAFT:
        return None
    p = Path(spec.draft)
    if not p.is_file():
        return None
    import hashlib

    st = p.stat()
    if st.st_size > DRAFT_HASH_LIMIT:
        return f"size {st.st_size}, mtime {int(st.st_mtime)}"
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def surface_record(result: TuneResult, *, backend: str, engine_version: str | None, date: str, draft: str | None):
    """The goodput surface of ``result`` (:class:`specops.watch.surface.Surface` as a dict, with its crossovers and
    where it was measured), or None when nothing reached ``min_rounds``."""
    from specops.watch.surface import Surface

    points = result.surface_points()
    if not points:
        return None
    meta = {"date": date, "backend": backend, "engine_version": engine_version, "draft_sha": draft}
    return Surface.from_dict({"points": points, **meta}).to_dict()


def write_back(
    loaded,
    resolved_profile,
    result: TuneResult,
    registry,
    *,
    engine=None,
    workload: dict,
    dry_run: bool = False,
    per_batch: dict | None = None,
    apply_per_batch: bool = False,
    date: str | None = None,
) -> WriteOutcome:
    """Write the winner into the profile file and the record beside it (or into a fresh lock).

    The new text is validated (loaded with every rule, rendered for ``engine``) from a temporary file beside
    the profile before it replaces it; on any problem nothing changes. ``dry_run`` does all that, writes nothing.
    """
    date = date or today()
    path = Path(loaded.path)
    if result.winner is None:
        raise SpecopsError("no setting was measured; nothing to write")
    notes: list[str] = list(workload.get("notes", []))  # what fitting the workload to the deployment changed
    pbs = per_batch["value"] if (per_batch and apply_per_batch) else None
    written = _setting_to_write(result, per_batch, pbs, notes)
    changes = desired_changes(loaded.profile, resolved_profile, written, per_batch_size=pbs)
    _note_per_batch_override(loaded.profile, written, pbs, notes)
    lock, record_path = _record_target(loaded, changes, notes)
    old_text = path.read_text(encoding="utf-8")
    comment = comment_line(result, date, record_path.name)
    new_text = _new_profile_text(loaded, old_text, changes, comment, result.winner.setting.label, notes)
    new_loaded = (
        _validated(loaded, new_text, old_text, resolved_profile, registry, engine) if new_text != old_text else loaded
    )
    record = build_record(
        result,
        profile_path=str(path),
        backend=loaded.profile.backend,
        engine_version=getattr(engine, "version", None),
        workload=workload,
        changes=changes,
        date=date,
        per_batch=per_batch,
        written_to=path.name,
        written=written,
        surface=surface_record(
            result,
            backend=loaded.profile.backend,
            engine_version=getattr(engine, "version", None),
            date=date,
            draft=draft_sha(resolved_profile),
        ),
    )
    old_record, new_record_text = _record_texts(record_path, lock, new_loaded.profile, record)
    out = WriteOutcome(
        path,
        unified_diff(old_text, new_text, path.name),
        record_path,
        unified_diff(old_record, new_record_text, record_path.name),
        format_changes(changes),
        notes,
        written=False,
        record=record,
    )
    if not dry_run:
        _write_files(out, new_text if new_text != old_text else None, new_record_text)
    return out


def _note_per_batch_override(profile, written: Setting, pbs, notes: list[str]) -> None:
    """A note when the profile's per_batch_size (kept, not swept) overrides the k written for some batch sizes."""
    if profile.speculative.per_batch_size is not None and pbs is None and written.method is not Method.NONE:
        notes.append(
            "speculative.per_batch_size is set and overrides k for the batch sizes it lists; the sweep ran without it"
        )


def _write_files(out: WriteOutcome, profile_text: str | None, record_text: str) -> None:
    """The profile (when it changed) and then the record, each replaced atomically."""
    if profile_text is not None:
        _atomic_write(out.profile_path, profile_text)
    _atomic_write(out.record_path, record_text)
    out.written = True


def _setting_to_write(result: TuneResult, per_batch: dict | None, pbs, notes: list[str]) -> Setting:
    """The winner; with a per-batch-size schedule ``pbs``, the schedule's method at its largest k (the measured
    setting, best at the lowest load among equals), which the schedule's ranges lower."""
    written = result.winner.setting
    if pbs is not None:
        low = min(result.levels)
        same = [
            r for r in result.results if r.setting.method.value == per_batch["method"] and r.setting.k == per_batch["k"]
        ]
        if same:
            written = max(same, key=lambda r: r.median(low) or 0.0).setting
        notes.append(f"speculative.per_batch_size {pbs} written with {written.label} ({per_batch['why']})")
    return written


def _record_target(loaded, changes: dict[tuple, Any], notes: list[str]) -> tuple[dict | None, Path]:
    """(the lock that gets the record, its path) when a fresh lock exists and still fits the change, else
    (None, ``<profile>.tune.json``)."""
    from specops.resolve.lock import lock_path, read_lock, stale_reason

    path = Path(loaded.path)
    lock_file = lock_path(path)
    lock = None
    if lock_file.is_file():
        try:
            lock = read_lock(lock_file)
        except SpecopsError as exc:
            notes.append(f"{lock_file.name} is not usable ({exc}); the record goes to its own file")
        else:
            if stale_reason(lock, loaded.profile) is not None:
                notes.append(f"{lock_file.name} is stale; the record goes to its own file (run `specops lock`)")
                lock = None
            elif ("speculative", "method") in changes or ("speculative", "draft") in changes:
                notes.append(
                    f"the method changed: {lock_file.name} pins the old one and is now stale; run "
                    f"`specops lock {loaded.path}` (the record goes to its own file)"
                )
                lock = None
    return lock, (lock_file if lock is not None else tune_record_path(path))


def _new_profile_text(
    loaded, old_text: str, changes: dict[tuple, Any], comment: str, winner_label: str, notes: list[str]
) -> str:
    """The profile's new text: the changes with specops' comment above the first, or (nothing to change)
    only an earlier comment of specops refreshed."""
    path = Path(loaded.path)
    if len(loaded.document.files) > 1:
        notes.append(
            f"{path.name} extends {', '.join(Path(f).name for f in loaded.document.files[:-1])}: "
            f"the change is written into {path.name} (the file given), the base is not touched"
        )
    if changes:
        comment_at = min(changes, key=_field_rank)
        comment_at = comment_at[:2] if comment_at[0] == "speculative" else comment_at[:1]
        new_text, edit_notes = edit_yaml(
            old_text, changes, base_data=base_data_of(path), comment=comment, comment_at=comment_at
        )
        notes += edit_notes
        return new_text
    new_text = TUNE_COMMENT.sub(
        lambda m: re.match(r"[ \t]*", m.group(0)).group(0) + "# " + comment + "\n", old_text, count=1
    )
    notes.append(
        f"the profile already runs the best setting ({winner_label})"
        + ("; only specops' comment is updated" if new_text != old_text else "; it is unchanged")
    )
    return new_text


def _field_rank(path: tuple) -> tuple:
    if path[0] != "speculative":
        return (1, 0, path)
    name = path[1] if len(path) > 1 else ""
    return (0, FIELD_ORDER.index(name) if name in FIELD_ORDER else len(FIELD_ORDER), path)


def _validated(loaded, new_text: str, old_text: str, resolved_profile, registry, engine):
    """The new profile, loaded with every rule (and rendered for ``engine``) from a temporary file beside
    the profile (so relative ``extends`` work); raises, changing nothing, when it does not pass."""
    from specops.config.profile import LoadedProfile, load_profile

    path = Path(loaded.path)
    tmp = path.with_name(f".{path.name}.tune-{os.getpid()}.yaml")
    try:
        tmp.write_text(new_text, encoding="utf-8")
        try:
            checked = load_profile(tmp, registry=registry)
        except ProfileError as exc:
            raise SpecopsError(
                "the tuned profile would not validate, so nothing was changed: "
                + "; ".join(f"{p.field}: {p.message}" for p in exc.problems)
            ) from None
        if engine is not None:
            _check_render(
                LoadedProfile(winner_profile(checked.profile, resolved_profile), checked.document, str(path)),
                registry,
                engine,
            )
        return LoadedProfile(checked.profile, checked.document, str(path))
    finally:
        tmp.unlink(missing_ok=True)


def _check_render(loaded, registry, engine) -> None:
    from specops.backends.render import render_plan

    try:
        render_plan(loaded, registry, engine=engine)
    except ProfileError as exc:
        raise SpecopsError(
            "the tuned profile would not render, so nothing was changed: " + "; ".join(p.message for p in exc.problems)
        ) from None


def _record_texts(record_path: Path, lock: dict | None, new_profile, record: dict) -> tuple[str, str]:
    """(old text, new text) of the file that gets the record: the lock with the record under ``"tune"`` and
    its inputs refreshed from the new profile (so it stays fresh), else the record's own JSON file."""
    if lock is not None:
        from specops.resolve.lock import digest, dumps, inputs_of

        new_lock = dict(lock)
        new_lock["inputs"] = inputs_of(new_profile)
        new_lock["inputs_sha256"] = digest(new_lock["inputs"])
        new_lock["tune"] = record
        return dumps(lock), dumps(new_lock)
    old_record = record_path.read_text(encoding="utf-8") if record_path.is_file() else ""
    return old_record, json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def winner_profile(profile, resolved_profile):
    """The newly written profile with the resolution applied again (an ``auto`` draft stays resolved)."""
    spec, rspec = profile.speculative, resolved_profile.speculative
    if spec.method is Method.AUTO or spec.draft == "auto":
        upd = {"method": rspec.method if spec.method is Method.AUTO else spec.method}
        if spec.draft == "auto" or (spec.method is Method.AUTO and rspec.method in NEEDS_DRAFT):
            upd.update(draft=rspec.draft, draft_revision=rspec.draft_revision, draft_file=rspec.draft_file)
        return profile.model_copy(update={"speculative": spec.model_copy(update=upd)})
    return profile


def _atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a temporary file renamed over it), keeping its permissions.

    Also for the lock file: :func:`specops.resolve.lock.write_lock` would drop them, and its fixed
    temporary name would collide between two writers.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        os.chmod(tmp, path.stat().st_mode & 0o777)
    except OSError:
        pass
    os.replace(tmp, path)
