"""``specops advise``: expected tokens per pass, speedup, best k and the batch caveat, from one acceptance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from specops.commands._common import duration_param, echo_json, json_option
from specops.errors import SpecopsError

if TYPE_CHECKING:
    from specops.perf.advise import AcceptanceInput

HELP = """What speculative decoding should give at an acceptance: tokens per target pass, speedup, best k.

Give the acceptance one way: --alpha (the model's per-token probability), --acceptance-rate (what
engines report: accepted/drafted, which is lower than α for k > 1) or --mean-length; or read it live
with --instance, --metrics-url or --prometheus (live values are rates, and mean lengths where the
engine counts drafts). PROFILE (optional) supplies k, the draft cost ratio, the backend, the served
model name and its concurrency (server.parallel).

\b
Cost model (Leviathan et al. 2023, arXiv:2211.17192):
  tokens per target pass  τ = (1 − α^(k+1)) / (1 − α)
  speedup                 S = τ / (k·c + c_verify(k+1))
c_verify(n), what a target pass over n tokens costs in decode steps, is the curve measured on this
machine for PROFILE's engine and model (`specops bench PROFILE --probe-verify`) or --verify-cost FILE;
without one it is 1 (a memory-bound target at batch 1), and the output says which was used.
The benefit fades as the batch grows; for vLLM at high concurrency advise suggests a
speculative.per_batch_size schedule.

\b
Examples:
  specops advise --alpha 0.8 -k 4 -c 0.05
  specops advise --acceptance-rate 0.62 -k 5 --batch-size 16 --json
  specops advise profiles/llama31-8b-eagle3.yaml --alpha 0.75
  specops advise examples/llamacpp-cpu-draft.yaml          # live, from the running instance
  specops advise --metrics-url http://127.0.0.1:8000/metrics --window 30s -k 3
"""


@click.command(help=HELP)
@click.argument("profile", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("--alpha", type=float, help="Per-token acceptance probability α of the model (0..1).")
@click.option(
    "--acceptance-rate",
    "rate",
    type=float,
    help="Acceptance rate as engines report it (accepted/drafted), measured at --k.",
)
@click.option("--mean-length", type=float, help="Measured mean acceptance length (1 + accepted/drafts) at --k.")
@click.option(
    "--instance",
    metavar="NAME",
    help="Read live from the running `specops up` instance NAME "
    "(its watcher's window). Default when PROFILE is given and no other source is.",
)
@click.option(
    "--metrics-url",
    metavar="URL",
    help="Read live from an engine's /metrics (lifetime totals, or the increase over --window).",
)
@click.option(
    "--prometheus",
    metavar="URL",
    help="Read live from Prometheus over --window (labels from the "
    "profile's monitor.labels and the served model name).",
)
@click.option(
    "--window",
    callback=duration_param,
    metavar="DURATION",
    help="Window of a live reading: --metrics-url scrapes twice this far apart (default: lifetime "
    "totals); --prometheus defaults to the profile's fallback.window or 60s.",
)
@click.option("--model-name", help="Model name to filter engine/Prometheus series on (default: the profile's).")
@click.option(
    "-k",
    "--k",
    "k",
    type=int,
    help="Draft tokens per step in effect (default: the profile's, else the "
    "measured draft length, else 4). --acceptance-rate/--mean-length were measured at this k.",
)
@click.option(
    "-c",
    "--draft-cost",
    "c",
    type=float,
    help="Cost of a draft pass relative to a target pass "
    "(default: the profile's fallback.draft_cost_ratio, else 0.05).",
)
@click.option("--batch-size", type=int, default=None, help="Concurrent sequences per step (default 1).")
@click.option("--k-max", type=int, default=8, show_default=True, help="Largest k in the table and the search.")
@click.option("--state-dir", help="Where instance state files live (default: $SPECOPS_STATE).")
@click.option(
    "--verify-cost",
    "verify_cost_file",
    type=click.Path(dir_okay=False, path_type=str),
    help="A verification-cost curve (the JSON `specops bench --probe-verify` writes) instead of the one "
    "stored for PROFILE's engine and model on this machine.",
)
@json_option
def advise(
    profile,
    alpha,
    rate,
    mean_length,
    instance,
    metrics_url,
    prometheus,
    window,
    model_name,
    k,
    c,
    batch_size,
    k_max,
    state_dir,
    verify_cost_file,
    as_json,
):
    given = _sources_given(alpha, rate, mean_length, instance, metrics_url, prometheus)
    if len(given) > 1:
        raise click.UsageError(f"give the acceptance one way, not {' and '.join(given)}")
    prof = None
    if profile:
        from specops.commands._common import load

        prof = load(profile).profile
    if not given:
        if prof is None:
            raise click.UsageError(
                "give --alpha, --acceptance-rate or --mean-length, or read live with "
                "--instance NAME, --metrics-url URL or --prometheus URL (or name a PROFILE "
                "whose instance is running)"
            )
        instance = prof.name

    profile_k = None
    if prof is not None and prof.speculative.method.value != "none":
        profile_k = prof.speculative.k or None
    backend = prof.backend if prof is not None else None
    served = model_name or (_served_name(prof) if prof is not None else None)

    if alpha is not None or rate is not None or mean_length is not None:
        acc = _given_acceptance(alpha, rate, mean_length, k or profile_k)
    elif instance is not None:
        acc, prof, backend = _instance_acceptance(instance, state_dir, prof, backend, k)
    elif metrics_url is not None:
        acc, backend = _scrape_acceptance(metrics_url, served, window, backend, k or profile_k)
    else:
        acc = _prometheus_acceptance(prometheus, prof, backend, served, window, k or profile_k)
    if k is None:
        from specops.perf.advise import DEFAULT_K

        k = profile_k or acc.measured_k or DEFAULT_K
    from specops.perf.advise import find_surface

    curve = _verify_cost(verify_cost_file, prof)
    _print_advice(acc, prof, backend, k, c, batch_size, k_max, as_json, find_surface(profile, prof), curve)


def _verify_cost(path: str | None, prof):
    """The curve in ``path``; else the one stored for the profile's engine, model and device; else None."""
    from specops.perf import verifycost

    if path:
        import json

        try:
            with open(path, encoding="utf-8") as f:
                return verifycost.curve_of(json.load(f))
        except OSError as exc:
            raise SpecopsError(f"--verify-cost {path}: {exc.strerror or exc}") from None
        except (ValueError, AttributeError, RecursionError) as exc:
            raise SpecopsError(f"--verify-cost {path}: not a verification-cost record: {exc}") from None
    if prof is None:
        return None
    from specops.plugins import get_registry

    try:
        engine = get_registry().backend(prof.backend).engine_info(prof, probe=True)
    except SpecopsError:
        return None  # no engine here: nothing can have been measured for it
    return verifycost.curve_for(prof, engine.version)


def _sources_given(
    alpha: float | None,
    rate: float | None,
    mean_length: float | None,
    instance: str | None,
    metrics_url: str | None,
    prometheus: str | None,
) -> list[str]:
    """The options that give the acceptance, as flags (at most one may)."""
    return [
        n
        for n, v in (
            ("--alpha", alpha),
            ("--acceptance-rate", rate),
            ("--mean-length", mean_length),
            ("--instance", instance),
            ("--metrics-url", metrics_url),
            ("--prometheus", prometheus),
        )
        if v is not None
    ]


def _given_acceptance(
    alpha: float | None, rate: float | None, mean_length: float | None, k: int | None
) -> AcceptanceInput:
    """The acceptance as given on the command line; a rate or mean length was measured at ``k``."""
    from specops.perf import advise as adv_mod

    if alpha is not None:
        return adv_mod.from_alpha(alpha)
    assumed = "" if k else ", k assumed 4"
    if rate is not None:
        return adv_mod.from_acceptance_rate(rate, k or adv_mod.DEFAULT_K, "--acceptance-rate" + assumed)
    return adv_mod.from_mean_length(mean_length, k or adv_mod.DEFAULT_K, "--mean-length" + assumed)


def _instance_acceptance(instance: str, state_dir: str | None, prof, backend: str | None, k: int | None):
    """The running instance's window, and its profile (read from its state when none was given)."""
    from specops.perf import advise as adv_mod

    stats, state = adv_mod.read_instance(instance, state_dir or (prof.supervisor.state_dir if prof else None))
    if prof is None and state.get("profile"):
        try:
            from specops.commands._common import load

            prof = load(state["profile"]).profile
            backend = prof.backend
        except (SpecopsError, OSError):
            prof = None
    running_k = _running_k(prof, state)
    acc = adv_mod.from_window(
        stats, k or running_k, f"instance {instance}, method {state.get('method')}, window {stats.window_s:g}s"
    )
    return acc, prof, backend


def _scrape_acceptance(
    metrics_url: str, served: str | None, window: float | None, backend: str | None, k: int | None
) -> tuple[AcceptanceInput, str | None]:
    """An engine's /metrics: lifetime totals, or the increase over ``window``; the backend found there."""
    from specops.perf import advise as adv_mod
    from specops.plugins import get_registry

    stats, found = adv_mod.read_scrape(metrics_url, get_registry(), served, window or 0.0, backend)
    backend = backend or getattr(found, "name", None)
    what = f"increase over {window:g}s" if window else "lifetime totals"
    return adv_mod.from_window(stats, k, f"{metrics_url}, {what}"), backend


def _prometheus_acceptance(
    prometheus: str, prof, backend: str | None, served: str | None, window: float | None, k: int | None
) -> AcceptanceInput:
    """Prometheus over ``window`` (default: the profile's fallback.window or 60s)."""
    from specops.backends import DEFAULT_BACKEND
    from specops.perf import advise as adv_mod
    from specops.plugins import get_registry
    from specops.watch.sources import promql_labels

    be = get_registry().backend(backend or DEFAULT_BACKEND)
    labels = promql_labels(be.model_name_label, dict(prof.monitor.labels) if prof else {}, served)
    win = window or (prof.fallback.window if prof else 60.0)
    stats = adv_mod.read_prometheus(prometheus, be.metric_prefix, labels, win)
    return adv_mod.from_window(stats, k, f"Prometheus {prometheus}, {win:g}s")


def _print_advice(
    acc: AcceptanceInput,
    prof,
    backend: str | None,
    k: int,
    c: float | None,
    batch_size: int | None,
    k_max: int,
    as_json: bool,
    surface=None,
    verify_cost=None,
) -> None:
    """The advice for ``acc`` at ``k``; c and the concurrency default to the profile's; ``surface``: the profile's
    measured goodput surface (its crossovers are printed)."""
    from specops.perf import advise as adv_mod
    from specops.speedup import DEFAULT_DRAFT_COST

    if c is None:
        c = prof.fallback.draft_cost_ratio if prof is not None else None
        c = DEFAULT_DRAFT_COST if c is None else c
    advice = adv_mod.advise(
        acc,
        k=k,
        c=c,
        batch_size=batch_size or 1,
        k_max=k_max,
        backend=backend,
        max_batch=prof.server.parallel if prof is not None else None,
        min_acceptance=prof.fallback.min_acceptance if prof is not None else None,
        surface=surface,
        verify_cost=verify_cost,
    )
    if as_json:
        echo_json(advice.to_dict())
    else:
        click.echo(adv_mod.format_advice(advice), nl=False)


def _served_name(prof) -> str | None:
    if prof.model.served_name:
        return prof.model.served_name
    from specops.plugins import get_registry

    if not getattr(get_registry().backends.get(prof.backend), "model_name_label", False):
        return None  # the engine labels nothing with model_name (llama-server)
    return prof.model.id


def _running_k(prof, state: dict) -> int | None:
    """The k of the method the instance runs now (a fallback step may differ from the primary)."""
    if prof is None:
        return None

    try:
        p = prof.at_step(int(state.get("step") or 0))
    except (IndexError, ValueError):
        return None
    return p.speculative.k if p.speculative.method.value != "none" else None
