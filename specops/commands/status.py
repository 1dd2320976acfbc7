"""``specops status`` and ``specops down``: reach running instances through their state files."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import click

from ..durations import format_duration
from ..errors import SpecopsError
from ..instance import InstancePaths, find_instances, pid_alive, read_state
from ._common import echo_json, json_option


def _instances(name: str | None, state_dir: str | None) -> list[InstancePaths]:
    if name and (name.endswith((".yaml", ".yml")) and os.path.isfile(name)):
        from ._common import load
        p = load(name).profile
        return [InstancePaths.for_profile(p.name, p.supervisor.state_dir)]
    found = find_instances(state_dir)
    if name:
        found = [i for i in found if i.root.name == name]
        if not found:
            raise SpecopsError(f"no instance named {name!r} (state files are in {InstancePaths.for_profile('x', state_dir).root.parent})")
    return found


def _live(state: dict) -> dict:
    """Add what only the running instance knows (the proxy's /specops/status), when reachable."""
    if not state.get("proxy"):
        return state
    try:
        with urllib.request.urlopen((state.get("admin_url") or state["url"]) + "/specops/status", timeout=2) as resp:
            return {**state, "live": json.loads(resp.read())}
    except (OSError, ValueError):
        return state


@click.command()
@click.argument("name", required=False)
@click.option("--state-dir", help="Where state files live (default: $SPECOPS_STATE or ~/.local/state/specops).")
@json_option
def status(name, state_dir, as_json):
    """Show running instances: state, method, acceptance over the window, restarts, last decision.

    NAME is a profile name or a profile file; without it, every instance with a state file is shown.

    \b
    Examples:
      specops status
      specops status llamacpp-cpu-draft --json
    """
    rows = []
    for inst in _instances(name, state_dir):
        st = read_state(inst) or {}
        alive = pid_alive(st.get("pid"))
        st["running"] = alive and st.get("state") not in ("stopped", "fatal")
        st["stale"] = not alive and st.get("state") not in ("stopped", "fatal")
        rows.append(_live(st) if alive else st)
    if as_json:
        echo_json(rows if name is None else (rows[0] if rows else None))
        return
    if not rows:
        click.echo("no instances")
        return
    for st in rows:
        _print(st)


def _print(st: dict) -> None:
    state = st.get("state", "?")
    if st.get("stale"):
        state += " (stale: specops is not running)"
    uptime = ""
    if st.get("ready_since") and st.get("running"):
        uptime = f", ready for {format_duration(round(time.time() - st['ready_since']))}"
    click.echo(f"{st.get('name')}: {state}{uptime}")
    click.echo(f"  url        {st.get('url')}  (engine {st.get('engine_url')}, {st.get('backend')} {st.get('engine_version')})")
    click.echo(f"  method     {st.get('method')}  (chain {' → '.join(st.get('chain') or [])})")
    acc = st.get("acceptance")
    if isinstance(acc, dict):
        a, mal = acc.get("acceptance"), acc.get("mean_acceptance_length")
        click.echo(f"  acceptance {('%.3f' % a) if a is not None else 'no data'} over {acc.get('window_s')}s "
                   f"(mean length {('%.2f' % mal) if mal is not None else '-'}, "
                   f"{acc.get('draft_tokens') or 0:.0f} drafted, {acc.get('status', '')})")
    if st.get("tokens_per_s") is not None:
        click.echo(f"  tokens/s   {st['tokens_per_s']:.1f}")
    click.echo(f"  restarts   {st.get('restarts', 0)}, switches {st.get('switches', 0)}, pid {st.get('pid')}, "
               f"engine pid {st.get('engine_pid')}")
    d = st.get("last_decision")
    if d:
        click.echo(f"  decision   {d.get('action', 'switch')} {d.get('from', '')}"
                   f"{' → ' + d['to'] if d.get('to') else ''}: {d.get('reason')}")
    click.echo(f"  logs       {st.get('engine_log')}  events {st.get('events')}")


@click.command()
@click.argument("name", required=False)
@click.option("--state-dir", help="Where state files live (default: $SPECOPS_STATE or ~/.local/state/specops).")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the instance to stop.")
def down(name, state_dir, timeout):
    """Stop a running instance gracefully (SIGTERM to specops, which stops its engine).

    \b
    Examples:
      specops down llamacpp-cpu-draft
      specops down examples/vllm-cpu-ngram.yaml
    """
    targets = _instances(name, state_dir)
    if not name and len(targets) > 1:
        raise SpecopsError("several instances: name one (`specops status` lists them)")
    stopped = 0
    for inst in targets:
        st = read_state(inst) or {}
        pid = st.get("pid")
        if not pid_alive(pid):
            click.echo(f"{inst.root.name}: not running")
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            raise SpecopsError(f"{inst.root.name}: specops pid {pid} still running after {timeout:g}s")
        click.echo(f"{inst.root.name}: stopped")
        stopped += 1
