"""The proxy's HTTP layer (aiohttp's server under :class:`specops.proxy.limits.Connection`) against hostile and
unusual framings: request smuggling, over-long lines, too many header fields, header sections at the
``max_header_bytes`` limit, pipelining (answered in order; a flood that is never read starves no one and
holds no memory), HTTP/1.0, HEAD, upgrades and bodies of every size, on a real Proxy on loopback in front of
the stand-in engine (the pipelined flood against a proxy process of its own, whose RSS is read from /proc).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from support_procs import stop_group
from support_upstream import Upstream, raw_http, running_proxy

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


@pytest.mark.parametrize("case", sorted(SMUGGLING))
def test_smuggling_framings_get_a_400_close_and_reach_nothing(engine, case):
    async def body():
        async with running_proxy(engine.url) as proxy:
            before = engine.stats()["by_path"].get("/debug/echo", 0)
            then = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # smuggled behind it: never answered
            r = await raw_http(proxy.port, SMUGGLING[case], then=then)
            assert r.status == 400 and r.closed, r
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert engine.stats()["by_path"].get("/debug/echo", 0) == before
            assert proxy.stats()["rejected_malformed"] == 1 and proxy.stats()["internal_errors"] == 0
            assert proxy.stats()["buffered_bytes"] == 0

    run(body())


def test_a_request_line_or_header_field_over_8190_bytes_is_a_400_and_closes(engine):
    async def body():
        async with running_proxy(engine.url) as proxy:
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


def test_pipelined_requests_are_answered_in_order_on_one_connection(engine):
    async def body():
        async with running_proxy(engine.url) as proxy:
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


def test_http_1_0_gets_its_answer_and_a_closed_connection(engine):
    async def body():
        async with running_proxy(engine.url) as proxy:
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


def test_head_is_answered_without_a_body_and_the_connection_serves_on(engine):
    async def body():
        async with running_proxy(engine.url) as proxy:
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


def test_an_upgrade_request_is_declined_and_what_follows_is_parsed_as_requests(engine):
    """An ``Upgrade`` request is answered like any other (the header is hop-by-hop: never forwarded, so no
    engine connection turns into a tunnel); what the client sent behind it is parsed as HTTP requests, each
    through every check, never passed on as raw bytes."""

    async def body():
        async with running_proxy(engine.url) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
                    b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                await writer.drain()
                answers = await _read_answers(reader, 2)
            finally:
                writer.close()
            assert [s for s, _ in answers] == [200, 404], answers
            assert proxy.stats()["completed"] == 2

    run(body())


def test_a_large_body_pipelined_with_the_next_request_is_no_header_overflow(engine):
    """A 200 KB body and the start of the next request sent at once: only the next request's own bytes count
    as headers still arriving, never the body before them (no 431)."""

    async def body():
        async with running_proxy(engine.url) as proxy:
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


@pytest.mark.parametrize("size", [100_000, 700_000, 3_000_000])
def test_bodies_and_answers_of_every_size_pass_whole(engine, size):
    """Engine answers over the 64 KiB read-ahead and under ``buffer_limit`` (1 MiB: read whole before they
    are answered), and above it (streamed), pass back byte for byte; request bodies of the same sizes arrive
    whole."""

    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            for _ in range(2):  # the second on a pooled engine connection
                async with s.get(proxy.url + f"/debug/big?bytes={size}") as r:
                    got = await r.read()
                    assert r.status == 200 and got == b"x" * size, len(got)
                async with s.post(proxy.url + "/debug/echo", data=b"y" * size) as r:
                    assert r.status == 200 and (await r.json())["body_len"] == size
            assert proxy.stats()["buffered_bytes"] == 0 and proxy.stats()["in_flight"] == 0

    run(body())


# ------------------------------------------------------------------------------ header section limits


def _get_with_header_section(size: int) -> bytes:
    """A ``GET /v1/models`` whose header section, request line to blank line included, is ``size`` bytes."""
    lines = [b"GET /v1/models HTTP/1.1\r\n", b"Host: x\r\n"]
    left = size - sum(map(len, lines)) - 2
    i = 0
    while left > 0:
        take = min(8000, left)
        if 0 < left - take < 20:  # leave room for a last line of its own
            take -= 20
        name = b"X-Pad-%03d: " % i
        lines.append(name + b"a" * (take - len(name) - 2) + b"\r\n")
        left -= take
        i += 1
    raw = b"".join(lines) + b"\r\n"
    assert len(raw) == size
    return raw


@pytest.mark.parametrize("split", ["one write", "two writes", "blank line split"])
def test_the_header_section_limit_is_max_header_bytes_to_the_byte(engine, split):
    """64 KiB of header section is served, one byte more is a 431 (the read that completes the headers used
    to go uncounted: up to twice the limit passed), however the bytes are split across writes."""

    async def send(port: int, raw: bytes):
        if split == "one write":
            return await raw_http(port, raw)
        cut = len(raw) // 2 if split == "two writes" else len(raw) - 2  # "\r\n" | "\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(raw[:cut])
            await writer.drain()
            await asyncio.sleep(0.2)  # the proxy reads the first part alone
            writer.write(raw[cut:])
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 5)
            return int(line.split()[1])
        finally:
            writer.close()

    async def body():
        async with running_proxy(engine.url) as proxy:
            limit = proxy.max_header_bytes
            assert limit == 64 * 1024
            ok = await send(proxy.port, _get_with_header_section(limit))
            assert (ok if isinstance(ok, int) else ok.status) == 200, ok
            over = await send(proxy.port, _get_with_header_section(limit + 1))
            assert (over if isinstance(over, int) else over.status) == 431, over
            if not isinstance(over, int):
                assert over.closed and over.json()["error"]["type"] == "request_header_fields_too_large"
            assert proxy.stats()["rejected_header_size"] == 1

    run(body())


def test_headers_pipelined_behind_a_complete_request_count_from_its_read(engine):
    """A bodyless request and the first 64 KiB+ of the next one's headers in one write: the next one's bytes
    in that read count, so the rest of its headers takes it over the limit (431)."""

    async def body():
        async with running_proxy(engine.url) as proxy:
            nxt = _get_with_header_section(proxy.max_header_bytes + 1)
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + nxt[:-2])
                await writer.drain()
                [(status, _)] = await _read_answers(reader, 1)
                assert status == 200
                await asyncio.sleep(0.2)
                writer.write(nxt[-2:])
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 5)
                assert line.split()[1] == b"431", line
            finally:
                writer.close()

    run(body())


@pytest.mark.parametrize("fields", [128, 129, 5000])
def test_more_than_128_header_fields_are_a_400_and_reach_nothing(engine, fields):
    """Many small fields (each under every size limit) are refused by their count: 128 in all are forwarded
    (the stand-in engine, aiohttp too, may then refuse them with the proxy's forwarding headers added)."""

    async def body():
        async with running_proxy(engine.url) as proxy:
            before = engine.stats()["by_path"].get("/v1/models", 0)
            head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-F%d: v\r\n" % i for i in range(fields - 1))
            r = await raw_http(proxy.port, head + b"\r\n")
            refused = fields > 128
            assert proxy.stats()["rejected_malformed"] == refused, (r, proxy.stats())
            if refused:
                assert r.status == 400 and r.closed and r.json()["error"]["type"] == "invalid_request_error", r
                assert engine.stats()["by_path"].get("/v1/models", 0) == before
            else:
                assert r.status in (200, 400) and not r.closed, r  # forwarded: the engine's own answer

    run(body())


# ------------------------------------------------------------------------------ a pipelined flood

# the proxy `specops up` runs (the loop it picks, a key the flood does not have), in a process of its own so
# that its RSS is its own; it prints its port and stops when its stdin closes
PROXY_PROCESS = """
import asyncio, sys
from specops.proxy import Proxy, run_event_loop

async def main():
    proxy = Proxy("127.0.0.1", 0, queue_size=8, queue_timeout=5, drain_timeout=1, api_key="sk-not-sent-7f2a")
    await proxy.start()
    proxy.set_upstream(sys.argv[1])
    print(proxy.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await proxy.stop()

run_event_loop(main())
"""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _bystander(port: int) -> float:
    """Seconds until a keyless ``GET /health`` on a new connection gets its status line."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), 30)
        assert line.split()[1] == b"200", line
    finally:
        writer.close()
    return time.monotonic() - t0


def test_pipelined_requests_never_read_starve_no_one_and_hold_no_memory(engine):
    """10 keyless connections each write 1 MB of pipelined ``GET /health`` and never read an answer: a
    bystander's ``/health`` is answered within 0.5 s throughout, and the proxy process grows by less than
    4 MiB (it parses a bounded number of requests per connection and stops reading until they are answered)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PROXY_PROCESS, engine.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(proc.stdout.readline())

        async def body():
            for _ in range(5):  # what a serving proxy allocates anyway belongs to "before"
                await _bystander(port)
            before = peak = _rss_kib(proc.pid)
            flood = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * (1_000_000 // 34)
            writers = []
            try:
                for _ in range(10):
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(flood)  # never drained: what the proxy does not read stays on this side
                    writers.append(writer)
                waits = []
                for _ in range(10):
                    waits.append(await _bystander(port))
                    peak = max(peak, _rss_kib(proc.pid))
                    await asyncio.sleep(0.1)
            finally:
                for writer in writers:
                    writer.transport.abort()
            return waits, peak - before

        waits, grown = run(body())
        assert max(waits) < 0.5, f"a bystander waited {max(waits):.2f}s: {waits}"
        assert grown < 4 * 1024, f"the proxy grew {grown} KiB under 10 connections of pipelined requests"
    finally:
        proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        stop_group(proc, timeout=5)
        proc.stdout.close()


def test_a_profile_that_still_names_an_http_layer_gets_a_located_error(tmp_path):
    """`proxy.http` chose between aiohttp and a second layer that is gone: a profile that sets it is refused
    with the reason and the layer that remains, never silently run on another layer."""
    from support_cli import run as cli

    profile = tmp_path / "p.yaml"
    profile.write_text("name: x\nbackend: llamacpp\nmodel: {id: a/b}\nproxy:\n  queue_size: 8\n  http: lean\n")
    r = cli("validate", str(profile))
    assert r.code != 0 and "Traceback" not in r.stdout + r.stderr, r
    assert f"{profile}:" in r.stdout + r.stderr and "proxy.http was removed" in r.stdout + r.stderr, r
    assert "aiohttp" in r.stdout + r.stderr
