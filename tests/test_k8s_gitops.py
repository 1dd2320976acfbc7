"""The GitOps example (examples/k8s-gitops) and the Argo CD plugin (deploy/argocd) work as documented.

- the committed `rendered/` is exactly what `specops k8s render` writes today (regenerate it with the
  command in examples/k8s-gitops/README.md, or SPECOPS_UPDATE_GOLDEN=1 on this test);
- `kubectl kustomize` builds both overlays, and every object it builds validates (support_k8s.validate);
- the Argo CD plugin's generate command, run in an Application's folder, renders the same objects.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT, run
from support_k8s import kubectl, objects, validate

TREE = ROOT / "examples" / "k8s-gitops"
ARGO = ROOT / "deploy" / "argocd"
UPDATE = os.environ.get("SPECOPS_UPDATE_GOLDEN") == "1"
NO_SECRETS = {"SPECOPS_API_KEY": None, "HF_TOKEN": None}


def kustomize(path: Path) -> list[dict]:
    built = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return objects(built.stdout)


def test_committed_render_is_current(tmp_path, monkeypatch):
    monkeypatch.chdir(TREE)
    out = tmp_path / "rendered"
    res = run("k8s", "render", "profiles/staging", "profiles/prod", "-o", str(out), env=NO_SECRETS)
    assert res.code == 0, res.stderr
    fresh = {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*.yaml"))}
    if UPDATE:
        shutil.rmtree(TREE / "rendered", ignore_errors=True)
        shutil.copytree(out, TREE / "rendered")
    committed = {
        str(p.relative_to(TREE / "rendered")): p.read_text() for p in sorted((TREE / "rendered").rglob("*.yaml"))
    }
    assert fresh == committed, "rendered/ is stale: run the render in examples/k8s-gitops/README.md"


@pytest.mark.parametrize("env,replicas,namespace", [("staging", 1, "llm-staging"), ("prod", 3, "llm-prod")])
def test_overlays_build_and_validate(env, replicas, namespace):
    objs = kustomize(TREE / "overlays" / env)
    kinds = {o["kind"]: o for o in objs}
    assert set(kinds) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "PodMonitor",
        "NetworkPolicy",
        # the switch-slot Leases (deploy.coordination auto): at most max_switching replicas switch at once
        "Lease",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    for obj in objs:
        assert obj["metadata"]["namespace"] == namespace
        assert obj["metadata"]["labels"]["team"] == "llm-platform"
        assert validate(obj) == [], obj["kind"]
    dep = kinds["Deployment"]["spec"]
    assert dep["replicas"] == replicas
    image = dep["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("registry.example.com/specops-vllm")
    assert image.endswith("0.1.0-rc1") if env == "staging" else "@sha256:" in image
    # the Component narrows the proxy port to the ingress controller, the metrics port to Prometheus
    ingress = kinds["NetworkPolicy"]["spec"]["ingress"]
    peers = [[f["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for f in r["from"]] for r in ingress]
    assert peers == [["ingress-nginx"], ["monitoring"]]
    assert [p["port"] for r in ingress for p in r["ports"]] == [8000, 9464]
    if env == "prod":
        assert dep["template"]["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert dep["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_argocd_plugin_renders_an_application_folder(monkeypatch):
    plugin = yaml.safe_load((ARGO / "plugin.yaml").read_text())
    assert plugin["apiVersion"] == "argoproj.io/v1alpha1" and plugin["kind"] == "ConfigManagementPlugin"
    command = plugin["spec"]["generate"]["command"]
    assert command[:3] == ["specops", "k8s", "render"] and "sh" not in command
    assert plugin["spec"]["discover"]["fileName"] == "./*.yaml"
    apps = [a for a in yaml.safe_load_all((TREE / "argocd" / "applications.yaml").read_text()) if a]
    committed = {}
    for env in ("staging", "prod"):
        folder = TREE / "rendered" / f"chat-{env}"
        committed[env] = sorted(
            (o["kind"], o["metadata"]["name"], yaml.safe_dump(o))
            for f in sorted(folder.glob("*.yaml"))
            if f.name != "kustomization.yaml"
            for o in objects(f.read_text())
        )
    for app in apps:
        source = app["spec"]["source"]
        assert source["plugin"]["name"] == plugin["metadata"]["name"]
        folder = ROOT / source["path"]
        assert folder.is_dir()
        monkeypatch.chdir(folder)  # Argo CD runs the command in the Application's folder, with no secrets
        res = run(*command[1:], env=NO_SECRETS)
        assert res.code == 0, res.stderr
        got = sorted((o["kind"], o["metadata"]["name"], yaml.safe_dump(o)) for o in objects(res.stdout))
        env = app["metadata"]["name"].removeprefix("chat-")
        assert got == committed[env]  # the plugin and the committed render agree object for object


def test_argocd_sidecar_patch_and_image():
    from dockerfile_parse import DockerfileParser

    patch = yaml.safe_load((ARGO / "repo-server-patch.yaml").read_text())
    c = patch["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["/var/run/argocd/argocd-cmp-server"]
    assert c["securityContext"]["runAsUser"] == 999 and c["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/run/argocd", "/home/argocd/cmp-server/plugins", "/tmp"} <= mounts
    df = DockerfileParser(fileobj=io.BytesIO((ROOT / "deploy" / "docker" / "Dockerfile.cmp").read_bytes()))
    copies = [i["value"] for i in df.structure if i["instruction"] == "COPY"]
    assert "deploy/argocd/plugin.yaml /home/argocd/cmp-server/config/plugin.yaml" in copies
    assert [i["value"] for i in df.structure if i["instruction"] == "USER"] == ["999"]


def test_flux_kustomizations_point_at_the_overlays():
    for ks in (k for k in yaml.safe_load_all((TREE / "flux" / "kustomizations.yaml").read_text()) if k):
        assert ks["apiVersion"] == "kustomize.toolkit.fluxcd.io/v1"
        assert (ROOT / ks["spec"]["path"] / "kustomization.yaml").is_file()
