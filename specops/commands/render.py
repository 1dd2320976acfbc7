"""``specops render``: print the exact engine command line for a profile."""

from __future__ import annotations

import click

from specops.backends.render import FORMATS, format_plan, render_plan
from specops.commands._common import load, port_type, profile_argument, version_param
from specops.config.profile import LoadedProfile
from specops.methods import Method
from specops.plugins import get_registry


def resolved(loaded: LoadedProfile, *, offline: bool, use_lock: bool) -> LoadedProfile:
    """Apply the resolver when the profile needs it (`auto`) or a lock file pins it; else unchanged."""
    spec = loaded.profile.speculative
    needs = spec.method is Method.AUTO or spec.draft == "auto"
    if not needs and not use_lock:
        return loaded
    from specops.resolve.lock import lock_path

    if not needs and not lock_path(loaded.path).is_file():
        return loaded
    from specops.resolve import resolve_profile

    res = resolve_profile(loaded, offline=offline, use_lock=use_lock)
    for note in res.notes:
        click.echo(f"note: {note}", err=True)
    return LoadedProfile(res.profile, loaded.document, loaded.path)


@click.command()
@profile_argument
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="shell",
    show_default=True,
    help="shell: one paste-able line; json: argv, env and URLs; args: one argument per line.",
)
@click.option(
    "--backend-version",
    metavar="VERSION",
    callback=version_param,
    help="Render for this engine version (vLLM: 0.32.0; llama-server: a release build such as b9100 "
    "or a flag generation: legacy, spec-type, spec-draft, current). Default: engine.version "
    "in the profile, else probe the installed engine.",
)
@click.option("--host", help="Bind address for the engine (default: server.host).")
@click.option("--port", type=port_type, help="Port for the engine, 1-65535 (default: server.port).")
@click.option("--offline", is_flag=True, help="Resolve `auto` from the lock file, HF cache and catalog only.")
@click.option("--no-lock", is_flag=True, help="Ignore <profile>.lock.json (resolve `auto` afresh).")
def render(profile, fmt, backend_version, host, port, offline, no_lock):
    """Print the argv and environment the engine will get for PROFILE.

    The output is deterministic: the same profile and engine version give byte-identical output,
    so GitOps diffs show exactly what changes. Secrets (API keys, tokens) are printed as ***.
    A profile with `auto` is resolved first; a <profile>.lock.json beside it pins the result
    (no Hub call), and a stale lock is reported on stderr.

    \b
    Examples:
      specops render profiles/llama31-8b-eagle3.yaml --backend-version 0.32.0
      specops render profiles/qwen25-coder-32b-gguf.yaml --backend-version current --format args
    """
    loaded = resolved(load(profile), offline=offline, use_lock=not no_lock)
    p = render_plan(loaded, get_registry(), backend_version=backend_version, host=host, port=port)
    click.echo(format_plan(p, fmt), nl=False)
