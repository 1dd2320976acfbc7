"""Failures no speculative method can fix stop the instance at once, with one clear line: a port another
process holds (named by pid and command), a missing target model. Neither is taken for a ready engine or
for a broken method: no restart loop, no walk down the fallback chain.

The holder is a plain Python HTTP server on 127.0.0.1, on a port the OS assigns, that answers 200 on every
path (the health path included): the worst case, where a health check alone would call it ready."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support_engines import need_llama_server, tiny_model
from support_ports import free_port
from support_procs import process_group, stop_group
from support_supervisor import Recorder, ScriptedDecider
from support_up import SPECOPS, llama_profile

from specops.backends.base import LaunchPlan
from specops.backends.render import render_plan
from specops.config.profile import LoadedProfile, load_profile
from specops.methods import Method
from specops.plugins import get_registry
from specops.run.events import EngineReady, EngineStarting, State
from specops.run.instance import EventLog
from specops.run.start import EngineStart, StartOutcome
from specops.run.supervise import Supervisor

ROOT = Path(__file__).resolve().parent.parent
#: An HTTP server that answers 200 to every GET on an OS-assigned loopback port, prints the port, and stops
#: by itself after argv[1] seconds.
HOLDER = r"""
import http.server, sys, time
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
server.timeout = 0.5
print(server.server_address[1], flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    server.handle_request()
"""


@contextlib.contextmanager
def held_port(lifetime_s: float = 300):
    """(port, pid) of a running holder; stopped on exit."""
    with process_group([sys.executable, "-c", HOLDER, str(lifetime_s)], stdout=subprocess.PIPE, text=True) as holder:
        port = int(holder.stdout.readline())
        yield port, holder.pid
    holder.stdout.close()


def specops(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI to its end; running past ``timeout`` (walking the chain, restarting) is a failure."""
    proc = subprocess.Popen(
        SPECOPS + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`specops {' '.join(args)}` still ran after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        stop_group(proc, 10)  # anything left in its group; all of it after a timeout or an error
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.strip()]


def events(state_dir: Path, name: str) -> list[dict]:
    path = state_dir / name / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def standin_plan(argv: list[str], port: int) -> LaunchPlan:
    return LaunchPlan(
        backend="llamacpp",
        engine_version="test",
        method=Method.NONE,
        argv=tuple(argv),
        env=(),
        host="127.0.0.1",
        port=port,
        model_name="tiny-test-model",
    )


@pytest.fixture(scope="module")
def models() -> Path:
    need_llama_server()
    tiny_model("gguf-draft-same.gguf")
    return tiny_model("gguf-target.gguf").parent


# ------------------------------------------------------------------------------------------- readiness


def test_another_server_answering_the_health_path_is_not_a_ready_engine():
    """The engine process never binds; the holder answers /health with 200. Not ready: the start fails as
    fatal, naming the process that answered."""
    with held_port() as (port, holder_pid):
        start = EngineStart(standin_plan([sys.executable, "-c", "import time; time.sleep(120)"], port))

        async def main():
            try:
                return await start.run(3.0, interval=0.1)
            finally:
                await start.process.stop(5)

        result = asyncio.run(main())
    assert result.outcome is StartOutcome.FAILED, result
    assert result.fatal
    assert f"pid {holder_pid}" in result.reason and str(port) in result.reason, result.reason


# ------------------------------------------------------------------------------------------- a held port


@pytest.mark.engines
def test_up_refuses_a_held_port_at_once_naming_its_holder(tmp_path, models):
    state = tmp_path / "state"
    with held_port() as (port, holder_pid):
        profile = llama_profile(
            tmp_path,
            models,
            "held",
            chain=["ngram", "none"],
            server={"port": port, "parallel": 2},
            proxy={"enabled": False},
        )
        res = specops(["up", str(profile)], {**os.environ, "SPECOPS_STATE": str(state)})
    lines = error_lines(res)
    assert res.returncode == 1, res
    assert len(lines) == 1, res.stderr
    [line] = lines
    assert f"{profile}:" in line and "server.port" in line, line  # located at the field that sets it
    assert f"127.0.0.1:{port} is already in use by pid {holder_pid} (python" in line, line
    assert "ready" not in res.stdout and "falling back" not in res.stdout, res.stdout
    evs = events(state, "held")
    assert not [e for e in evs if e["event"] in ("start", "switch", "decision", "restart")], evs


@pytest.mark.engines
def test_llama_server_that_cannot_bind_stops_the_supervisor_without_fallback(tmp_path, models):
    """The port is taken after the pre-launch check (a race): llama-server's bind failure is fatal for the
    instance. One launch, no restart, the decider never asked; the holder answering /health meanwhile is
    not taken for the engine."""
    with held_port() as (port, holder_pid):
        path = llama_profile(tmp_path, models, "race", chain=["ngram", "none"], proxy={"enabled": False})
        loaded = load_profile(path)
        registry = get_registry()
        backend = registry.backend("llamacpp")
        engine = backend.engine_info(loaded.profile, probe=True)

        def render(index: int) -> LaunchPlan:
            step = LoadedProfile(loaded.profile.at_step(index), loaded.document, loaded.path)
            return render_plan(step, registry, engine=engine, host="127.0.0.1", port=port)

        async def main():
            rec = Recorder()
            decider = ScriptedDecider(1, 2)
            sup = Supervisor(
                loaded.profile,
                render,
                events=EventLog(None),
                say=lambda msg: None,
                decider=decider,
                listeners=[rec],
                health_interval=0.05,
                launch_problem=backend.launch_problem,
                bind_failure=backend.bind_failure,
            )
            rc = await asyncio.wait_for(sup.run(), 120)
            return sup, rec, decider, rc

        sup, rec, decider, rc = asyncio.run(main())
    assert rc == 1 and sup.state is State.FATAL
    assert decider.failures == [], decider.failures  # nothing for a fallback to decide
    assert len(rec.of(EngineStarting)) == 1 and not rec.of(EngineReady)
    assert sup.restarts == 0 and sup.index == 0
    reason = sup.fatal_reason or ""
    assert f"127.0.0.1:{port}" in reason and f"pid {holder_pid}" in reason, reason
    assert "couldn't bind" in reason, reason  # the engine's own words
    [fatal] = [e for e in sup.events.recent if e["event"] == "fatal"]
    assert fatal["method"] == "draft_model"


# ------------------------------------------------------------------------------------------- a missing target


@pytest.mark.engines
@pytest.mark.parametrize("command", ["up", "bench", "tune"])
def test_missing_target_stops_every_launching_command_at_once(tmp_path, models, command):
    state = tmp_path / "state"
    absent = tmp_path / "absent-target.gguf"
    profile = llama_profile(tmp_path, models, "notarget", target=str(absent), chain=["ngram", "none"])
    args = [command, str(profile)]
    if command == "bench":
        args += ["-q", "-p", "code", "-c", "1", "-n", "1", "--max-tokens", "4", "-o", str(tmp_path / "bench")]
    if command == "tune":
        args += ["-q", "--dry-run", "--no-plot", "-k", "2", "-c", "1", "-n", "1", "--max-tokens", "4"]
    res = specops(args, {**os.environ, "SPECOPS_STATE": str(state)})
    lines = error_lines(res)
    assert res.returncode == 1, res
    assert len(lines) == 1, res.stderr
    [line] = lines
    assert f"{profile}:" in line and "model.id" in line and f"{absent}: no such file" in line, line
    assert "Traceback" not in res.stdout + res.stderr
    assert "ready in" not in res.stdout and "falling back" not in res.stdout, res.stdout
    assert not [e for e in events(state, "notarget") if e["event"] == "start"]


def test_up_on_the_layerskip_benchmark_without_its_fixture_stops_at_once(tmp_path):
    """The benchmark profile before its fixture exists (SPECOPS_MODELS empty): stopped before anything is
    probed or launched, so not even vLLM is needed to say so."""
    data = yaml.safe_load((ROOT / "benchmarks" / "layerskip-vllm.yaml").read_text())
    data["server"]["port"] = free_port()  # the profile's own port may be another run's
    profile = tmp_path / "layerskip-vllm.yaml"
    profile.write_text(yaml.safe_dump(data, sort_keys=False))
    models = tmp_path / "models"
    models.mkdir()
    env = {**os.environ, "SPECOPS_STATE": str(tmp_path / "state"), "SPECOPS_MODELS": str(models)}
    res = specops(["up", str(profile)], env)
    lines = error_lines(res)
    assert res.returncode == 1, res
    assert len(lines) == 1, res.stderr
    assert "model.id" in lines[0] and f"{models}/layerskip-hf-768x16/target: no such" in lines[0], lines[0]
    assert "Traceback" not in res.stdout + res.stderr and "falling back" not in res.stdout
