"""An example specops backend plugin: SGLang.

specops finds this module through the ``specops`` entry-point group (see pyproject.toml) and calls its
``specops_backends`` hook, exactly as it does for the built-in vllm and llamacpp backends.
"""
from __future__ import annotations

import re
import subprocess

from specops.backends.base import Backend, EngineInfo, LaunchPlan, RenderError
from specops.errors import SpecopsError
from specops.hookspecs import hookimpl
from specops.methods import Method

#: specops method -> SGLang ``--speculative-algorithm``.
ALGORITHM = {Method.EAGLE: "EAGLE", Method.EAGLE3: "EAGLE3", Method.DRAFT_MODEL: "STANDALONE",
             Method.NGRAM: "NGRAM"}
LLAMACPP_ONLY = ("gpu_layers", "draft_gpu_layers", "draft_devices", "split_mode", "tensor_split", "main_gpu")


class SglangBackend(Backend):
    name = "sglang"
    methods = frozenset(ALGORITHM) | {Method.NONE}
    health_path = "/health"
    metrics_path = "/metrics"
    install_hint = "SGLang not found: `pip install sglang` in the Python that engine.python points at"

    def check_profile(self, p):
        if p.model.id.endswith(".gguf"):
            yield ("model", "id"), "SGLang serves Hugging Face repos or directories, not .gguf files"
        for field in LLAMACPP_ONLY:
            if getattr(p.gpus, field) is not None:
                yield ("gpus", field), f"gpus.{field} is a llama.cpp setting; SGLang does not use it"

    def engine_info(self, profile, version=None, *, probe=True):
        pinned = version or profile.engine.version
        python = profile.engine.python or "python3"
        if pinned:
            return EngineInfo(self.name, pinned, "pinned", (python, "-m", "sglang.launch_server"))
        if not probe:
            raise SpecopsError(self.install_hint + " (or render for a pinned version with --backend-version)")
        code = "import importlib.metadata as m; print(m.version('sglang'))"
        try:
            res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            raise SpecopsError(self.install_hint) from None
        if res.returncode != 0:
            raise SpecopsError(self.install_hint)
        return EngineInfo(self.name, res.stdout.strip(), f"probed {python}", (python, "-m", "sglang.launch_server"))

    def render(self, profile, engine, *, host=None, port=None):
        p, spec, g = profile, profile.speculative, profile.gpus
        host, port = host or p.server.host, port or p.server.port
        argv = list(engine.invocation) + ["--model-path", p.model.id, "--host", host, "--port", str(port),
                                          "--enable-metrics"]
        if p.model.revision:
            argv += ["--revision", p.model.revision]
        if p.model.max_model_len:
            argv += ["--context-length", str(p.model.max_model_len)]
        if p.model.served_name:
            argv += ["--served-model-name", p.model.served_name]
        if g.tensor_parallel_size > 1:
            argv += ["--tp-size", str(g.tensor_parallel_size)]
        if g.memory_utilization is not None:
            argv += ["--mem-fraction-static", f"{g.memory_utilization:g}"]
        secrets = []
        if p.server.api_key:
            argv += ["--api-key", p.server.api_key]
            secrets.append(p.server.api_key)
        if spec.method is Method.AUTO or spec.draft == "auto":
            raise RenderError(("speculative", "method"), "`auto` must be resolved first (`specops resolve`)")
        if spec.method is not Method.NONE:
            argv += ["--speculative-algorithm", ALGORITHM[spec.method]]
            if spec.draft:
                argv += ["--speculative-draft-model-path", spec.draft]
            # a chain of k draft steps, one candidate per step: k + 1 tokens verified per target pass
            argv += ["--speculative-num-steps", str(spec.k), "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", str(spec.k + 1)]
        argv += p.server.extra_args
        env = dict(p.server.env)
        if g.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, g.devices))
        env_items = tuple(sorted(env.items()))
        secrets += [v for k, v in env_items if re.search(r"TOKEN|KEY|SECRET|PASSWORD", k.upper())]
        return LaunchPlan(backend=self.name, engine_version=engine.version, method=spec.method, argv=tuple(argv),
                          env=env_items, host=host, port=port, health_path=self.health_path,
                          metrics_path=self.metrics_path, model_name=p.model.served_name or p.model.id,
                          secrets=tuple(secrets), notes=("example plugin: check flags against your SGLang",))

    def acceptance_counters(self, *args, **kwargs):
        """SGLang exports an acceptance *length* gauge, not draft/accepted counters: nothing to window here,
        so specops reports acceptance as unknown (never as zero) for this backend."""
        return None


@hookimpl
def specops_backends():
    return [SglangBackend()]


__all__ = ["SglangBackend", "specops_backends"]
