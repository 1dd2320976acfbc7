"""Deterministic output of rendered objects: one YAML stream, or one folder per profile for kustomize."""

from __future__ import annotations

from pathlib import Path

from specops.k8s.manifests import Rendered
from specops.k8s.source import dump


def stream(rendered: list[Rendered]) -> str:
    """Every object of every profile as one multi-document YAML stream."""
    docs = [dump(obj) for r in rendered for _, obj in r.objects]
    return "---\n" + "---\n".join(docs) if docs else ""


def kustomization(resources: list[str]) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}


def files(rendered: list[Rendered]) -> dict[str, str]:
    """Relative path -> text: ``<name>/<kind>.yaml`` and a ``kustomization.yaml`` per folder and on top."""
    out: dict[str, str] = {}
    for r in rendered:
        names = [fname for fname, _ in r.objects]
        for fname, obj in r.objects:
            out[f"{r.name}/{fname}"] = dump(obj)
        out[f"{r.name}/kustomization.yaml"] = dump(kustomization(names))
    out["kustomization.yaml"] = dump(kustomization([r.name for r in rendered]))
    return out


def write(rendered: list[Rendered], directory: Path) -> list[Path]:
    """Write :func:`files` under ``directory`` (created); files of earlier renders are replaced."""
    written = []
    for rel, text in sorted(files(rendered).items()):
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
