"""``specops status`` and ``specops down``: reach running instances through their state files."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
import urllib.error
import urllib.request

import click

from specops.commands._common import echo_json, json_option
from specops.config.durations import format_duration
from specops.errors import SpecopsError
from specops.run.identity import owner_problem, signal_process, specops_up_problem
from specops.run.instance import InstancePaths, StateError, find_instances, read_state
from specops.run.lock import lock_holder_problem, remove_stale_state
from specops.terminal import one_line
from specops.urls import http_url

#: The most of /specops/status read from a live instance.
MAX_LIVE_BYTES = 4 << 20
#: The pods' ``app.kubernetes.io/instance`` as Prometheus names it (the PodMonitor's ``podTargetLabels``).
FLEET_INSTANCE_LABEL = "app_kubernetes_io_instance"


def _profile_file(name: str | None):
    """The profile when NAME names a profile file (else None: NAME is an instance name)."""
    if name and name.endswith((".yaml", ".yml")) and os.path.isfile(name):
        from specops.commands._common import load

        return load(name).profile
    return None


def _instances(name: str | None, state_dir: str | None, profile=None) -> list[InstancePaths]:
    if profile is not None:
        return [InstancePaths.for_profile(profile.name, profile.supervisor.state_dir)]
    found = find_instances(state_dir)
    if name:
        found = [i for i in found if i.root.name == name]
        if not found:
            raise SpecopsError(
                f"no instance named {name!r} (state files are in {InstancePaths.for_profile('x', state_dir).root.parent})"
            )
    return found


def _profile_status_url(profile) -> tuple[str, str | None] | None:
    """(URL, key to send) of the profile's own proxy status: its admin port (on loopback, no key), else
    its public address with ``server.api_key``; None when the profile runs no proxy."""
    if not profile.proxy.enabled:
        return None
    if profile.proxy.admin_port is not None:
        return http_url("127.0.0.1", profile.proxy.admin_port), None
    return http_url(profile.server.host, profile.server.port), profile.server.api_key


def _live(state: dict, profile=None) -> dict:
    """Add what only the running instance knows (the proxy's /specops/status), when reachable.

    Given the profile file, the address comes from the profile alone (``proxy.admin_port``, else
    ``server.host``/``port``), and only there is ``server.api_key`` sent: a state file is no place to
    take a destination for a secret from. Without it, the state's URL is asked without any key, and a
    401 there makes the row say how to see the live section.
    """
    if profile is not None:
        target = _profile_status_url(profile)
        if target is None:
            return state
        url, api_key = target
    else:
        if not state.get("proxy"):
            return state
        url, api_key = state.get("admin_url") or state.get("url"), None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return state
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        req = urllib.request.Request(url + "/specops/status", headers=headers)
        with urllib.request.urlopen(req, timeout=2) as resp:
            return {**state, "live": json.loads(resp.read(MAX_LIVE_BYTES))}
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return {
                **state,
                "live_problem": "the proxy wants the API key: run `specops status PROFILE.yaml` with "
                "the key's variable set, or set proxy.admin_port",
            }
        return state
    except (OSError, ValueError, RecursionError):
        return state


def _row(inst: InstancePaths, profile=None) -> dict:
    """One instance's state as status shows it; a state file that cannot be used is one row saying why."""
    name = inst.root.name
    try:
        st = read_state(inst)
    except StateError as exc:
        return {"name": name, "state": "unreadable", "running": False, "stale": False, "problem": str(exc)}
    if st is None:
        return {
            "name": name,
            "state": "absent",
            "running": False,
            "stale": False,
            "problem": f"no state file {inst.state}",
        }
    if not isinstance(st.get("name"), str):
        st["name"] = name
    why = owner_problem(st)
    done = st.get("state") in ("stopped", "fatal")
    st["running"] = why is None and not done
    st["stale"] = why is not None and not done
    if st["stale"]:
        st["stale_reason"] = why
    return _live(st, profile) if why is None else st


@click.command()
@click.argument("name", required=False)
@click.option("--state-dir", help="Where state files live (default: $SPECOPS_STATE or ~/.local/state/specops).")
@click.option(
    "--fleet",
    "fleet_url",
    metavar="PROMETHEUS_URL",
    help="Show every replica of a deployment as this Prometheus sees it (method, acceptance, tokens/s, "
    "queue, switches, up) and the fleet added up; NAME selects the pods `specops k8s render` labels.",
)
@click.option("--by", default="pod", show_default=True, help="With --fleet: the label that tells replicas apart.")
@click.option("--selector", help="With --fleet: label matchers for the targets, e.g. 'namespace=\"llm\"'.")
@click.option("--window", default="5m", show_default=True, help="With --fleet: the window for acceptance and switches.")
@json_option
def status(name, state_dir, as_json, fleet_url=None, by="pod", selector=None, window="5m"):
    """Show running instances: state, method, acceptance over the window, restarts, last decision.

    NAME is a profile name or a profile file; without it, every instance with a state file is shown.
    An instance whose state file cannot be read is listed with the reason (`problem` in --json).
    With --fleet, the replicas come from Prometheus instead (any number of pods or servers).

    \b
    Examples:
      specops status
      specops status llamacpp-cpu-draft --json
      specops status profiles/llama31-8b-eagle3.yaml --fleet http://prometheus:9090
      specops status --fleet http://prometheus:9090 --selector 'namespace="llm"' --by pod --json
    """
    if fleet_url is not None or selector is not None or (by, window) != ("pod", "5m"):
        _fleet(name, fleet_url, by, selector, window, as_json)
        return
    profile = _profile_file(name)
    rows = [_row(inst, profile) for inst in _instances(name, state_dir, profile)]
    if as_json:
        echo_json(rows if name is None else (rows[0] if rows else None))
        return
    if not rows:
        click.echo("no instances")
        return
    for st in rows:
        try:
            _print(st)
        except Exception as exc:  # a state file of odd shape: one line for it, and on with the others
            click.echo(f"{one_line(st.get('name'))}: unreadable ({type(exc).__name__} while showing its state)")


def _fleet(name, url, by, selector, window, as_json) -> None:
    """``status --fleet``: the replicas of NAME's deployment (or of --selector) from Prometheus."""
    from specops.config.durations import parse_duration
    from specops.k8s.manifests import k8s_name
    from specops.watch.fleet import check_label, fleet_text, parse_selector, read_fleet

    if url is None:
        raise click.UsageError("--by, --selector and --window go with --fleet PROMETHEUS_URL")
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"{url!r} is not an http(s) URL", param_hint="--fleet")
    try:
        window_s = parse_duration(window)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--window") from None
    if window_s <= 0:
        raise click.BadParameter("the window must be longer than 0s", param_hint="--window")
    matchers = parse_selector(selector)
    if name:  # the pods' app.kubernetes.io/instance, which the PodMonitor copies onto every series
        profile = _profile_file(name)
        matchers.append(f'{FLEET_INSTANCE_LABEL}="{k8s_name(profile.name if profile is not None else name)}"')
    view = read_fleet(url, check_label(by), matchers, window_s)
    if as_json:
        echo_json(view)
    else:
        for line in fleet_text(view):
            click.echo(line)


def _num(value) -> float | None:
    """A number fit to format (not a bool, finite), else None."""
    if type(value) in (int, float):
        try:
            f = float(value)
        except OverflowError:
            return None
        return f if f == f and abs(f) != float("inf") else None
    return None


#: Rules of a window that got no verdict, in words (see specops.watch.policy).
_NO_VERDICT = {
    "window-filling": "the window is still filling",
    "not-fresh": "waiting for a window that does not overlap the last counted one",
    "min-draft-tokens": "too few drafted tokens in the window",
    "no-data": "nothing drafted in the window",
    "spec-off": "the engine reports no speculative counters",
    "coarse": "only a lifetime ratio (reported, not acted on)",
    "source-unavailable": "metrics unavailable",
    "switch-pending": "a switch is under way",
    "no-speculation": "speculation is off",
}


def verdict_line(st: dict) -> str | None:
    """The fallback verdict against the threshold and the hysteresis count, e.g.
    ``below 0.6: 1 of 2 windows (falls back after 2)``; None when the state file predates these fields.

    The acceptance line above it is the latest (sliding) window; the verdict counts disjoint windows
    (see specops.watch.policy), so the two may differ for up to one window length.
    """
    policy = st.get("policy")
    if not isinstance(policy, dict) or "consecutive_windows" not in policy:
        return None
    if policy.get("method") == "none":
        return "no speculation: nothing to judge"
    if policy.get("mode") == "goodput":
        return None  # no acceptance verdict: the goodput lines say what it decides and why
    streak = round(_num(policy.get("streak")) or 0)
    need = round(_num(policy.get("consecutive_windows")) or 1)
    thr = _num(policy.get("min_acceptance"))
    mode = one_line(policy.get("mode") or "threshold", 40)
    model = mode == "model"
    if mode == "threshold":
        bound = f"below {thr:g}" if thr is not None else "below the threshold"
    else:
        bound = "predicted speedup below 1" if model else f"low by the {mode} rule"
    last = st.get("last_verdict") if isinstance(st.get("last_verdict"), dict) else None
    window = st.get("last_window") if isinstance(st.get("last_window"), dict) else {}
    if streak:
        out = f"{bound}: {streak} of {need} windows"
        out += (
            " (fallback disabled: watch only)"
            if policy.get("fallback_enabled") is False
            else f" (falls back after {need})"
        )
    elif last is not None:
        measure = "predicted_speedup" if model else "acceptance"
        value = _num(last.get(measure))
        shown = f"; last counted window: {measure.replace('_', ' ')} {value:.3f}" if value is not None else ""
        out = f"not {bound}: 0 of {need} windows{shown}"
    else:
        out = f"no verdict yet (falls back after {need} windows {bound})"
    why = _NO_VERDICT.get(one_line(window.get("rule")))
    if why and window.get("rule") != "not-fresh":
        if window.get("rule") == "min-draft-tokens":
            why += f" (min_draft_tokens {one_line(policy.get('min_draft_tokens'))})"
        out += f"; latest window: {why}"
    return out


def _print(st: dict) -> None:
    name = one_line(st.get("name"))
    if st.get("problem"):
        click.echo(f"{name}: {st['state']}: {one_line(st['problem'], 400)}")
        return
    state = one_line(st.get("state", "?"))
    if st.get("stale"):
        state += f" (stale: {one_line(st.get('stale_reason') or 'specops is not running', 300)})"
    uptime = ""
    since = _num(st.get("ready_since"))
    if since is not None and st.get("running"):
        uptime = f", ready for {format_duration(max(0, round(time.time() - since)))}"
    click.echo(f"{name}: {state}{uptime}")
    click.echo(
        f"  url        {one_line(st.get('url'))}  (engine {one_line(st.get('engine_url'))}, "
        f"{one_line(st.get('backend'))} {one_line(st.get('engine_version'))})"
    )
    chain = st.get("chain") if isinstance(st.get("chain"), list) else []
    click.echo(f"  method     {one_line(st.get('method'))}  (chain {' → '.join(one_line(c, 40) for c in chain[:20])})")
    acc = st.get("acceptance")
    drafts = _drafts_line(st.get("draft_length"), acc)
    if drafts:
        click.echo(f"  drafts     {drafts}")
    if isinstance(acc, dict):
        a, mal = _num(acc.get("acceptance")), _num(acc.get("mean_acceptance_length"))
        data = one_line(acc.get("status", ""))
        # the window's data state is not a verdict: say it only when the window has no usable data
        data_note = "" if data in ("ok", "") else f", {data}: {one_line(acc.get('reason'), 200)}"
        click.echo(
            f"  acceptance {f'{a:.3f}' if a is not None else 'no data'} over {one_line(acc.get('window_s'))}s "
            f"(mean length {f'{mal:.2f}' if mal is not None else '-'}, "
            f"{_num(acc.get('draft_tokens')) or 0:.0f} drafted{data_note})"
        )
    policy = st.get("policy") if isinstance(st.get("policy"), dict) else {}
    rule = policy.get("rule")
    if isinstance(rule, dict) and rule.get("line"):  # which rule decides the fallback, and why (specops.watch.rule)
        click.echo(f"  rule       {one_line(rule['line'], 400)}")
    verdict = verdict_line(st)
    if verdict:
        click.echo(f"  verdict    {verdict}")
    tps = _num(st.get("tokens_per_s"))
    if tps is not None:
        click.echo(f"  tokens/s   {tps:.1f}")
    click.echo(
        f"  restarts   {one_line(st.get('restarts', 0))}, switches {one_line(st.get('switches', 0))}, "
        f"pid {one_line(st.get('pid'))}, engine pid {one_line(st.get('engine_pid'))}"
    )
    d = st.get("last_decision")
    if isinstance(d, dict):
        to = f" → {one_line(d['to'])}" if d.get("to") else ""
        click.echo(
            f"  decision   {one_line(d.get('action', 'switch'))} {one_line(d.get('from', ''))}{to}: "
            f"{one_line(d.get('reason'), 300)}"
        )
    print_goodput(st)
    _print_twins(st)
    _print_canary(st.get("canary"))
    _print_reload(st.get("profile_reload"))
    _print_spot(st.get("spot_check"))
    _print_fleet_slot(st.get("fleet"))
    if st.get("live_problem"):
        click.echo(f"  live       {one_line(st['live_problem'], 300)}")
    click.echo(f"  logs       {one_line(st.get('engine_log'), 400)}  events {one_line(st.get('events'), 400)}")


def _drafts_line(length, acc) -> str | None:
    """How long the engine's drafts can be (what its backend says of the rendered plan, never a k it
    ignores), and the mean it drafted over the window (Δdrafted / Δdrafts) where it counts drafts."""
    if not isinstance(length, dict):
        return None
    out = one_line(length.get("text"), 200)
    acc = acc if isinstance(acc, dict) else {}
    drafted, drafts = _num(acc.get("draft_tokens")), _num(acc.get("drafts"))
    if drafted is not None and drafts:
        out += f"; measured mean {drafted / drafts:.1f} tokens per draft over {one_line(acc.get('window_s'))}s"
    return out


def _print_twins(st: dict) -> None:
    """``routing.twins``: each engine (live, routed requests, restarts) and the request classes' table."""
    engines = st.get("engines") if isinstance(st.get("engines"), list) else []
    for e in engines[:16]:
        if not isinstance(e, dict):
            continue
        mark = " (default route)" if e.get("current") else ""
        click.echo(
            f"  engine {one_line(e.get('engine'), 4)}   {one_line(e.get('method'), 40)}: "
            f"{'live' if e.get('live') else 'not live'}{mark}, {one_line(e.get('routed', 0), 20)} routed, "
            f"{one_line(e.get('in_flight', 0), 20)} in flight"
            + (
                f", restarts {one_line(e.get('restarts'), 20)}, pid {one_line(e.get('engine_pid'), 20)}"
                if "state" in e and not isinstance(e.get("remote"), dict)
                else ""
            )
        )
        _print_remote(e.get("remote"))
    routing = st.get("routing") if isinstance(st.get("routing"), dict) else {}
    classes = routing.get("classes") if isinstance(routing.get("classes"), list) else []
    aliases = routing.get("aliases") if isinstance(routing.get("aliases"), dict) else {}
    if aliases:
        shown = ", ".join(f"{one_line(k, 64)} → {one_line(v, 8)}" for k, v in list(aliases.items())[:20])
        click.echo(f"  aliases    {shown}")
    if classes:
        click.echo(
            f"  classes    by {one_line(routing.get('class_key'), 20)}: class, verdict, acceptance, mean acceptance "
            "length, served on/off, tok/s on/off"
        )
    for row in classes[-20:]:
        if not isinstance(row, dict):
            continue
        verdict = {True: "speculate", False: "no speculation", None: "learning"}.get(row.get("speculate"), "?")
        if verdict == "learning" and routing.get("learning") not in (None, row.get("class")):
            verdict = "waiting to learn"  # routing.classes.learn: one_at_a_time, another class holds the turn
        a, mal = _num(row.get("acceptance")), _num(row.get("mean_acceptance_length"))
        on, off = _num(row.get("tokens_per_s_on")), _num(row.get("tokens_per_s_off"))
        click.echo(
            f"    {one_line(row.get('class'), 64)}: {verdict}, acceptance {f'{a:.3f}' if a is not None else '-'}, "
            f"length {f'{mal:.2f}' if mal is not None else '-'}, "
            f"{one_line(row.get('served_on'), 20)}/{one_line(row.get('served_off'), 20)}, "
            f"{f'{on:.1f}' if on is not None else '-'}/{f'{off:.1f}' if off is not None else '-'} tok/s"
        )


def _print_remote(r) -> None:
    """A remote twin's health and the hop's latency (``routing.twins`` entry with a ``url``)."""
    if not isinstance(r, dict):
        return
    reported = r.get("reported_method")
    click.echo(
        f"    remote   {one_line(r.get('url'), 200)}: stands for {one_line(r.get('method'), 40)}"
        + (f" (reports {one_line(reported, 40)})" if reported else " (not a specops proxy: /health)")
        + f", health check {_ms(r.get('health_rtt_ms'))} (max {_ms(r.get('health_rtt_max_ms'))}), "
        f"{one_line(r.get('requests'), 20)} answered in {_ms(r.get('request_p50_ms'))} p50 / "
        f"{_ms(r.get('request_p99_ms'))} p99, {one_line(r.get('outages'), 20)} outages: {one_line(r.get('reason'), 300)}"
    )


def _ms(value) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.1f} ms"


def _print_canary(canary) -> None:
    """``routing.canary``: the new draft measured on live traffic now, else how the last canary ended."""
    if not isinstance(canary, dict):
        return
    for key, what in (("running", "measuring"), ("last", "last")):
        c = canary.get(key)
        if not isinstance(c, dict):
            continue
        a, b = _num(c.get("canary_acceptance")), _num(c.get("current_acceptance"))
        state = one_line(c.get("state") or c.get("outcome"), 20)
        click.echo(
            f"  canary     {what}: {one_line(c.get('draft'), 200)} {state}, live acceptance "
            f"{f'{a:.3f}' if a is not None else '-'} against {f'{b:.3f}' if b is not None else '-'} "
            f"(current draft): {one_line(c.get('reason'), 300)}"
        )
        return


def print_goodput(st: dict) -> None:
    """``fallback.mode: goodput``: the live concurrency, the tokens/s predicted per option, the verdict and why,
    the switch cost and the surface's crossovers (what ``--json`` has as ``last_goodput`` and ``policy.goodput``)."""
    last = st.get("last_goodput") if isinstance(st.get("last_goodput"), dict) else None
    policy = st.get("policy") if isinstance(st.get("policy"), dict) else {}
    g = policy.get("goodput") if isinstance(policy.get("goodput"), dict) else None
    if last is None and g is None:
        return
    last = last or {}
    conc = _num(last.get("concurrency"))
    live = _num(last.get("live_tokens_per_s"))
    click.echo(
        f"  goodput    concurrency {'no reading yet' if conc is None else f'{conc:.2f}'}"
        + (f" ({one_line(last.get('concurrency_source'), 60)})" if last.get("concurrency_source") else "")
        + (f", live {live:.1f} tok/s" if live is not None else "")
    )
    pred = last.get("predicted") if isinstance(last.get("predicted"), dict) else {}
    shown = [f"{one_line(k, 60)} {v:.1f}" for k, v in list(pred.items())[:20] if _num(v) is not None]
    if shown:
        best = f" (best: {one_line(last.get('best'), 60)})" if last.get("best") else ""
        click.echo(f"  predicted  {', '.join(shown)} tok/s{best}")
    if last.get("reason"):
        click.echo(f"  why        [{one_line(last.get('rule'), 40)}] {one_line(last.get('reason'), 400)}")
    aged = last.get("aged_acceptance") if isinstance(last.get("aged_acceptance"), dict) else {}
    for label, a in list(aged.items())[:10]:
        if isinstance(a, dict):
            click.echo(
                f"  aged       {one_line(label, 60)}: live acceptance {one_line(a.get('age_s'), 20)}s old (weight "
                f"{one_line(a.get('weight'), 20)}, half-life {one_line(a.get('half_life_s'), 20)}s), expected mean "
                f"acceptance length {one_line(a.get('expected_tau'), 20)}"
            )
    cost = _num((g or {}).get("switch_cost_s"))
    surface = (g or {}).get("surface") if isinstance((g or {}).get("surface"), dict) else None
    cross = surface.get("crossover") if surface and isinstance(surface.get("crossover"), dict) else {}
    parts = [f"switch cost {cost:g}s ({one_line((g or {}).get('switch_cost_basis'), 30)})"] if cost is not None else []
    parts += [
        f"{one_line(k, 60)} stops paying at c={one_line(v, 20)}" for k, v in list(cross.items())[:10] if v is not None
    ]
    parts += [f"{one_line(k, 60)} pays at every measured level" for k, v in list(cross.items())[:10] if v is None]
    if surface is not None:
        parts.append(f"surface of {one_line(surface.get('date') or 'an unknown date', 40)}")
    elif g is not None:
        parts.append("no surface: learned online")
    if parts:
        click.echo(f"  switching  {'; '.join(parts)}")


def _print_reload(rel) -> None:
    """The running profile's hash and reloads; a rejected reload (SIGHUP or a changed file) with its error."""
    if not isinstance(rel, dict):
        return
    click.echo(
        f"  profile    sha256 {one_line(rel.get('running_sha256'))[:16]}, {one_line(rel.get('applied', 0))} reloads applied"
    )
    rejected = rel.get("rejected")
    if isinstance(rejected, dict):
        click.echo(
            f"  reload     profile reload rejected, keeps running the old config: {one_line(rejected.get('message'), 600)}"
        )


def _print_fleet_slot(fleet) -> None:
    """Fleet-safe switching (``deploy.coordination``): the slot this replica holds or waits for, and who holds them."""
    if not isinstance(fleet, dict):
        return
    since = _num(fleet.get("waiting_since"))
    if fleet.get("slot"):
        now = f"holds {one_line(fleet['slot'], 120)}" + (" (switching)" if fleet.get("switching") else "")
    elif since is not None:
        wait = format_duration(max(0, round(time.time() - since)))
        now = f"waiting {wait} for a switch slot to go to {one_line(fleet.get('wants'), 60)}"
    else:
        now = "no switch pending"
    holders = fleet.get("holders") if isinstance(fleet.get("holders"), list) else []
    held = f"; held by {', '.join(one_line(h, 80) for h in holders[:10])}" if holders else ""
    error = f"; error: {one_line(fleet.get('error'), 300)}" if fleet.get("error") else ""
    click.echo(
        f"  fleet      {now} ({one_line(fleet.get('coordination'))}, at most {one_line(fleet.get('max_switching'))} "
        f"switching, as {one_line(fleet.get('identity'), 80)}){held}{error}"
    )


def _print_spot(spot) -> None:
    """Live spot checks (``certify.spot_check``): the last check's verdict, the last divergence."""
    if not isinstance(spot, dict):
        return
    last = spot.get("last") if isinstance(spot.get("last"), dict) else None
    if last is None:
        seen = f"no check yet ({one_line(spot.get('waiting') or 'waiting for the first interval', 300)})"
    else:
        seen = f"last {one_line(last.get('verdict'))}: " + ", ".join(
            f"{one_line(last.get(k, 0))} {k}" for k in ("identical", "tolerated", "diverged", "failed")
        )
    click.echo(
        f"  spot       {seen}; {one_line(spot.get('checks', 0))} checks, {one_line(spot.get('skipped', 0))} skipped "
        f"(vs {one_line(spot.get('reference'), 200)})"
    )
    div = spot.get("last_divergence")
    if isinstance(div, dict):
        ids = (  # where, not what: a divergence carries no text of the client's answer
            f": token id {one_line(div.get('spec_token_id'))} vs reference {one_line(div.get('base_token_id'))}"
            if "spec_token_id" in div
            else ""
        )
        click.echo(
            f"  diverged   {one_line(div.get('source'))} at {one_line(div.get('unit'))} {one_line(div.get('position'))}{ids}"
            + (f" (text in {one_line(spot.get('text_file'), 300)})" if spot.get("text_file") else "")
        )


def _is_the_instance(inst: InstancePaths, pid: int) -> str | None:
    """None when ``pid`` is this instance's ``specops up``: its command line says so and it holds the lock."""
    return specops_up_problem(pid) or lock_holder_problem(inst, pid)


@click.command()
@click.argument("name", required=False)
@click.option("--state-dir", help="Where state files live (default: $SPECOPS_STATE or ~/.local/state/specops).")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the instance to stop.")
def down(name, state_dir, timeout):
    """Stop a running instance gracefully (SIGTERM to specops, which stops its engine).

    Only the very specops process that wrote the state file is signalled: its pid, start time and boot
    id must all match, its command line must be `specops up`, and it must hold the instance's lock
    (up.pid). A state file whose process is gone (or whose pid now names another process) is stale:
    nothing is signalled, and the stale file is removed. A state folder another user owns, or that
    group or others may write, is refused.

    \b
    Examples:
      specops down llamacpp-cpu-draft
      specops down examples/vllm-cpu-ngram.yaml
    """
    targets = _instances(name, state_dir, _profile_file(name))
    if not name and len(targets) > 1:
        raise SpecopsError("several instances: name one (`specops status` lists them)")
    if not targets:
        click.echo("no instances")
        return
    failed = []
    for inst in targets:
        label = inst.root.name
        try:
            st = read_state(inst)
        except StateError as exc:
            click.echo(f"{label}: {exc}; nothing signalled")
            failed.append(label)
            continue
        if st is None:
            click.echo(f"{label}: not running (no state file)")
            continue
        why = owner_problem(st)
        if why is not None:
            if st.get("state") in ("stopped", "fatal"):
                click.echo(f"{label}: not running ({st['state']})")
            elif st.get("identity") is None:  # cannot tell: leave it for the operator
                click.echo(f"{label}: not signalled: {why}")
                failed.append(label)
            else:
                removed = remove_stale_state(inst)
                click.echo(
                    f"{label}: not running (stale state: {why}); nothing signalled"
                    + ("; removed the stale state file" if removed else "")
                )
            continue
        identity = st["identity"]
        refused = signal_process(identity, signal.SIGTERM, functools.partial(_is_the_instance, inst))
        if refused:
            click.echo(f"{label}: not signalled: {refused}")
            failed.append(label)
            continue
        deadline = time.monotonic() + timeout
        while owner_problem(st) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if owner_problem(st) is None:
            raise SpecopsError(f"{label}: specops pid {identity['pid']} still running after {timeout:g}s")
        click.echo(f"{label}: stopped")
    if failed:
        raise SpecopsError(f"not stopped: {', '.join(failed)}")
