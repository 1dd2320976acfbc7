"""Forged state files against `specops down` and `specops status`, through the real CLI on loopback.

A state file's identity (pid, start time, boot id) is public: anyone can read it from /proc, so a forged
``state.json`` can name a real process with its real identity. `down` must signal only the `specops up`
that holds the instance's lock, and only in a state folder nobody else may write; `status` must send the
profile's API key only to the profile's own address, never to a URL a state file names.

Every process signalled or named here is one this module started (`sleep` victims, lookalikes, stand-ins),
and each is ended at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT, SPECOPS, Result, run_subprocess
from support_ports import free_port
from support_procs import stop_group

from specops.run.identity import is_specops_up_argv, proc_starttime, self_identity

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
KEY = "sk-test-0123456789abcdef"

#: Holds the instance's lock like `specops up` does, until SIGTERM.
HOLDER = r"""
import signal, sys, time
from pathlib import Path
from specops.run.instance import InstancePaths
from specops.run.lock import acquire, release

paths = InstancePaths(Path(sys.argv[-1]))
acquire(paths)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("ready", flush=True)
deadline = time.monotonic() + 100
while not stop and time.monotonic() < deadline:
    time.sleep(0.02)
release(paths)
"""

#: Looks like `specops up` on the command line, holds nothing.
LOOKALIKE = "import time\nprint('ready', flush=True)\ntime.sleep(100)\n"

#: A plugin (an installed distribution as pip lays it out) with the stand-in engine as backend `standin`,
#: so the real `python -m specops.cli up` runs without llama-server.
PLUGIN = """
from support_standin import StandinBackend
from specops.hookspecs import hookimpl


class PluggedStandin(StandinBackend):
    name = "standin"


@hookimpl
def specops_backends():
    return [PluggedStandin()]
"""


class Procs:
    """The processes a test started, each leading its own process group; every group stopped at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], wait_ready: bool = False, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True, **kw)
        self.procs.append(p)
        if wait_ready:
            line = p.stdout.readline()
            assert line.strip() == "ready", (line, p.poll())
        return p

    def sleep(self) -> subprocess.Popen:
        return self.start(["sleep", "100"])

    def specops_script(self, source: str, *args: str) -> subprocess.Popen:
        """``python <tmp>/bin/specops up ARGS`` running ``source``: the command line of pip's entry script."""
        script = self.tmp / "bin" / "specops"
        script.parent.mkdir(exist_ok=True)
        script.write_text(source)
        return self.start(
            [sys.executable, str(script), "up", *args], wait_ready=True, stdout=subprocess.PIPE, text=True
        )

    def end(self) -> None:
        for p in self.procs:
            stop_group(p, timeout=5)
            if p.stdout:
                p.stdout.close()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.end()


@pytest.fixture
def state(tmp_path):
    root = tmp_path / "state"
    root.mkdir(mode=0o700)
    return root


def identity_of(pid: int) -> dict:
    return {"pid": pid, "starttime": proc_starttime(pid), "boot_id": self_identity()["boot_id"]}


def forge(state_root: Path, name: str, pid: int, **fields) -> Path:
    """A state.json as an attacker writes it: the victim's real, public identity."""
    d = state_root / name
    d.mkdir(mode=0o700, exist_ok=True)
    f = d / "state.json"
    f.write_text(json.dumps({"name": name, "pid": pid, "state": "ready", "identity": identity_of(pid), **fields}))
    return f


def cli(*args, state_root: Path | None = None, env: dict | None = None) -> Result:
    """The installed `specops` console script, as a separate process."""
    extra = {"SPECOPS_STATE": str(state_root)} if state_root is not None else {}
    return run_subprocess(*args, env={**extra, **(env or {})})


def still_alive(p: subprocess.Popen) -> bool:
    time.sleep(0.2)  # a SIGTERM sent just before would have ended `sleep` by now
    return p.poll() is None


# ------------------------------------------------------------------------------------ down: whom it signals


def test_down_refuses_a_forged_state_naming_a_real_process(state, procs):
    """The reported attack: a `sleep` with its real identity in state.json got SIGTERM from `down`."""
    victim = procs.sleep()
    forge(state, "forged", victim.pid)
    res = cli("down", "forged", state_root=state)
    assert res.code == 1 and "forged: not signalled" in res.stdout, res
    assert f"pid {victim.pid} is not `specops up`" in res.stdout and "sleep 100" in res.stdout, res
    assert still_alive(victim)


def test_down_refuses_a_specops_lookalike_that_does_not_hold_the_lock(state, procs):
    """`specops up` on the command line is not enough: the named pid must hold this instance's flock. Here
    the real holder is another process, so the lock is held (nothing is stale), just not by the victim."""
    holder = procs.start(
        [sys.executable, "-c", HOLDER, str(state / "busy")], wait_ready=True, stdout=subprocess.PIPE, text=True
    )
    victim = procs.specops_script(LOOKALIKE, "profile.yaml")
    forge(state, "busy", victim.pid)
    res = cli("down", "busy", state_root=state)
    assert res.code == 1, res
    assert f"pid {victim.pid} does not hold the instance's lock {state / 'busy' / 'up.pid'}" in res.stdout, res
    assert still_alive(victim) and holder.poll() is None


def test_down_refuses_a_lookalike_holding_a_lock_of_another_instance(state, procs):
    """A flock on a file named up.pid elsewhere (another inode) proves nothing about this instance."""
    victim = procs.specops_script(HOLDER, str(state / "elsewhere"))
    forge(state, "target", victim.pid)
    (state / "target" / "up.pid").write_text("")
    res = cli("down", "target", state_root=state)
    assert res.code == 1 and "does not hold the instance's lock" in res.stdout, res
    assert still_alive(victim)


def test_down_still_stops_a_specops_up_that_holds_the_lock(state, procs):
    """The stand-in has `specops up`'s command line and holds the flock: it is stopped, nothing else."""
    inst = procs.specops_script(HOLDER, str(state / "mine"))
    forge(state, "mine", inst.pid)  # the identity it would write itself
    res = cli("down", "mine", "--timeout", "20", state_root=state)
    assert res.code == 0 and "mine: stopped" in res.stdout, res
    assert inst.wait(timeout=10) == 0  # its SIGTERM handler ran: a clean stop, not a kill


@pytest.mark.parametrize(
    "argv, is_up",
    [
        (["/venv/bin/python3", "/venv/bin/specops", "up", "p.yaml"], True),
        (["/usr/bin/python3.12", "-s", "/usr/local/bin/specops", "up", "p.yaml"], True),
        (["python", "-W", "ignore", "-m", "specops.cli", "up", "p.yaml"], True),
        (["specops", "up", "p.yaml"], True),
        (["/venv/bin/python3", "/venv/bin/specops", "down", "p"], False),
        (["/venv/bin/python3", "-c", "specops up", "up"], False),
        (["/venv/bin/python3", "/tmp/evil.py", "specops", "up"], False),
        (["sleep", "100"], False),
        (["/bin/sh", "/venv/bin/specops", "up"], False),
        ([], False),
    ],
)
def test_which_command_lines_are_specops_up(argv, is_up):
    assert is_specops_up_argv(argv) is is_up


# ------------------------------------------------------------------------------------ state folder trust


def _profile(tmp: Path, name: str, state_dir: Path | None = None, **server) -> Path:
    data = {
        "name": name,
        "backend": "llamacpp",
        "model": {"id": str(tmp / "target.gguf")},
        "speculative": {"method": "ngram"},
        "gpus": {"devices": []},
        "server": {"port": 9, **server},
        "proxy": {"enabled": True},
    }
    if state_dir is not None:
        data["supervisor"] = {"state_dir": str(state_dir)}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("how", ["SPECOPS_STATE", "--state-dir", "supervisor.state_dir"])
@pytest.mark.parametrize("loose", [0o777, 0o770], ids=["0777", "0770"])
def test_a_state_folder_others_may_write_is_refused(tmp_path, procs, how, loose):
    """Anyone in the group (or anyone at all) could have written this state file: `down` and `status` refuse
    the folder, naming it, its owner and its mode, however it was set."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, loose)
    victim = procs.sleep()
    forge(shared, "inst", victim.pid)
    if how == "SPECOPS_STATE":
        args, env = ["inst"], {"SPECOPS_STATE": str(shared)}
    elif how == "--state-dir":
        args, env = ["inst", "--state-dir", str(shared)], {}
    else:
        args, env = [str(_profile(tmp_path, "inst", shared))], {}
    for command in ("down", "status"):
        res = cli(command, *args, env=env)
        assert res.code == 1 and "Traceback" not in res.stderr, (command, res)
        assert f"state folder {shared} is writable by group or others" in res.stderr, (command, res)
        assert f"mode {loose:04o}" in res.stderr and f"owner uid {os.geteuid()}" in res.stderr, (command, res)
    assert still_alive(victim)


def test_a_state_folder_of_another_user_is_refused(tmp_path, procs):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    victim = procs.sleep()
    forge(theirs, "inst", victim.pid)
    os.chown(theirs, 65534, 65534)
    for command in ("down", "status"):
        res = cli(command, "inst", state_root=theirs)
        assert res.code == 1, (command, res)
        assert f"state folder {theirs} belongs to another user (owner uid 65534" in res.stderr, (command, res)
        assert "mode 0700" in res.stderr and "$SPECOPS_STATE" in res.stderr, (command, res)
    assert still_alive(victim)


def test_an_instance_folder_others_may_write_is_refused(state, procs):
    victim = procs.sleep()
    forge(state, "inst", victim.pid)
    os.chmod(state / "inst", 0o777)
    res = cli("down", "inst", state_root=state)
    assert res.code == 1 and "nothing signalled" in res.stdout, res
    assert f"instance folder {state / 'inst'} is writable by group or others" in res.stdout, res
    row = json.loads(cli("status", "inst", "--json", state_root=state).stdout)
    assert row["state"] == "unreadable" and "writable by group or others" in row["problem"]
    assert still_alive(victim)


# ------------------------------------------------------------------------------------ status: where the key goes


class Listener:
    """A loopback HTTP server that records each request's Authorization header and answers a status."""

    def __init__(self, label: str):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
                body = json.dumps({"answered_by": label}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def listeners():
    made: list[Listener] = []

    def make(label: str) -> Listener:
        made.append(Listener(label))
        return made[-1]

    yield make
    for listener in made:
        listener.close()


def test_status_sends_the_key_to_the_profile_address_never_to_the_state_url(tmp_path, state, procs, listeners):
    """The reported attack: a forged admin_url made `status PROFILE` send `Authorization: Bearer <key>` to a
    listener of the forger's choosing. The key goes to the profile's own port, and only there."""
    forged, real = listeners("forged"), listeners("profile")
    victim = procs.sleep()
    forge(state, "inst", victim.pid, proxy=True, admin_url=forged.url, url=forged.url)
    profile = _profile(tmp_path, "inst", state, port=real.port, api_key="${TEST_STATUS_KEY}")
    res = cli("status", str(profile), "--json", env={"TEST_STATUS_KEY": KEY})
    assert res.code == 0, res
    assert forged.seen == []
    assert real.seen == [{"path": "/specops/status", "authorization": f"Bearer {KEY}"}]
    assert json.loads(res.stdout)["live"] == {"answered_by": "profile"}

    # by name, without the profile: the state's URL may be asked, never with a key
    res = cli("status", "inst", "--json", state_root=state, env={"TEST_STATUS_KEY": KEY})
    assert res.code == 0, res
    assert all(r["authorization"] is None for r in forged.seen), forged.seen
    assert len(real.seen) == 1


def test_status_with_an_admin_port_asks_it_without_the_key(tmp_path, state, procs, listeners):
    forged, admin = listeners("forged"), listeners("admin")
    victim = procs.sleep()
    forge(state, "inst", victim.pid, proxy=True, admin_url=forged.url, url=forged.url)
    profile = _profile(tmp_path, "inst", state, api_key="${TEST_STATUS_KEY}")
    data = yaml.safe_load(profile.read_text())
    data["proxy"]["admin_port"] = admin.port
    profile.write_text(yaml.safe_dump(data))
    res = cli("status", str(profile), "--json", env={"TEST_STATUS_KEY": KEY})
    assert res.code == 0, res
    assert forged.seen == [] and admin.seen == [{"path": "/specops/status", "authorization": None}]


# ------------------------------------------------------------------------------------ the real `specops up`


def _plugin_site(root: Path) -> Path:
    """The stand-in backend as an installed plugin distribution (module + dist-info with entry points)."""
    root.mkdir()
    (root / "specops_standin_plugin.py").write_text(PLUGIN)
    info = root / "specops_standin_plugin-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: specops-standin-plugin\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[specops]\nstandin = specops_standin_plugin\n")
    return root


def test_down_stops_a_real_specops_up_and_leaves_it_alone_when_forged_elsewhere(tmp_path, state, procs):
    """`python -m specops.cli up` (the real command line, lock and state) on the stand-in engine: `down`
    stops it cleanly; a forged state naming it under another instance name is refused first."""
    site = _plugin_site(tmp_path / "site")
    env = {
        **os.environ,
        "SPECOPS_STATE": str(state),
        "PYTHONPATH": os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    profile = _profile(tmp_path, "real-up")
    (tmp_path / "target.gguf").write_bytes(b"GGUF")  # the stand-in engine does not read it
    data = yaml.safe_load(profile.read_text())
    data.update(backend="standin", supervisor={"stop_timeout": 5})
    data["server"]["port"] = free_port()
    profile.write_text(yaml.safe_dump(data))
    log = open(tmp_path / "up.log", "w")
    up = procs.start(
        [sys.executable, "-m", "specops.cli", "up", str(profile), "--offline"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        st: dict = {}
        while time.monotonic() < deadline and st.get("state") != "ready":
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            try:
                st = json.loads((state / "real-up" / "state.json").read_text())
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.1)
        assert st.get("state") == "ready", (tmp_path / "up.log").read_text()
        assert st["pid"] == up.pid

        forge(state, "decoy", up.pid)  # its real identity, another instance's name: it holds no lock there
        res = cli("down", "decoy", state_root=state)
        assert res.code == 1 and f"no lock file {state / 'decoy' / 'up.pid'}" in res.stdout, res
        assert still_alive(up)

        res = cli("down", "real-up", "--timeout", "60", state_root=state)
        assert res.code == 0 and "real-up: stopped" in res.stdout, res
        assert up.wait(timeout=30) == 0
        assert json.loads((state / "real-up" / "state.json").read_text())["state"] == "stopped"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        log.close()


def test_the_console_script_is_what_down_recognises():
    """The installed entry script (which systemd units and pods run) has the command line `down` accepts."""
    shebang = SPECOPS.read_text().splitlines()[0]
    assert shebang.startswith("#!") and is_specops_up_argv([shebang[2:].split()[0], str(SPECOPS), "up", "p.yaml"])
