"""``specops doctor``: check the machine (and a profile) and say what to fix."""

from __future__ import annotations

import click

from specops.commands._common import echo_json, json_option


@click.command()
@click.argument("profile", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "--offline", is_flag=True, help="Do not ask the Hub; resolve from the lock file, the HF cache and the catalog."
)
@json_option
def doctor(profile, offline, as_json):
    """Check the environment (and PROFILE, when given) and say what to fix.

    \b
    Checks: the engines found (where, which version, llama-server flag generation, and how
    engine.python / engine.executable / PATH / specops' CPU development engines were searched), the
    GPUs the engine would see (nvidia-smi, CUDA_VISIBLE_DEVICES), the profile's ports (a loopback
    bind test), the state folder (writable, mode 0700), the Hub or offline mode, the HF cache and
    token (never printed), Prometheus for `monitor.source: promql`; and for PROFILE: validation, the
    lock, resolution and compatibility checks, the render, the memory fit.

    \b
    Each line is ok, warning or error, with what to do. Exit 0 when there is no error, 1 otherwise.

    \b
    Examples:
      specops doctor                                   # the machine
      specops doctor profiles/llama31-8b-eagle3.yaml   # the machine and this profile
      specops doctor prod.yaml --json                  # for scripts and CI
    """
    from specops.doctor import run_doctor

    report = run_doctor(profile, offline=offline)
    if as_json:
        echo_json(report.to_dict())
    else:
        for line in report.lines():
            click.echo(line)
    if not report.ok:
        raise SystemExit(1)
