"""The profile: one deployment described in YAML, validated by pydantic models.

This is the module to import: :func:`load_profile` reads, merges, interpolates and validates a profile file
into a :class:`~specops.config.loaded.LoadedProfile`. The pieces live beside it: the section models in
:mod:`specops.config.sections` (the single source of truth for validation, defaults, the JSON Schema and
the README's field reference), the mapping of pydantic's errors to YAML locations in
:mod:`specops.config.validation`, and the cross-field rules in :mod:`specops.config.rules`, so every error
carries a field path that :mod:`specops.config.located` maps back to file:line:column.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specops.config import yamlsource
from specops.config.loaded import LoadedProfile
from specops.config.rules import semantic_problems
from specops.config.sections import (
    ENV_NAME,
    LABEL_NAME,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_GPU_INDEX,
    MAX_K,
    MAX_LAYERS,
    MAX_NGRAM,
    MAX_PARALLEL,
    MAX_SEQUENCES,
    MAX_SHARE,
    TOP_LEVEL_FIELDS,
    VERSION_TEXT,
    ChainItem,
    ChainStep,
    Duration,
    EngineSpec,
    Fallback,
    Gpus,
    ModelSpec,
    Monitor,
    NgramSpec,
    Profile,
    ProxySettings,
    RepoFile,
    Retry,
    Section,
    Server,
    Speculative,
    SupervisorSettings,
    VersionText,
    check_version_text,
)
from specops.config.validation import validate_document
from specops.errors import ProfileError
from specops.paths import builtin_env

if TYPE_CHECKING:
    from specops.plugins import Registry

__all__ = [
    "ENV_NAME",
    "LABEL_NAME",
    "MAX_CONTEXT",
    "MAX_COUNT",
    "MAX_GPU_INDEX",
    "MAX_K",
    "MAX_LAYERS",
    "MAX_NGRAM",
    "MAX_PARALLEL",
    "MAX_SEQUENCES",
    "MAX_SHARE",
    "TOP_LEVEL_FIELDS",
    "VERSION_TEXT",
    "ChainItem",
    "ChainStep",
    "Duration",
    "EngineSpec",
    "Fallback",
    "Gpus",
    "LoadedProfile",
    "ModelSpec",
    "Monitor",
    "NgramSpec",
    "Profile",
    "ProxySettings",
    "RepoFile",
    "Retry",
    "Section",
    "Server",
    "Speculative",
    "SupervisorSettings",
    "VersionText",
    "check_version_text",
    "load_profile",
    "schema",
    "semantic_problems",
    "validate_document",
]


# ---------------------------------------------------------------------------------------------------
# loading


def load_profile(
    path: str | Path, env: Mapping[str, str] | None = None, *, registry: Registry | None = None
) -> LoadedProfile:
    """Read, merge, interpolate and validate a profile; raise ProfileError listing every located problem."""
    doc = yamlsource.load(path, {**builtin_env(), **(os.environ if env is None else env)}, fields=TOP_LEVEL_FIELDS)
    profile = validate_document(doc)
    loaded = LoadedProfile(profile, doc, str(path))
    if registry is None:
        from specops.plugins import get_registry

        registry = get_registry()
    problems = semantic_problems(loaded, registry)
    if problems:
        raise ProfileError(problems)
    return loaded


def schema() -> dict[str, Any]:
    """JSON Schema of the profile (for editors and CI). ``extends`` is handled before validation."""
    s = Profile.model_json_schema()
    s["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    s["title"] = "specops profile"
    s["properties"] = {
        "extends": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            "description": "Base profile(s) to deep-merge under this one (paths relative to this file).",
        },
        **s["properties"],
    }
    return s
