"""What `specops down`/`status`/`up` do with the state folder when its content is wrong, stale or hostile.

Every process signalled here is one this module started ("strangers" are `sleep 60` children, the
"instance" is a small Python child that takes the lock and writes the state like `specops up` does).
In-process runs go through a guard that refuses to deliver any signal to a process the test did not
start, so even a regression cannot hit anything else on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support_cli import ROOT, run
from support_procs import stop_group

from specops.errors import SpecopsError
from specops.run.identity import proc_starttime, self_identity
from specops.run.instance import EventLog, InstancePaths, StateError, read_state, write_state
from specops.run.lock import acquire, release

pytestmark = pytest.mark.timeout(60)

INSTANCE = r"""
import signal, sys, time
from pathlib import Path
from specops.run.instance import InstancePaths, write_state
from specops.run.lock import acquire, release

paths = InstancePaths(Path(sys.argv[2]))  # argv: specops up ROOT
acquire(paths)
write_state(paths, {"name": paths.root.name, "state": "ready"})
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("ready", flush=True)
deadline = time.monotonic() + 50
while not stop and time.monotonic() < deadline:
    time.sleep(0.02)
write_state(paths, {"name": paths.root.name, "state": "stopped"})
release(paths)
print("stopped by SIGTERM" if stop else "timed out", flush=True)
"""


class Started:
    """Processes this test started: the only ones the signal guard lets through. Each leads its own process
    group (so the guard's pid check also covers a killpg), and every group is stopped at teardown."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.other_pids: set[int] = set()  # started some other way (asyncio), ended by their test

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs} | self.other_pids

    def stranger(self) -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def instance(self, root: Path) -> subprocess.Popen:
        """A stand-in for `specops up`: holds the lock, writes the state, stops on SIGTERM. It runs as an
        entry script named `specops` with `up`, the command line `down` wants (as pip's script runs)."""
        script = root.parent.parent / "bin" / "specops"
        script.parent.mkdir(exist_ok=True)
        script.write_text(INSTANCE)
        p = subprocess.Popen(
            [sys.executable, str(script), "up", str(root)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(p)
        line = p.stdout.readline()
        assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")
        return p

    def end(self) -> None:
        for p in self.procs:
            stop_group(p, timeout=5)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def started(monkeypatch):
    """Started processes, plus a guard on os.kill / os.killpg / pidfd_send_signal in this process:
    a real signal reaches only a process of ``started``; any other attempt is recorded, not sent."""
    s = Started()
    refused: list[tuple] = []
    real_kill, real_killpg, real_pidfd = os.kill, os.killpg, signal.pidfd_send_signal

    def kill(pid, sig):
        if sig == 0 or pid in s.pids:
            return real_kill(pid, sig)
        refused.append(("kill", pid, sig))

    def killpg(pgid, sig):
        if sig == 0 or pgid in s.pids:
            return real_killpg(pgid, sig)
        refused.append(("killpg", pgid, sig))

    def pidfd_send_signal(fd, sig, *args):
        with open(f"/proc/self/fdinfo/{fd}") as f:
            pid = int(next(line.split()[1] for line in f if line.startswith("Pid:")))
        if sig == 0 or pid in s.pids:
            return real_pidfd(fd, sig, *args)
        refused.append(("pidfd", pid, sig))

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(os, "killpg", killpg)
    monkeypatch.setattr(signal, "pidfd_send_signal", pidfd_send_signal)
    s.refused = refused
    try:
        yield s
    finally:
        monkeypatch.undo()
        s.end()
    assert not refused, f"specops tried to signal processes it must not touch: {refused}"


@pytest.fixture
def state(tmp_path, monkeypatch):
    root = tmp_path / "state"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("SPECOPS_STATE", str(root))
    return root


def put(state_root: Path, name: str, content) -> Path:
    d = state_root / name
    d.mkdir(exist_ok=True)
    f = d / "state.json"
    f.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return f


def identity_of(pid: int, **override) -> dict:
    return {"pid": pid, "starttime": proc_starttime(pid), "boot_id": self_identity()["boot_id"], **override}


def alive(p: subprocess.Popen) -> bool:
    return p.poll() is None


# ------------------------------------------------------------------------------------ down: what it signals


@pytest.mark.parametrize("pid", [-1, 0, 1, True, False, "abc", "1", 1.5, 10**30, None, [1], {"pid": 1}], ids=repr)
def test_down_refuses_a_pid_that_is_not_a_plain_process_id(state, started, pid):
    """`-1` would be kill(-1) (every process), `true` pid 1; strings and floats used to give a traceback."""
    stranger = started.stranger()
    put(state, "bad", {"pid": pid, "state": "ready"})
    res = run("down", "bad")
    assert res.code == 1, res
    assert "nothing signalled" in res.stdout and "invalid pid" in res.stdout, res
    assert "Traceback" not in res.stdout + res.stderr
    assert alive(stranger)


def test_down_leaves_a_stranger_that_reused_the_pid_alone(state, started):
    """The state names a live process, but not the instance that wrote it (other start time): stale."""
    stranger = started.stranger()
    ident = identity_of(stranger.pid, starttime=proc_starttime(stranger.pid) - 1)
    f = put(state, "reused", {"pid": stranger.pid, "state": "ready", "identity": ident})
    res = run("down", "reused")
    assert res.code == 0, res
    assert "stale" in res.stdout and "reused" in res.stdout and "nothing signalled" in res.stdout
    assert not f.exists()  # the stale state is cleaned up
    time.sleep(0.1)
    assert alive(stranger)


def test_down_leaves_a_process_from_before_the_reboot_alone(state, started):
    stranger = started.stranger()
    ident = identity_of(stranger.pid, boot_id="00000000-0000-0000-0000-000000000000")
    put(state, "rebooted", {"pid": stranger.pid, "state": "ready", "identity": ident})
    res = run("down", "rebooted")
    assert res.code == 0 and "before the last reboot" in res.stdout, res
    assert alive(stranger)


def test_down_does_not_signal_a_pid_it_cannot_verify(state, started):
    """A state file without an identity (an older specops, or hand-made) names just a pid: not enough."""
    stranger = started.stranger()
    f = put(state, "legacy", {"pid": stranger.pid, "state": "ready"})
    res = run("down", "legacy")
    assert res.code == 1 and "not signalled" in res.stdout and "no process identity" in res.stdout, res
    assert f.exists()  # not proven stale either: left for the operator
    assert alive(stranger)


def test_down_stops_the_instance_that_wrote_the_state(state, started):
    inst = started.instance(state / "real")
    st = read_state(InstancePaths(state / "real"))
    assert st["identity"]["pid"] == inst.pid and st["identity"]["starttime"] == proc_starttime(inst.pid)
    res = run("down", "real", "--timeout", "20")
    assert res.code == 0 and "real: stopped" in res.stdout, res
    assert inst.wait(timeout=10) == 0
    assert inst.stdout.read().strip() == "stopped by SIGTERM"
    assert not started.refused


def test_down_of_a_dead_instance_says_stale_and_signals_nothing(state, started):
    inst = started.instance(state / "crashed")
    inst.kill()
    inst.wait(timeout=10)
    res = run("down", "crashed")
    assert res.code == 0 and "not running" in res.stdout and "stale" in res.stdout, res
    assert not (state / "crashed" / "state.json").exists()


# ------------------------------------------------------------------------------------ status

BAD_CONTENT = {
    "pid-string": json.dumps({"pid": "abc", "state": "ready"}).encode(),
    "list": b"[1, 2, 3]",
    "huge-pid": json.dumps({"pid": 10**30, "state": "ready"}).encode(),
    "negative-pid": json.dumps({"pid": -1, "state": "ready"}).encode(),
    "bool-pid": json.dumps({"pid": True, "state": "ready"}).encode(),
    "invalid-json": b'{"pid": ',
    "not-utf8": b'{"pid": 12, "name": "\xff\xfe"}',
    "nested": b"[" * 200_000,
    "huge-number": b'{"pid": ' + b"9" * 5000 + b"}",
    "bad-identity": json.dumps({"pid": 12, "state": "ready", "identity": "me"}).encode(),
    "bad-state": json.dumps({"pid": 12, "state": ["ready"]}).encode(),
    "empty": b"",
}


def test_status_reports_each_unreadable_state_file_and_goes_on(state, started):
    for name, content in BAD_CONTENT.items():
        put(state, name, content)
    big = put(state, "big", b"")
    with open(big, "r+b") as f:  # 100 MB (sparse): never read
        f.truncate(100 * 1024 * 1024)
    os.mkfifo(state / "fifo-dir-is-skipped")
    started.instance(state / "zz-good")

    res = run("status")
    out = res.stdout + res.stderr
    assert res.code == 0 and "Traceback" not in out, out
    for name in [*BAD_CONTENT, "big"]:
        lines = [line for line in res.stdout.splitlines() if line.startswith(f"{name}: ")]
        assert len(lines) == 1 and "unreadable" in lines[0], (name, res.stdout)
    assert "too large" in res.stdout
    assert "zz-good: ready" in res.stdout

    rows = {r["name"]: r for r in json.loads(run("status", "--json").stdout)}
    assert set(rows) == {*BAD_CONTENT, "big", "zz-good"}
    for name in [*BAD_CONTENT, "big"]:
        assert rows[name]["state"] == "unreadable" and rows[name]["running"] is False
        assert "\n" not in rows[name]["problem"] and rows[name]["problem"]
    assert rows["zz-good"]["running"] is True and "problem" not in rows["zz-good"]
    one = json.loads(run("status", "pid-string", "--json").stdout)
    assert one["problem"].endswith("invalid pid 'abc'")


def test_status_survives_fields_of_any_type(state, started):
    """A state file of the right shape but odd field types prints without a traceback."""
    stranger = started.stranger()
    put(
        state,
        "odd",
        {
            "pid": stranger.pid,
            "identity": identity_of(stranger.pid),
            "state": "ready",
            "name": {"x": 1},
            "chain": [1, None, {"a": 2}],
            "acceptance": {"acceptance": "x", "mean_acceptance_length": [1], "draft_tokens": "many", "window_s": {}},
            "tokens_per_s": "fast",
            "ready_since": "yesterday",
            "last_decision": {"to": 3, "reason": []},
            "url": "file:///etc/passwd",
            "proxy": True,
            "restarts": 1e308,
        },
    )
    res = run("status")
    assert res.code == 0 and "Traceback" not in res.stdout + res.stderr, res
    assert res.stdout.startswith("odd: ready")
    row = json.loads(run("status", "odd", "--json").stdout)
    assert row["running"] is True and "live" not in row  # no file:// read through the state's url
    assert alive(stranger)


def test_status_marks_a_reused_pid_stale(state, started):
    stranger = started.stranger()
    put(state, "reused", {"pid": stranger.pid, "state": "ready", "identity": identity_of(stranger.pid, starttime=0)})
    row = json.loads(run("status", "reused", "--json").stdout)
    assert row["running"] is False and row["stale"] is True and "reused" in row["stale_reason"]
    assert "stale: pid" in run("status").stdout


# ------------------------------------------------------------------------------------ the up.pid lock


def test_a_second_up_is_refused_while_the_first_holds_the_lock(state, started):
    inst = started.instance(state / "busy")
    with pytest.raises(SpecopsError, match=f"already up \\(specops pid {inst.pid}\\)"):
        acquire(InstancePaths(state / "busy"))


def test_a_lock_naming_a_live_stranger_is_taken_over(state, started):
    """The old pid of the lock now belongs to an unrelated live process: the lock is stale."""
    stranger = started.stranger()
    paths = InstancePaths(state / "reused")
    paths.root.mkdir(mode=0o700)
    for content in (json.dumps(identity_of(stranger.pid, starttime=1)), f"{stranger.pid}\n"):
        paths.lock.write_text(content)
        said: list[str] = []
        acquire(paths, say=said.append)
        try:
            assert len(said) == 1 and "stale lock" in said[0] and "not the specops instance" in said[0], said
            assert json.loads(paths.lock.read_text())["pid"] == os.getpid()
        finally:
            release(paths)
        assert not paths.lock.exists()
    assert alive(stranger)


def test_a_lock_left_by_a_killed_instance_is_taken_over(state, started):
    inst = started.instance(state / "crashed")
    inst.kill()
    inst.wait(timeout=10)
    paths = InstancePaths(state / "crashed")
    said: list[str] = []
    acquire(paths, say=said.append)
    try:
        assert "not running" in said[0]
    finally:
        release(paths)


def test_a_bare_pid_lock_of_a_running_older_specops_is_respected(state, started):
    """An older specops wrote a bare pid and held no flock: believed while that pid runs specops."""
    older = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "specops", "up"], start_new_session=True
    )
    started.procs.append(older)
    deadline = time.monotonic() + 10
    while b"specops" not in Path(f"/proc/{older.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)  # until it has exec'd
    paths = InstancePaths(state / "older")
    paths.root.mkdir(mode=0o700)
    paths.lock.write_text(f"{older.pid}\n")
    with pytest.raises(SpecopsError, match="already up"):
        acquire(paths)


# ------------------------------------------------------------------------------------ permissions


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_state_folder_and_files_are_private_from_creation(tmp_path, loose_umask, monkeypatch):
    root = tmp_path / "fresh" / "state"
    monkeypatch.setenv("SPECOPS_STATE", str(root))
    paths = InstancePaths.for_profile("demo")
    created: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *a, **kw):  # every file specops creates is created 0600
        if flags & os.O_CREAT:
            created.append((os.path.basename(path), mode))
        return real_open(path, flags, mode, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    acquire(paths)
    try:
        write_state(paths, {"name": "demo", "state": "starting"})
        write_state(paths, {"name": "demo", "state": "ready"})
        EventLog(paths.events).emit("up")
    finally:
        release(paths)
    monkeypatch.undo()
    assert mode(root) == 0o700 and mode(root.parent) == 0o700 and mode(paths.root) == 0o700
    assert mode(paths.state) == 0o600 and mode(paths.events) == 0o600
    assert created and all(m == 0o600 for _, m in created), created
    assert sorted(os.listdir(paths.root)) == ["events.jsonl", "state.json"]  # no temporary file left


def test_files_of_an_older_specops_are_tightened(tmp_path, loose_umask):
    paths = InstancePaths(tmp_path / "state" / "old")
    paths.root.mkdir(parents=True, mode=0o755)
    os.chmod(paths.root, 0o755)
    paths.events.write_text("")
    os.chmod(paths.events, 0o644)
    EventLog(paths.events).emit("up")
    assert mode(paths.root) == 0o700 and mode(paths.events) == 0o600


def test_a_state_folder_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder owned by another user")
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(SpecopsError, match="belongs to another user"):
        write_state(InstancePaths(d), {"state": "ready"})


def test_engine_log_is_private_and_only_our_group_is_signalled(tmp_path, loose_umask, started):
    import asyncio

    from specops.backends.base import LaunchPlan
    from specops.methods import Method
    from specops.run.process import EngineProcess, group_members

    plan = LaunchPlan(
        backend="fake",
        engine_version="0",
        method=Method("none"),
        argv=(sys.executable, "-c", "import time; print('up', flush=True); time.sleep(50)"),
        env=(),
        host="127.0.0.1",
        port=9,
    )
    log = tmp_path / "inst" / "engine.log"

    async def main():
        eng = EngineProcess(plan, on_line=lambda line: None, log_path=log)
        await eng.start()
        started.other_pids.add(eng.proc.pid)  # the guard lets its group through
        pgid = eng.proc.pid
        assert group_members(pgid) == [pgid]
        # a process with the leader's pid but another start time is not our engine: nothing is sent
        real = eng._leader_start
        eng._leader_start = real - 1
        eng.kill_now()
        await asyncio.sleep(0.1)
        assert eng.running
        eng._leader_start = real
        await eng.stop(5)
        assert not group_members(pgid)
        eng.kill_now()  # the group is gone: its number may be a stranger's now, so nothing is sent

    guarded, calls = os.killpg, []

    def counting(pgid, sig):
        calls.append((pgid, sig))
        return guarded(pgid, sig)

    os.killpg = counting
    try:
        asyncio.run(main())
    finally:
        os.killpg = guarded
    assert calls == [(calls[0][0], signal.SIGTERM)], calls  # one SIGTERM to the live group, nothing else
    assert mode(log) == 0o600 and "up" in log.read_text()


def test_read_state_never_raises_anything_but_state_error(tmp_path):
    paths = InstancePaths(tmp_path)
    for content in [*BAD_CONTENT.values(), b"\x00" * 10, b'"just a string"', b"null", b"1e999"]:
        paths.state.write_bytes(content)
        with pytest.raises(StateError) as exc:
            read_state(paths)
        assert "\n" not in str(exc.value)
    paths.state.unlink()
    paths.state.symlink_to("/dev/zero")
    with pytest.raises(StateError, match="symbolic link"):
        read_state(paths)
