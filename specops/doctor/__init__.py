"""``specops doctor``: check the machine (and a profile) and say what to fix, one line per finding.

Each check gives a :class:`Check`: ``ok``, ``warning`` (works, but not as you may think) or ``error``
(``specops up`` would fail, or the profile is wrong), what was found, and one line of what to do. Nothing
here starts an engine or binds a port beyond a loopback bind test; the Hub is asked one small question
(unless offline), Prometheus one ``/-/ready``. A check that fails in an unforeseen way becomes an error
row naming the check, never a traceback.

The checks, in order: specops itself; the profile (validation); the engines (where each was found, its
version and llama-server flag generation, and how discovery searched: ``engine.python``,
``engine.executable``, PATH, specops' CPU development engines); the GPUs the engine would see
(``nvidia-smi``, ``CUDA_VISIBLE_DEVICES``); the profile's ports; the state folder; the Hub (or offline
mode), the HF cache and token; Prometheus for ``promql`` profiles; then for a profile the lock, the
resolution and compatibility checks, the render, and the memory fit.
"""

from __future__ import annotations

from collections.abc import Callable

from specops.doctor.base import ERROR, Check, Context, Report, one_line
from specops.doctor.hub import check_hf_cache, check_hf_token, check_hub, check_prometheus
from specops.doctor.machine import check_engines, check_gpus, check_ports, check_specops, check_state
from specops.doctor.profile import (
    check_fallback,
    check_lock,
    check_memory,
    check_profile,
    check_render,
    check_resolve,
)

__all__ = ["Check", "Report", "run_doctor"]


def run_doctor(profile_path: str | None, *, offline: bool = False, registry=None) -> Report:
    """Every check, for the machine and (when given) one profile."""
    if registry is None:
        from specops.plugins import get_registry

        registry = get_registry()

    ctx = Context(registry=registry, offline=offline, profile_path=profile_path)
    report = Report(profile=profile_path)
    steps: list[tuple[str, Callable[[Context], list[Check]]]] = [
        ("specops", check_specops),
        ("profile", check_profile),
        ("engine", check_engines),
        ("gpus", check_gpus),
        ("ports", check_ports),
        ("state", check_state),
        ("hub", check_hub),
        ("hf-cache", check_hf_cache),
        ("hf-token", check_hf_token),
        ("prometheus", check_prometheus),
        ("lock", check_lock),
        ("resolve", check_resolve),
        ("render", check_render),
        ("fallback", check_fallback),
        ("memory", check_memory),
    ]
    for name, step in steps:
        try:
            report.checks += step(ctx)
        except Exception as exc:  # a check must never end the report: say which one broke, and go on
            report.checks.append(
                Check(name, ERROR, f"doctor could not check this: {type(exc).__name__}: {one_line(str(exc))}")
            )
    return report
