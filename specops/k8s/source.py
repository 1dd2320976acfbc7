"""The profile as the pods read it: one self-contained YAML document in a ConfigMap, and its hash.

``extends`` is merged here (a ConfigMap key cannot hold ``../base/x.yaml``), with the loader's rules
(mappings merge key by key, lists and scalars are replaced whole), but ``${VAR}`` references stay as
written: the pods fill them from their own environment (Secrets through ``secretKeyRef``), so no secret
value ever lands in the ConfigMap. The files were read and checked by :func:`load_profile` first (roots,
sizes, cycles), so reading them again here only repeats what passed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from specops.config.yamlsource import read_text

#: ``${VAR}`` or ``${VAR:-default}`` as the whole value.
ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}$")


def merged_source(path: str | Path) -> dict[str, Any]:
    """The profile at ``path`` with every ``extends`` merged under it; ``${VAR}`` left as written."""
    return _merged(Path(path), depth=0)


def _merged(path: Path, depth: int) -> dict[str, Any]:
    data = yaml.safe_load(read_text(path, str(path))) or {}
    if not isinstance(data, dict):
        return {}
    bases = data.pop("extends", None)
    if bases is None or depth > 16:
        return data
    out: dict[str, Any] | None = None
    for base in [bases] if isinstance(bases, str) else list(bases):
        parent = _merged((path.parent / str(base)), depth + 1)
        out = parent if out is None else merge(out, parent)
    return data if out is None else merge(out, data)


def merge(base: Any, overlay: Any) -> Any:
    """Deep merge: mappings merge key by key (overlay wins), everything else is replaced whole."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = copy.deepcopy(base)
        for key, value in overlay.items():
            out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    return copy.deepcopy(overlay)


def env_reference(value: Any) -> str | None:
    """The variable a value reads when it is exactly ``${VAR}`` or ``${VAR:-default}``, else None."""
    m = ENV_REF.match(value) if isinstance(value, str) else None
    return m.group(1) if m else None


def dump(data: Any) -> str:
    """Deterministic YAML (the order as written, block style, no aliases)."""

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)


def content_hash(*texts: str) -> str:
    """A short, stable hash of what the pods read (changes it and the pods roll)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(json.dumps(t).encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


_UNSET = re.compile(r"^environment variable \$\{([A-Za-z_][A-Za-z0-9_]*)\} is not set")
#: Stands in, while rendering, for a variable only the pods have (a Secret's value, LeaderWorkerSet's).
PLACEHOLDER = "specops-k8s-render-placeholder"


def load_for_render(path: str, registry, pod_vars) -> Any:
    """Load and validate ``path`` where the variables only the pods will have may be unset.

    ``pod_vars(loaded)`` names the variables the rendered pods get (from Secrets, from LeaderWorkerSet);
    when loading fails only because some of those are unset here, the profile is validated with a
    placeholder for them (their values never reach the manifests: the ConfigMap keeps ``${VAR}``).
    """
    import os

    from specops.config.profile import load_profile
    from specops.errors import ProfileError

    try:
        return load_profile(path, registry=registry)
    except ProfileError as exc:
        matches = [_UNSET.match(p.message) for p in exc.problems]
        if not all(matches):
            raise
        unset = {m.group(1) for m in matches if m}
        original = exc
    stand_in = {name: PLACEHOLDER for name in unset}
    loaded = load_profile(path, env={**os.environ, **stand_in}, registry=registry)
    if not unset <= set(pod_vars(loaded)):
        raise original
    return loaded


def is_deployable_profile(path: str | Path) -> bool:
    """Whether a YAML file in a folder is a profile to render: a mapping with a top-level ``name`` and no
    ``kind`` (Kubernetes and kustomize files have one); a base without ``name`` is not deployable alone."""
    from specops.errors import ProfileError

    try:
        data = yaml.safe_load(read_text(Path(path), str(path)))
    except (ProfileError, yaml.YAMLError):
        return True  # let the loader report it, located
    return isinstance(data, dict) and "name" in data and "kind" not in data
