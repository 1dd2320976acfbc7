"""The proxy's lean HTTP layer (``proxy.http: lean``, specops/proxy/fastpath.py) against the aiohttp one: the
framings used for request smuggling, over-long lines, pipelining, HTTP/1.0 and upgrades on a real Proxy on
loopback with the stand-in engine; and every proxy and security test file run again on the lean layer
(``SPECOPS_PROXY_HTTP=lean``, which a Proxy made without ``http=`` reads).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from support_upstream import Upstream, raw_http, running_proxy

HERE = Path(__file__).resolve().parent
LAYERS = pytest.mark.parametrize("http", ["aiohttp", "lean"])

pytestmark = pytest.mark.timeout(120)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def engine():
    with Upstream.start("E") as up:
        yield up


async def _read_answers(reader: asyncio.StreamReader, n: int) -> list[tuple[int, bytes]]:
    """``n`` answers with a Content-Length read off one connection: (status, body) each."""
    out = []
    for _ in range(n):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await asyncio.wait_for(reader.readexactly(int(fields.get("content-length", "0"))), 5)
        out.append((int(lines[0].split()[1]), body))
    return out


# ---------------------------------------------------------------------------------------- framing


SMUGGLING = {
    "cl_and_te": b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two_cl": b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
    "obs_fold": b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n 5\r\n\r\nabcde",
    "bare_lf": b"POST /debug/echo HTTP/1.1\nHost: x\nContent-Length: 5\n\nabcde",
    "te_list": b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "space_before_colon": b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nContent-Length : 5\r\n\r\nabcde",
    "te_unknown": b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n",
}


@LAYERS
@pytest.mark.parametrize("case", sorted(SMUGGLING))
def test_smuggling_framings_get_a_400_close_and_reach_nothing(engine, http, case):
    async def body():
        async with running_proxy(engine.url, http=http) as proxy:
            before = engine.stats()["by_path"].get("/debug/echo", 0)
            then = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # smuggled behind it: never answered
            r = await raw_http(proxy.port, SMUGGLING[case], then=then)
            assert r.status == 400 and r.closed, r
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert engine.stats()["by_path"].get("/debug/echo", 0) == before
            assert proxy.stats()["rejected_malformed"] == 1 and proxy.stats()["internal_errors"] == 0
            assert proxy.stats()["buffered_bytes"] == 0

    run(body())


@LAYERS
def test_a_request_line_or_header_field_over_8190_bytes_is_a_400_and_closes(engine, http):
    async def body():
        async with running_proxy(engine.url, http=http) as proxy:
            long_target = b"GET /v1/models?q=" + b"a" * 8200 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            long_field = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n"
            for raw in (long_target, long_field):
                r = await raw_http(proxy.port, raw)
                assert r.status == 400 and r.closed, r
            # the same field sent in pieces (the line grows across reads)
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: ")
                for _ in range(10):
                    writer.write(b"a" * 1000)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                got = await asyncio.wait_for(reader.read(12), 5)
                assert got[:7] == b"HTTP/1." and got[8:] == b" 400", got  # aiohttp answers it as HTTP/1.0
            finally:
                writer.close()
            ok = await raw_http(proxy.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"a" * 8000 + b"\r\n\r\n")
            assert ok.status == 200
            assert proxy.stats()["header_bytes"] == 0

    run(body())


# ---------------------------------------------------------------------------------------- connections


@LAYERS
def test_pipelined_requests_are_answered_in_order_on_one_connection(engine, http):
    async def body():
        async with running_proxy(engine.url, http=http) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                one = b'{"prompt": "p", "max_tokens": 3}'
                writer.write(
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s"
                    b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n" % (len(one), one)
                )
                await writer.drain()
                answers = await _read_answers(reader, 3)
            finally:
                writer.close()
            assert [s for s, _ in answers] == [200, 200, 404], answers
            assert b'"data"' in answers[0][1] and b"t0 t1 t2" in answers[1][1]

    run(body())


@LAYERS
def test_http_1_0_gets_its_answer_and_a_closed_connection(engine, http):
    async def body():
        async with running_proxy(engine.url, http=http) as proxy:
            r = await raw_http(proxy.port, b"GET /v1/models HTTP/1.0\r\nHost: x\r\n\r\n")
            assert r.status == 200 and r.json()["data"] and r.closed, r
            streamed = b'{"prompt": "p", "max_tokens": 4, "stream": true}'
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(
                    b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(streamed), streamed)
                )
                got = await asyncio.wait_for(reader.read(), 10)  # to the end: the close ends the body
            finally:
                writer.close()
            head, _, rest = got.partition(b"\r\n\r\n")
            assert (
                head[:7] == b"HTTP/1." and head[8:12] == b" 200" and b"transfer-encoding: chunked" not in head.lower()
            ), head
            assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]

    run(body())


@LAYERS
def test_head_is_answered_without_a_body_and_the_connection_serves_on(engine, http):
    async def body():
        async with running_proxy(engine.url, http=http) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200") and b"content-length:" in head.lower(), head
                for _ in range(2):  # the engine connection a HEAD used is not handed a second answer
                    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                    await writer.drain()
                    [(status, got)] = await _read_answers(reader, 1)
                    assert status == 200 and b'"data"' in got, got
            finally:
                writer.close()

    run(body())


def test_lean_layer_reads_nothing_after_an_upgrade_request(engine):
    """An ``Upgrade`` request is answered like any other (the header is hop-by-hop: not forwarded), then the
    connection closes: what the client sent behind it is never parsed as requests."""

    async def body():
        async with running_proxy(engine.url, http="lean") as proxy:
            r = await raw_http(
                proxy.port,
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
            )
            assert r.status == 200 and r.closed, r
            assert proxy.stats()["completed"] == 1

    run(body())


# ---------------------------------------------------------------------------------------- settings


def test_the_http_layer_is_a_profile_setting_and_bad_values_are_refused(tmp_path, monkeypatch):
    from specops.config.profile import Profile, ProxySettings
    from specops.proxy import Proxy

    assert ProxySettings().http is None and ProxySettings(http="lean").http == "lean"
    with pytest.raises(ValueError):
        ProxySettings(http="nginx")
    with pytest.raises(ValueError, match="http must be one of aiohttp, lean"):
        Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1, http="nginx")
    monkeypatch.setenv("SPECOPS_PROXY_HTTP", "lean")
    assert Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1).http == "lean"
    assert Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1, http="aiohttp").http == "aiohttp"
    monkeypatch.delenv("SPECOPS_PROXY_HTTP")
    assert Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1).http == "aiohttp"
    profile = Profile(name="x", backend="llamacpp", model={"id": "a/b"}, proxy={"http": "lean"})
    assert Proxy.from_profile(profile).http == "lean"
    assert Proxy.from_profile(profile.model_copy(update={"proxy": ProxySettings()})).http == "aiohttp"


def test_status_names_the_http_layer(engine):
    async def body():
        async with running_proxy(engine.url, http="lean") as proxy:
            r = await raw_http(proxy.port, b"GET /specops/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert r.status == 200 and r.json()["proxy"]["http"] == "lean", r

    run(body())


@LAYERS
def test_a_large_body_pipelined_with_the_next_request_is_no_header_overflow(engine, http):
    """A 200 KB body and the start of the next request sent at once: only the next request's own bytes count
    as headers still arriving, never the body before them (no 431)."""

    async def body():
        async with running_proxy(engine.url, http=http) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                big = b"b" * 200_000
                writer.write(
                    b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                    b"Content-Length: %d\r\n\r\n%sGET /v1/models HTTP/1.1\r\nHost: x\r\n" % (len(big), big)
                )
                await writer.drain()
                [(status, got)] = await _read_answers(reader, 1)
                assert status == 200 and json.loads(got)["body_len"] == 200_000, got[:200]
                writer.write(b"\r\n")
                [(status, got)] = await _read_answers(reader, 1)
                assert status == 200 and b'"data"' in got, got[:200]
            finally:
                writer.close()
            assert proxy.stats()["rejected_header_size"] == 0

    run(body())


@LAYERS
@pytest.mark.parametrize("size", [100_000, 700_000, 3_000_000])
def test_bodies_and_answers_of_every_size_pass_whole(engine, http, size):
    """Engine answers over the 64 KiB read-ahead and under ``buffer_limit`` (1 MiB: read whole before they
    are answered), and above it (streamed), pass back byte for byte; request bodies of the same sizes arrive
    whole."""

    async def body():
        async with running_proxy(engine.url, http=http) as proxy, aiohttp.ClientSession() as s:
            for _ in range(2):  # the second on a pooled engine connection
                async with s.get(proxy.url + f"/debug/big?bytes={size}") as r:
                    got = await r.read()
                    assert r.status == 200 and got == b"x" * size, len(got)
                async with s.post(proxy.url + "/debug/echo", data=b"y" * size) as r:
                    assert r.status == 200 and (await r.json())["body_len"] == size
            assert proxy.stats()["buffered_bytes"] == 0 and proxy.stats()["in_flight"] == 0

    run(body())


# ------------------------------------------------------------------------------ the whole proxy suite, lean

SUITES = [
    "test_proxy.py",
    "test_proxy_security.py",
    "test_security_proxy2.py",
    "test_proxy_switch.py",
    "test_twins_more.py",
]


#: the same, with real engines (llama-server on CPU)
ENGINE_SUITES = ["test_proxy_engines.py", "test_twins_llamacpp.py"]


def _suite_on_lean(suite: str, timeout: float) -> None:
    """Run one test file in a pytest of its own, with every Proxy it makes on the lean layer."""
    from unittest import mock

    from specops.proxy import Proxy

    env = {**os.environ, "SPECOPS_PROXY_HTTP": "lean"}
    with mock.patch.dict(os.environ, env):  # what the file's proxies will be made on
        assert Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1).http == "lean"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / suite), "-q", "-p", "no:cacheprovider", "-x"],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{suite} on the lean layer ({time.monotonic() - t0:.0f}s):\n{proc.stdout[-6000:]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", SUITES)
def test_every_proxy_test_passes_on_the_lean_layer(suite):
    _suite_on_lean(suite, 840)


@pytest.mark.engines
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("suite", ENGINE_SUITES)
def test_every_engine_proxy_test_passes_on_the_lean_layer(suite):
    _suite_on_lean(suite, 1740)
