"""``specops render``: print the exact engine command line for a profile."""
from __future__ import annotations

import click

from ..plugins import get_registry
from ..render import FORMATS, format_plan, plan
from ._common import load, profile_argument


@click.command()
@profile_argument
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="shell", show_default=True,
              help="shell: one paste-able line; json: argv, env and URLs; args: one argument per line.")
@click.option("--backend-version", metavar="VERSION",
              help="Render for this engine version (vLLM: 0.32.0; llama-server: a release build such as b9100 "
                   "or a flag generation: legacy, spec-type, spec-draft, current). Default: engine.version "
                   "in the profile, else probe the installed engine.")
@click.option("--host", help="Bind address for the engine (default: server.host).")
@click.option("--port", type=int, help="Port for the engine (default: server.port).")
def render(profile, fmt, backend_version, host, port):
    """Print the argv and environment the engine will get for PROFILE.

    The output is deterministic: the same profile and engine version give byte-identical output,
    so GitOps diffs show exactly what changes. Secrets (API keys, tokens) are printed as ***.

    \b
    Examples:
      specops render profiles/llama31-8b-eagle3.yaml --backend-version 0.32.0
      specops render profiles/qwen25-coder-32b-gguf.yaml --backend-version current --format args
    """
    loaded = load(profile)
    p = plan(loaded, get_registry(), backend_version=backend_version, host=host, port=port)
    click.echo(format_plan(p, fmt), nl=False)
