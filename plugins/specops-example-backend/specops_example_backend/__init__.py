"""An example specops backend plugin: SGLang.

specops finds this module through the ``specops`` entry-point group (see pyproject.toml) and calls its
``specops_backends`` hook, exactly as it does for the built-in vllm and llamacpp backends, and its
``register_commands`` hook, which adds ``specops sglang-algorithms``.
"""

from __future__ import annotations

import json
import subprocess

import click

from specops.backends.base import Backend, EngineInfo, RenderError
from specops.errors import SpecopsError
from specops.hookspecs import hookimpl
from specops.methods import Method

#: specops method -> SGLang ``--speculative-algorithm``.
ALGORITHM = {Method.EAGLE: "EAGLE", Method.EAGLE3: "EAGLE3", Method.DRAFT_MODEL: "STANDALONE", Method.NGRAM: "NGRAM"}
LLAMACPP_ONLY = ("gpu_layers", "draft_gpu_layers", "draft_devices", "split_mode", "tensor_split", "main_gpu")


class SglangBackend(Backend):
    name = "sglang"
    methods = frozenset(ALGORITHM) | {Method.NONE}
    health_path = "/health"
    metrics_path = "/metrics"
    install_hint = "SGLang not found: `pip install sglang` in the Python that engine.python points at"
    # capabilities (see specops.backends.base.Backend); the others keep their defaults
    display_name = "SGLang"
    model_name_label = True  # SGLang labels its series with model_name

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
        argv = list(engine.invocation) + [
            "--model-path",
            p.model.id,
            "--host",
            host,
            "--port",
            str(port),
            "--enable-metrics",
        ]
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
            argv += [
                "--speculative-num-steps",
                str(spec.k),
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                str(spec.k + 1),
            ]
        argv += p.server.extra_args
        env = dict(p.server.env)
        if g.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, g.devices))
        # the base class adds the values of secret-named environment variables, by specops' own rule
        return self.launch_plan(
            p,
            engine,
            argv,
            env,
            host,
            port,
            model_name=p.model.served_name or p.model.id,
            notes=("example plugin: check flags against your SGLang",),
            secrets=secrets,
        )

    def acceptance_counters(self, *args, **kwargs):
        """SGLang exports an acceptance *length* gauge, not draft/accepted counters: nothing to window here,
        so specops reports acceptance as unknown (never as zero) for this backend."""
        return None


@hookimpl
def specops_backends():
    return [SglangBackend()]


@hookimpl
def register_commands(cli):
    @cli.command(name="sglang-algorithms")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    def sglang_algorithms(as_json):
        """Which --speculative-algorithm each specops method renders for SGLang (example plugin)."""
        rows = {m.value: ALGORITHM[m] for m in sorted(ALGORITHM, key=lambda m: m.value)}
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        for method, algorithm in rows.items():
            click.echo(f"{method:<12} {algorithm}")


__all__ = ["SglangBackend", "register_commands", "specops_backends"]
