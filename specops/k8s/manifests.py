"""The Kubernetes objects of one profile, as plain data (``specops k8s render``).

Pods run ``specops up`` (the engine is its child, on loopback; clients reach specops' proxy), so git holds
the policy and the pods hold the runtime state: Argo CD / Flux see no drift when a replica falls back.

- single node: ConfigMap, Deployment, Service, PodDisruptionBudget, PodMonitor (or ServiceMonitor),
  NetworkPolicy, and the switch-slot Leases with their ServiceAccount/Role/RoleBinding (:mod:`specops.k8s.rbac`);
- several nodes per replica (``deploy.multi_node.nodes`` > 1): a LeaderWorkerSet instead of the Deployment
  (vLLM over Ray or with ``--nnodes/--headless``; llama.cpp with ``rpc-server`` workers); only the leader runs
  specops and serves HTTP and ``/metrics``.

The containers run with a read-only root file system; what they write goes to emptyDirs (the state
directory, ``/tmp``, the home directory that holds the engines' caches) and the HF cache volume. With an API
key and a monitor, the pods get a ``metrics`` sidecar (``specops k8s metrics-relay``) that serves only the
metrics, so the PodMonitor/ServiceMonitor holds no key that buys inference.

Every problem found here is a located profile error, like the loader's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specops import __version__
from specops.config.profile import LoadedProfile
from specops.config.rules import multi_node_mode
from specops.config.sections import Profile
from specops.errors import ProfileError
from specops.k8s import rbac
from specops.k8s.layout import (
    LWS_VARS,
    RPC_WORKERS_VAR,
    backend_of,
    configmap_profile,
    gated_note,
    gpus_per_pod,
    group_notes,
    profile_problems,
)
from specops.k8s.names import k8s_name
from specops.k8s.network import metrics_port, networkpolicy, relays_metrics
from specops.k8s.source import content_hash, dump, env_reference, merged_source
from specops.k8s.twins import remote_twin_notes, twin_notes
from specops.methods import Method

#: Where the pods find their profile (the ConfigMap is mounted here).
CONFIG_DIR = "/etc/specops"
PROFILE_KEY = "profile.yaml"
#: ``specops up`` reads ``<profile>.lock.json`` beside the profile (specops.resolve.lock.lock_path).
LOCK_KEY = "profile.lock.json"
PROFILE_PATH = f"{CONFIG_DIR}/{PROFILE_KEY}"
STATE_DIR = "/var/lib/specops"
#: The image's home directory (deploy/docker/Dockerfile.*); an emptyDir there holds the engines' caches
#: (~/.cache: vLLM, Triton, torch), since the root file system is read-only.
HOME_DIR = "/home/specops"
METRICS_CONTAINER = "metrics"
#: The image's non-root user (deploy/docker/Dockerfile.*: ``useradd --uid 1000``).
UID = 1000
CONTAINER = "specops"
HASH_ANNOTATION = "specops.dev/profile-hash"
#: Labels LeaderWorkerSet puts on its pods (leaderworkerset.x-k8s.io/v1, api/leaderworkerset/v1).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
#: Seconds the preStop hook waits before draining, so that the endpoints (and load balancers) stop sending
#: to the pod first; then it waits for in-flight requests (at most proxy.drain_timeout), then SIGTERM.
PRESTOP_SLEEP = 5
#: Margin on top of drain + stop in terminationGracePeriodSeconds.
GRACE_MARGIN = 15
STARTUP_PERIOD = 10


@dataclass
class Rendered:
    """The objects of one profile (in the order they are written) and notes for stderr."""

    name: str
    objects: list[tuple[str, dict]] = field(default_factory=list)  # (file name, object)
    notes: list[str] = field(default_factory=list)
    #: Several profiles may render it (a plain pool, :mod:`specops.k8s.pools`): kept once when they agree.
    shared: bool = False


def labels(p: Profile) -> dict[str, str]:
    """The labels that select this deployment's pods."""
    return {"app.kubernetes.io/name": "specops", "app.kubernetes.io/instance": k8s_name(p.name)}


def _all_labels(p: Profile) -> dict[str, str]:
    return {
        **labels(p),
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/managed-by": "specops",
        "app.kubernetes.io/version": __version__,
    }


def _meta(p: Profile, name: str) -> dict:
    return {"name": name, "labels": _all_labels(p)}


# ------------------------------------------------------------------------------------------- pieces


def startup_seconds(p: Profile) -> int:
    s = p.deploy.startup_timeout
    return math.ceil(s if s is not None else p.engine.ready_timeout + 300)


def grace_seconds(p: Profile) -> int:
    """terminationGracePeriodSeconds: preStop, then specops drains and stops the engine."""
    return PRESTOP_SLEEP + math.ceil(p.proxy.drain_timeout + p.supervisor.stop_timeout) + GRACE_MARGIN


def _resources(p: Profile, gpus: int) -> dict:
    r = p.deploy.resources
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    for key, value in (("cpu", r.cpu), ("memory", r.memory)):
        if value is not None:
            requests[key] = limits[key] = value
    if gpus:
        requests[r.gpu_resource] = limits[r.gpu_resource] = str(gpus)
    out = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _env(p: Profile, key_var: str | None, *, lws: bool) -> list[dict]:
    d = p.deploy
    env: list[dict] = [
        {"name": "SPECOPS_STATE", "value": f"{STATE_DIR}/state"},
        {"name": "SPECOPS_CACHE", "value": f"{STATE_DIR}/cache"},
        {"name": "HF_HOME", "value": d.hf_cache.mount_path},
        {"name": "HOME", "value": HOME_DIR},  # writable (an emptyDir), whatever the image says
    ]
    backend = backend_of(p)
    cache_env = getattr(backend, "download_cache_env", "")
    if cache_env:  # the engine's own downloads (llama-server -hf: LLAMA_CACHE) go to the HF cache volume too
        folder = f"{d.hf_cache.mount_path.rstrip('/')}/{backend.download_cache_dir}"
        env.append({"name": cache_env, "value": folder})
    if lws:
        env.append({"name": "SPECOPS_PUBLIC_VARS", "value": ",".join((*LWS_VARS, RPC_WORKERS_VAR))})
    if d.secrets.hf_token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": _secret(d.secrets.hf_token)}})
    if d.secrets.api_key is not None and key_var is not None:
        env.append({"name": key_var, "valueFrom": {"secretKeyRef": _secret(d.secrets.api_key)}})
    spot_var = p.certify.spot_check.api_key_env
    if d.secrets.spot_reference_key is not None and spot_var:
        env.append({"name": spot_var, "valueFrom": {"secretKeyRef": _secret(d.secrets.spot_reference_key)}})
    return env


def _secret(ref) -> dict:
    return {"name": ref.name, "key": ref.key}


def _security_context() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
    }


def _pod_security_context() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "fsGroup": UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _volumes(p: Profile, cm_name: str, *, config: bool = True) -> list[dict]:
    d = p.deploy
    shm: dict[str, Any] = {"medium": "Memory"}
    if d.resources.shm_size:
        shm["sizeLimit"] = d.resources.shm_size
    vols: list[dict] = []
    if config:
        vols.append({"name": "profile", "configMap": {"name": cm_name}})
    vols.append({"name": "dshm", "emptyDir": shm})
    if d.hf_cache.pvc:
        pvc = {"claimName": d.hf_cache.pvc}
        if d.hf_cache.read_only:
            pvc["readOnly"] = True
        vols.append({"name": "hf-cache", "persistentVolumeClaim": pvc})
    else:
        vols.append({"name": "hf-cache", "emptyDir": {}})
    vols.append({"name": "state", "emptyDir": {}})
    vols += _scratch_volumes()
    return vols


def _scratch_volumes() -> list[dict]:
    """What a read-only root file system leaves to write to: ``/tmp`` and the home directory."""
    return [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}]


def _scratch_mounts() -> list[dict]:
    return [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": HOME_DIR}]


def _mounts(p: Profile, *, config: bool = True) -> list[dict]:
    d = p.deploy
    mounts: list[dict] = []
    if config:
        mounts.append({"name": "profile", "mountPath": CONFIG_DIR, "readOnly": True})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    hf = {"name": "hf-cache", "mountPath": d.hf_cache.mount_path}
    if d.hf_cache.read_only:
        hf["readOnly"] = True
    mounts.append(hf)
    mounts.append({"name": "state", "mountPath": STATE_DIR})
    return mounts + _scratch_mounts()


def _status_args(p: Profile, key_var: str | None) -> list[str]:
    """How the in-pod helpers reach specops' status on loopback: the admin port (no key), else the public one."""
    argv = ["--port", str(p.proxy.admin_port or p.server.port)]
    if p.proxy.admin_port is None and key_var is not None:
        argv += ["--key-env", key_var]
    return argv


def probe_command(p: Profile, key_var: str | None, *, readiness: bool = False) -> list[str]:
    """The exec probe: specops' proxy answers and serves (``specops k8s probe``, loopback only).

    A single replica stays ready while a switch holds requests (its proxy queues them; there is no other
    replica to route to); with several, a switching replica leaves the Service.
    """
    argv = ["specops", "k8s", "probe", *_status_args(p, key_var)]
    if readiness and p.deploy.replicas <= 1:
        argv.append("--accept-held")
    return argv


def prestop_command(p: Profile, key_var: str | None) -> list[str]:
    """preStop: the endpoints drop the pod, then in-flight requests finish (at most ``proxy.drain_timeout``)."""
    return [
        "specops",
        "k8s",
        "prestop",
        *_status_args(p, key_var),
        "--settle",
        str(PRESTOP_SLEEP),
        "--timeout",
        str(math.ceil(p.proxy.drain_timeout)),
    ]


def _server_container(p: Profile, key_var: str | None, args: list[str], *, lws: bool, gpus: int) -> dict:
    d = p.deploy
    probe = {"exec": {"command": probe_command(p, key_var)}}
    ports = [{"name": "http", "containerPort": p.server.port, "protocol": "TCP"}]
    mode = multi_node_mode(p, backend_of(p))
    if mode == "ray":
        ports.append({"name": "ray", "containerPort": d.multi_node.ray_port, "protocol": "TCP"})
    elif mode == "nnodes":
        ports.append({"name": "dist", "containerPort": d.multi_node.master_port, "protocol": "TCP"})
    c: dict[str, Any] = {
        "name": CONTAINER,
        "image": image(p),
        "imagePullPolicy": d.image_pull_policy,
        "command": ["specops"],
        "args": args,
        "ports": ports,
        "env": _env(p, key_var, lws=lws) + rbac.downward_env(p),
        "resources": _resources(p, gpus),
        "volumeMounts": _mounts(p),
        # the engine may take long to download and load: only the startup probe waits for it
        "startupProbe": {
            **probe,
            "periodSeconds": STARTUP_PERIOD,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(startup_seconds(p) / STARTUP_PERIOD)),
        },
        # ready = specops' proxy serves (not while it holds requests for a switch or a restart)
        "readinessProbe": {
            "exec": {"command": probe_command(p, key_var, readiness=True)},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        # alive = specops' proxy accepts connections; it does while the engine loads or switches
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"exec": {"command": prestop_command(p, key_var)}}},
        "securityContext": _security_context(),
    }
    return c


def image(p: Profile) -> str:
    return p.deploy.image or f"specops-{p.backend}:{__version__}"


def _pod_spec(p: Profile, containers: list[dict], volumes: list[dict]) -> dict:
    d = p.deploy
    spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "securityContext": _pod_security_context(),
        "terminationGracePeriodSeconds": grace_seconds(p),
        # no {SERVICE}_PORT variables: a Service named like the engine (vllm) would set VLLM_PORT, which vLLM reads
        "enableServiceLinks": False,
    }
    if rbac.service_account(p, k8s_name(p.name)) and any(c["name"] == CONTAINER for c in containers):
        spec["serviceAccountName"] = rbac.service_account(p, k8s_name(p.name))  # it takes switch-slot Leases
    else:  # nothing in the pod talks to the API server: no token to steal
        spec["automountServiceAccountToken"] = False
    if d.node_selector:
        spec["nodeSelector"] = dict(sorted(d.node_selector.items()))
    if d.tolerations:
        spec["tolerations"] = [_toleration(t) for t in d.tolerations]
    return spec


def _toleration(t) -> dict:
    out: dict[str, Any] = {}
    if t.key is not None:
        out["key"] = t.key
    out["operator"] = t.operator
    if t.value is not None:
        out["value"] = t.value
    if t.effect is not None:
        out["effect"] = t.effect
    if t.toleration_seconds is not None:
        out["tolerationSeconds"] = t.toleration_seconds
    return out


# ------------------------------------------------------------------------------------------- objects


def render(loaded: LoadedProfile, lock_text: str | None = None, source_name: str | None = None) -> Rendered:
    """Every object of ``loaded``'s deployment; raises a located ProfileError when it cannot run in a pod."""
    source = checked_source(loaded)
    return build(loaded.profile, configmap_profile(loaded, source), key_variable(source), lock_text, source_name)


def checked_source(loaded: LoadedProfile) -> dict:
    """The profile as the pods read it (``extends`` merged), once it passed what a pod needs (else a ProfileError)."""
    source = merged_source(loaded.path)
    problems = profile_problems(loaded, source)
    if problems:
        raise ProfileError(problems)
    return source


def key_variable(source: dict) -> str | None:
    """The variable ``server.api_key`` reads (``${VAR}``), if it reads one."""
    return env_reference((source.get("server") or {}).get("api_key"))


def build(p: Profile, doc: dict, key_var: str | None, lock_text: str | None, source_name: str | None) -> Rendered:
    """The objects of the deployment ``p`` whose pods read ``doc`` (the ConfigMap's profile)."""
    name = k8s_name(p.name)
    out = Rendered(name)
    header = (
        f"# Rendered by `specops k8s render` from {source_name or p.name}: `extends` merged, server.host set to "
        "0.0.0.0 (the pod's own network namespace).\n"
    )
    body = dump(doc)
    # the hash covers what the pods read (not the header's file name): a change rolls them, a rename does not
    digest = content_hash(body, lock_text or "")
    data = {PROFILE_KEY: header + body}
    if lock_text is not None:
        data[LOCK_KEY] = lock_text
    cm_name = f"{name}-profile"
    out.objects.append(
        ("configmap.yaml", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(p, cm_name), "data": data})
    )
    mode = multi_node_mode(p, backend_of(p))
    annotations = {HASH_ANNOTATION: digest, "kubectl.kubernetes.io/default-container": CONTAINER}
    if mode is None:
        out.objects.append(("deployment.yaml", _deployment(p, name, cm_name, key_var, annotations)))
    else:
        out.objects.append(("leaderworkerset.yaml", _lws(p, name, cm_name, key_var, annotations, mode)))
        if p.gpus.pipeline_parallel_size > 1 and p.speculative.method is not Method.NONE:
            out.notes.append(
                f"{p.name}: pipeline parallelism with speculative decoding: the draft runs on the last stage, "
                "and which vLLM versions accept the pair varies; check yours (tensor parallelism across the "
                "nodes avoids the question)"
            )
        out.notes += group_notes(p, mode)
    out.objects.append(("service.yaml", _service(p, name, lws=mode is not None)))
    out.objects.append(("pdb.yaml", _pdb(p, name)))
    if p.deploy.monitor == "podmonitor":
        out.objects.append(("podmonitor.yaml", _podmonitor(p, name, lws=mode is not None)))
    elif p.deploy.monitor == "servicemonitor":
        out.objects.append(("servicemonitor.yaml", _servicemonitor(p, name)))
    out.objects.append(("networkpolicy.yaml", networkpolicy(p, _meta(p, name), labels(p), mode)))
    out.objects += rbac.objects(p, name, _meta)
    if lock_text is None and (p.speculative.method is Method.AUTO or p.speculative.draft == "auto"):
        out.notes.append(
            f"{p.name}: `auto` without a lock file: every pod resolves the draft when it starts (Hub access "
            "needed, and replicas may pick differently); run `specops lock` and commit the .lock.json"
        )
    if p.deploy.secrets.api_key is None:
        why = (
            f"server.api_key reads ${{{key_var}}} but no deploy.secrets.api_key provides it"
            if key_var
            else "no API key"
        )
        out.notes.append(f"{p.name}: {why}: anyone who reaches the Service can use the model")
    gated = gated_note(p)
    if gated:
        out.notes.append(gated)
    out.notes += twin_notes(p)
    given = {key_var} if key_var and p.deploy.secrets.api_key is not None else set()
    out.notes += remote_twin_notes(p, given | set(p.server.env))
    return out


def _deployment(p: Profile, name: str, cm_name: str, key_var: str | None, annotations: dict) -> dict:
    container = _server_container(p, key_var, ["up", PROFILE_PATH], lws=False, gpus=gpus_per_pod(p))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(p, name),
        "spec": {
            "replicas": p.deploy.replicas,
            "selector": {"matchLabels": labels(p)},
            # GPUs are rarely spare: replace one pod at a time instead of surging a new one that stays Pending
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "progressDeadlineSeconds": startup_seconds(p) + 300,
            "template": {
                "metadata": {"labels": _all_labels(p), "annotations": annotations},
                "spec": _pod_spec(p, [container, *_relay_containers(p, key_var)], _volumes(p, cm_name)),
            },
        },
    }


def _lws(p: Profile, name: str, cm_name: str, key_var: str | None, annotations: dict, mode: str) -> dict:
    mn = p.deploy.multi_node
    gpus = gpus_per_pod(p)
    leader_args = ["k8s", "leader", "--mode", mode, "--nodes", str(mn.nodes)]
    if mode == "ray":
        leader_args += ["--ray-port", str(mn.ray_port)]
    elif mode == "rpc":
        leader_args += ["--rpc-port", str(mn.rpc_port)]
    leader_args += ["--timeout", str(startup_seconds(p)), PROFILE_PATH]
    leader = _server_container(p, key_var, leader_args, lws=True, gpus=gpus)
    worker: dict[str, Any] = {
        "name": "worker",
        "image": image(p),
        "imagePullPolicy": p.deploy.image_pull_policy,
        "env": _env(p, None, lws=True),
        "resources": _resources(p, gpus),
        "securityContext": _security_context(),
    }
    if mode == "ray":
        # the Ray worker of this group; the leader's engine places its shards here
        worker["command"] = ["ray"]
        worker["args"] = ["start", f"--address=$(LWS_LEADER_ADDRESS):{mn.ray_port}", "--block"]
        worker["volumeMounts"] = _mounts(p, config=False)
        volumes = _volumes(p, cm_name, config=False)
    elif mode == "nnodes":
        # the same vLLM command with --node-rank $LWS_WORKER_INDEX and --headless, following the leader's method
        worker["command"] = ["specops"]
        worker["args"] = ["k8s", "worker", "--port", str(p.server.port)]
        worker["args"] += ["--key-env", key_var] if key_var else []
        worker["args"].append(PROFILE_PATH)
        worker["env"] = _env(p, key_var, lws=True)  # it loads the same profile, which may read the key
        worker["volumeMounts"] = _mounts(p)
        volumes = _volumes(p, cm_name)
    else:  # rpc: llama.cpp's rpc-server (built with -DGGML_RPC=ON); insecure on untrusted networks
        worker["command"] = ["rpc-server"]
        worker["args"] = ["-H", "0.0.0.0", "-p", str(mn.rpc_port)]
        worker["ports"] = [{"name": "rpc", "containerPort": mn.rpc_port, "protocol": "TCP"}]
        worker["readinessProbe"] = {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5}
        worker["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}, *_scratch_mounts()]
        volumes = [v for v in _volumes(p, cm_name, config=False) if v["name"] in ("dshm", "tmp", "home")]
    leader_spec = _pod_spec(p, [leader, *_relay_containers(p, key_var)], _volumes(p, cm_name))
    worker_spec = _pod_spec(p, [worker], volumes)
    worker_spec["terminationGracePeriodSeconds"] = grace_seconds(p)
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": _meta(p, name),
        "spec": {
            "replicas": p.deploy.replicas,
            # workers must start before the leader is ready (the leader waits for them): not LeaderReady
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": mn.nodes,
                # a lost node breaks the group's engine: recreate the whole group
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {
                        "labels": {**_all_labels(p), "specops.dev/role": "leader"},
                        "annotations": annotations,
                    },
                    "spec": leader_spec,
                },
                "workerTemplate": {
                    "metadata": {
                        "labels": {**_all_labels(p), "specops.dev/role": "worker"},
                        "annotations": {**annotations, "kubectl.kubernetes.io/default-container": "worker"},
                    },
                    "spec": worker_spec,
                },
            },
        },
    }


def _service(p: Profile, name: str, *, lws: bool) -> dict:
    selector = dict(labels(p))
    if lws:
        selector[LWS_WORKER_INDEX_LABEL] = "0"  # only the leader serves HTTP
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(p, name),
        "spec": {
            "type": p.deploy.service.type,
            "selector": selector,
            "ports": [
                {
                    "name": "http",
                    "port": p.deploy.service.port or p.server.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                },
                *_metrics_service_ports(p),
            ],
        },
    }


def _pdb(p: Profile, name: str) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(p, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(p)}},
    }


def _relay_containers(p: Profile, key_var: str | None) -> list[dict]:
    """The metrics sidecar (:func:`specops.k8s.pod.metrics_relay`): GET of the two metrics paths, on their own
    port, answered with the key added on loopback; the key stays in the pod."""
    if not relays_metrics(p) or key_var is None or p.deploy.secrets.api_key is None:
        return []
    port = metrics_port(p)
    args = ["k8s", "metrics-relay", "--listen-port", str(port), "--port", str(p.server.port), "--key-env", key_var]
    return [
        {
            "name": METRICS_CONTAINER,
            "image": image(p),
            "imagePullPolicy": p.deploy.image_pull_policy,
            "command": ["specops"],
            "args": args,
            "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP"}],
            "env": [{"name": key_var, "valueFrom": {"secretKeyRef": _secret(p.deploy.secrets.api_key)}}],
            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
            "readinessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 10},
            "securityContext": _security_context(),
        }
    ]


def _metrics_service_ports(p: Profile) -> list[dict]:
    if not relays_metrics(p) or p.deploy.monitor != "servicemonitor":
        return []
    return [{"name": "metrics", "port": metrics_port(p), "targetPort": "metrics", "protocol": "TCP"}]


def _scrape_endpoints(p: Profile, key: str) -> list[dict]:
    """specops' own metrics and the engine's (through the proxy: the engine listens on loopback only), from
    the metrics sidecar when the public port asks for the API key: the monitor holds no key."""
    port = "metrics" if relays_metrics(p) else "http"
    return [{key: port, "path": path, "interval": "15s"} for path in ("/specops/metrics", "/metrics")]


def _podmonitor(p: Profile, name: str, *, lws: bool) -> dict:
    selector = dict(labels(p))
    if lws:
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(p, name),
        "spec": {
            "selector": {"matchLabels": selector},
            "podTargetLabels": ["app.kubernetes.io/instance"],
            "podMetricsEndpoints": _scrape_endpoints(p, "port"),
        },
    }


def _servicemonitor(p: Profile, name: str) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(p, name),
        "spec": {
            "selector": {"matchLabels": labels(p)},
            "targetLabels": ["app.kubernetes.io/instance"],
            "endpoints": _scrape_endpoints(p, "port"),
        },
    }
