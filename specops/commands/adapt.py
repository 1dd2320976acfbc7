"""``specops adapt``: what the proxy captured, a draft trained on it, and that draft written into the profile."""

from __future__ import annotations

import time
from pathlib import Path

import click

from specops.commands._common import echo_json, json_option, load, profile_argument


@click.group()
def adapt():
    """Adapt the draft to the traffic: capture (profile `capture:`), train, evaluate, promote.

    \b
    specops adapt capture-stats PROFILE      # what the proxy kept, per request class
    specops adapt train PROFILE              # a new draft from the captured traffic
    specops adapt promote PROFILE DRAFT      # certify it against the current draft, then write it in
    """


def _folder(profile_path: str, from_path: str | None) -> Path:
    if from_path:
        return Path(from_path)
    from specops.adapt.capture import capture_dir

    return capture_dir(load(profile_path).profile)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@adapt.command("capture-stats")
@profile_argument
@click.option("--from", "from_path", type=click.Path(path_type=str), help="A capture folder or file (default: the profile's).")
@json_option
def capture_stats(profile, from_path, as_json):
    """What the proxy captured for PROFILE: records, held-out share and text per class (every line checked)."""
    from specops.adapt.dataset import stats

    folder = _folder(profile, from_path)
    s = stats(folder)
    if as_json:
        echo_json({"folder": str(folder), **s.to_dict()})
        return
    click.echo(f"{folder}: {s.records} records in {s.files} files ({s.bytes} bytes), {_when(s.oldest)} .. {_when(s.newest)}")
    if not s.classes:
        return
    click.echo(f"{'class':<24} {'records':>8} {'held out':>9} {'prompt chars':>13} {'output chars':>13}")
    for name, c in sorted(s.classes.items()):
        click.echo(f"{name[:24]:<24} {c.records:>8} {c.held_out:>9} {c.prompt_chars:>13} {c.output_chars:>13}")
