"""``specops plugins``: which backends are installed, what they support, and where they come from."""

from __future__ import annotations

import click

from specops.commands._common import echo_json, json_option
from specops.plugins import get_registry


@click.command()
@json_option
def plugins(as_json):
    """List the backends the installed plugins provide, with their methods and origin.

    `methods` are what specops renders, checks and falls back between; `not rendered` lists speculative
    methods the engine has that specops does not render (run them through server.extra_args, unchecked).

    Built-in backends (vllm, llamacpp) register through the same `specops` entry-point group as
    third-party plugins.

    \b
    Example:
      specops plugins --json
    """
    reg = get_registry()
    rows = [
        {
            "backend": name,
            "methods": sorted(m.value for m in b.methods),
            "engine_only_methods": dict(b.engine_only_methods),
            "origin": reg.origins[name],
            "health_path": b.health_path,
            "metrics_path": b.metrics_path,
        }
        for name, b in sorted(reg.backends.items())
    ]
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        click.echo(f"{r['backend']:<10} {r['origin']}")
        click.echo(f"{'':<10} methods: {', '.join(r['methods'])}")
        for name, what in r["engine_only_methods"].items():
            click.echo(f"{'':<10} not rendered: {name}: {what}")
