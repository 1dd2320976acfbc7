"""Security review, profile reload: the reloader reads the profile, its bases and its lock as the loader reads
profiles (bounded, regular files only), and its stop does not wait for a check that never returns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT

from specops.config.profile import load_profile
from specops.run.instance import EventLog
from specops.run.reload import ProfileReloader

pytestmark = pytest.mark.timeout(120)

BASE = {
    "name": "reload-security",
    "backend": "vllm",
    "model": {"id": "/models/target", "max_model_len": 512},
    "speculative": {"method": "ngram", "num_speculative_tokens": 4},
    "server": {"port": 18080},
    "fallback": {"chain": ["none"]},
}
HUGE = 64 << 20  # a sparse file: no disk used, but 64 MiB to whoever reads it whole


def profile(tmp_path: Path) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False))
    return path


def reloader(path: Path, tmp_path: Path, said: list[str]) -> ProfileReloader:
    loaded = load_profile(path)
    return ProfileReloader(
        loaded, loaded, apply=lambda *a: True, events=EventLog(tmp_path / "ev.jsonl"), say=said.append, offline=True
    )


def bounded(fn):
    """``fn()`` in a daemon thread; fails (instead of hanging the suite) when it is still blocked after 30 s."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the reloader is blocked reading a file"
    return box["out"]


def test_a_fifo_at_the_lock_path_is_rejected_not_waited_on(tmp_path):
    path = profile(tmp_path)
    said: list[str] = []
    os.mkfifo(tmp_path / "p.lock.json")  # nobody ever writes to it: an open() for reading waits forever

    def check():
        r = reloader(path, tmp_path, said)
        path.write_text(yaml.safe_dump({**BASE, "speculative": {"method": "ngram", "num_speculative_tokens": 2}}))
        return r.check(forced=True)

    out = bounded(check)
    assert out is not None and out.result == "rejected"
    assert f"{tmp_path / 'p.lock.json'}:1:1" in out.message and "not a regular file" in out.message


@pytest.mark.parametrize("which", ["profile", "lock"])
def test_a_symlink_to_a_huge_file_is_read_no_further_than_a_profile(tmp_path, which):
    path = profile(tmp_path)
    said: list[str] = []
    r = reloader(path, tmp_path, said)
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(HUGE)
    target = path if which == "profile" else tmp_path / "p.lock.json"
    target.unlink(missing_ok=True)
    target.symlink_to(huge)
    tracemalloc.start()
    try:
        out = r.check(forced=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out is not None and out.result == "rejected"
    assert f"{target} is larger than 1 MiB" in out.message
    assert peak < HUGE // 4, f"the check allocated {peak >> 20} MiB"


def test_stop_does_not_wait_for_a_check_that_never_returns(tmp_path):
    """A check stuck on a file system that does not answer (a hung network mount; here a load that never
    returns, since a FIFO no longer blocks) must not keep ``specops up`` from stopping, nor the process from
    exiting."""
    path = profile(tmp_path)
    script = textwrap.dedent(
        f"""
        import asyncio, pathlib, threading
        from specops.config.profile import load_profile
        from specops.run.instance import EventLog
        from specops.run.reload import ProfileReloader

        path = {str(path)!r}
        entered, never = threading.Event(), threading.Event()

        def stuck(p):
            entered.set()
            never.wait()

        async def main():
            loaded = load_profile(path)
            r = ProfileReloader(loaded, loaded, apply=lambda *a: True, events=EventLog(pathlib.Path({str(tmp_path / "ev")!r})),
                                say=print, offline=True, load=stuck)
            r.start()
            with open(path, "a") as f:
                f.write("# edited\\n")
            r.trigger()
            while not entered.is_set():
                await asyncio.sleep(0.05)
            await r.stop()
            print("stopped", flush=True)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "still runs after" in done.stdout and done.stdout.rstrip().endswith("stopped")


def test_the_lock_read_at_start_refuses_a_fifo_and_a_huge_file_without_waiting(tmp_path):
    """`up`, `render` and `resolve` read the lock through read_lock before any reloader runs: a FIFO there
    is refused at once (it would block the read forever), and a huge file is not read whole."""
    from specops.resolve.lock import read_lock

    fifo = tmp_path / "fifo.lock.json"
    os.mkfifo(fifo)
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(_refusal(read_lock, fifo)), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "read_lock blocked on a FIFO"
    assert "not a regular file" in result[0]

    huge = tmp_path / "huge.lock.json"
    with open(huge, "wb") as f:
        f.truncate(64 << 20)  # sparse: costs no disk
    tracemalloc.start()
    try:
        why = _refusal(read_lock, huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "larger than" in why and peak < 16 << 20


def _refusal(read, path) -> str:
    from specops.errors import SpecopsError

    try:
        read(path)
    except SpecopsError as exc:
        return str(exc)
    return "accepted"
