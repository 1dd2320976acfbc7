"""No request lost during a switch: the proxy under load while the supervisor's hold → drain → release runs
(driven here exactly as the supervisor does), and an engine SIGKILLed mid-stream. Engines are stand-in
processes (tests/support_upstream.py); the lead adds the same scenarios against real engines."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from support_load import Load
from support_upstream import (
    Upstream,
    check_completion,
    check_stream,
    expected_text,
    parse_sse,
    running_proxy,
    stream_error,
)

pytestmark = pytest.mark.timeout(90)

CLIENTS = 32  # half of them streaming
SWITCH_AT = 1.0  # seconds into the load
NEW_ENGINE_START = 0.5  # seconds the "new engine" takes to come up after the old one stopped
AFTER_SWITCH = 1.5  # clients keep sending this long after the release (hard stop: 60 s, the load's max_seconds)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def switch_request(i: int, n: int) -> tuple[str, dict]:
    """Client ``i``'s requests: half streamed, half chat, each of its own length, some with live timings."""
    chat, tokens = i % 4 in (0, 1), 4 + i % 13
    payload = {"max_tokens": tokens, "stream": i % 2 == 0, "timings_per_token": i % 3 == 0}
    payload.update({"messages": [{"role": "user", "content": f"c{i}"}]} if chat else {"prompt": f"client {i}"})
    return ("/v1/chat/completions" if chat else "/v1/completions"), payload


def served_by(payload: dict, text: str) -> str:
    """The stand-in that answered a complete, well-formed answer of the asked length."""
    chat = "messages" in payload
    if payload["stream"]:
        return check_stream(parse_sse(text), payload["max_tokens"], chat=chat)
    return check_completion(json.loads(text), payload["max_tokens"], chat=chat)


def test_no_request_lost_during_a_forced_switch_under_load(record_property):
    old = Upstream.start("OLD", token_delay=0.002, acceptance=0.9)
    new = Upstream.start("NEW", token_delay=0.002, acceptance=0.3)
    timings = []
    try:

        async def body():
            async with (
                running_proxy(
                    old.url,
                    queue_size=256,
                    queue_timeout=20,
                    drain_timeout=10,
                    on_timings=lambda n, a: timings.append((n, a)),
                ) as proxy,
                aiohttp.ClientSession() as s,
            ):
                load = Load(
                    proxy.url,
                    clients=CLIENTS,
                    request_timeout=30,
                    max_seconds=60,
                    request=switch_request,
                    check=served_by,
                ).start()
                try:
                    await asyncio.sleep(SWITCH_AT)
                    proxy.hold()
                    drained = await proxy.drain()
                    old_stats = await old.astats(s)
                    await asyncio.to_thread(old.stop)
                    await asyncio.sleep(NEW_ENGINE_START)  # the new engine is "starting"
                    deadline = asyncio.get_running_loop().time() + 5
                    while proxy.stats()["queue_depth"] < CLIENTS and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.01)  # (on a loaded machine clients may lag)
                    depth = proxy.stats()["queue_depth"]
                    proxy.release(new.url)
                    await asyncio.sleep(AFTER_SWITCH)
                finally:
                    await asyncio.to_thread(load.stop)
                return load, drained, old_stats, depth, proxy.stats()

        load, drained, old_stats, depth, st = run(body())
    finally:
        old.stop()
        new.stop()

    report = (
        f"{load.report()}; drain: {drained.finished} finished / {drained.cut} cut in {drained.waited_s:.3f}s; "
        f"waited={st['waited']} (queue depth at release {depth}), longest wait={st['longest_wait_s']:.3f}s, "
        f"retried={st['retried']}"
    )
    print("\n" + report)
    record_property("switch_report", report)
    assert load.lost == 0 and load.counts["stream_error"] == 0, load.failures[:5] + load.stream_errors[:5]
    assert load.labels["OLD"] > 0 and load.labels["NEW"] > 0 and sum(load.labels.values()) == load.ok
    assert drained.cut == 0 and drained.finished == drained.in_flight > 0
    assert old_stats["cancelled"] == 0 and old_stats["active"] == 0  # nothing was cut on the old engine
    assert st["waited"] >= CLIENTS and depth == CLIENTS  # every client waited once
    assert NEW_ENGINE_START <= st["longest_wait_s"] < NEW_ENGINE_START + 5
    assert st["upstream_errors"] == 0 and st["broken_streams"] == 0 and st["cut_streams"] == 0
    assert st["in_flight"] == 0 and st["queue_depth"] == 0
    assert sum(n for n, _ in timings) > 0  # live acceptance flowed throughout


@pytest.mark.parametrize("supervisor_notices", [False, True], ids=["proxy-detects", "supervisor-reports"])
def test_engine_sigkilled_mid_stream(supervisor_notices):
    doomed = Upstream.start("DOOMED", token_delay=0.05)
    rescue = None
    try:

        async def body():
            nonlocal rescue
            async with (
                running_proxy(doomed.url, queue_timeout=20, recover_interval=30) as proxy,
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
                ) as s,
            ):
                got_token = [asyncio.Event() for _ in range(4)]

                async def streaming(i):
                    text = b""
                    async with s.post(
                        proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": 60, "stream": True}
                    ) as r:
                        async for piece in r.content.iter_any():
                            text += piece
                            if b'"text"' in text:
                                got_token[i].set()
                        return r.status, text.decode()

                async def plain(n):
                    async with s.post(proxy.url + "/v1/completions", json={"prompt": "p", "max_tokens": n}) as r:
                        return r.status, await r.json()

                streams = [asyncio.ensure_future(streaming(i)) for i in range(4)]
                in_flight_plain = [asyncio.ensure_future(plain(30)) for _ in range(4)]  # 1.5 s, no byte yet
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in got_token)), 10)
                assert proxy.stats()["in_flight"] == 8
                doomed.kill()  # SIGKILL, mid-stream
                if supervisor_notices:
                    proxy.upstream_failed("engine exited with signal 9")
                late_plain = [asyncio.ensure_future(plain(5)) for _ in range(4)]  # arrive after the death
                t0 = time.monotonic()
                while proxy.state == "serving" and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.01)
                assert proxy.state == "down"
                rescue = await asyncio.to_thread(Upstream.start, "RESCUE")  # the supervisor restarts it
                proxy.release(rescue.url)
                return (
                    await asyncio.gather(*streams),
                    await asyncio.gather(*in_flight_plain),
                    await asyncio.gather(*late_plain),
                    proxy.stats(),
                )

        streamed, in_flight, late, st = run(body())
    finally:
        doomed.stop()
        if rescue is not None:
            rescue.stop()

    for status, text in streamed:  # each went on on the restarted engine (tests/test_stream_continuation.py)
        events = parse_sse(text)
        assert status == 200 and events[-1] == "[DONE]" and stream_error(events) is None, events[-2:]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text(60)
        assert events[0]["system_fingerprint"] == "DOOMED" and events[-2]["system_fingerprint"] == "RESCUE"
    for status, doc in in_flight + late:
        assert status == 200 and check_completion(doc, doc["usage"]["completion_tokens"]) == "RESCUE"
    # the 4 in-flight ones were retried; the late ones were retried too if they reached the dead engine
    # before the proxy knew, else they simply waited in the queue
    assert 4 <= st["retried"] <= 8 and st["retried_ok"] == st["retried"] and st["upstream_errors"] == 0
    assert st["waited"] >= 4
    assert st["broken_streams"] + st["cut_streams"] == 0 and st["continued_streams"] == 4
