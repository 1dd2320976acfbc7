"""``specops watch``: read-only acceptance watching for engines run elsewhere (e.g. Kubernetes).

Every option is checked before anything runs, each with a one-line click error: durations are finite
and bounded (``--window`` in (0, 1 day], ``--interval`` in [0.1 s, 1 h]), ``--min-acceptance`` is in
[0, 1], ``--on-decision`` is split like a shell would (bad quoting is an error) and run without one, and
URLs (the target, ``--url``, ``--webhook``, ``--prometheus-url``) are ``http``/``https`` with a host.
URLs are printed redacted (:mod:`specops.urls`).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import shutil
import time

import click

from specops.commands._common import load
from specops.config.profile import Profile
from specops.errors import SpecopsError
from specops.plugins import get_registry
from specops.run.instance import EventLog
from specops.urls import check_http_url, http_url, redact_text, redact_url
from specops.watch.policy import Policy
from specops.watch.watcher import MAX_INTERVAL, MAX_WINDOW, MAX_WINDOW_SAMPLES, MIN_INTERVAL


def _fmt(seconds: float) -> str:
    from specops.config.durations import format_duration

    return format_duration(seconds)


def _duration(low: float, high: float, *, low_open: bool):
    """A click callback: a duration (``90``, ``1.5``, ``500ms``, ``2m``) in seconds, finite, within bounds."""

    def callback(ctx, param, value):
        if value is None:
            return None
        from specops.config.durations import parse_duration

        text = str(value).strip()
        try:
            seconds = float(text)  # plain numbers first: "-1", "nan", "1e400" get a precise message
        except ValueError:
            try:
                seconds = parse_duration(text)
            except (ValueError, OverflowError) as exc:
                raise click.BadParameter(str(exc)) from None
        lo = (f"more than {_fmt(low)}" if low else "more than 0") if low_open else f"at least {_fmt(low)}"
        if not math.isfinite(seconds):
            raise click.BadParameter(
                f"{text!r} is not a finite duration: use a number of seconds {lo} and at most {_fmt(high)}"
            )
        if (seconds <= low if low_open else seconds < low) or seconds > high:
            raise click.BadParameter(f"{text!r}: must be {lo} and at most {_fmt(high)}")
        return seconds

    return callback


def _fraction(ctx, param, value):
    if value is None:
        return None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise click.BadParameter(f"{value!r}: an acceptance rate is a number from 0 to 1 (e.g. 0.6)")
    return value


def _url(what: str):
    def callback(ctx, param, value):
        if value is None:
            return None
        try:
            return check_http_url(value, "URL")
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return callback


def _command(ctx, param, value):
    """``--on-decision``: split like a shell would, up front; the program must exist."""
    if value is None:
        return None
    try:
        argv = shlex.split(value)
    except ValueError as exc:
        raise click.BadParameter(
            f"cannot split the command like a shell would: {exc} "
            f"(quote it as one argument, e.g. --on-decision 'notify.sh --flag')"
        ) from None
    if not argv:
        raise click.BadParameter("the command is empty")
    if shutil.which(argv[0]) is None:
        raise click.BadParameter(f"{argv[0]!r}: no such program (not on PATH, or not executable)")
    return argv


def _check_bounds(profile: Profile, say=None) -> Profile:
    """The profile with the window, interval and labels the watch will use (from the profile and the
    options), or a one-line error: a profile may hold values that the options' checks never saw. An
    interval below :data:`MIN_INTERVAL` is raised to it (as under ``specops up``), with a warning."""
    from specops.watch.sources import label_name_problem

    fb, mon = profile.fallback, profile.monitor
    window, interval = fb.window, mon.interval
    if not isinstance(window, (int, float)) or not math.isfinite(window) or not 0 < window <= MAX_WINDOW:
        raise SpecopsError(f"fallback.window must be more than 0 and at most {_fmt(MAX_WINDOW)}, got {window!r}")
    if not isinstance(interval, (int, float)) or not math.isfinite(interval) or not 0 < interval <= MAX_INTERVAL:
        raise SpecopsError(
            f"monitor.interval must be from {_fmt(MIN_INTERVAL)} to {_fmt(MAX_INTERVAL)}, got {interval!r}"
        )
    if interval < MIN_INTERVAL:
        if say is not None:
            say(
                f"warning: monitor.interval {_fmt(interval)} is below {_fmt(MIN_INTERVAL)}; reading every "
                f"{_fmt(MIN_INTERVAL)}"
            )
        interval = MIN_INTERVAL
        profile = profile.model_copy(update={"monitor": mon.model_copy(update={"interval": interval})})
    if window / interval > MAX_WINDOW_SAMPLES:
        raise SpecopsError(
            f"a window of {_fmt(window)} read every {_fmt(interval)} would hold more than "
            f"{MAX_WINDOW_SAMPLES} samples; raise the interval or shorten the window"
        )
    acc = fb.min_acceptance
    if not isinstance(acc, (int, float)) or not math.isfinite(acc) or not 0 <= acc <= 1:
        raise SpecopsError(f"fallback.min_acceptance must be from 0 to 1, got {acc!r}")
    for name in mon.labels or {}:
        problem = label_name_problem(name)
        if problem is not None:
            raise SpecopsError(problem)
    if mon.source == "promql":
        try:
            check_http_url(mon.prometheus_url, "monitor.prometheus_url")
        except ValueError as exc:
            raise SpecopsError(str(exc)) from None
    return profile


def _profile_for_url(url: str, backend: str, model_name: str | None, method: str, overrides: dict) -> Profile:
    fallback = {
        k: v
        for k, v in overrides.items()
        if k in ("window", "min_acceptance", "min_draft_tokens", "consecutive_windows", "mode") and v is not None
    }
    monitor = {k: v for k, v in overrides.items() if k in ("interval", "prometheus_url") and v is not None}
    if monitor.get("prometheus_url"):
        monitor["source"] = "promql"
    try:
        return Profile.model_validate(
            {
                "name": "watch",
                "backend": backend,
                "model": {"id": model_name or "unknown", "served_name": model_name},
                "speculative": {
                    "method": method,
                    "draft": "external"
                    if method in ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model")
                    else None,
                },
                "fallback": fallback,
                "monitor": monitor,
                "proxy": {"enabled": False},
            }
        )
    except Exception as exc:  # pydantic ValidationError: the options were wrong
        errors = getattr(exc, "errors", None)
        if callable(errors):
            first = errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise SpecopsError(f"invalid watch options: {where}: {first.get('msg')}") from None
        raise SpecopsError(f"invalid watch options: {redact_text(str(exc)).splitlines()[0]}") from None


def _detect_backend(metrics_url: str, timeout: float) -> str:
    from specops.watch.sources import ScrapeSource, SourceError

    try:
        prefix = next(b.metric_prefix for b in get_registry().backends.values() if b.metric_prefix)
        text, _ = ScrapeSource(metrics_url, prefix, None, timeout).fetch()  # fetch() reads all of /metrics
    except SourceError as exc:
        raise SpecopsError(f"cannot read the engine's metrics to detect it ({exc}); pass --backend") from None
    for backend in get_registry().backends.values():
        if backend.metric_prefix and backend.metric_prefix in text:
            return backend.name
    prefixes = "/".join(b.metric_prefix for b in get_registry().backends.values() if b.metric_prefix)
    raise SpecopsError(f"{redact_url(metrics_url)} shows no {prefixes} series; pass --backend")


WATCH_HELP = """Watch the acceptance of an engine that specops does not run, and recommend what to do.

TARGET is the engine's base URL or a profile. Nothing is restarted: on a switch decision specops
prints the recommendation and, if asked, runs --on-decision or POSTs to --webhook (for a
Kubernetes operator or a CI job to act on). Stops on Ctrl-C.

\b
Examples:
  specops watch http://10.0.0.5:8000 --method eagle3 --window 120
  specops watch profiles/llama31-8b-eagle3.yaml --webhook http://127.0.0.1:9000/hook
  specops watch http://127.0.0.1:8080 --once --json
"""


@click.command(help=WATCH_HELP)
@click.argument("target")
@click.option("--backend", help="Engine kind for a URL target (default: detected from its /metrics).")
@click.option("--model-name", help="Only series of this model (vLLM's model_name label).")
@click.option(
    "--method",
    default="draft_model",
    show_default=True,
    help="For a URL target: the speculative method the engine runs (recommendations follow its chain).",
)
@click.option(
    "--url",
    "engine_url",
    callback=_url("--url"),
    help="For a profile target: the engine's base URL (default: server.host/port).",
)
@click.option(
    "--window",
    callback=_duration(0.0, MAX_WINDOW, low_open=True),
    help="Window: seconds or a duration like 90s, 2m (default: the profile's, else 60; at most 1 day).",
)
@click.option(
    "--interval",
    callback=_duration(MIN_INTERVAL, MAX_INTERVAL, low_open=False),
    help="Time between reads: seconds or e.g. 500ms, 10s (default: the profile's, else 5; 0.1 s to 1 h).",
)
@click.option(
    "--min-acceptance", type=float, callback=_fraction, help="Threshold from 0 to 1 (default: the profile's, else 0.6)."
)
@click.option(
    "--min-draft-tokens",
    type=click.IntRange(1, 10**12),
    help="Decide only with this many drafted tokens in the window.",
)
@click.option(
    "--consecutive-windows", type=click.IntRange(1, 10_000), help="Low windows in a row before recommending a switch."
)
@click.option(
    "--prometheus-url",
    callback=_url("--prometheus-url"),
    help="Read acceptance with PromQL from this Prometheus instead of /metrics.",
)
@click.option(
    "--on-decision",
    "command",
    callback=_command,
    help="Command run on each switch recommendation (decision JSON on stdin and in $SPECOPS_DECISION). "
    "Split like a shell would; no shell is used.",
)
@click.option(
    "--webhook",
    callback=_url("--webhook"),
    help="http(s) URL that receives each switch recommendation as a JSON POST (printed redacted).",
)
@click.option("--once", is_flag=True, help="Read twice, one window apart, print the window and exit.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tick on stdout.")
def watch(
    target,
    backend,
    model_name,
    method,
    engine_url,
    window,
    interval,
    min_acceptance,
    min_draft_tokens,
    consecutive_windows,
    prometheus_url,
    command,
    webhook,
    once,
    as_json,
):
    overrides = {
        "window": window,
        "interval": interval,
        "min_acceptance": min_acceptance,
        "min_draft_tokens": min_draft_tokens,
        "consecutive_windows": consecutive_windows,
        "prometheus_url": prometheus_url,
    }
    if backend is not None and backend not in get_registry().backends:
        raise click.BadParameter(
            f"{backend!r}: not an installed backend ({', '.join(sorted(get_registry().backends))})",
            param_hint="--backend",
        )
    if "://" in target:
        try:
            check_http_url(target, "TARGET")
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="TARGET") from None
        base = target.rstrip("/")
        backend = backend or _detect_backend(base + "/metrics", 5.0)
        profile = _profile_for_url(base, backend, model_name, method, overrides)
        surface = None
    else:
        loaded = load(target)
        surface = _surface(loaded)
        profile = _with_overrides(loaded.profile, overrides)
        base = (engine_url or http_url(profile.server.host, profile.server.port)).rstrip("/")
    profile = _check_bounds(profile, say=lambda msg: click.echo(msg, err=True))
    served = model_name or profile.model.served_name
    try:
        asyncio.run(_watch(profile, base, served, command, webhook, once, as_json, surface=surface))
    except KeyboardInterrupt:
        pass


def _with_overrides(profile: Profile, overrides: dict) -> Profile:
    """A profile target with the options given on the command line (a --prometheus-url reads with PromQL)."""
    fb = {k: v for k, v in overrides.items() if v is not None and k not in ("interval", "prometheus_url")}
    mon = {k: v for k, v in overrides.items() if v is not None and k in ("interval", "prometheus_url")}
    if mon.get("prometheus_url"):
        mon["source"] = "promql"
    return profile.model_copy(
        update={
            "fallback": profile.fallback.model_copy(update=fb),
            "monitor": profile.monitor.model_copy(update=mon),
        }
    )


def _surface(loaded):
    """Mode goodput's surface, a relative ``fallback.goodput.surface`` read from the profile's folder (located
    errors), as ``specops up`` reads it."""
    if loaded.profile.fallback.mode not in ("goodput", None):  # unset: goodput where a surface is named
        return None
    from specops.errors import SpecopsError
    from specops.watch.surface import profile_surface

    try:
        return profile_surface(loaded)
    except SpecopsError as exc:
        raise click.ClickException(str(exc)) from None


async def _watch(
    profile: Profile,
    base: str,
    model_name: str | None,
    command,
    webhook,
    once: bool,
    as_json: bool,
    *,
    surface=None,
):
    from specops.watch.decide import FallbackDecider
    from specops.watch.watcher import AcceptanceReader, Watcher, notify

    backend = get_registry().backend(profile.backend)
    m = profile.monitor
    reader = AcceptanceReader(m.source, backend, profile.fallback.window, m.timeout, m.prometheus_url, dict(m.labels))
    api_key = profile.server.api_key
    reader.attach(base + backend.metrics_path, model_name, {"Authorization": f"Bearer {api_key}"} if api_key else None)
    say = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo

    def on_decision(decision, stats):
        say(
            f"recommendation: switch {decision.from_method} → {decision.to_method} [{decision.rule}]: {decision.reason}"
        )
        if command or webhook:
            notify(decision, stats, command=command, webhook=webhook, say=say)

    decider = FallbackDecider(Policy.from_profile(profile, surface=surface), events=EventLog(None), say=say)
    watcher = Watcher(profile, reader, decider, say=say, on_recommend=on_decision)
    if once:
        now = time.monotonic()
        await asyncio.to_thread(reader.read_blocking, now)
        await asyncio.sleep(profile.fallback.window)
        reading = await asyncio.to_thread(reader.read_blocking, time.monotonic())
        _print(reading, watcher.handle(reading, time.monotonic()), as_json)
        return
    while True:
        now = time.monotonic()
        reading = await asyncio.to_thread(reader.read_blocking, now)
        decision = watcher.handle(reading, now)
        _print(reading, decision, as_json)
        await asyncio.sleep(max(0.0, profile.monitor.interval - (time.monotonic() - now)))


def _print(reading, decision, as_json: bool) -> None:
    s = reading.stats
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ts": round(time.time(), 3),
                    "window": s.to_dict(),
                    "tokens_per_s": reading.tokens_per_s,
                    "decision": decision.to_dict(),
                },
                default=str,
            )
        )
        return
    acc = f"{s.acceptance:.3f}" if s.acceptance is not None else "-"
    mal = f"{s.mean_acceptance_length:.2f}" if s.mean_acceptance_length is not None else "-"
    tps = f"{reading.tokens_per_s:.1f}" if reading.tokens_per_s is not None else "-"
    click.echo(
        f"{time.strftime('%H:%M:%S')}  acceptance {acc}  length {mal}  drafted {s.draft_tokens or 0:.0f}  "
        f"tok/s {tps}  [{s.status}] {decision.action}/{decision.rule}"
    )
