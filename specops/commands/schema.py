"""``specops schema``: the profile's JSON Schema, for editors and CI."""

from __future__ import annotations

import json

import click

from specops.config.profile import schema as profile_schema


@click.command()
def schema():
    """Print the JSON Schema of a profile.

    \b
    Example (VS Code / yaml-language-server):
      specops schema > specops.schema.json
      # then in a profile:  # yaml-language-server: $schema=specops.schema.json
    """
    click.echo(json.dumps(profile_schema(), indent=2))
