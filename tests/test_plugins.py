"""Plugins: the example backend package is pip-installed and used through the real entry-point machinery.

The example (plugins/specops-example-backend) is installed with pip into a temporary target directory
that the specops processes of these tests see on PYTHONPATH, so discovery goes through the `specops`
entry-point group exactly as for a user who `pip install`s a plugin.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support_cli import ROOT, run, run_subprocess

EXAMPLE = ROOT / "plugins" / "specops-example-backend"
EXAMPLE_PROFILE = EXAMPLE / "example-profile.yaml"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example plugin, pip-installed (no deps: specops is the host) into a fresh target directory."""
    work = tmp_path_factory.mktemp("plugin")
    src = work / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))  # keep the repo clean
    site = work / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "specops_example_backend" / "__init__.py").exists()
    return site


def _fake_dist(root: Path, dist: str, module: str, source: str, entry_name: str) -> Path:
    """A plugin as an installed distribution looks on sys.path: a module plus dist-info with entry points."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source, encoding="utf-8")
    info = root / f"{dist}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[specops]\n{entry_name} = {module}\n", encoding="utf-8")
    return root


DUPLICATE = """
from specops.hookspecs import hookimpl
from specops_example_backend import SglangBackend

@hookimpl
def specops_backends():
    return [SglangBackend()]
"""

SHADOW_VLLM = """
from specops.backends.base import Backend
from specops.hookspecs import hookimpl

class Impostor(Backend):
    name = "vllm"

@hookimpl
def specops_backends():
    return [Impostor()]
"""


BROKEN_COMMANDS = """
from specops.hookspecs import hookimpl

@hookimpl
def register_commands(cli):
    raise RuntimeError("boom\\nsecond line")
"""

MISSPELT_HOOK = """
from specops.hookspecs import hookimpl

@hookimpl
def specops_backend():
    return []
"""

WRONG_ARGUMENT = """
from specops.hookspecs import hookimpl

@hookimpl
def register_commands(group):
    pass
"""

UNMARKED = """
def specops_backends():
    return []
"""

TAKES_RENDER = """
import click
from specops.hookspecs import hookimpl

@hookimpl
def register_commands(cli):
    @cli.command(name="render")
    def render():
        click.echo("not specops' render")
"""


def test_example_plugin_is_listed_with_its_origin(example_site):
    res = run_subprocess("plugins", "--json", env={"PYTHONPATH": str(example_site)})
    assert res.code == 0, res.stderr
    rows = {r["backend"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"vllm", "llamacpp", "sglang"}
    sglang = rows["sglang"]
    assert sglang["origin"] == "sglang (specops-example-backend 0.1.0)"
    assert sglang["methods"] == ["draft_model", "eagle", "eagle3", "ngram", "none"]
    assert (sglang["health_path"], sglang["metrics_path"]) == ("/health", "/metrics")
    # the built-ins come from specops' own entry points, like the plugin
    assert rows["vllm"]["origin"] == f"vllm (specops {importlib.metadata.version('specops')})"


def test_example_plugin_renders_a_profile(example_site):
    env = {"PYTHONPATH": str(example_site), "SGLANG_API_KEY": "sk-sglang-secret"}
    res = run_subprocess("render", EXAMPLE_PROFILE, "--format", "json", env=env)
    assert res.code == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["backend"] == "sglang" and plan["method"] == "eagle3"
    argv = plan["argv"]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    pairs = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert pairs["--model-path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert pairs["--speculative-algorithm"] == "EAGLE3"
    assert pairs["--speculative-draft-model-path"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert pairs["--speculative-num-steps"] == "3" and pairs["--speculative-num-draft-tokens"] == "4"
    assert pairs["--api-key"] == "***" and "sk-sglang-secret" not in res.stdout
    assert plan["metrics_url"] == "http://127.0.0.1:30000/metrics"
    shell = run_subprocess("render", EXAMPLE_PROFILE, env=env)
    assert shell.code == 0 and shell.stdout.startswith("CUDA_VISIBLE_DEVICES=0 python3 -m sglang.launch_server ")


def test_example_plugin_checks_profiles(example_site, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: b\nbackend: sglang\nmodel:\n  id: /models/x.gguf\nspeculative:\n  method: medusa\n  draft: a/b\n",
        encoding="utf-8",
    )
    res = run_subprocess("validate", bad, env={"PYTHONPATH": str(example_site)})
    assert res.code == 1
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error")]
    assert any(f"{bad}:4:7: model.id: SGLang serves" in e for e in errors), errors
    assert any(f"{bad}:6:11: speculative.method: backend sglang does not support method medusa" in e for e in errors), (
        errors
    )
    ok = run_subprocess("validate", EXAMPLE_PROFILE, env={"PYTHONPATH": str(example_site)})
    assert ok.code == 0 and ok.stdout.startswith("ok ")


def test_without_the_plugin_the_backend_is_unknown():
    res = run("validate", str(EXAMPLE_PROFILE))
    assert res.code == 1
    assert "backend: unknown backend 'sglang' (installed: llamacpp, vllm)" in res.stdout


def test_two_plugins_with_the_same_backend_name_are_a_clear_error(example_site, tmp_path):
    dup = _fake_dist(tmp_path / "dup", "specops-sglang-copy", "sglang_copy", DUPLICATE, "sglang-copy")
    env = {"PYTHONPATH": f"{example_site}:{dup}"}
    for args in (["plugins"], ["validate", "profiles/llama31-8b-eagle3.yaml"]):
        res = run_subprocess(*args, env=env)
        assert res.code == 1, res
        assert "Traceback" not in res.stderr
        line = res.stderr.strip()
        assert line.startswith("error: backend 'sglang' is registered twice: by ")
        # both origins are named, so the operator knows which package to remove
        assert "specops-example-backend 0.1.0" in line and "specops-sglang-copy 0.0.1" in line


def test_a_plugin_cannot_silently_replace_a_builtin_backend(tmp_path):
    shadow = _fake_dist(tmp_path / "shadow", "specops-shadow", "shadow_vllm", SHADOW_VLLM, "shadow")
    res = run_subprocess("plugins", env={"PYTHONPATH": str(shadow)})
    assert res.code == 1
    assert res.stderr.startswith("error: backend 'vllm' is registered twice: by ")
    assert "vllm (specops " in res.stderr and "specops-shadow 0.0.1" in res.stderr


def test_builtin_backends_are_registered_through_entry_points():
    eps = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="specops")
        if ep.dist is not None and ep.dist.name == "specops"
    }
    assert eps == {"vllm": "specops.backends.vllm", "llamacpp": "specops.backends.llamacpp"}


def test_hookspecs_live_in_one_module_and_backends_declare_everything():
    from specops import hookspecs
    from specops.plugins import get_registry

    specs = [name for name, obj in vars(hookspecs).items() if callable(obj) and hasattr(obj, "specops_spec")]
    assert specs == ["specops_backends", "register_commands", "capture_redact"]
    for name, backend in get_registry().backends.items():
        assert backend.name == name and backend.methods
        assert backend.health_path.startswith("/") and backend.metrics_path.startswith("/")
        for method in ("engine_info", "render", "check_profile", "acceptance_counters"):
            assert callable(getattr(backend, method)), (name, method)
        assert "probe" in inspect.signature(backend.engine_info).parameters


def test_example_plugin_adds_a_command(example_site):
    env = {"PYTHONPATH": str(example_site)}
    res = run_subprocess("sglang-algorithms", "--json", env=env)
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout) == {
        "draft_model": "STANDALONE",
        "eagle": "EAGLE",
        "eagle3": "EAGLE3",
        "ngram": "NGRAM",
    }
    listed = run_subprocess("--help", env=env)
    assert listed.code == 0 and "sglang-algorithms" in listed.stdout
    # built-in commands are unchanged, and without the plugin the name is unknown as before
    assert run_subprocess("plugins", env=env).code == 0
    gone = run_subprocess("sglang-algorithms")
    assert gone.code == 2 and "No such command 'sglang-algorithms'" in gone.stderr


def test_a_failing_register_commands_is_a_one_line_error(tmp_path):
    broken = _fake_dist(tmp_path / "broken", "specops-broken", "broken_cmds", BROKEN_COMMANDS, "broken")
    env = {"PYTHONPATH": str(broken)}
    res = run_subprocess("--help", env=env)
    assert res.code == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (
        "error: plugin broken (specops-broken 0.0.1): register_commands failed: RuntimeError: boom second line"
    )
    # plugin commands are collected only when needed: the built-in ones still work
    ok = run_subprocess("validate", "profiles/llama31-8b-eagle3.yaml", env=env)
    assert ok.code == 0, ok.stderr


@pytest.mark.parametrize(
    "source,message",
    [
        (
            MISSPELT_HOOK,
            "error: plugin bad (specops-bad 0.0.1): unknown hook 'specops_backend' "
            "(specops hooks: specops_backends, register_commands, capture_redact)",
        ),
        (
            WRONG_ARGUMENT,
            "error: plugin bad (specops-bad 0.0.1): Plugin 'bad' for hook 'register_commands' "
            "hookimpl definition: register_commands(group)",
        ),
        (UNMARKED, "error: plugin bad (specops-bad 0.0.1): specops_backends lacks the @hookimpl marker"),
    ],
)
def test_hooks_are_checked_against_their_specs(tmp_path, source, message):
    bad = _fake_dist(tmp_path / "bad", "specops-bad", "bad_plugin", source, "bad")
    res = run_subprocess("plugins", env={"PYTHONPATH": str(bad)})
    assert res.code == 1 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(message), res.stderr


def test_a_plugin_cannot_take_a_builtin_command(tmp_path):
    taker = _fake_dist(tmp_path / "taker", "specops-taker", "taker", TAKES_RENDER, "taker")
    res = run_subprocess("--help", env={"PYTHONPATH": str(taker)})
    assert res.code == 1
    assert res.stderr.strip() == "error: plugin taker (specops-taker 0.0.1): command 'render' is one of specops' own"


def test_the_example_plugin_uses_specops_secret_rule():
    source = (EXAMPLE / "specops_example_backend" / "__init__.py").read_text(encoding="utf-8")
    # the secret rule is specops' own, applied by Backend.launch_plan: the plugin neither copies nor re-implements it
    assert "self.launch_plan(" in source and "TOKEN|KEY" not in source and "def looks_secret" not in source


#: A backend name as a whole string literal (``"llamacpp"``, ``'vllm:'``), or an import of a built-in backend.
NAME_CHECK = re.compile(
    r"""["'](vllm|llamacpp):?["']|specops\.backends\.(vllm|llamacpp)\b"""
    r"""|from specops\.backends import .*\b(vllm|llamacpp)\b"""
)


def test_backend_facts_are_capabilities_not_name_comparisons():
    """What differs between engines is asked of the backend object, so a plugin's backend gets all of it."""
    pkg = ROOT / "specops"
    # everything but the backends themselves, the CPU development engines (devenv, and the command that sets
    # them up) and the plugin registry, which names the built-in plugin modules to load
    skip = (pkg / "backends", pkg / "devenv")
    files = [
        p
        for p in pkg.rglob("*.py")
        if not p.is_relative_to(skip[0])
        and not p.is_relative_to(skip[1])
        and p not in (pkg / "commands" / "engines.py", pkg / "plugins.py")
    ]
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if NAME_CHECK.search(line)
    ]
    assert offenders == []


def test_a_plugin_backend_gets_the_engine_facts_of_k8s_and_the_profile_rules(tmp_path, monkeypatch):
    """Multi-node modes, the engine's own download cache and the TP × PP layout are asked of the backend, so
    a plugin's backend that says the same as llama.cpp (here a look-alike under another name) gets the same
    LeaderWorkerSet; one that says nothing has no multi-node layout."""
    from specops.backends.base import Backend
    from specops.backends.llamacpp import LlamaCppBackend
    from specops.errors import ProfileError
    from specops.k8s.layout import gpus_per_pod, pod_variables
    from specops.k8s.manifests import render
    from specops.k8s.source import load_for_render
    from specops.plugins import get_registry

    class Lookalike(LlamaCppBackend):
        name = "lookalike"

    class Plain(Backend):
        name = "plain"
        methods = LlamaCppBackend.methods

    registry = get_registry()
    monkeypatch.setitem(registry.backends, "lookalike", Lookalike())
    monkeypatch.setitem(registry.backends, "plain", Plain())
    text = (ROOT / "tests" / "k8s_profiles" / "llamacpp-rpc.yaml").read_text(encoding="utf-8")
    profile = tmp_path / "lookalike.yaml"
    profile.write_text(text.replace("backend: llamacpp", "backend: lookalike"), encoding="utf-8")
    loaded = load_for_render(str(profile), registry, pod_variables)
    kinds = {obj["kind"]: obj for _, obj in render(loaded).objects}
    template = kinds["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    assert leader["args"][:4] == ["k8s", "leader", "--mode", "rpc"]  # the first of its multi_node_modes
    assert {"name": "LLAMA_CACHE", "value": "/data/hf/llama.cpp"} in leader["env"]  # its download_cache_env
    assert template["workerTemplate"]["spec"]["containers"][0]["command"] == ["rpc-server"]
    assert gpus_per_pod(loaded.profile) == 1  # layers split over the devices it gets, not TP × PP

    profile.write_text(text.replace("backend: llamacpp", "backend: plain"), encoding="utf-8")
    with pytest.raises(ProfileError, match="no multi-node layout for backend plain"):
        load_for_render(str(profile), registry, pod_variables)
