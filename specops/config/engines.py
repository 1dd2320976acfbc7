"""The engines a profile with twins runs behind one proxy (primary, twins, canary): their names and GPU shares.

Above :mod:`specops.config.sections` (it reads the whole profile) and below every user: the rules that check
``routing.memory_utilization`` (:mod:`specops.config.rules`), the memory estimate, the manifests and ``specops up``.
"""

from __future__ import annotations

from pathlib import PurePath

from specops.config.sections import Profile

#: The key of ``routing.memory_utilization`` that names the primary engine (twins are named by their method).
PRIMARY = "primary"
#: The key of ``routing.memory_utilization`` that names the canary engine (``routing.canary``).
CANARY = "canary"
#: What the engines share of each GPU when the profile sets no ``gpus.memory_utilization`` (vLLM's default until
#: 0.31; 0.32.0's is 0.92, read in its CacheConfig): passed explicitly, split between the engines.
DEFAULT_GPU_SHARE = 0.9


def served_names(p: Profile) -> set[str]:
    """The names the engines answer to when no alias is used: ``model.served_name``, else the engine's default
    (vLLM: the model id; llama-server: the id, or a local file's name)."""
    if p.model.served_name:
        return {p.model.served_name}
    return {p.model.id, PurePath(p.model.id).name}


def engine_names(p: Profile) -> list[str]:
    """The engines of a profile with twins, as ``routing.memory_utilization`` names them: primary, the twins that
    run here (a remote twin's engine is another deployment's), then the canary when one may run (it needs memory of
    its own while it runs beside the others)."""
    canary = [CANARY] if p.routing.canary.enabled else []
    return [PRIMARY, *(m.value for m in p.routing.local_twins), *canary]


def gpu_shares(p: Profile) -> dict[str, float]:
    """Each engine's ``--gpu-memory-utilization`` when twins share the GPUs (empty without twins, or on CPU).

    vLLM's share is per instance (each engine may take that fraction of a GPU's memory, whatever the others hold),
    so engines on one GPU must split it: the profile's own shares, else the total split evenly."""
    if not p.routing.twins or p.gpus.devices == []:
        return {}
    if p.routing.memory_utilization:
        return dict(p.routing.memory_utilization)
    names = engine_names(p)
    if len(names) < 2:  # remote twins only: the primary has the GPUs to itself
        return {}
    total = p.gpus.memory_utilization or DEFAULT_GPU_SHARE
    return {name: round(total / len(names), 4) for name in names}


def splits_gpu_by_share(backend: str) -> bool:
    """Whether ``backend`` sizes each engine's GPU memory with ``gpus.memory_utilization`` (vLLM's parallel layout;
    True when the backend is not installed, as the memory estimate assumes)."""
    from specops.plugins import get_registry  # the registry imports the config: only when asked

    return bool(getattr(get_registry().backends.get(backend), "parallel_layout", True))


def with_gpu_share(p: Profile, engine: str) -> Profile:
    """``p`` as ``engine`` runs it: its own ``gpus.memory_utilization`` share (unchanged without twins).

    Only for backends that size GPU memory with ``gpus.memory_utilization`` (vLLM); the caller knows which."""
    share = gpu_shares(p).get(engine)
    if share is None:
        return p
    return p.model_copy(update={"gpus": p.gpus.model_copy(update={"memory_utilization": share})})
