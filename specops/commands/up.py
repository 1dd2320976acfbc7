"""``specops up``: launch and supervise the engine for a profile."""

from __future__ import annotations

import click

from specops.commands._common import load, profile_argument, version_param
from specops.plugins import get_registry
from specops.serve.up import UpOptions, up_blocking


@click.command()
@profile_argument
@click.option(
    "--backend-version",
    metavar="VERSION",
    callback=version_param,
    help="Expect this engine version (checked against the probe).",
)
@click.option("--quiet-engine", is_flag=True, help="Do not echo the engine's output (it still goes to the log file).")
@click.option("--offline", is_flag=True, help="Resolve drafts from the lock file, HF cache and catalog only.")
@click.option(
    "--require-certificate",
    is_flag=True,
    help="Refuse to start unless PROFILE.cert.json (`specops certify`) is current: without it, a changed "
    "engine version, draft revision or chat template is only a warning.",
)
def up(profile, backend_version, quiet_engine, offline, require_certificate):
    """Launch the engine for PROFILE, supervise it, watch acceptance and fall back when it drops.

    Runs in the foreground until SIGINT/SIGTERM (or `specops down NAME`), then stops the engine
    gracefully: SIGTERM to its process group, SIGKILL after supervisor.stop_timeout. The engine's
    output is echoed with a prefix and appended to <state_dir>/<name>/engine.log; decisions go to
    events.jsonl beside it. Exit code 1 when no method of the fallback chain can start.

    SIGHUP (`systemctl reload`), or a change of the profile file (polled every 2 s), reloads the profile:
    a valid change restarts the engine with it, without losing a request; an invalid one keeps the
    running config and shows its located error in `specops status`.

    \b
    Examples:
      specops up examples/llamacpp-cpu-draft.yaml
      specops up profiles/llama31-8b-eagle3.yaml --quiet-engine
    """
    loaded = load(profile)
    raise SystemExit(
        up_blocking(
            loaded,
            get_registry(),
            UpOptions(
                backend_version=backend_version,
                show_engine_output=not quiet_engine,
                offline=offline,
                require_certificate=require_certificate,
            ),
        )
    )
