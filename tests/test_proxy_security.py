"""The front proxy facing hostile or careless clients: request targets that name other hosts, slow and
oversized requests, connection floods, the API key, forwarding headers, and what gets logged.

Every test runs the real Proxy against the stand-in engine (tests/support_upstream.py) on loopback; the
hostile requests are written byte for byte on raw sockets (:func:`raw_http`) so that exactly the target
under test is sent, and a :class:`Canary` listener on another port proves nothing was forwarded there.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from conftest import unavailable
from pydantic import ValidationError
from support_procs import stop_group
from support_upstream import Canary, Upstream, check_completion, raw_http, running_proxy

pytestmark = pytest.mark.timeout(60)


def run(coro, timeout: float = 30.0, loop: str = "asyncio"):
    """Run one async test body, bounded in time, on asyncio's loop or on uvloop (what `specops up` uses)."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:  # a dependency of specops (pyproject) on every platform but Windows
            unavailable("uvloop is not installed (pip install -e '.[test]')")
        return uvloop.run(asyncio.wait_for(coro, timeout))
    return asyncio.run(asyncio.wait_for(coro, timeout))


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


@pytest.fixture(scope="module")
def engine():
    with Upstream.start("E", acceptance=0.75) as up:
        yield up


async def _wait_until(pred, timeout: float = 5.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


def _request(line: str, *headers: str, body: bytes = b"") -> bytes:
    head = [line, "Host: 127.0.0.1", *headers]
    if body and not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _no_tracebacks(caplog) -> None:
    for rec in caplog.records:
        assert rec.exc_info is None, (rec.name, rec.getMessage())
        assert "Traceback" not in rec.getMessage()


# ------------------------------------------------------------------------------------ request targets


@pytest.mark.parametrize(
    "target", ["@127.0.0.1:{canary}", "127.0.0.1:{canary}", "@127.0.0.1:1", "user:pw@127.0.0.1:{canary}"]
)
def test_connect_is_refused_and_opens_no_connection_anywhere(engine, target, caplog):
    """CONNECT @127.0.0.1:PORT used to connect to PORT (the engine's host:port became userinfo): 405 now."""

    async def body():
        async with Canary() as canary, running_proxy(engine.url) as proxy:
            t = target.format(canary=canary.port)
            r = await raw_http(proxy.port, _request(f"CONNECT {t} HTTP/1.1"))
            assert r.status == 405, r
            assert r.json()["error"]["type"] == "method_not_allowed"
            assert r.headers["content-type"].startswith("application/json") and r.closed
            await asyncio.sleep(0.1)
            assert canary.hits == 0
            st = proxy.stats()
            assert st["rejected_method"] == 1 and st["upstream_errors"] == 0 and st["completed"] == 0

    with caplog.at_level(logging.DEBUG):
        run(body())
    _no_tracebacks(caplog)


@pytest.mark.parametrize(
    "line",
    [
        "GET http://127.0.0.1:{canary}/v1/models HTTP/1.1",  # absolute-form
        "POST http://127.0.0.1:{canary}/v1/completions HTTP/1.1",
        "GET http://x@127.0.0.1:{canary}/v1/models HTTP/1.1",
        "OPTIONS * HTTP/1.1",  # asterisk-form
        "GET 127.0.0.1:{canary}/v1/models HTTP/1.1",
        "GET @127.0.0.1:{canary}/v1/models HTTP/1.1",  # refused by the HTTP parser itself
        "GET /v1/models#@127.0.0.1:{canary} HTTP/1.1",  # a fragment is no part of a target
    ],
)
def test_non_origin_targets_get_a_json_400_and_reach_nothing(engine, line, caplog):
    """Absolute-form and ``*`` targets used to end in a 500 with a traceback on the console."""

    async def body():
        async with Canary() as canary, running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            before = await engine.astats(s)
            r = await raw_http(proxy.port, _request(line.format(canary=canary.port)))
            assert r.status == 400, r
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "invalid_request_error" and r.closed
            await asyncio.sleep(0.1)
            assert canary.hits == 0
            after = await engine.astats(s)
            assert after["by_path"] == before["by_path"]
            assert proxy.stats()["upstream_errors"] == 0

    with caplog.at_level(logging.DEBUG):
        run(body())
    _no_tracebacks(caplog)


def test_origin_form_targets_only_ever_reach_the_engine(engine):
    """A path that looks like an authority stays a path on the engine; encoded bytes pass unchanged."""

    async def body():
        async with Canary() as canary, running_proxy(engine.url) as proxy:
            for target in (
                f"//127.0.0.1:{canary.port}/debug/echo",
                f"/@127.0.0.1:{canary.port}",
                f"/debug/echo/%2F%2E%2E%40127.0.0.1:{canary.port}?u=@127.0.0.1:{canary.port}&x=%20",
            ):
                r = await raw_http(proxy.port, _request(f"GET {target} HTTP/1.1", "Connection: close"))
                if target.startswith("/debug/echo"):
                    assert r.status == 200 and r.json()["raw_path"] == target, r
                else:
                    assert r.status == 404, (target, r)  # the engine's router: no such path
            await asyncio.sleep(0.1)
            assert canary.hits == 0
            st = proxy.stats()
            assert st["completed"] == 3 and st["upstream_errors"] == 0  # all three answered by the engine

    run(body())


def test_upstream_url_is_built_from_parts():
    from specops.proxy.forward import Generation, upstream_url

    gen = Generation(1, "http://[::1]:8001/")
    assert str(upstream_url(gen, "/v1/x%2Fy?a=1&b=%20")) == "http://[::1]:8001/v1/x%2Fy?a=1&b=%20"
    url = upstream_url(Generation(2, "http://127.0.0.1:8001"), "//evil.example:1/x")
    assert (url.host, url.port, url.raw_path) == ("127.0.0.1", 8001, "//evil.example:1/x")
    for bad in ("@127.0.0.1:1", "http://127.0.0.1:1/", "*", ""):
        with pytest.raises(ValueError):
            upstream_url(gen, bad)


# ------------------------------------------------------------------------------------ logging


def test_rejections_log_one_line_each_never_a_traceback(engine, caplog):
    async def body():
        async with running_proxy(engine.url) as proxy:
            for line in (
                "CONNECT @127.0.0.1:1 HTTP/1.1",
                "GET http://127.0.0.1:1/ HTTP/1.1",
                "OPTIONS * HTTP/1.1",
                "GET @x/ HTTP/1.1",
                "GET /\x01 HTTP/1.1",
            ):
                r = await raw_http(proxy.port, _request(line))
                assert r.status in (400, 405), (line, r)
            r = await raw_http(proxy.port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40)
            assert r.status in (400, None)  # TLS to a plain port: refused, no traceback

    with caplog.at_level(logging.DEBUG, logger="specops.proxy"):
        run(body())
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 5 <= len(lines) <= 6, [r.getMessage() for r in lines]
    for rec in lines:
        msg = rec.getMessage()
        assert rec.name == "specops.proxy" and "\n" not in msg and len(msg) < 400, msg
    assert any("405" in r.getMessage() and "CONNECT" in r.getMessage() for r in lines)
    for rec in caplog.records:
        assert rec.exc_info is None or rec.levelno == logging.DEBUG, rec.getMessage()
        assert "Traceback" not in rec.getMessage()


def test_rejection_lines_are_rate_limited_with_a_count_of_the_rest(engine, caplog):
    async def body():
        async with running_proxy(engine.url, log_rejects_per_s=3) as proxy:
            for _ in range(20):
                r = await raw_http(proxy.port, _request("OPTIONS * HTTP/1.1"), close_wait=0.05)
                assert r.status == 400
            printed = len([r for r in caplog.records if r.levelno >= logging.WARNING])
            suppressed = proxy.stats()["log_suppressed"]
            assert printed + suppressed == 20 and suppressed >= 10, (printed, suppressed)
            await asyncio.sleep(1.05)  # a new second: the next line says what was skipped
            caplog.clear()
            r = await raw_http(proxy.port, _request("OPTIONS * HTTP/1.1"), close_wait=0.05)
            assert r.status == 400
            msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(msgs) == 1 and f"({suppressed} similar lines suppressed" in msgs[0], msgs
            assert proxy.stats()["rejected_bad_target"] == 21

    with caplog.at_level(logging.WARNING, logger="specops.proxy"):
        run(body())


_CONSOLE_PROXY = """
import asyncio, signal, sys
from specops.proxy import Proxy

async def main():
    proxy = Proxy("127.0.0.1", 0, queue_size=8, queue_timeout=5, drain_timeout=1, body_timeout=0.3,
                  max_body_size=4096, log_rejects_per_s=100)
    await proxy.start()
    proxy.set_upstream(sys.argv[1])
    print("LISTENING", proxy.port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await proxy.stop()

asyncio.run(main())
"""


def test_the_console_shows_one_line_per_rejection_and_never_a_traceback(engine):
    """Like `specops up`: no logging configured, so whatever the proxy logs reaches stderr as is."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _CONSOLE_PROXY, engine.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(proc.stdout.readline().split()[1])
        hostile = [
            _request("CONNECT @127.0.0.1:1 HTTP/1.1"),
            _request("GET http://127.0.0.1:1/ HTTP/1.1"),
            _request("OPTIONS * HTTP/1.1"),
            _request("GET @x/ HTTP/1.1"),
            b"\x16\x03\x01\x00\xa5\x01" + b"\x00" * 60,
            b"GARBAGE\r\n\r\n",
            _request("GET /\x7f\x00 HTTP/1.1"),
            _request("POST /v1/completions HTTP/1.1", "Content-Length: 1000000000", body=b"{"),
            _request("POST /v1/completions HTTP/1.1", "Content-Length: 100", body=b"{"),
            _request("POST /debug/echo HTTP/1.1", "Transfer-Encoding: chunked", body=b"zz\r\n"),
        ]

        async def send_all():
            for data in hostile:
                await raw_http(port, data, close_wait=0.3)

        run(send_all())
    finally:
        proc.terminate()  # the proxy alone first: its console lines are what the test reads
        try:
            _, err = proc.communicate(timeout=10)
        finally:
            stop_group(proc, timeout=5)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(hostile) - 2 <= len(lines) <= len(hostile), err  # one line each (a few may be one parse error)
    assert all(ln.startswith("proxy: ") and len(ln) < 400 for ln in lines), err


# ------------------------------------------------------------------------------------ slow clients


@LOOPS
def test_headers_that_do_not_arrive_in_time_close_the_connection(engine, loop):
    async def body():
        async with running_proxy(engine.url, header_timeout=0.5) as proxy:

            async def silent():
                t0 = time.monotonic()
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                try:
                    assert await asyncio.wait_for(reader.read(100), 5) == b""
                finally:
                    writer.close()
                return time.monotonic() - t0

            async def trickle():  # slowloris: a header line every 0.1 s, forever
                t0 = time.monotonic()
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                try:
                    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
                    for i in range(50):
                        await asyncio.sleep(0.1)
                        try:
                            writer.write(f"X-Slow-{i}: y\r\n".encode())
                            await writer.drain()
                        except (ConnectionError, RuntimeError):  # uvloop: RuntimeError once the proxy closed it
                            break
                        if reader.at_eof():
                            break
                    got = await asyncio.wait_for(reader.read(100), 5)
                    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
                except ConnectionError:
                    pass
                finally:
                    writer.close()
                return time.monotonic() - t0

            waits = await asyncio.gather(silent(), trickle(), *(silent() for _ in range(20)))
            assert all(0.3 <= w < 3.0 for w in waits), waits
            await _wait_until(lambda: proxy.stats()["connections"] == 0)
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/models") as r:
                assert r.status == 200  # and the proxy serves on

    run(body(), loop=loop)


def test_the_first_request_deadline_does_not_rely_on_aiohttps_keepalive_timer(engine, monkeypatch):
    """Before aiohttp 3.14 its keep-alive timer did not run until a first request: the proxy's own does."""
    from aiohttp import web

    monkeypatch.setattr(web.RequestHandler, "_process_keepalive", lambda self: None)

    async def body():
        async with running_proxy(engine.url, header_timeout=0.5) as proxy:

            async def wait_closed(first: bytes) -> float:
                t0 = time.monotonic()
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                try:
                    writer.write(first)
                    assert await asyncio.wait_for(reader.read(100), 5) == b""
                finally:
                    writer.close()
                return time.monotonic() - t0

            waits = await asyncio.gather(wait_closed(b""), wait_closed(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"))
            assert all(0.3 <= w < 3.0 for w in waits), waits
            async with aiohttp.ClientSession() as s:  # a request in time is not cut by it
                async with s.get(proxy.url + "/v1/models") as r:
                    assert r.status == 200
                await asyncio.sleep(0.8)
                async with s.get(proxy.url + "/v1/models") as r:
                    assert r.status == 200

    run(body())


@LOOPS
def test_a_body_that_does_not_arrive_in_time_gets_408_and_never_reaches_the_engine(engine, loop):
    async def body():
        async with running_proxy(engine.url, body_timeout=0.5) as proxy, aiohttp.ClientSession() as s:
            before = (await engine.astats(s))["started"]
            req = _request(
                "POST /v1/completions HTTP/1.1",
                "Content-Length: 100",
                "Content-Type: application/json",
                body=b'{"prompt":',
            )
            r = await raw_http(proxy.port, req)
            assert r.status == 408 and r.json()["error"]["type"] == "request_timeout" and r.closed, r
            assert 0.4 <= r.elapsed < 3
            assert (await engine.astats(s))["started"] == before
            st = proxy.stats()
            assert st["rejected_body_timeout"] == 1 and st["buffered_bytes"] == 0

    run(body(), loop=loop)


def test_a_huge_content_length_is_refused_at_once_without_reading(engine):
    """Content-Length: 1000000000 with one byte sent used to be held forever."""

    async def body():
        async with running_proxy(engine.url) as proxy:
            r = await raw_http(
                proxy.port, _request("POST /v1/completions HTTP/1.1", "Content-Length: 1000000000", body=b"{")
            )
            assert r.status == 413 and r.json()["error"]["type"] == "request_too_large", r
            assert r.elapsed < 1.0 and r.closed
            assert proxy.stats()["buffered_bytes"] == 0 and proxy.stats()["rejected_too_large"] == 1

    run(body())


def test_a_chunked_body_over_the_limit_gets_413(engine):
    async def body():
        async with running_proxy(engine.url, max_body_size=2000) as proxy:
            chunk = b"x" * 1500
            data = (b"%x\r\n" % len(chunk)) + chunk + b"\r\n"
            req = _request("POST /debug/echo HTTP/1.1", "Transfer-Encoding: chunked", body=data + data + b"0\r\n\r\n")
            r = await raw_http(proxy.port, req)
            assert r.status == 413, r
            ok = _request(
                "POST /debug/echo HTTP/1.1", "Transfer-Encoding: chunked", "Connection: close", body=data + b"0\r\n\r\n"
            )
            r = await raw_http(proxy.port, ok)
            assert r.status == 200 and r.json()["body_len"] == 1500
            await _wait_until(lambda: proxy.stats()["buffered_bytes"] == 0)

    run(body())


def test_malformed_bodies_get_a_400_or_a_408_never_a_500(engine, caplog):
    async def body():
        async with running_proxy(engine.url, body_timeout=0.5) as proxy:
            head = b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            for rest in (b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabcdef\r\n0\r\n\r\n", b"5\r\nab"):
                r = await raw_http(proxy.port, head + rest)
                assert r.status in (400, 408), (rest, r)
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)  # the bad part later
                writer.write(head + b"3\r\nabc\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(rest)
                got = await asyncio.wait_for(reader.read(100), 5)
                writer.close()
                assert got.startswith((b"HTTP/1.1 400", b"HTTP/1.1 408")), got
            for dup in (b"Content-Length: 5\r\nContent-Length: 6", b"Content-Length: 5\r\nTransfer-Encoding: chunked"):
                r = await raw_http(proxy.port, b"POST /debug/echo HTTP/1.1\r\nHost: x\r\n" + dup + b"\r\n\r\nabcdef")
                assert r.status == 400 and r.closed, r
            await _wait_until(lambda: proxy.stats()["buffered_bytes"] == 0)
            assert proxy.stats()["internal_errors"] == 0

    with caplog.at_level(logging.DEBUG):
        run(body())
    _no_tracebacks(caplog)


# ------------------------------------------------------------------------------------ floods


@LOOPS
def test_connections_past_the_cap_are_refused_promptly_and_the_cap_frees_up(engine, loop):
    async def body():
        async with running_proxy(engine.url, max_connections=3, header_timeout=20) as proxy:
            held = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(3)]
            await _wait_until(lambda: proxy.stats()["connections"] == 3)
            t0 = time.monotonic()
            r = await raw_http(proxy.port, _request("GET /v1/models HTTP/1.1"))
            assert r.status == 503 and r.closed and "retry-after" in r.headers, r
            assert r.json()["error"]["type"] == "specops_too_many_connections"
            assert time.monotonic() - t0 < 2.0
            # one that connects and sends nothing is closed as well, without waiting for a request
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            got = await asyncio.wait_for(reader.read(), 3)
            writer.close()
            assert got.startswith(b"HTTP/1.1 503")
            assert proxy.stats()["rejected_connections"] == 2 and proxy.stats()["connections"] == 3
            for _, w in held:
                w.close()
            await _wait_until(lambda: proxy.stats()["connections"] == 0)
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/models") as resp:
                assert resp.status == 200

    run(body(), loop=loop)


def test_a_slowloris_flood_stays_under_the_cap_and_is_cleared_by_the_header_timeout(engine):
    """2000 slowloris connections used to stay open for minutes; here 300 against a cap of 100."""

    async def body():
        async with running_proxy(engine.url, max_connections=100, header_timeout=1.0) as proxy:
            peak = 0
            conns = []
            for _ in range(300):
                try:
                    conns.append(await asyncio.open_connection("127.0.0.1", proxy.port))
                except OSError:
                    break
                conns[-1][1].write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never finished
                peak = max(peak, proxy.stats()["connections"])
            t0 = time.monotonic()
            for _ in range(30):  # keep trickling, as slowloris does
                for _, w in conns:
                    if not w.is_closing():
                        w.write(b"X-a: b\r\n")
                peak = max(peak, proxy.stats()["connections"])
                if proxy.stats()["connections"] == 0:
                    break
                await asyncio.sleep(0.2)
            cleared = time.monotonic() - t0
            for _, w in conns:
                w.close()
            assert peak <= 100 and proxy.stats()["rejected_connections"] >= 150, (peak, proxy.stats())
            await _wait_until(lambda: proxy.stats()["connections"] == 0, timeout=5)
            assert cleared < 5.0
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/models") as r:
                assert r.status == 200

    run(body())


def test_buffered_bodies_are_capped_across_requests_queued_ones_included(engine):
    """8 x 60 MiB bodies used to take the proxy from 56 to 740 MiB: past the cap the answer is 503."""

    async def body():
        async with (
            running_proxy(engine.url, max_buffered_bytes=1_000_000, max_body_size=800_000, retry_after=3) as proxy,
            aiohttp.ClientSession() as s,
        ):
            proxy.hold()  # every accepted request waits, holding its body

            async def send(n: int):
                async with s.post(proxy.url + "/debug/echo", data=b"b" * n) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            first = asyncio.ensure_future(send(600_000))
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 1)
            assert proxy.stats()["buffered_bytes"] == 600_000
            burst = await asyncio.gather(*(send(600_000) for _ in range(7)))
            for status, retry_after, doc in burst:
                assert status == 503 and retry_after == "3" and doc["error"]["type"] == "specops_buffer_full"
            small = asyncio.ensure_future(send(1000))  # still fits: queued
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 2)
            assert proxy.stats()["buffered_bytes"] == 601_000
            proxy.release()
            for status, _, doc in await asyncio.gather(first, small):
                assert status == 200 and doc["body_len"] in (600_000, 1000)
            await _wait_until(lambda: proxy.stats()["buffered_bytes"] == 0)
            assert (await send(600_000))[0] == 200  # the room is given back
            assert proxy.stats()["rejected_buffer_full"] == 7

    run(body())


# ------------------------------------------------------------------------------------ API key


def test_api_key_is_checked_before_the_queue_and_the_engine(engine):
    async def body():
        async with running_proxy(engine.url, api_key="s3cret") as proxy, aiohttp.ClientSession() as s:
            before = (await engine.astats(s))["started"]
            proxy.hold()
            for auth in (None, "Bearer wrong", "Bearer s3cretX", "Bearer s3cre", "Basic s3cret", "s3cret", "Bearer"):
                headers = {"Authorization": auth} if auth else {}
                async with s.post(
                    proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=headers
                ) as r:
                    assert r.status == 401, auth
                    assert r.headers["WWW-Authenticate"] == "Bearer"
                    assert (await r.json())["error"]["type"] == "authentication_error"
                assert proxy.stats()["queue_depth"] == 0  # never queued
            # a large unauthenticated body is refused without being read
            big = _request("POST /v1/completions HTTP/1.1", "Content-Length: 10000000", body=b"x" * 1000)
            r = await raw_http(proxy.port, big)
            assert r.status == 401 and r.closed and r.elapsed < 1.0
            proxy.release()
            for auth in ("Bearer s3cret", "bearer s3cret", "BEARER   s3cret"):
                async with s.post(
                    proxy.url + "/v1/completions",
                    json={"prompt": "p", "max_tokens": 2},
                    headers={"Authorization": auth},
                ) as r:
                    assert r.status == 200 and check_completion(await r.json(), 2) == "E"
            async with s.get(proxy.url + "/debug/echo", headers={"Authorization": "Bearer s3cret"}) as r:
                sent = {k.lower(): v for k, v in (await r.json())["headers"]}
                assert sent["authorization"] == "Bearer s3cret"  # the engine checks it too
            async with s.get(proxy.url + "/health") as r:  # load balancers: no key
                assert r.status == 200
            async with s.post(proxy.url + "/health") as r:
                assert r.status == 401
            assert (await engine.astats(s))["started"] == before + 3
            assert proxy.stats()["rejected_unauthorized"] == 9

    run(body())


def test_status_and_metrics_need_the_key_on_the_public_port_not_on_the_admin_port(engine):
    async def body():
        async with running_proxy(engine.url, api_key="k") as proxy, aiohttp.ClientSession() as s:
            for path in ("/specops/status", "/specops/metrics", "/specops/nope"):
                async with s.get(proxy.url + path) as r:
                    assert r.status == 401, path
                async with s.get(proxy.url + path, headers={"Authorization": "Bearer k"}) as r:
                    assert r.status == (404 if path.endswith("nope") else 200), path
            async with s.get(proxy.url + "/specops/status", headers={"Authorization": "Bearer k"}) as r:
                limits = (await r.json())["proxy"]["limits"]
                assert limits["api_key"] is True and "k" not in str(limits.values())
        async with running_proxy(engine.url, api_key="k", admin_port=0) as proxy, aiohttp.ClientSession() as s:
            async with s.get(proxy.admin_url + "/specops/status") as r:
                assert r.status == 200
            async with s.get(proxy.admin_url + "/specops/metrics") as r:
                assert r.status == 200 and "specops_proxy_refused_total" in await r.text()
            r = await raw_http(proxy.admin_port, _request("GET http://127.0.0.1:1/specops/status HTTP/1.1"))
            assert r.status == 400

    run(body())


# ------------------------------------------------------------------------------------ forwarding headers


def test_forwarding_headers_are_the_proxys_own(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            spoof = [
                ("X-Forwarded-For", "203.0.113.7"),
                ("X-Forwarded-For", "198.51.100.1"),
                ("X-Forwarded-Host", "evil.example"),
                ("X-Forwarded-Proto", "https"),
                ("X-Forwarded-Port", "443"),
                ("Forwarded", "for=203.0.113.9;proto=https"),
                ("X-Real-IP", "203.0.113.8"),
            ]
            async with s.get(proxy.url + "/debug/echo", headers=spoof) as r:
                doc = await r.json()
            sent = {}
            for k, v in doc["headers"]:
                sent.setdefault(k.lower(), []).append(v)
            assert sent["x-forwarded-for"] == ["203.0.113.7, 198.51.100.1, 127.0.0.1"]  # appended: last is ours
            assert sent["x-forwarded-host"] == [f"127.0.0.1:{proxy.port}"]
            assert sent["x-forwarded-proto"] == ["http"]
            for dropped in ("forwarded", "x-forwarded-port", "x-real-ip"):
                assert dropped not in sent, dropped

    run(body())


# ------------------------------------------------------------------------------------ settings & loop


def test_profile_settings_reach_the_proxy_with_the_same_defaults():
    from specops import proxy as proxy_mod
    from specops.config.profile import Profile, ProxySettings
    from specops.proxy import Proxy

    defaults = ProxySettings()
    assert defaults.max_body_size == proxy_mod.DEFAULT_MAX_BODY_SIZE == 16 * 1024 * 1024
    assert defaults.max_buffered_bytes == proxy_mod.DEFAULT_MAX_BUFFERED_BYTES
    assert defaults.max_connections == proxy_mod.DEFAULT_MAX_CONNECTIONS
    assert defaults.header_timeout == proxy_mod.DEFAULT_HEADER_TIMEOUT
    assert defaults.body_timeout == proxy_mod.DEFAULT_BODY_TIMEOUT
    profile = Profile(
        name="x",
        backend="llamacpp",
        model={"id": "a/b"},
        server={"host": "127.0.0.1", "port": 9123, "api_key": "k"},
        proxy={
            "max_body_size": 4096,
            "max_buffered_bytes": 8192,
            "max_connections": 7,
            "header_timeout": "2s",
            "body_timeout": "500ms",
            "queue_size": 5,
            "admin_port": 9124,
        },
    )
    p = Proxy.from_profile(profile, queue_timeout=1.0)
    assert (
        p.host,
        p.port,
        p.api_key,
        p.max_body_size,
        p.max_buffered_bytes,
        p.max_connections,
        p.header_timeout,
        p.body_timeout,
        p.queue_size,
        p.admin_port,
        p.queue_timeout,
    ) == ("127.0.0.1", 9123, "k", 4096, 8192, 7, 2.0, 0.5, 5, 9124, 1.0)
    for bad in ({"max_connections": 0}, {"header_timeout": 0}, {"body_timeout": "2h"}, {"max_body_size": 10}):
        with pytest.raises(ValidationError):
            ProxySettings(**bad)


def test_the_proxy_works_on_uvloop_and_without_it(engine, monkeypatch):
    from specops.proxy import loop_factory, run_event_loop

    async def round_trip():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3}) as r:
                assert r.status == 200 and check_completion(await r.json(), 3) == "E"
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.setenv("SPECOPS_UVLOOP", "0")
    assert loop_factory() is None
    assert run_event_loop(round_trip()).startswith("asyncio")
    monkeypatch.delenv("SPECOPS_UVLOOP")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert loop_factory() is None
        return
    assert run_event_loop(round_trip()).startswith("uvloop")
