"""Options and helpers shared by several commands."""

from __future__ import annotations

import json

import click

from specops.config.profile import LoadedProfile, load_profile
from specops.plugins import get_registry

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
profile_argument = click.argument("profile", type=click.Path(dir_okay=False, path_type=str))


def load(path: str) -> LoadedProfile:
    """Load and validate a profile with the installed plugins (raises a located ProfileError)."""
    return load_profile(path, registry=get_registry())


def echo_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def version_param(ctx, param, value):
    """click callback: an engine version as ``--backend-version`` takes it (never echoed back when wrong)."""
    if value is None:
        return None
    from specops.config.profile import check_version_text

    problem = check_version_text(value)
    if problem:
        raise click.BadParameter(problem)
    return value


#: ``--port``: a TCP port, 1–65535 (0 and booleans are no ports).
port_type = click.IntRange(1, 65535)


def duration_param(ctx, param, value):
    """click callback: ``30s``, ``10m``, ``1h30m`` or seconds → float seconds (None stays None)."""
    if value is None:
        return None
    from specops.config.durations import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
