"""The front proxy against clients without a key that send endless headers, clients that stop reading their
answers, and key holders reading ``/specops/status`` (security review, issue 25, items 1, 5 and 11).

Every test runs the real Proxy on loopback (the header flood against a proxy process of its own, whose RSS
is read from /proc; the status test against `specops up` wired as in production, on the stand-in engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from support_ports import free_port
from support_procs import stop_group
from support_up import SPECOPS, write_profile
from support_upstream import Upstream, raw_http, running_proxy

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
KEY_VAR = "PROXY2_TEST_KEY"
KEY = "sk-proxy2-test-7c41e0"

# the proxy `specops up` runs (the loop it picks, a key), in a process of its own so that its RSS is its own;
# it prints its port and stops when its stdin closes
PROXY_PROCESS = """
import asyncio, os, sys
from specops.proxy import Proxy, run_event_loop

KEY_VAR = "PROXY2_TEST_KEY"

async def main():
    proxy = Proxy("127.0.0.1", 0, queue_size=8, queue_timeout=5, drain_timeout=1, api_key=os.environ[KEY_VAR])
    await proxy.start()
    proxy.set_upstream("http://127.0.0.1:9")  # never reached: nothing gets past the key
    print(proxy.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await proxy.stop()

run_event_loop(main())
"""


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _wait_until(pred, timeout: float = 10.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _status(port: int) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{port}/specops/status", headers={"Authorization": f"Bearer {KEY}"}) as r,
    ):
        assert r.status == 200
        return await r.json()


async def _settled(port: int, within: float = 10.0) -> dict:
    """The proxy's counters once the refused connections have closed: a refusal keeps reading for about a
    second so that the client gets its answer, and counts those header bytes until then (longer on a busy
    machine). ``within`` bounds the wait; the last status is returned either way."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        proxy = (await _status(port))["proxy"]
        if (proxy["header_bytes"] == 0 and proxy["buffered_bytes"] == 0) or loop.time() > deadline:
            return proxy
        await asyncio.sleep(0.1)


async def _endless_headers(port: int, lines: int, line_bytes: int, pause: float = 0.0) -> str:
    """A request line, then up to ``lines`` header lines (each in two writes, ``pause`` seconds apart) and
    never their end: what the proxy answered (its status), 'closed' (closed without an answer) or 'open' (it
    took every line)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    value = b"a" * line_bytes
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n")
        answer = asyncio.ensure_future(reader.readline())
        for i in range(lines):
            if answer.done():
                break
            line = b"X-Pad-%d: %s\r\n" % (i, value)
            for piece in (line[: len(line) // 2], line[len(line) // 2 :]):
                writer.write(piece)
                await writer.drain()
            await asyncio.sleep(pause)
        first = await asyncio.wait_for(answer, 2.0)
        return first.split()[1].decode() if first.startswith(b"HTTP/") else "closed"
    except asyncio.TimeoutError:  # before OSError: TimeoutError is one since Python 3.11
        return "open"
    except (ConnectionError, OSError):
        return "closed"
    finally:
        writer.close()


# ------------------------------------------------------------------------------------ headers (item 1)


@contextlib.contextmanager
def proxy_process():
    """The proxy of PROXY_PROCESS, running: (its pid, its port); stopped on exit."""
    env = {**os.environ, KEY_VAR: KEY}
    proc = subprocess.Popen(
        [sys.executable, "-c", PROXY_PROCESS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        yield proc.pid, int(proc.stdout.readline())
    finally:
        proc.stdin.close()  # the proxy process's own way out ...
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        stop_group(proc, timeout=5)  # ... then its whole group, whatever is left
        proc.stdout.close()


def test_endless_header_lines_get_431_and_the_proxy_process_stays_small():
    """50 connections sending 120 header lines of 8000 bytes each (under every per-line limit, never ending
    the headers, no key): each used to hold ~2 MiB of the `specops up` process, kept after it closed."""
    with proxy_process() as (pid, port):

        async def body():
            for _ in range(5):  # what a serving proxy allocates anyway belongs to "before"
                await _status(port)
            before = _rss_kib(pid)
            peak = before
            attacking = True

            async def sample():
                nonlocal peak
                while attacking:
                    peak = max(peak, _rss_kib(pid))
                    await asyncio.sleep(0.02)

            sampler = asyncio.ensure_future(sample())
            ends = await asyncio.gather(*(_endless_headers(port, 120, 8000) for _ in range(50)))
            attacking = False
            await sampler
            peak = max(peak, _rss_kib(pid))
            proxy = await _settled(port)
            return before, peak, ends, proxy

        before, peak, ends, proxy = run(body())
    assert set(ends) <= {"431", "closed"} and ends.count("431") >= 45, ends
    assert proxy["rejected_header_size"] == 50 and proxy["header_bytes"] == 0 and proxy["buffered_bytes"] == 0
    assert proxy["limits"]["max_header_bytes"] == 64 * 1024
    grown = peak - before
    assert grown < 50 * 512, f"the proxy grew {grown} KiB for 50 connections ({before} -> {peak} KiB)"


def test_what_refused_headers_took_is_given_back_once_they_closed():
    """200 connections at once, each sending 8000-byte header lines (a line in two writes every 20 ms, as
    benchmarks/bench_header_memory.py sends them) until the 431: what their headers took is freed when they
    close, but glibc keeps freed heap pages (4.7-9.6 MiB of this process here, 4 runs); the proxy's
    ``malloc_trim`` (at most once a second) gives them back (0.5 MiB kept, 4 runs): under 2 MiB within 10 s."""
    with proxy_process() as (pid, port):

        async def body():
            for _ in range(20):  # what a serving proxy allocates anyway belongs to "before"
                await _status(port)
            await asyncio.sleep(0.5)
            before = _rss_kib(pid)
            ends = await asyncio.gather(*(_endless_headers(port, 128, 8000, pause=0.02) for _ in range(200)))
            proxy = await _settled(port)
            kept = _rss_kib(pid) - before
            deadline = asyncio.get_running_loop().time() + 10
            while kept >= 2048 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.2)
                kept = _rss_kib(pid) - before
            return ends, proxy, kept

        ends, proxy, kept = run(body())
    assert ends.count("431") >= 190 and proxy["rejected_header_size"] == 200, ends
    assert kept < 2048, f"the proxy process kept {kept} KiB of the refused connections' headers after they closed"


@pytest.fixture(scope="module")
def engine():
    with Upstream.start("E", acceptance=0.75) as up:
        yield up


def test_unfinished_headers_count_against_the_buffer_budget(engine):
    """Headers still arriving hold budget: past max_buffered_bytes the next one gets 503, and it is all
    given back when they close; a long field is refused, ordinary large headers still pass."""

    async def body():
        async with running_proxy(engine.url, max_buffered_bytes=100_000, api_key=KEY) as proxy:
            held = []
            for _ in range(2):  # 2 x ~40 KB of headers, under the 64 KiB of one request
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                for i in range(5):
                    writer.write(b"X-Pad-%d: %s\r\n" % (i, b"a" * 8000))
                await writer.drain()
                held.append((reader, writer))
            await _wait_until(lambda: proxy.stats()["header_bytes"] > 80_000)
            two = proxy.stats()["header_bytes"]
            assert proxy.stats()["buffered_bytes"] == two
            third = await _endless_headers(proxy.port, 5, 8000)
            assert third in ("503", "closed") and proxy.stats()["rejected_buffer_full"] == 1
            await _wait_until(lambda: proxy.stats()["connections"] == 2)  # its bytes are held until it closes
            assert proxy.stats()["header_bytes"] == two
            for _, w in held:
                w.close()
            await _wait_until(lambda: proxy.stats()["connections"] == 0)
            assert proxy.stats()["header_bytes"] == 0 and proxy.stats()["buffered_bytes"] == 0

            auth = f"Authorization: Bearer {KEY}"
            long_field = f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}\r\nX-Long: {'a' * 9000}\r\n\r\n".encode()
            r = await raw_http(proxy.port, long_field)
            assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error" and r.closed, r
            ordinary = [auth, f"X-Token: {'t' * 6000}", *(f"X-Header-{i}: {'v' * 200}" for i in range(30))]
            r = await raw_http(
                proxy.port, ("\r\n".join(["GET /v1/models HTTP/1.1", "Host: x", *ordinary]) + "\r\n\r\n").encode()
            )
            assert r.status == 200 and r.json()["data"], r

    run(body())


# ------------------------------------------------------------------------------ stalled readers (item 5)


async def _stalled_post(port: int, n: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST an ``n``-byte body to the stand-in's echo, then read nothing of the answer (a small receive
    buffer, so the kernel soon stops taking it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=16384)
    writer.write(
        b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        b"Content-Length: %d\r\n\r\n" % n
    )
    writer.write(b"b" * n)
    await writer.drain()
    return reader, writer


def test_clients_that_stop_reading_give_back_the_budget_and_are_cut(engine):
    """Posting big bodies and never reading the answers used to keep their budget for as long as the
    connections stayed (every other POST got 503 specops_buffer_full): now the budget comes back when the
    answer starts, and a client that reads nothing for send_timeout is cut."""
    mb10 = 10_000_000

    async def body():
        async with (
            running_proxy(engine.url, max_buffered_bytes=24_000_000, send_timeout=2.0) as proxy,
            aiohttp.ClientSession() as s,
        ):
            stalled = [await _stalled_post(proxy.port, mb10) for _ in range(2)]
            await _wait_until(lambda: proxy.stats()["in_flight"] == 2 and proxy.stats()["buffered_bytes"] == 0)
            async with s.post(proxy.url + "/debug/echo", data=b"c" * mb10) as r:
                assert r.status == 200 and (await r.json())["body_len"] == mb10
            await _wait_until(lambda: proxy.stats()["connections"] == 0, timeout=15)
            assert proxy.stats()["cut_slow_clients"] == 2 and proxy.stats()["in_flight"] == 0
            for reader, writer in stalled:  # what they got is cut short: no whole answer
                got = 0
                try:
                    while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
                        got += len(chunk)
                except ConnectionError:
                    pass
                assert 0 < got < mb10
                writer.close()
            assert proxy.stats()["buffered_bytes"] == 0

    run(body())


def test_send_timeout_is_a_profile_setting():
    from specops.config.profile import Profile, ProxySettings
    from specops.proxy import Proxy

    assert ProxySettings().send_timeout == 30.0
    profile = Profile(
        name="x", backend="llamacpp", model={"id": "a/b"}, proxy={"send_timeout": "5s", "admin_port": 9124}
    )
    assert Proxy.from_profile(profile, queue_timeout=1.0).send_timeout == 5.0
    with pytest.raises(ValueError):
        Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1, send_timeout=0)


# ------------------------------------------------------------------------------ /specops/status (item 11)


def test_status_endpoint_keeps_the_engine_address_and_profile_path_to_the_local_command(tmp_path):
    """A key holder reading /specops/status used to see the profile's absolute path and the engine's
    internal URL; `specops status` on the machine still shows both (it reads the state file)."""
    state_dir = tmp_path / "state"
    name = "statusdoc"
    port = free_port()
    profile = write_profile(
        tmp_path / "statusdoc.yaml",
        {
            "name": name,
            "backend": "llamacpp",
            "model": {"id": str(tmp_path / "target.gguf")},
            "speculative": {"method": "ngram"},
            "gpus": {"devices": []},
            "server": {"port": port, "api_key": "${" + KEY_VAR + "}"},
            "supervisor": {"state_dir": str(state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
        },
    )
    (tmp_path / "target.gguf").write_bytes(b"GGUF")  # the stand-in reads no weights; the launch check wants a file
    env = {**os.environ, KEY_VAR: KEY}
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "support_standin.py"), "up", str(profile)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        st: dict = {}
        while st.get("state") != "ready":
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-2000:]
            time.sleep(0.1)
            try:
                st = json.loads((state_dir / name / "state.json").read_text())
            except (FileNotFoundError, ValueError):
                st = {}
        engine_url = st["engine_url"]
        engine_authority = engine_url.split("://", 1)[1]
        assert str(profile) in st["profile_reload"]["path"]

        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/specops/status", headers={"Authorization": f"Bearer {KEY}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        doc = json.loads(text)
        assert doc["proxy"]["state"] == "serving" and doc["method"] == "ngram"
        assert engine_authority not in text and str(tmp_path) not in text
        assert "engine_url" not in doc and "upstream" not in doc["proxy"] and "path" not in doc["profile_reload"]

        out = subprocess.run(
            SPECOPS + ["status", str(profile), "--json"], capture_output=True, text=True, env=env, timeout=30
        )
        assert out.returncode == 0, out.stderr
        row = json.loads(out.stdout)
        assert row["engine_url"] == engine_url and row["profile_reload"]["path"] == str(profile)
        assert row["live"]["proxy"]["state"] == "serving" and "live_problem" not in row
        text_out = subprocess.run(
            SPECOPS + ["status", str(profile)], capture_output=True, text=True, env=env, timeout=30
        ).stdout
        assert f"(engine {engine_url}," in text_out and KEY not in text_out
    finally:
        stop_group(proc, timeout=15)  # SIGTERM: specops up stops its engine too
        log.close()


def test_status_endpoint_leaves_out_every_engine_address_a_provider_adds(engine):
    """Rows the status provider adds (a twin engine's, say) lose their engine URLs too; the in-process
    status keeps them all."""
    twin = "http://127.0.0.1:48123"
    provider = lambda: {  # noqa: E731
        "engine_url": engine.url,
        "engines": [{"position": 1, "upstream": twin, "url": twin, "state": "ready"}],
        "profile_reload": {"path": "/srv/profiles/p.yaml", "applied": 2},
        "last_decision": {"reason": f"engine at {twin} is slow"},
    }

    async def body():
        async with (
            running_proxy(engine.url, status_provider=provider, api_key=KEY) as proxy,
            aiohttp.ClientSession() as s,
        ):
            headers = {"Authorization": f"Bearer {KEY}"}
            async with s.get(proxy.url + "/specops/status", headers=headers) as r:
                text = await r.text()
            doc = json.loads(text)
            for hidden in (engine.url.split("://")[1], "127.0.0.1:48123", "/srv/profiles"):
                assert hidden not in text, hidden
            assert doc["engines"] == [{"position": 1, "state": "ready"}] and doc["profile_reload"] == {"applied": 2}
            assert doc["last_decision"]["reason"] == "engine at the engine is slow"
            assert doc["proxy"]["state"] == "serving" and doc["proxy"]["url"] == proxy.url
            full = proxy.status()
            assert full["engine_url"] == engine.url and full["engines"][0]["url"] == twin
            assert full["proxy"]["upstream"] == engine.url

    run(body())
