"""`specops render` and `specops validate` load only the control plane: no engine, no proxy, no Hub client.

They run on every CI push and in every GitOps diff, so what they import is their start time. Asserted on the
modules a real CLI process holds when it exits (timings live in benchmarks/bench_cli_start.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "examples" / "vllm-cpu-ngram.yaml"

#: Runs the real CLI entry point and writes the names in sys.modules at exit to the file named last.
_RUNNER = (
    "import atexit, sys\n"
    "out = sys.argv.pop()\n"
    "atexit.register(lambda: open(out, 'w').write('\\n'.join(sorted(sys.modules))))\n"
    "from specops.cli import main\n"
    "sys.argv = ['specops', *sys.argv[1:]]\n"
    "main()\n"
)

#: Prefixes no render/validate of a profile without `auto` may load: engines, the proxy and its HTTP stack,
#: metrics, the Hub client, and the draft resolver (a lock-file lookup must not load the resolver).
HEAVY = (
    "torch",
    "vllm",
    "aiohttp",
    "httptools",
    "prometheus_client",
    "huggingface_hub",
    "gguf",
    "specops.proxy",
    "specops.run",
    "specops.watch",
    "specops.resolve.resolver",
    "specops.resolve.hub",
    "specops.resolve.discover",
    "specops.resolve.check",
)


def loaded_modules(tmp_path: Path, *argv: str) -> set[str]:
    out = tmp_path / "modules.txt"
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, *argv, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return set(out.read_text().split())


#: Pure modules under a heavy prefix that validate may load: the fallback rule (which mode decides, from the profile
#: and a stored curve; it imports only specops.speedup) and the package it sits in.
LIGHT = frozenset({"specops.watch", "specops.watch.rule"})


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules - LIGHT if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.mark.parametrize(
    "argv",
    [
        ("render", str(PROFILE), "--backend-version", "0.32.0"),
        ("render", str(PROFILE), "--backend-version", "0.32.0", "--format", "json"),
        ("validate", str(PROFILE)),
    ],
    ids=["render", "render-json", "validate"],
)
def test_control_plane_imports_no_heavy_module(tmp_path, argv):
    modules = loaded_modules(tmp_path, *argv)
    assert "specops.config.profile" in modules  # the profile was really loaded
    assert heavy(modules) == []


def test_json_schema_is_not_built_to_render(tmp_path):
    """The profile's JSON Schema (for `specops schema`) is built on demand, not when the models are defined."""
    modules = loaded_modules(tmp_path, "render", str(PROFILE), "--backend-version", "0.32.0")
    assert "pydantic.type_adapter" not in modules


def test_command_import_turns_the_collector_back_on():
    """The CLI pauses the cyclic GC only while it imports a command (start time); the command runs with it on."""
    import gc

    from specops.cli import cli

    assert gc.isenabled()
    command = cli.get_command(None, "validate")
    assert command is not None and command.name == "validate"
    assert gc.isenabled()
