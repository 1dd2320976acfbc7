"""The front proxy against a stand-in engine process: pass-through, streaming, queue, disconnects, timings,
drain, broken streams, status and metrics. Switch scenarios under load live in test_proxy_switch.py."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from support_ports import free_port
from support_upstream import (
    Upstream,
    check_completion,
    check_stream,
    expected_text,
    parse_sse,
    running_proxy,
    stream_error,
)

from specops.proxy.forward import ask_timings_per_token

pytestmark = pytest.mark.timeout(60)


def run(coro, timeout: float = 30.0):
    """Run one async test body, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def engine():
    """A shared stand-in engine (llama.cpp-like: acceptance 0.75, 2 draft tokens per token)."""
    with Upstream.start("E", acceptance=0.75) as up:
        yield up


@pytest.fixture
def fresh_engine():
    with Upstream.start("F", acceptance=0.5) as up:
        yield up


async def _wait_until(pred, timeout: float = 5.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await pred() if asyncio.iscoroutinefunction(pred) else pred()
        if value:
            return value
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


# ------------------------------------------------------------------------------------------ pass-through


def test_every_engine_path_passes_through_unchanged(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            for base in (engine.url, proxy.url):
                async with s.post(base + "/v1/completions", json={"prompt": "a b", "max_tokens": 7}) as r:
                    assert r.status == 200 and r.headers["X-Upstream-Name"] == "E"
                    assert check_completion(await r.json(), 7) == "E"
                async with s.post(
                    base + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                ) as r:
                    assert check_completion(await r.json(), 4, chat=True) == "E"
                async with s.post(
                    base + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True},
                ) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    assert check_stream(parse_sse(await r.text()), 5, chat=True) == "E"
            async with s.get(proxy.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "tiny-test-model"
            async with s.post(proxy.url + "/v1/embeddings", json={"input": ["ab", "abcd"]}) as r:
                assert [d["embedding"][0] for d in (await r.json())["data"]] == [2.0, 4.0]
            async with s.get(proxy.url + "/health") as r:
                assert r.status == 200 and (await r.json()) == {"status": "ok"}
            async with s.get(proxy.url + "/metrics") as r:
                assert "llamacpp:spec_decode_num_draft_tokens_total" in await r.text()
            async with s.post(proxy.url + "/v1/completions", json={"max_tokens": 3}) as r:  # engine's 400
                assert r.status == 400 and "prompt is required" in (await r.json())["error"]["message"]
            async with s.post(
                proxy.url + "/v1/completions", headers={"X-Test-Status": "429"}, json={"prompt": "x"}
            ) as r:
                assert r.status == 429
            async with s.get(proxy.url + "/no/such/path") as r:
                assert r.status == 404
            assert proxy.stats()["completed"] == 10 and proxy.stats()["upstream_errors"] == 0

    run(body())


def test_headers_query_and_raw_path_kept_hop_by_hop_dropped(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            headers = {
                "X-Custom": "v1",
                "Authorization": "Bearer k",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "drop me",
                "X-Test-Echo-Status": "418",
                "Accept-Encoding": "identity",
            }
            async with s.put(proxy.url + "/debug/echo/a%2Fb?q=1&r=%20x", data=b"raw body", headers=headers) as r:
                assert r.status == 418
                doc = await r.json()
                assert r.headers.getall("X-Multi") == ["one", "two"]
                assert "upstream_cookie=c1" in r.headers["Set-Cookie"]
                assert r.headers["X-Upstream-Name"] == "E"
                assert r.headers.get("Connection", "").lower() != "keep-alive, x-hop"
            sent = {k.lower(): v for k, v in doc["headers"]}
            assert doc["method"] == "PUT" and doc["raw_path"] == "/debug/echo/a%2Fb?q=1&r=%20x"
            assert doc["body"] == "raw body"
            assert sent["x-custom"] == "v1" and sent["authorization"] == "Bearer k"
            assert sent["accept-encoding"] == "identity"
            assert "x-hop" not in sent and "connection" not in sent
            assert sent["x-forwarded-for"] == "127.0.0.1"
            assert sent["x-forwarded-host"] == f"127.0.0.1:{proxy.port}"
            assert sent["host"] == f"127.0.0.1:{engine.port}"
            async with s.head(proxy.url + "/debug/echo") as r:
                assert r.status == 200 and int(r.headers["Content-Length"]) > 0 and await r.read() == b""
            async with s.get(proxy.url + "/debug/echo", headers={"X-Test-Echo-Status": "204"}) as r:
                assert r.status == 204 and await r.read() == b""

    run(body())


def test_large_bodies_both_ways(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            big = b"y" * (5 * 1024 * 1024)
            async with s.post(proxy.url + "/debug/echo", data=big) as r:
                assert (await r.json())["body_len"] == len(big)
            async with s.get(proxy.url + "/debug/big?bytes=3000000") as r:  # above the buffer limit: streamed
                assert r.headers["Content-Length"] == "3000000"
                assert len(await r.read()) == 3000000
        async with running_proxy(engine.url, max_body_size=1000) as proxy, aiohttp.ClientSession() as s:
            async with s.post(proxy.url + "/debug/echo", data=b"z" * 1001) as r:
                assert r.status == 413 and (await r.json())["error"]["type"] == "request_too_large"

    run(body())


def test_sse_is_forwarded_chunk_by_chunk(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            arrivals = []
            raw = b""
            async with s.post(
                proxy.url + "/v1/completions",
                headers={"X-Test-Token-Delay": "0.15"},
                json={"prompt": "p", "max_tokens": 5, "stream": True},
            ) as r:
                async for piece in r.content.iter_any():
                    raw += piece
                    arrivals.append((time.monotonic() - t0, piece.count(b"data: ")))
            check_stream(parse_sse(raw.decode()), 5)
            token_times = [t for t, n in arrivals if n]
            assert len(token_times) >= 5, arrivals  # arrived in separate pieces, not one buffer
            assert token_times[-1] - token_times[0] >= 0.45, arrivals  # the first did not wait for the last

    run(body())


def test_engine_closing_pooled_connections_costs_no_retry(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            # llama-server closes the connection just after a stream, without `Connection: close`
            for _ in range(5):
                async with s.post(
                    proxy.url + "/v1/completions",
                    headers={"X-Test-Close-After": "0.02"},
                    json={"prompt": "p", "max_tokens": 3, "stream": True},
                ) as r:
                    check_stream(parse_sse(await r.text()), 3)
                async with s.post(
                    proxy.url + "/v1/completions",
                    headers={"X-Test-Token-Delay": "0.03"},
                    json={"prompt": "p", "max_tokens": 2},
                ) as r:
                    assert r.status == 200 and check_completion(await r.json(), 2) == "E"
            assert proxy.stats()["reconnects"] == 0 and proxy.stats()["retried"] == 0
            # a keep-alive connection the engine closes while the next request is on it: resent at once
            async with s.get(proxy.url + "/debug/echo", headers={"X-Test-Close-After": "0.05"}) as r:
                assert r.status == 200
            async with s.post(
                proxy.url + "/v1/completions",
                headers={"X-Test-Token-Delay": "0.05"},
                json={"prompt": "p", "max_tokens": 4},
            ) as r:
                assert r.status == 200 and check_completion(await r.json(), 4) == "E"
            st = proxy.stats()
            assert st["reconnects"] == 1 and st["retried"] == 0 and st["upstream_errors"] == 0
            assert st["state"] == "serving"

    run(body())


# ------------------------------------------------------------------------------------------ timings


def test_timings_per_token_streamed_as_deltas(engine):
    async def body():
        calls = []
        async with (
            running_proxy(engine.url, on_timings=lambda n, a: calls.append((n, a))) as proxy,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(
                proxy.url + "/v1/completions",
                json={"prompt": "p", "max_tokens": 9, "stream": True, "timings_per_token": True},
            ) as r:
                events = parse_sse(await r.text())
            check_stream(events, 9)
            final = events[-2]["timings"]
            assert len(calls) == 9  # one per token: live, not only at the end
            assert all(n == 2 for n, _ in calls)
            assert sum(n for n, _ in calls) == final["draft_n"] == 18
            assert sum(a for _, a in calls) == final["draft_n_accepted"] == 13
            assert proxy.stats()["timings_draft_n_accepted"] == 13

    run(body())


def test_timings_from_final_chunk_json_body_and_chat(engine):
    async def body():
        calls = []
        async with (
            running_proxy(engine.url, on_timings=lambda n, a: calls.append((n, a))) as proxy,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(
                proxy.url + "/v1/completions",
                json={"prompt": "p", "max_tokens": 6, "stream": True, "timings_per_token": False},
            ) as r:
                check_stream(parse_sse(await r.text()), 6)
            assert calls == [(12, 9)]  # the client said no: only the final chunk carries timings
            calls.clear()
            # a streamed request that does not name the field is sent with it: acceptance chunk by chunk
            async with s.post(
                proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 6, "stream": True}
            ) as r:
                events = parse_sse(await r.text())
            check_stream(events, 6)
            assert len(calls) == 6 and sum(n for n, _ in calls) == 12 and sum(a for _, a in calls) == 9
            assert all("timings" in e for e in events[:-1])
            calls.clear()
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 4}) as r:
                check_completion(await r.json(), 4)
            assert calls == [(8, 6)]
            calls.clear()
            async with s.post(
                proxy.url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 3,
                    "stream": True,
                    "timings_per_token": True,
                },
            ) as r:
                check_stream(parse_sse(await r.text()), 3, chat=True)
            assert calls == [(2, 1), (2, 2), (2, 1)]

    run(body())


@pytest.mark.parametrize(
    "body, sent",
    [
        (b'{"prompt":"p","stream":true}', b'{"timings_per_token":true,"prompt":"p","stream":true}'),
        (b' \n{ "stream" : true}', b' \n{"timings_per_token":true, "stream" : true}'),
        (b'{"prompt":"p","stream":false}', None),  # not streamed: the final answer carries timings anyway
        (b'{"prompt":"p"}', None),
        (b'{"stream":true,"timings_per_token":false}', None),  # the client's choice stands
        (b'{"prompt":"say \\"stream\\": true"}', None),  # only inside a string
        (b'[{"stream":true}]', None),  # not an object: the engine answers it as it is
        (b"", None),
    ],
)
def test_streamed_requests_ask_for_per_token_timings(body, sent):
    out = ask_timings_per_token(body)
    assert out == (body if sent is None else sent)
    if sent is not None:
        assert json.loads(out)["timings_per_token"] is True


def test_no_timings_without_callback_or_without_speculation():
    async def body():
        calls = []
        with Upstream.start("N") as plain:  # no speculation: no draft_n in timings
            async with (
                running_proxy(plain.url, on_timings=lambda n, a: calls.append((n, a))) as proxy,
                aiohttp.ClientSession() as s,
            ):
                async with s.post(
                    proxy.url + "/v1/completions",
                    json={"prompt": "p", "max_tokens": 3, "stream": True, "timings_per_token": True},
                ) as r:
                    events = parse_sse(await r.text())
                check_stream(events, 3)
                assert "timings" in events[0] and calls == []
        with Upstream.start("S", acceptance=1.0) as spec:
            async with running_proxy(spec.url) as proxy, aiohttp.ClientSession() as s:
                async with s.post(
                    proxy.url + "/v1/completions",
                    json={"prompt": "p", "max_tokens": 3, "stream": True, "timings_per_token": True},
                ) as r:
                    check_stream(parse_sse(await r.text()), 3)
                assert proxy.stats()["timings_draft_n"] == 0  # on_timings unset: nothing parsed
                async with s.post(
                    proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3, "stream": True}
                ) as r:
                    events = parse_sse(await r.text())
                check_stream(events, 3)
                assert "timings" not in events[0]  # nobody reads them: the request is sent as it came

    run(body())


# ------------------------------------------------------------------------------------------ queue


def test_queue_full_gets_503_with_retry_after_then_release_serves_the_queue(engine):
    async def body():
        async with (
            running_proxy(engine.url, queue_size=2, queue_timeout=10, retry_after=7) as proxy,
            aiohttp.ClientSession() as s,
        ):
            proxy.hold()

            async def call():
                async with s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}) as r:
                    return r.status, await r.json()

            waiting = [asyncio.ensure_future(call()) for _ in range(2)]
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 2)
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "p"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "7"
                assert (await r.json())["error"]["type"] == "specops_queue_full"
            async with s.get(proxy.url + "/specops/status") as r:
                st = (await r.json())["proxy"]
                assert st["state"] == "held" and st["queue_depth"] == 2 and st["rejected_queue_full"] == 1
            await asyncio.sleep(0.2)
            assert not any(w.done() for w in waiting)
            proxy.release()
            for status, doc in await asyncio.gather(*waiting):
                assert status == 200 and check_completion(doc, 2) == "E"
            st = proxy.stats()
            assert st["waited"] == 2 and 0.2 <= st["longest_wait_s"] < 5 and st["queue_depth"] == 0

    run(body())


def test_queue_timeout_gets_503_with_retry_after(engine):
    async def body():
        async with running_proxy(engine.url, queue_size=8, queue_timeout=0.4) as proxy, aiohttp.ClientSession() as s:
            proxy.hold()
            t0 = time.monotonic()
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "p"}) as r:
                waited = time.monotonic() - t0
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["type"] == "specops_queue_timeout"
            assert 0.35 <= waited < 3
            assert proxy.stats()["rejected_queue_timeout"] == 1

    run(body())


def test_requests_before_the_first_engine_wait_for_it(engine):
    async def body():
        async with running_proxy(None) as proxy, aiohttp.ClientSession() as s:
            assert proxy.state == "idle"
            req = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3}))
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 1)
            proxy.set_upstream(engine.url)
            r = await req
            assert r.status == 200 and check_completion(await r.json(), 3) == "E"
            r.release()

    run(body())


def test_stop_answers_waiting_requests_with_503(engine):
    async def body():
        async with aiohttp.ClientSession() as s:
            async with running_proxy(engine.url, queue_timeout=20) as proxy:
                proxy.hold()
                req = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json={"prompt": "p"}))
                await _wait_until(lambda: proxy.stats()["queue_depth"] == 1)
                await proxy.stop()
                r = await req
                assert r.status == 503 and "Retry-After" in r.headers
                r.release()

    run(body())


# ------------------------------------------------------------------------------------------ disconnects


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_engine_request(fresh_engine, stream):
    async def body():
        async with running_proxy(fresh_engine.url) as proxy, aiohttp.ClientSession() as s:
            before = await fresh_engine.astats(s)

            async def call():
                async with s.post(
                    proxy.url + "/v1/completions",
                    headers={"X-Test-Token-Delay": "0.05"},
                    json={"prompt": "p", "max_tokens": 200, "stream": stream},
                ) as r:
                    await r.read()

            task = asyncio.ensure_future(call())
            await _wait_until(lambda: proxy.stats()["in_flight"] == 1)
            await asyncio.sleep(0.3)
            task.cancel()  # the client goes away (closes its connection)
            t0 = time.monotonic()

            async def engine_saw_it():
                st = await fresh_engine.astats(s)
                return st["cancelled"] == before["cancelled"] + 1 and st["active"] == 0

            await _wait_until(engine_saw_it, timeout=3)
            assert time.monotonic() - t0 < 2.0  # cancelled at once, not after 10 s of tokens
            st = await fresh_engine.astats(s)
            assert st["finished"] == before["finished"]
            await _wait_until(lambda: proxy.stats()["in_flight"] == 0)
            assert proxy.stats()["client_disconnects"] == 1

    run(body())


def test_client_leaving_the_queue_frees_its_place(engine):
    async def body():
        async with running_proxy(engine.url, queue_size=1) as proxy, aiohttp.ClientSession() as s:
            proxy.hold()
            task = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json={"prompt": "p"}))
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 1)
            task.cancel()
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 0)
            waiting = asyncio.ensure_future(
                s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 1})
            )
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 1)  # the place is free again
            proxy.release()
            r = await waiting
            assert r.status == 200
            r.release()
            assert proxy.stats()["rejected_queue_full"] == 0

    run(body())


# ------------------------------------------------------------------------------------------ drain & failures


def test_drain_lets_in_flight_requests_finish(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:

            async def call(stream):
                async with s.post(
                    proxy.url + "/v1/completions",
                    headers={"X-Test-Token-Delay": "0.05"},
                    json={"prompt": "p", "max_tokens": 8, "stream": stream},
                ) as r:
                    return await r.text()

            calls = [asyncio.ensure_future(call(st)) for st in (True, False)]
            await _wait_until(lambda: proxy.stats()["in_flight"] == 2)
            proxy.hold()
            result = await proxy.drain(5)
            assert (result.in_flight, result.finished, result.cut, result.timed_out) == (2, 2, 0, False)
            assert 0.1 < result.waited_s < 3
            texts = await asyncio.gather(*calls)
            check_stream(parse_sse(texts[0]), 8)
            check_completion(json.loads(texts[1]), 8)
            events = [e["event"] for e in proxy.status()["proxy"]["events"]]
            assert events[-2:] == ["hold", "drain"]

    run(body())


def test_drain_timeout_cuts_then_continues_streams_and_retries_unstarted(engine):
    async def body():
        with Upstream.start("NEW") as new:
            async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:

                async def call(stream):
                    async with s.post(
                        proxy.url + "/v1/completions",
                        headers={"X-Test-Token-Delay": "0.04"},
                        json={"prompt": "p", "max_tokens": 30, "stream": stream},
                    ) as r:
                        return r.status, await r.text()

                calls = [asyncio.ensure_future(call(st)) for st in (True, False)]
                await _wait_until(lambda: proxy.stats()["in_flight"] == 2)
                await asyncio.sleep(0.2)
                proxy.hold()
                result = await proxy.drain(0.3)
                assert (result.in_flight, result.finished, result.cut, result.cut_streams, result.timed_out) == (
                    2,
                    0,
                    2,
                    1,
                    True,
                )
                await asyncio.sleep(0.2)
                proxy.release(new.url)
                (s1, streamed), (s2, plain) = await asyncio.gather(*calls)
                events = parse_sse(streamed)  # the cut stream went on on the new engine (test_stream_continuation.py)
                assert s1 == 200 and events[-1] == "[DONE]" and stream_error(events) is None, events[-2:]
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text(30)
                assert events[0]["system_fingerprint"] != "NEW" and events[-2]["system_fingerprint"] == "NEW"
                doc = json.loads(plain)
                assert s2 == 200 and check_completion(doc, 30) == "NEW"  # retried on the new engine
                st = proxy.stats()
                assert (st["cut_streams"], st["continued_streams"]) == (0, 1)
                assert st["retried"] == 1 and st["retried_ok"] == 1

    run(body())


@pytest.mark.parametrize("chat", [False, True])
def test_stream_broken_by_the_engine_is_continued_from_the_text_sent(engine, chat):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            payload = {"max_tokens": 10, "stream": True}
            payload.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "p"})
            async with s.post(proxy.url + path, json=payload, headers={"X-Test-Die-After": "3"}) as r:
                assert r.status == 200
                events = parse_sse(await r.text())
            # the engine drops each connection after 3 tokens: 3 continuations (7, 4, 1 tokens) complete it
            assert events[-1] == "[DONE]" and stream_error(events) is None, events[-2:]
            assert len([e for e in events[:-1] if "choices" in e]) == 10 + chat + 1  # tokens, role, finish
            st = proxy.stats()
            assert (st["broken_streams"], st["continued_streams"], st["stream_continuations"]) == (0, 1, 3)

    run(body())


def test_upstream_failed_queues_new_requests_until_release(engine):
    async def body():
        async with running_proxy(engine.url) as proxy, aiohttp.ClientSession() as s:
            proxy.upstream_failed("test says so")
            assert proxy.state == "down"
            req = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}))
            await _wait_until(lambda: proxy.stats()["queue_depth"] == 1)
            proxy.release(engine.url)
            r = await req
            assert r.status == 200 and check_completion(await r.json(), 2) == "E"
            r.release()
            assert proxy.stats()["generation"] == 2

    run(body())


def test_unreachable_engine_is_detected_and_the_request_retried_on_the_next():
    async def body():
        dead = f"http://127.0.0.1:{free_port()}"
        async with running_proxy(dead, recover_interval=0.1) as proxy, aiohttp.ClientSession() as s:
            req = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}))
            await _wait_until(lambda: proxy.state == "down")
            assert proxy.stats()["retried"] == 1
            with Upstream.start("LATE") as late:
                proxy.release(late.url)
                r = await req
                assert r.status == 200 and check_completion(await r.json(), 2) == "LATE"
                r.release()
            assert proxy.stats()["retried_ok"] == 1

    run(body())


def test_engine_back_on_the_same_port_is_picked_up_by_health():
    async def body():
        port = free_port()
        async with (
            running_proxy(f"http://127.0.0.1:{port}", recover_interval=0.1) as proxy,
            aiohttp.ClientSession() as s,
        ):
            req = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}))
            await _wait_until(lambda: proxy.state == "down")
            with Upstream.start("BACK", port=port):
                r = await req  # no release(): the health check reopened it
                assert r.status == 200 and check_completion(await r.json(), 2) == "BACK"
                r.release()
                assert proxy.state == "serving"
                assert "upstream_recovered" in [e["event"] for e in proxy.status()["proxy"]["events"]]

    run(body())


def test_without_retry_an_unstarted_failure_is_a_502():
    async def body():
        dead = f"http://127.0.0.1:{free_port()}"
        async with running_proxy(dead, retry_unstarted=False) as proxy, aiohttp.ClientSession() as s:
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "p"}) as r:
                assert r.status == 502
                assert (await r.json())["error"]["type"] == "specops_upstream_error"
            assert proxy.stats()["upstream_errors"] == 1 and proxy.stats()["retried"] == 0

    run(body())


# ------------------------------------------------------------------------------------------ status & metrics


def test_states_are_an_enum_and_only_the_table_s_changes_happen():
    from specops.proxy import TRANSITIONS, IllegalTransition, Proxy, ProxyState

    assert [s.value for s in ProxyState] == ["idle", "serving", "held", "down", "stopped"]
    assert set(TRANSITIONS) == set(ProxyState) and not TRANSITIONS[ProxyState.STOPPED]

    async def body():
        proxy = Proxy("127.0.0.1", 0, queue_size=1, queue_timeout=1, drain_timeout=1)
        assert proxy.state is ProxyState.IDLE and proxy.stats()["state"] == "idle"
        proxy.hold()
        assert proxy.state == "held" and f"{proxy.state}" == str(proxy.state) == "held"
        proxy.set_upstream("http://127.0.0.1:1")
        assert proxy.state is ProxyState.SERVING
        with pytest.raises(IllegalTransition, match="serving → idle"):
            proxy._set_state(ProxyState.IDLE)
        assert proxy.state is ProxyState.SERVING
        proxy.upstream_failed()
        assert proxy.state == "down"
        await proxy.stop()
        with pytest.raises(IllegalTransition):
            proxy._set_state(ProxyState.SERVING)
        with pytest.raises(RuntimeError, match="the proxy is stopped"):
            proxy.release()
        proxy.hold()  # no-ops once stopped
        proxy.upstream_failed()
        assert proxy.state is ProxyState.STOPPED
        assert json.loads(json.dumps(proxy.stats()))["state"] == "stopped"
        assert 'specops_proxy_state{state="stopped"} 1.0' in proxy.metrics_text().decode()

    run(body())


def test_status_and_metrics_endpoints(engine):
    from prometheus_client import CollectorRegistry, Counter

    async def body():
        reg = CollectorRegistry()
        Counter("specops_decisions", "decisions", registry=reg).inc(3)
        provider = lambda: {
            "supervisor": {"state": "RUNNING", "method": "eagle3"},  # noqa: E731
            "decisions": [{"action": "keep", "acceptance": 0.8}],
        }
        async with (
            running_proxy(engine.url, status_provider=provider, metrics_registry=reg) as proxy,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}) as r:
                assert r.status == 200
            async with s.get(proxy.url + "/specops/status") as r:
                doc = await r.json()
            assert doc["supervisor"]["method"] == "eagle3" and doc["decisions"][0]["action"] == "keep"
            assert doc["proxy"]["state"] == "serving" and proxy.stats()["upstream"] == engine.url
            assert "upstream" not in doc["proxy"]  # the engine's address stays on the machine (state file)
            assert doc["proxy"]["in_flight"] == 0 and doc["proxy"]["queue_depth"] == 0
            assert doc["proxy"]["completed"] == 1
            async with s.get(proxy.url + "/specops/metrics") as r:
                text = await r.text()
            assert "specops_decisions_total 3.0" in text
            for line in (
                "specops_proxy_queue_depth 0.0",
                "specops_proxy_in_flight 0.0",
                "specops_proxy_completed_total 1.0",
                'specops_proxy_state{state="serving"} 1.0',
                "specops_proxy_waited_requests_total 0.0",
                "specops_proxy_longest_wait_seconds 0.0",
                "specops_proxy_retried_requests_total 0.0",
                'specops_proxy_broken_streams_total{cause="engine"} 0.0',
            ):
                assert line in text, line
            async with s.get(proxy.url + "/specops/nope") as r:
                assert r.status == 404

    run(body())


def test_separate_admin_port(engine):
    async def body():
        async with (
            running_proxy(engine.url, admin_port=0, status_provider=lambda: {"x": 1}) as proxy,
            aiohttp.ClientSession() as s,
        ):
            assert proxy.admin_url != proxy.url
            async with s.get(proxy.admin_url + "/specops/status") as r:
                assert (await r.json())["x"] == 1
            async with s.get(proxy.admin_url + "/v1/models") as r:
                assert r.status == 404  # the admin port does not proxy
            async with s.get(proxy.url + "/specops/status") as r:
                assert r.status == 404  # and the public port does not answer admin:
                assert await r.text() == "404: Not Found"  # the request went to the engine
            assert proxy.stats()["requests"] == 1

    run(body())
