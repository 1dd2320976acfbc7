"""``specops k8s``: Kubernetes manifests for profiles, and the helpers the pods run."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def k8s():
    """Deploy profiles on Kubernetes: render manifests, and the in-pod probe and multi-node helpers.

    \b
    Examples:
      specops k8s render profiles/llama31-8b-eagle3.yaml
      specops k8s render profiles/*.yaml -o deploy/rendered   # one folder per profile, kustomize-ready
    """


def profile_files(paths: tuple[str, ...]) -> list[str]:
    """The profiles to render: files as given; for a folder, its `*.yaml`/`*.yml` files that are profiles
    (a top-level `name`; bases without one and Kubernetes/kustomize files with a `kind` are skipped)."""
    from specops.k8s.source import is_deployable_profile

    out: list[str] = []
    for path in paths:
        folder = Path(path)
        if not folder.is_dir():
            out.append(path)
            continue
        found = [str(f) for f in sorted(folder.iterdir()) if f.suffix in (".yaml", ".yml") and f.is_file()]
        out += [f for f in found if is_deployable_profile(f)]
    return out


@k8s.command()
@click.argument("profiles", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write <DIR>/<name>/*.yaml with a kustomization.yaml per folder (default: one YAML stream on stdout).",
)
def render(profiles, output):
    """Print the Kubernetes manifests that run PROFILE... with `specops up` in the pods.

    A folder stands for the profiles in it (files with a top-level `name`; bases are skipped), so an
    Argo CD plugin can run `specops k8s render .` in an application's folder.

    Per profile: a ConfigMap (the profile with `extends` merged and `${VAR}` kept, plus its lock file), a
    Deployment (or a LeaderWorkerSet when deploy.multi_node.nodes > 1), a Service to specops' proxy, a
    PodDisruptionBudget, a PodMonitor (or ServiceMonitor) and a NetworkPolicy. Secrets only as
    secretKeyRef. With deploy.pools.plain, two pools: the profile's (speculating) and `<model>-plain`
    (no speculation, shared by the model's profiles), with autoscalers and Gateway API Inference
    Extension objects where the profile asks for them. The output is deterministic; a pod-template annotation carries the profile's hash, so a
    change in git rolls the pods.

    \b
    Examples:
      specops k8s render profiles/llama31-8b-eagle3.yaml | kubectl apply --dry-run=client -f -
      specops k8s render profiles/gitops/prod/llama31-8b-chat.yaml -o rendered/
    """
    from specops.errors import ProfileError
    from specops.k8s import emit
    from specops.k8s.layout import pod_variables
    from specops.k8s.manifests import render as render_profile
    from specops.k8s.pools import has_pools, merge_shared, render_pools
    from specops.k8s.source import load_for_render
    from specops.plugins import get_registry
    from specops.resolve.lock import lock_path

    rendered, problems = [], []
    paths = profile_files(profiles)
    if not paths:
        raise click.UsageError("no profile found (a folder's profiles are its YAML files with a top-level name)")
    for path in paths:
        try:
            loaded = load_for_render(path, get_registry(), pod_variables)
            lock = lock_path(path)
            lock_text = lock.read_text(encoding="utf-8") if lock.is_file() else None
            if has_pools(loaded.profile):
                pools = render_pools(loaded, lock_text, source_name=Path(path).name)
            else:
                pools = [render_profile(loaded, lock_text, source_name=Path(path).name)]
        except ProfileError as exc:
            problems += exc.problems
            continue
        rendered += pools
    if problems:
        raise ProfileError(problems)
    rendered = merge_shared(rendered)
    for note in dict.fromkeys(n for r in rendered for n in r.notes):
        click.echo(f"note: {note}", err=True)
    names = [r.name for r in rendered]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        from specops.errors import SpecopsError

        raise SpecopsError(f"two profiles render to the same Kubernetes name: {', '.join(dupes)}")
    if output is None:
        click.echo(emit.stream(rendered), nl=False)
        return
    for path in emit.write(rendered, output):
        click.echo(str(path))


@k8s.command()
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="specops' port on loopback.")
@click.option("--key-env", help="Variable holding the API key (when the status endpoint needs it).")
@click.option("--accept-held", is_flag=True, help="Ready while a switch holds requests too (a single replica).")
def probe(port, key_env, accept_held):
    """Exit 0 when specops' proxy on 127.0.0.1:PORT serves (the pods' startup and readiness probe).

    \b
    Examples (what `specops k8s render` writes into the pod spec):
      specops k8s probe --port 8000 --key-env SPECOPS_API_KEY                 # startup probe
      specops k8s probe --port 8000 --key-env SPECOPS_API_KEY --accept-held   # readiness, a single replica
    """
    from specops.k8s.pod import probe as check

    why = check(port, key_env, accept=("serving", "held") if accept_held else ("serving",))
    if why:
        click.echo(why, err=True)
        sys.exit(1)


@k8s.command("metrics-relay")
@click.option("--listen-port", type=click.IntRange(1, 65535), required=True, help="The port Prometheus scrapes.")
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="specops' port on loopback.")
@click.option("--key-env", help="Variable holding the API key specops' port asks for.")
def metrics_relay(listen_port, port, key_env):
    """Serve /specops/metrics and /metrics (nothing else) on LISTEN_PORT, without a key (the pods' scrape port).

    \b
    Example (the sidecar `specops k8s render` adds when the metrics would otherwise need the API key):
      specops k8s metrics-relay --listen-port 9464 --port 8000 --key-env SPECOPS_API_KEY
    """
    from specops.k8s.pod import serve_metrics_relay

    sys.exit(serve_metrics_relay(listen_port, port, key_env))


@k8s.command()
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="specops' port on loopback.")
@click.option("--key-env", help="Variable holding the API key (when the status endpoint needs it).")
@click.option("--settle", type=click.FloatRange(0, 600), default=5.0, show_default=True, help="Seconds first.")
@click.option("--timeout", type=click.FloatRange(0, 86400), required=True, help="Longest wait (drain_timeout).")
def prestop(port, key_env, settle, timeout):
    """The pods' preStop hook: wait SETTLE seconds, then until specops has no request in flight.

    \b
    Example (what `specops k8s render` writes into the pod spec, with proxy.drain_timeout 30):
      specops k8s prestop --port 8000 --key-env SPECOPS_API_KEY --settle 5 --timeout 30
    """
    from specops.k8s.pod import prestop as drain

    click.echo(drain(port, key_env, settle=settle, timeout=timeout), err=True)


@k8s.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=str))
@click.option("--mode", type=click.Choice(["ray", "nnodes", "rpc"]), required=True)
@click.option("--nodes", type=click.IntRange(2, 64), required=True, help="Pods in the group, leader included.")
@click.option("--ray-port", type=click.IntRange(1, 65535), default=6379, show_default=True)
@click.option("--rpc-port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--timeout", type=float, default=1800.0, show_default=True, help="Seconds to wait for the group.")
def leader(profile, mode, nodes, ray_port, rpc_port, timeout):
    """A multi-node group's leader pod: prepare the group, then exec `specops up PROFILE`.

    \b
    Examples (what `specops k8s render` writes into a LeaderWorkerSet's leader):
      specops k8s leader --mode ray --nodes 2 --ray-port 6379 --timeout 2100 /etc/specops/profile.yaml
      specops k8s leader --mode rpc --nodes 3 --rpc-port 50052 --timeout 2100 /etc/specops/profile.yaml
    """
    from specops.k8s.pod import leader as run_leader

    run_leader(mode, nodes, profile, ray_port=ray_port, rpc_port=rpc_port, timeout=timeout)


@k8s.command()
@click.argument("profile", type=click.Path(dir_okay=False, path_type=str))
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="specops' port on the leader.")
@click.option("--key-env", help="Variable holding the API key (to read the leader's status).")
def worker(profile, port, key_env):
    """An `nnodes` worker pod: the leader's vLLM command at this rank, headless, at the leader's method.

    \b
    Example (what `specops k8s render` writes into a LeaderWorkerSet's workers in mode nnodes):
      specops k8s worker --port 8000 --key-env SPECOPS_API_KEY /etc/specops/profile.yaml
    """
    from specops.k8s.pod import worker as run_worker

    sys.exit(run_worker(profile, port, key_env))
