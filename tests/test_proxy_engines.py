"""The proxy in front of real llama-server processes (tiny GGUF models on CPU): a forced switch under load
of 32 clients, an engine SIGKILLed mid-stream, and a client disconnect reaching the engine. The switch is
driven exactly as the supervisor does (hold → drain → stop old → start new → release).

Marked ``engines``: needs ``specops engines setup llamacpp`` (skips cleanly otherwise).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import aiohttp
import pytest
from support_engines import need_llama_server, tiny_model
from support_load import Load
from support_ports import free_port
from support_procs import stop_group
from support_upstream import parse_sse, running_proxy, stream_error

pytestmark = [pytest.mark.engines, pytest.mark.timeout(180)]

CLIENTS = 32
SWITCH_AT = 1.5  # seconds into the load
AFTER_SWITCH = 2.0  # clients keep sending this long after the release (hard stop: 100 s, max_seconds)


class LlamaServer:
    """One llama-server process on a free loopback port, in its own process group."""

    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(need_llama_server()), *args, "--host", "127.0.0.1", "--port", str(self.port), "--metrics"],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                async with session.get(self.url + "/health", headers={"Connection": "close"}) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"llama-server not ready within {timeout}s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM the server's group (SIGKILL after 15 s); called in ``finally``, after a ``kill()`` too."""
        stop_group(self.proc, timeout=15)
        self.log.close()


def _check_completion(doc: dict, n: int) -> dict:
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == n, doc
    return doc.get("timings", {})


def _check_stream(text: str, n: int) -> dict:
    events = parse_sse(text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events[-3:]
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks[-2:]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == n, final
    return final.get("timings", {})


def _session(total: float = 60) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=total))


def switch_request(i: int, n: int) -> tuple[str, dict]:
    """Client ``i``'s requests: half streamed, each of its own fixed length, a quarter with timings per token."""
    payload = {
        "prompt": f"client {i} says",
        "max_tokens": 8 + i % 17,
        "temperature": 0,
        "ignore_eos": True,
        "stream": i % 2 == 0,
        "timings_per_token": i % 4 == 0,
    }
    return "/v1/completions", payload


def speculated(payload: dict, text: str) -> str:
    """Whether the engine that gave this whole answer (of the asked length) drafted: read from its timings."""
    n = payload["max_tokens"]
    timings = _check_stream(text, n) if payload["stream"] else _check_completion(json.loads(text), n)
    return "speculative" if timings.get("draft_n") else "plain"


def test_real_engines_forced_switch_under_load_loses_no_request(tmp_path, record_property):
    target, draft = tiny_model("gguf-target.gguf"), tiny_model("gguf-draft-same.gguf")
    common = ["-m", str(target), "-c", "8192", "-np", "16"]
    live = [0, 0]

    def on_timings(n, a):
        live[0] += n
        live[1] += a

    async def body():
        old = LlamaServer(
            common + ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", "4"], tmp_path / "old.log"
        )
        new = None
        try:
            async with _session() as s:
                await old.ready(s)
                async with running_proxy(
                    old.url, queue_size=256, queue_timeout=60, drain_timeout=20, on_timings=on_timings
                ) as proxy:
                    load = Load(
                        proxy.url,
                        clients=CLIENTS,
                        request_timeout=60,
                        max_seconds=100,
                        request=switch_request,
                        check=speculated,
                    ).start()
                    try:
                        await asyncio.sleep(SWITCH_AT)
                        t0 = time.monotonic()
                        proxy.hold()
                        drained = await proxy.drain()
                        await asyncio.to_thread(old.stop)
                        new = LlamaServer(common + ["--spec-type", "none"], tmp_path / "new.log")
                        await new.ready(s)
                        proxy.release(new.url)
                        switch_s = time.monotonic() - t0
                        await asyncio.sleep(AFTER_SWITCH)
                    finally:
                        await asyncio.to_thread(load.stop)
                    return load, drained, switch_s, proxy.stats()
        finally:
            old.stop()
            if new is not None:
                new.stop()

    load, drained, switch_s, st = asyncio.run(asyncio.wait_for(body(), 150))
    report = (
        f"real llama-server: {load.report()}; switch took {switch_s:.2f}s (drain {drained.waited_s:.3f}s: "
        f"{drained.finished} finished, {drained.cut} cut); waited={st['waited']}, "
        f"longest wait={st['longest_wait_s']:.3f}s, retried={st['retried']}, reconnects={st['reconnects']}; "
        f"live timings {live[1]}/{live[0]} accepted"
    )
    print("\n" + report)
    record_property("switch_report", report)
    assert load.lost == 0 and load.counts["stream_error"] == 0, load.failures[:5] + load.stream_errors[:5]
    assert load.labels["speculative"] > 0 and load.labels["plain"] > 0
    assert drained.cut == 0
    assert st["waited"] >= CLIENTS and st["longest_wait_s"] > 0
    assert st["upstream_errors"] == 0 and st["broken_streams"] == 0 and st["cut_streams"] == 0
    assert st["retried"] == 0 and st["in_flight"] == 0 and st["queue_depth"] == 0
    assert live[0] > 0 and 0.5 < live[1] / live[0] <= 1.0  # same-weights draft: high acceptance


def test_real_engine_sigkilled_mid_stream(tmp_path):
    target = tiny_model("gguf-target.gguf")
    common = ["-m", str(target), "-c", "16384", "-np", "8"]

    async def body():
        doomed = LlamaServer(common, tmp_path / "doomed.log")
        rescue = None
        try:
            # a stream lives through the kill and the rescue's start: the test's own limit bounds it
            async with _session(total=110) as s:
                await doomed.ready(s)
                async with running_proxy(doomed.url, queue_timeout=60, recover_interval=30) as proxy:
                    first = [asyncio.Event() for _ in range(4)]

                    async def streaming(i):
                        text = b""
                        async with s.post(
                            proxy.url + "/v1/completions",
                            json={"prompt": f"stream {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True},
                        ) as r:
                            async for piece in r.content.iter_any():
                                text += piece
                                first[i].set()
                            return r.status, text.decode("utf-8", "replace")

                    async def plain(n):
                        async with s.post(
                            proxy.url + "/v1/completions", json={"prompt": "plain", "max_tokens": n, "ignore_eos": True}
                        ) as r:
                            return r.status, n, await r.json()

                    streams = [asyncio.ensure_future(streaming(i)) for i in range(4)]
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 30)
                    started = [asyncio.ensure_future(plain(600)) for _ in range(4)]  # no byte until the end
                    await asyncio.sleep(0.1)
                    assert proxy.stats()["in_flight"] == 8
                    doomed.kill()
                    late = [asyncio.ensure_future(plain(20)) for _ in range(4)]
                    t0 = time.monotonic()
                    while proxy.state == "serving" and time.monotonic() - t0 < 10:
                        await asyncio.sleep(0.01)
                    rescue = LlamaServer(common, tmp_path / "rescue.log")  # what the supervisor does
                    await rescue.ready(s)
                    proxy.release(rescue.url)
                    return (await asyncio.gather(*streams), await asyncio.gather(*started, *late), proxy.stats())
        finally:
            doomed.stop()
            if rescue is not None:
                rescue.stop()

    streamed, plain, st = asyncio.run(asyncio.wait_for(body(), 120))
    for status, text in streamed:  # each went on on the rescue engine from the text it had sent
        events = parse_sse(text)
        assert status == 200 and stream_error(events) is None and events[-1] == "[DONE]", events[-2:]
        assert len({e["id"] for e in events[:-1]}) == 1
    for status, n, doc in plain:
        assert status == 200 and _check_completion(doc, n) is not None
    assert st["retried"] >= 4 and st["retried_ok"] == st["retried"] and st["upstream_errors"] == 0
    assert (st["broken_streams"], st["continued_streams"]) == (0, 4)


def test_real_engine_sees_the_client_disconnect(tmp_path):
    target = tiny_model("gguf-target.gguf")

    async def body():
        eng = LlamaServer(["-m", str(target), "-c", "2048", "-np", "1"], tmp_path / "engine.log")
        try:
            async with _session() as s:
                await eng.ready(s)
                async with running_proxy(eng.url) as proxy:
                    got = asyncio.Event()

                    async def call():
                        async with s.post(
                            proxy.url + "/v1/completions",
                            json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True},
                        ) as r:
                            async for _ in r.content.iter_any():
                                got.set()

                    task = asyncio.ensure_future(call())
                    await asyncio.wait_for(got.wait(), 30)
                    task.cancel()
                    t0 = time.monotonic()
                    # one slot: the next request runs only once the engine dropped the abandoned one
                    async with s.post(eng.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}) as r:
                        assert r.status == 200
                    waited = time.monotonic() - t0
                    return waited, proxy.stats()
        finally:
            eng.stop()

    waited, st = asyncio.run(asyncio.wait_for(body(), 90))
    # 2000 tokens left would take the tiny engine many seconds; dropping them takes well under one, 3 s beside
    # other tests on 2 cores
    assert waited < 3.0, f"the engine kept generating for {waited:.2f}s after the client left"
    assert st["client_disconnects"] == 1


def test_real_llama_server_reports_acceptance_per_chunk_when_the_proxy_asks(tmp_path):
    # the client does not ask for timings_per_token; the proxy (reading timings) does, so the acceptance of a
    # streamed request reaches on_timings chunk by chunk, not once when the request ends
    target, draft = tiny_model("gguf-target.gguf"), tiny_model("gguf-draft-same.gguf")
    args = ["-m", str(target), "-c", "2048", "-np", "1", "-md", str(draft), "--spec-type", "draft-simple"]
    calls: list[tuple[int, int]] = []

    async def body():
        server = LlamaServer([*args, "--spec-draft-n-max", "4"], tmp_path / "llama.log")
        try:
            async with _session() as s:
                await server.ready(s)
                async with running_proxy(server.url, on_timings=lambda n, a: calls.append((n, a))) as proxy:
                    payload = {"prompt": "the", "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True}
                    async with s.post(proxy.url + "/v1/completions", json=payload) as r:
                        assert r.status == 200
                        return await r.text()
        finally:
            server.stop()

    text = asyncio.run(asyncio.wait_for(body(), 120))
    final, events = _check_stream(text, 32), parse_sse(text)
    with_timings = [e for e in events[:-1] if "timings" in e]
    assert len(with_timings) > 1 and len(calls) > 1, (len(with_timings), calls)
    assert sum(n for n, _ in calls) == final["draft_n"] > 0
    assert sum(a for _, a in calls) == final["draft_n_accepted"]
