"""The lock file: ``<profile stem>.lock.json`` next to the profile, pinning what ``auto`` resolved to.

It records the resolved method, draft repo, GGUF file and commit shas of draft and target, every
alternative considered with its verdict, and the profile inputs it was resolved from. ``render`` and
``up`` apply a lock whose inputs still match the profile (no Hub needed), and say when it is stale, so a
GitOps deploy renders the same command everywhere. The JSON is deterministic: sorted keys, no time
stamps, no download counts (they change daily), no endpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from specops.config.yamlsource import read_text
from specops.errors import ProfileError, SpecopsError
from specops.methods import Method
from specops.reponames import is_repo_id, repo_file_problem, repo_id_problem, revision_problem

LOCK_VERSION = 1
#: The profile sections whose values decide a resolution (their change makes a lock stale).
INPUT_SECTIONS = ("backend", "model", "speculative", "gpus")


def lock_path(profile_path: str | Path) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + ".lock.json")


def inputs_of(profile) -> dict:
    """The resolution inputs of a profile: its backend, model, speculative and gpus sections, plus the pinned
    engine version (defaults left out, so a new specops field does not stale every lock)."""
    data = profile.model_dump(mode="json", include=set(INPUT_SECTIONS), exclude_defaults=True)
    if profile.engine.version:
        data["engine_version"] = profile.engine.version
    data["backend"] = profile.backend
    return data


def digest(inputs: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dumps(lock: dict) -> str:
    return json.dumps(lock, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_lock(path: str | Path, lock: dict) -> Path:
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(dumps(lock), encoding="utf-8")
    tmp.replace(p)
    return p


def read_lock(path: str | Path) -> dict:
    p = Path(path)
    try:  # bounded, regular files only: a FIFO or a huge file at the lock path is refused, never waited on
        data = json.loads(read_text(p, str(p)))
    except ProfileError as exc:
        raise SpecopsError(f"cannot read the lock file: {exc}") from None
    except ValueError as exc:
        raise SpecopsError(f"{p}: not a valid lock file (JSON error: {exc}); delete it or run `specops lock`") from None
    if not isinstance(data, dict) or data.get("lock_version") != LOCK_VERSION or "speculative" not in data:
        raise SpecopsError(f"{p}: not a specops lock file of version {LOCK_VERSION}; run `specops lock` again")
    try:
        Method(data["speculative"]["method"])
    except (KeyError, ValueError, TypeError):
        raise SpecopsError(f"{p}: the lock names no valid method; run `specops lock` again") from None
    problem = lock_problem(data)
    if problem is not None:
        raise SpecopsError(f"{p}: {problem}; fix or delete it and run `specops lock` again")
    return data


def lock_problem(data: dict) -> str | None:
    """What makes a lock's pins unusable (None: usable). The pins end up in engine arguments and HF cache
    paths, so each file name and revision goes through the same validator as the Hub's answers
    (:mod:`.names`): a ``draft_file`` of ``../../x.gguf`` is refused, not rendered."""
    spec = data.get("speculative")
    if not isinstance(spec, dict):
        return "speculative must be an object"
    target = data.get("target")
    if target is not None and not isinstance(target, dict):
        return "target must be an object"
    draft = spec.get("draft")
    if draft is not None:
        if not isinstance(draft, str) or not draft or "\x00" in draft or len(draft) > 4096:
            return f"speculative.draft must be a Hub repo id or a path, not {str(draft)[:60]!r}"
        from specops.resolve.models import is_local_ref

        if not is_local_ref(draft) and not is_repo_id(draft):
            return f"speculative.draft: {repo_id_problem(draft)}: {draft[:100]!r}"
    fields = [
        ("speculative.draft_file", spec.get("draft_file"), repo_file_problem),
        ("speculative.draft_revision", spec.get("draft_revision"), revision_problem),
    ]
    if isinstance(target, dict):
        fields += [
            ("target.file", target.get("file"), repo_file_problem),
            ("target.revision", target.get("revision"), revision_problem),
        ]
    for where, value, check in fields:
        if value is None:
            continue
        why = check(value)
        if why is not None:
            return f"{where} {str(value)[:100]!r} is unusable: {why}"
    for key in ("alternatives", "findings"):
        items = data.get(key)
        if items is not None and not (isinstance(items, list) and all(isinstance(i, dict) for i in items)):
            return f"{key} must be a list of objects"
    for f in data.get("findings") or []:
        if not isinstance(f.get("severity"), str) or not isinstance(f.get("message"), str):
            return "findings: each needs a severity and a message (strings)"
    for a in data.get("alternatives") or []:
        if a.get("draft") is not None and not isinstance(a.get("draft"), str):
            return "alternatives: draft must be a string"
    return None


def stale_reason(lock: dict, profile) -> str | None:
    """Why the lock no longer matches the profile (the fields that changed), or None when it is fresh."""
    now = inputs_of(profile)
    if lock.get("inputs_sha256") == digest(now):
        return None
    before = lock.get("inputs") or {}
    changed = sorted(_diff(before, now))
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return f"the profile changed since it was locked ({shown or 'inputs differ'})"


def _diff(a: Any, b: Any, prefix: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: set[str] = set()
        for k in set(a) | set(b):
            out |= _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return set() if a == b else {prefix or "(root)"}


def apply_lock(profile, lock: dict):
    """The profile with the lock's pins: method, draft, draft revision/file, and the target's commit."""
    s = lock["speculative"]
    method = Method(s["method"])
    spec = profile.speculative
    update = {
        "method": method,
        "draft": s.get("draft"),
        "draft_revision": spec.draft_revision or s.get("draft_revision"),
        "draft_file": spec.draft_file or s.get("draft_file"),
    }
    new_spec = spec.model_copy(update=update)
    target = lock.get("target") or {}
    model = profile.model
    if not model.revision and target.get("revision"):
        model = model.model_copy(update={"revision": target["revision"]})
    if not model.file and target.get("file"):
        model = model.model_copy(update={"file": target["file"]})
    return profile.model_copy(update={"speculative": new_spec, "model": model})


def build_lock(profile_path: str | Path, input_profile, resolution) -> dict:
    """The lock for a successful resolution (deterministic for the same Hub state)."""
    from specops import __version__

    chosen = resolution.profile.speculative
    target = resolution.target
    inputs = inputs_of(input_profile)
    choice = resolution.choice
    return {
        "lock_version": LOCK_VERSION,
        "generated_by": f"specops {__version__}",
        "profile": Path(profile_path).name,
        "inputs": inputs,
        "inputs_sha256": digest(inputs),
        "backend": input_profile.backend,
        "target": {
            "id": input_profile.model.id,
            "revision": target.revision if target else None,
            "file": (target.gguf_file if target and target.kind == "hub" else None),
        },
        "speculative": {
            "method": chosen.method.value,
            "draft": chosen.draft,
            "draft_revision": chosen.draft_revision,
            "draft_file": chosen.draft_file,
        },
        "choice": None
        if choice is None
        else {
            "method": choice.method.value,
            "draft": choice.draft,
            "why": choice.why(popularity=False),
            "verdict": choice.verdict,
            "reason": choice.reason,
        },
        "alternatives": [
            {
                "rank": i + 1,
                "method": c.method.value,
                "draft": c.draft,
                "verdict": c.verdict,
                "reason": c.reason,
                "why": c.why(popularity=False),
            }
            for i, c in enumerate(resolution.candidates)
        ],
        "findings": [f.to_dict() for f in resolution.findings if f.severity in ("error", "warning")],
        "memory": resolution.memory.to_dict() if resolution.memory else None,
        "catalog_version": resolution.catalog_version,
    }
