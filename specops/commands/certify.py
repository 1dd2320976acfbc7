"""``specops certify``: prove on the real engine that PROFILE is lossless and measure it; keep the certificate."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specops.commands._common import duration_param, echo_json, json_option, load, profile_argument, version_param

CERTIFY_HELP = """Certify PROFILE on its real engine: lossless under greedy decoding, and how fast.

Launches the engine as the profile says and again with method none, sends the same prompts to both
and compares the greedy outputs token by token (the first divergence is shown with both
continuations). Measures acceptance per draft position, acceptance rate and mean acceptance length
per prompt set (from the engine's counters) and tokens/s with and without speculation at
concurrency 1 and the profile's (server.parallel). With a chat template in the model, requests go
through /v1/chat/completions so the engine applies it; without one, raw prompts go to
/v1/completions (the report says which).

\b
Writes the certificate beside the profile (PROFILE.cert.json, deterministic JSON to keep in git):
engine and version, target and draft revisions, the chat template's hash, the figures, the date.
`specops validate --require-certificate` fails when it is missing or stale; `specops up` warns
when the engine, draft or template differ from the certified ones.

\b
Exit code 0 when certified (lossless, exactly or within --tolerance, and the engine speculated),
1 otherwise (the certificate is written either way, with its verdict).

\b
Examples:
  specops certify examples/llamacpp-cpu-draft.yaml
  specops certify profiles/llama31-8b-eagle3.yaml --workload code,chat,my-traffic.jsonl --plots out/
  specops certify p.yaml --tolerance 0.05     # bf16 batch-verify: accept near ties within 0.05 nats
"""


@click.command(help=CERTIFY_HELP)
@profile_argument
@click.option(
    "-w",
    "--workload",
    "prompt_sets",
    default="code,summarize,chat,creative",
    show_default=True,
    help="Comma-separated built-in prompt sets (code, summarize, chat, creative, extraction) and/or JSONL files "
    '(one {"prompt", "max_tokens", "temperature", "set"} per line).',
)
@click.option("-n", "--prompts-per-set", type=int, help="Use only the first N prompts of each set.")
@click.option("--max-tokens", type=int, help="Override every prompt's max_tokens.")
@click.option(
    "-c", "--concurrency", type=int, help="The higher concurrency to measure (default: server.parallel, else only 1)."
)
@click.option(
    "--rounds",
    type=int,
    default=1,
    show_default=True,
    help="Repeat the tokens/s passes this many times on each engine; tokens/s are medians over rounds.",
)
@click.option(
    "--endpoint",
    type=click.Choice(["auto", "chat", "completions"]),
    default="auto",
    show_default=True,
    help="auto: chat completions when the model has a chat template, else completions.",
)
@click.option(
    "--tolerance",
    type=float,
    default=0.0,
    show_default=True,
    help="Nats: accept a greedy divergence whose first differing token was within this log-probability of the "
    "baseline's token (batch-verify numerics in bf16/fp16 can flip near ties). 0: exact. Stated in the report.",
)
@click.option("--step", type=int, default=0, show_default=True, help="Chain step to certify (0: the profile's method).")
@click.option("--backend-version", metavar="VERSION", callback=version_param, help="Expect this engine version.")
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(dir_okay=False),
    help="Where to write the certificate (default: beside the profile, PROFILE.cert.json).",
)
@click.option("--no-write", is_flag=True, help="Measure and print, but write no certificate.")
@click.option(
    "--plots",
    "plots_dir",
    type=click.Path(file_okay=False),
    help="Write certificate.png (acceptance per position, speedup) here (needs matplotlib).",
)
@click.option(
    "--both-at-once",
    is_flag=True,
    help="Start both engines (with and without speculation) together so their start-ups overlap; the "
    "measurements still take turns. Needs memory for two (on a GPU lower gpus.memory_utilization).",
)
@click.option("--log-dir", type=click.Path(file_okay=False), help="Keep the engines' logs here.")
@click.option(
    "--spot-reference",
    metavar="URL",
    help="Live spot checks instead of a certification: compare greedy probes sent to the running deployment "
    "(server.host:port of PROFILE) with this instance of the same model without speculation, every --every, "
    "recording spot_check / spot_divergence events in the deployment's events.jsonl. To check the clients' own "
    "greedy requests, enable certify.spot_check in the profile: `specops up` runs the checks itself.",
)
@click.option(
    "--every",
    callback=duration_param,
    metavar="DURATION",
    default="10m",
    show_default=True,
    help="Spot checks: time between checks (at least 10s).",
)
@click.option("--checks", type=int, help="Spot checks: stop after this many (default: until interrupted).")
@click.option("--sample", type=int, default=2, show_default=True, help="Spot checks: greedy probes per check.")
@click.option(
    "--metrics-file",
    type=click.Path(dir_okay=False),
    help="Spot checks: write the specops_spot_check_* metrics here after each check (Prometheus text format, "
    "for node_exporter's textfile collector).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress output on stderr.")
@json_option
def certify(
    profile,
    prompt_sets,
    prompts_per_set,
    max_tokens,
    concurrency,
    rounds,
    endpoint,
    tolerance,
    step,
    backend_version,
    output,
    no_write,
    plots_dir,
    both_at_once,
    log_dir,
    spot_reference,
    every,
    checks,
    sample,
    metrics_file,
    quiet,
    as_json,
):
    from specops.perf.certify import CertifyConfig, run_certify_blocking, summary_text
    from specops.perf.certify_file import cert_path, write_cert
    from specops.plugins import get_registry

    loaded = load(profile)
    say = (lambda m: None) if quiet else (lambda m: click.echo(f"specops: {m}", err=True))
    if spot_reference:
        results = _spot_checks(
            loaded,
            spot_reference,
            prompt_sets,
            max_tokens,
            tolerance,
            endpoint,
            every,
            checks,
            sample,
            metrics_file,
            say,
        )
        if as_json:
            echo_json(json.loads(json.dumps(results, default=str)))
        if any(not r["lossless"] for r in results):
            raise SystemExit(1)
        return
    cfg = CertifyConfig(
        prompt_sets=[x.strip() for x in prompt_sets.split(",") if x.strip()],
        prompts_per_set=prompts_per_set,
        max_tokens=max_tokens,
        concurrency=concurrency,
        rounds=rounds,
        endpoint=endpoint,
        tolerance=tolerance,
        step_index=step,
        backend_version=backend_version,
        both_at_once=both_at_once,
        log_dir=Path(log_dir) if log_dir else None,
    )
    if cfg.log_dir:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
    cert = run_certify_blocking(loaded, get_registry(), cfg, say=say)
    written = None
    if not no_write:
        written = write_cert(output or cert_path(loaded.path), cert)
    plots = []
    if plots_dir:
        from specops.perf.plots import plots_missing

        why = plots_missing()
        if why:
            click.echo(f"warning: {why}", err=True)
        else:
            from specops.perf.certify import plot_certificate

            plots = plot_certificate(cert, Path(plots_dir))
    if as_json:
        echo_json(json.loads(json.dumps(cert, default=str)))
    else:
        click.echo(summary_text(cert), nl=False)
        if written:
            click.echo(f"wrote {written}")
        for p in plots:
            click.echo(f"wrote {p}")
    if not cert["verdict"]["certified"]:
        raise SystemExit(1)


def _spot_checks(
    loaded, reference, prompt_sets, max_tokens, tolerance, endpoint, every, checks, sample, metrics_file, say
):
    """``--spot-reference``: live spot checks against the running deployment until interrupted (or --checks)."""
    import asyncio
    import os

    from specops.perf.certify import Endpoint, load_sets
    from specops.perf.certify_file import chat_template
    from specops.perf.certify_spot import TEXT_FILE, SpotChecker, SpotConfig, SpotMetrics, model_name_of
    from specops.plugins import get_registry
    from specops.run.instance import EventLog, InstancePaths
    from specops.urls import http_url

    profile = loaded.profile
    live_url = http_url(profile.server.host, profile.server.port)
    key = profile.server.api_key
    env_name = profile.certify.spot_check.api_key_env  # the reference's key (else the deployment's)
    ref_key = os.environ.get(env_name) if env_name else key
    if endpoint == "auto":
        chat = chat_template(profile, get_registry().backend(profile.backend)).sha256 is not None
    else:
        chat = endpoint == "chat"
    prompts = [p for ps in load_sets([x.strip() for x in prompt_sets.split(",") if x.strip()]).values() for p in ps]
    cfg = SpotConfig(every=every, sample=sample, max_tokens=max_tokens or 32, tolerance=tolerance, chat=chat)
    metrics = SpotMetrics()

    async def main():
        live = Endpoint(live_url, await model_name_of(live_url, key), key)
        ref = Endpoint(reference.rstrip("/"), await model_name_of(reference, ref_key), ref_key)
        paths = InstancePaths.for_profile(profile.name, profile.supervisor.state_dir)
        text_file = paths.root / TEXT_FILE if profile.certify.spot_check.keep_text else None  # opt-in
        checker = SpotChecker(
            live, ref, prompts, cfg, events=EventLog(paths.events), metrics=metrics, say=say, text_file=text_file
        )
        say(f"spot checks: {live_url} (speculation) vs {reference} (reference), {sample} probes every {every:g}s")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set() and (checks is None or len(checker.results) < checks):
            await checker.run(stop, checks=1)
            if metrics_file:
                from prometheus_client import write_to_textfile

                write_to_textfile(metrics_file, metrics.registry)
            if checks is not None and len(checker.results) >= checks:
                break
            try:
                await asyncio.wait_for(stop.wait(), cfg.every)
            except asyncio.TimeoutError:
                pass
        return checker.results

    return asyncio.run(main())
