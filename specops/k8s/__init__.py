"""Kubernetes manifests for a profile (``specops k8s render``) and the helpers the pods run.

- :mod:`specops.k8s.source`: the profile as the pods read it (``extends`` merged, ``${VAR}`` kept) and its hash;
- :mod:`specops.k8s.manifests`: ConfigMap, Deployment or LeaderWorkerSet, Service, PodDisruptionBudget,
  PodMonitor/ServiceMonitor and NetworkPolicy, as plain data;
- :mod:`specops.k8s.emit`: deterministic YAML, one folder per profile with a ``kustomization.yaml``;
- :mod:`specops.k8s.pod`: what runs inside the pods (the readiness probe, the multi-node leader and worker).

The layer sits above ``perf`` and below the command line: it reads profiles (``config``) and renders
engine commands (``backends``); nothing below it imports it.
"""
