"""``specops watch``: read-only acceptance watching for engines run elsewhere (e.g. Kubernetes)."""
from __future__ import annotations

import asyncio
import json
import shlex
import time

import click

from ..errors import SpecopsError
from ..instance import EventLog
from ..plugins import get_registry
from ..policy import Policy
from ..profile import Profile
from ._common import load


def _profile_for_url(url: str, backend: str, model_name: str | None, method: str, overrides: dict) -> Profile:
    fallback = {k: v for k, v in overrides.items() if k in ("window", "min_acceptance", "min_draft_tokens",
                                                             "consecutive_windows", "mode") and v is not None}
    monitor = {k: v for k, v in overrides.items() if k in ("interval", "prometheus_url") and v is not None}
    if monitor.get("prometheus_url"):
        monitor["source"] = "promql"
    try:
        return Profile.model_validate({
            "name": "watch", "backend": backend, "model": {"id": model_name or "unknown", "served_name": model_name},
            "speculative": {"method": method, "draft": "external" if method in (
                "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model") else None},
            "fallback": fallback, "monitor": monitor, "proxy": {"enabled": False},
        })
    except Exception as exc:  # pydantic ValidationError: the options were wrong
        raise SpecopsError(f"invalid watch options: {exc}") from None


def _detect_backend(metrics_url: str, timeout: float) -> str:
    import urllib.request
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
            text = resp.read(4 * 1024 * 1024).decode("utf-8", "replace")
    except OSError as exc:
        raise SpecopsError(f"cannot read {metrics_url} to detect the engine: {exc}; pass --backend") from None
    for backend in get_registry().backends.values():
        if backend.metric_prefix and backend.metric_prefix in text:
            return backend.name
    raise SpecopsError(f"{metrics_url} shows no vllm:/llamacpp: series; pass --backend")


@click.command()
@click.argument("target")
@click.option("--backend", help="Engine kind for a URL target (default: detected from its /metrics).")
@click.option("--model-name", help="Only series of this model (vLLM's model_name label).")
@click.option("--method", default="draft_model", show_default=True,
              help="For a URL target: the speculative method the engine runs (recommendations follow its chain).")
@click.option("--url", "engine_url", help="For a profile target: the engine's base URL (default: server.host/port).")
@click.option("--window", type=float, help="Window in seconds (default: the profile's, else 60).")
@click.option("--interval", type=float, help="Seconds between reads (default: the profile's, else 5).")
@click.option("--min-acceptance", type=float, help="Threshold (default: the profile's, else 0.6).")
@click.option("--min-draft-tokens", type=int, help="Decide only with this many drafted tokens in the window.")
@click.option("--consecutive-windows", type=int, help="Low windows in a row before recommending a switch.")
@click.option("--prometheus-url", help="Read acceptance with PromQL from this Prometheus instead of /metrics.")
@click.option("--on-decision", "command", help="Command run on each switch recommendation (decision JSON on "
              "stdin and in $SPECOPS_DECISION). Split like a shell would; no shell is used.")
@click.option("--webhook", help="URL that receives each switch recommendation as a JSON POST.")
@click.option("--once", is_flag=True, help="Read twice, one window apart, print the window and exit.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per tick on stdout.")
def watch(target, backend, model_name, method, engine_url, window, interval, min_acceptance, min_draft_tokens,
          consecutive_windows, prometheus_url, command, webhook, once, as_json):
    """Watch the acceptance of an engine that specops does not run, and recommend what to do.

    TARGET is the engine's base URL or a profile. Nothing is restarted: on a switch decision specops
    prints the recommendation and, if asked, runs --on-decision or POSTs to --webhook (for a
    Kubernetes operator or a CI job to act on). Stops on Ctrl-C.

    \b
    Examples:
      specops watch http://10.0.0.5:8000 --method eagle3 --window 120
      specops watch profiles/llama31-8b-eagle3.yaml --webhook http://127.0.0.1:9000/hook
      specops watch http://127.0.0.1:8080 --once --json
    """
    overrides = {"window": window, "interval": interval, "min_acceptance": min_acceptance,
                 "min_draft_tokens": min_draft_tokens, "consecutive_windows": consecutive_windows,
                 "prometheus_url": prometheus_url}
    if target.startswith(("http://", "https://")):
        base = target.rstrip("/")
        backend = backend or _detect_backend(base + "/metrics", 5.0)
        profile = _profile_for_url(base, backend, model_name, method, overrides)
    else:
        profile = load(target).profile
        fb = {k: v for k, v in overrides.items() if v is not None and k not in ("interval", "prometheus_url")}
        mon = {k: v for k, v in overrides.items() if v is not None and k in ("interval", "prometheus_url")}
        if mon.get("prometheus_url"):
            mon["source"] = "promql"
        profile = profile.model_copy(update={"fallback": profile.fallback.model_copy(update=fb),
                                             "monitor": profile.monitor.model_copy(update=mon)})
        h = "127.0.0.1" if profile.server.host in ("0.0.0.0", "::") else profile.server.host
        base = (engine_url or f"http://{h}:{profile.server.port}").rstrip("/")
    argv = shlex.split(command) if command else None
    try:
        asyncio.run(_watch(profile, base, model_name or profile.model.served_name, argv, webhook, once, as_json))
    except KeyboardInterrupt:
        pass


async def _watch(profile: Profile, base: str, model_name: str | None, command, webhook, once: bool, as_json: bool):
    from ..watch import AcceptanceReader, Watcher, notify

    backend = get_registry().backend(profile.backend)
    m = profile.monitor
    reader = AcceptanceReader(m.source, backend, profile.fallback.window, m.timeout, m.prometheus_url, dict(m.labels))
    api_key = profile.server.api_key
    reader.attach(base + backend.metrics_path, model_name,
                  {"Authorization": f"Bearer {api_key}"} if api_key else None)
    say = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    watcher = Watcher(profile, reader, Policy.from_profile(profile), events=EventLog(None), say=say)

    def on_decision(decision, stats):
        say(f"recommendation: switch {decision.from_method} → {decision.to_method} [{decision.rule}]: {decision.reason}")
        if command or webhook:
            notify(decision, stats, command=command, webhook=webhook, say=say)

    watcher.on_recommend = on_decision
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
        click.echo(json.dumps({"ts": round(time.time(), 3), "window": s.to_dict(), "tokens_per_s": reading.tokens_per_s,
                               "decision": decision.to_dict()}, default=str))
        return
    acc = f"{s.acceptance:.3f}" if s.acceptance is not None else "-"
    mal = f"{s.mean_acceptance_length:.2f}" if s.mean_acceptance_length is not None else "-"
    tps = f"{reading.tokens_per_s:.1f}" if reading.tokens_per_s is not None else "-"
    click.echo(f"{time.strftime('%H:%M:%S')}  acceptance {acc}  length {mal}  drafted {s.draft_tokens or 0:.0f}  "
               f"tok/s {tps}  [{s.status}] {decision.action}/{decision.rule}")
