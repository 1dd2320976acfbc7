"""The profile's ``deploy`` section: how ``specops k8s render`` deploys it on Kubernetes, and how many
replicas may switch methods at once (``specops up``'s fleet coordination)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from specops.config.fields import MAX_COUNT, MAX_PARALLEL, Duration, Section

#: Kubernetes object names (DNS-1123 subdomain: Secrets, PVCs) and label values / keys.
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
#: A key inside a Secret (``data`` keys).
K8S_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
#: A Kubernetes resource quantity (``500m``, ``16Gi``, ``2``, ``1.5``).
K8S_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
#: A label key (``kubernetes.io/hostname``, ``nvidia.com/gpu.product``) and a label value.
K8S_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
K8S_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
#: A container image reference (registry/repo[:tag][@digest]); no spaces, no shell characters.
IMAGE_REF = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")
MAX_NODES = 64  # nodes of one multi-node group
MAX_REPLICAS = 10_000


def _pattern(regex: re.Pattern, what: str):
    def check(value: Any) -> Any:
        if value is not None and not regex.match(value):
            raise ValueError(f"not {what}")
        return value

    return AfterValidator(check)


K8sName = Annotated[
    str, _pattern(K8S_NAME, "a Kubernetes name (lower-case letters, digits, `-` and `.`, at most 253 characters)")
]
Quantity = Annotated[str, _pattern(K8S_QUANTITY, "a Kubernetes quantity such as 500m, 8, 16Gi")]


class SecretRef(Section):
    """A key of a Kubernetes Secret. Only the reference is written here, never the value."""

    name: K8sName = Field(..., description="Name of the Secret (in the deployment's namespace).")
    key: Annotated[str, _pattern(K8S_SECRET_KEY, "a Secret key (letters, digits, `-`, `_`, `.`)")] = Field(
        ..., description="Key inside the Secret."
    )


class DeploySecrets(Section):
    """Secrets the pods read through `secretKeyRef` (never inline values, never in the ConfigMap)."""

    hf_token: SecretRef | None = Field(
        None, description="Secret key holding `HF_TOKEN` (gated or private Hub repos); the pods get it as `HF_TOKEN`."
    )
    api_key: SecretRef | None = Field(
        None,
        description="Secret key holding the API key; the pods get it in the variable that `server.api_key` names "
        "(`${VAR}`), and so does the pods' `metrics` sidecar, so that Prometheus scrapes without it.",
    )
    spot_reference_key: SecretRef | None = Field(
        None,
        description="Secret key holding the spot-check reference's API key; the pods get it in the variable "
        "`certify.spot_check.api_key_env` names.",
    )


class Toleration(Section):
    """One pod toleration (Kubernetes `tolerations[]`)."""

    key: Annotated[str, _pattern(K8S_LABEL_KEY, "a taint key")] | None = Field(
        None, description="Taint key (unset with `operator: Exists`: every taint)."
    )
    operator: Literal["Equal", "Exists"] = Field("Equal", description="`Equal` (key and value) or `Exists` (key).")
    value: Annotated[str, _pattern(K8S_LABEL_VALUE, "a taint value")] | None = Field(None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate (unset: every effect)."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="`NoExecute` only: how long the pod stays once tainted."
    )


class DeployResources(Section):
    """Resources of each pod (of each node's pod in a multi-node group)."""

    gpus: int | None = Field(
        None,
        ge=0,
        le=MAX_PARALLEL,
        description="GPUs per pod. Unset: vLLM tensor_parallel_size × pipeline_parallel_size (divided by "
        "`multi_node.nodes` for a group); llama.cpp the number of `gpus.devices` (1 when unset, 0 for `[]`).",
    )
    gpu_resource: Annotated[str, _pattern(K8S_LABEL_KEY, "an extended resource name")] = Field(
        "nvidia.com/gpu", description="Extended resource name of a GPU (`amd.com/gpu` for ROCm)."
    )
    cpu: Quantity | None = Field(None, description="CPU request and limit (e.g. `8`, `500m`).")
    memory: Quantity | None = Field(None, description="Memory request and limit (e.g. `64Gi`).")
    shm_size: Quantity | None = Field(
        "16Gi", description="Size limit of `/dev/shm` (an `emptyDir` in memory; NCCL and vLLM's workers need it)."
    )


class DeployService(Section):
    """The Service clients reach (it targets the specops proxy, never the engine)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: int | None = Field(None, ge=1, le=65535, description="Service port. Unset: `server.port`.")


class HfCache(Section):
    """Where the pods keep Hugging Face downloads (`HF_HOME`)."""

    pvc: K8sName | None = Field(
        None,
        description="PersistentVolumeClaim to mount (shared by the replicas: ReadWriteMany, or ReadOnlyMany "
        "with pre-downloaded weights). Unset: an `emptyDir` (every pod downloads again).",
    )
    mount_path: str = Field("/data/hf", pattern=r"^/[A-Za-z0-9._/-]*$", description="Where it is mounted; `HF_HOME`.")
    read_only: bool = Field(False, description="Mount it read-only (weights downloaded beforehand).")


class MultiNode(Section):
    """One engine across several nodes (a LeaderWorkerSet group per replica)."""

    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Nodes (pods) per replica; more than 1: a LeaderWorkerSet.")
    mode: Literal["ray", "nnodes", "rpc"] | None = Field(
        None,
        description="vLLM `ray` (a Ray cluster per group, `--distributed-executor-backend ray`) or `nnodes` "
        "(`--nnodes/--node-rank/--master-addr`, `--headless` on ranks ≥ 1); llama.cpp `rpc` (`rpc-server` on "
        "each worker, `llama-server --rpc`). Unset: `ray` for vLLM, `rpc` for llama.cpp.",
    )
    ray_port: int = Field(6379, ge=1, le=65535, description="Ray head port on the leader.")
    master_port: int = Field(29500, ge=1, le=65535, description="`nnodes`: torch.distributed port on the leader.")
    rpc_port: int = Field(50052, ge=1, le=65535, description="`rpc`: the workers' `rpc-server` port.")


class Autoscale(Section):
    """A HorizontalPodAutoscaler (autoscaling/v2) for a pool: replicas follow each pod's requests in flight."""

    min_replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="Fewest replicas the autoscaler keeps.")
    max_replicas: int = Field(..., ge=1, le=MAX_REPLICAS, description="Most replicas the autoscaler adds.")
    target: float | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description="Requests in flight per pod the autoscaler holds the pool at. Unset: from the goodput surface "
        "in the profile's lock file (`specops tune`, then `specops lock`): the speculating pool at the concurrency "
        "above which its method stops beating `none` (the crossover), the plain pool at the lowest concurrency "
        "where `none` reaches 90% of its best tokens/s.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Autoscale:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is above max_replicas")
        return self


class PlainPool(Section):
    """The pool of the same model without speculation that the speculating pool routes requests to."""

    replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="Replicas (groups, for a multi-node layout).")
    autoscale: Autoscale | None = Field(None, description="An autoscaler for the plain pool (unset: `replicas`).")


class InferenceGateway(Section):
    """Gateway API Inference Extension objects: an `InferencePool` per pool and an `HTTPRoute` to them."""

    gateway: K8sName = Field(..., description="The Gateway (`gateway.networking.k8s.io`) the HTTPRoute attaches to.")
    namespace: K8sName | None = Field(None, description="The Gateway's namespace. Unset: the route's own.")
    endpoint_picker_port: int = Field(
        9002,
        ge=1,
        le=65535,
        description="Port of each pool's endpoint picker Service, `<pool>-epp` (deployed with the extension, e.g. "
        "its `inferencepool` Helm chart), that the `InferencePool` names.",
    )


class Pools(Section):
    """Two pools of one model (`k8s render`): the speculating replicas, and plain ones their proxies route to."""

    plain: PlainPool | None = Field(
        None,
        description="Render a plain pool beside this one: the same model without speculation, named after the model "
        "(`<model>-plain`, shared by every profile of the model), with the profile's `routing.twins: [none]` "
        "replaced in the speculating pods by a remote twin at the plain pool's Service. `{replicas: N, autoscale: "
        "{...}}` (replicas default 1; autoscale as `deploy.pools.autoscale`). Unset: one pool. See docs/pools.md.",
    )
    autoscale: Autoscale | None = Field(
        None,
        description="An autoscaler (autoscaling/v2 HPA) for the speculating pool: `{min_replicas (default 1), "
        "max_replicas, target}`, `target` the requests in flight per pod it holds the pool at, unset: the goodput "
        "surface's crossover (see docs/pools.md). Unset: `deploy.replicas`.",
    )
    inference_gateway: InferenceGateway | None = Field(
        None,
        description="Also render an `InferencePool` per pool and an `HTTPRoute` that sends clients' explicit "
        "choices at the gateway: `X-Specops-Speculation: off` to the plain pool, the profile's aliases and the "
        "rest to the speculating pool. `{gateway: NAME, namespace: NS, endpoint_picker_port: 9002}` (the Gateway "
        "the route attaches to; each pool's endpoint picker Service is `<pool>-epp`).",
    )


class Deploy(Section):
    """How `specops k8s render` deploys this profile, and how many replicas `specops up` lets switch at once."""

    image: (
        Annotated[str, _pattern(IMAGE_REF, "a container image reference (registry/name:tag or @sha256:...)")] | None
    ) = Field(
        None,
        description="Container image with specops and the engine (see `deploy/docker/`). Unset: "
        "`specops-<backend>:<specops version>` (set the real one with kustomize `images:`).",
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="Kubernetes `imagePullPolicy`."
    )
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="Replicas (groups, for a multi-node layout).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Pod `nodeSelector` (e.g. `nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3`)."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations (e.g. of GPU taints).")
    gpus_per_node: int = Field(
        8,
        ge=1,
        le=MAX_PARALLEL,
        description="GPUs one node of the cluster has (the selected nodes'). `k8s render` refuses a pod that asks "
        "for more (it would stay Pending) and says how many `multi_node.nodes` spread the layout.",
    )
    resources: DeployResources = Field(default_factory=DeployResources)
    service: DeployService = Field(default_factory=DeployService)
    hf_cache: HfCache = Field(default_factory=HfCache)
    secrets: DeploySecrets = Field(default_factory=DeploySecrets)
    startup_timeout: Duration | None = Field(
        None,
        description="How long a pod may take to become ready the first time (the startupProbe's budget: download "
        "and load). At least `engine.ready_timeout`. Unset: `engine.ready_timeout` + 5m.",
    )
    monitor: Literal["podmonitor", "servicemonitor", "none"] = Field(
        "podmonitor", description="Prometheus-operator object that scrapes specops' and the engine's metrics."
    )
    multi_node: MultiNode = Field(default_factory=MultiNode)
    max_switching: int = Field(
        1,
        ge=1,
        le=MAX_REPLICAS,
        description="At most this many replicas switch methods at the same time; the others wait for a slot. "
        "Only the watcher's switches wait: a fallback after the engine failed never does.",
    )
    coordination: Annotated[
        Literal["auto", "lease", "directory", "off"],
        BeforeValidator(lambda v: "off" if v is False else v),  # YAML 1.1 reads a bare `off` as false
    ] = Field(
        "auto",
        description="Where the replicas share their switch slots: `lease` (Kubernetes Lease objects; the Role "
        "`specops k8s render` writes allows it), `directory` (lock files in `coordination_dir`, for plain "
        "servers) or `off`. `auto`: `lease` in a pod, `directory` when `coordination_dir` is set, else `off`.",
    )
    coordination_dir: str | None = Field(
        None,
        min_length=1,
        description="`directory`: a directory every replica of the deployment can lock files in (local, or a "
        "file system with working `flock`).",
    )
    lease_duration: Duration = Field(
        30.0,
        ge=5,
        le=3600,
        description="A slot held this long without renewal is free again (a replica that died holding it); the "
        "holder renews it every third of this while it switches.",
    )
    pools: Pools = Field(default_factory=Pools)
