"""An answer survives the death of its engine (issue 40 item 3): a stream the client has started reading, whose
engine dies, goes on from the text already sent on a live engine (the restarted one, a twin) and ends with [DONE];
where that is unsound it ends with an error event, counted by reason (specops/proxy/resume.py).

The engines are stand-in processes (tests/support_upstream.py): ``X-Test-Exit-After: NAME:N`` makes the one named
NAME exit after N tokens, as a SIGKILLed engine does; each continues its own text as a real engine would."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from support_upstream import Upstream, expected_text, parse_sse, running_proxy, stream_error

pytestmark = pytest.mark.timeout(90)

TOKENS = 12
DIES_AT = 4


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(chat: bool, **extra) -> tuple[str, dict]:
    payload = {"max_tokens": TOKENS, "stream": True, **extra}
    if chat:
        return "/v1/chat/completions", dict(payload, messages=[{"role": "user", "content": "count for me"}])
    return "/v1/completions", dict(payload, prompt="count for me")


def answer(events: list, chat: bool) -> str:
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    if chat:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return "".join(c["choices"][0]["text"] for c in chunks)


async def wait_until(pred, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def stream_through(proxy, path: str, payload: dict, headers: dict) -> str:
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=payload, headers=headers) as r:
        assert r.status == 200
        return await r.text()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("live_timings", [False, True], ids=["events-counted", "engine-counted"])
def test_a_stream_whose_engine_dies_goes_on_on_the_restarted_engine(chat, live_timings):
    """The engine dies mid-stream, the supervisor's restart comes up on another address: the client's stream reads
    as one answer (its text, id, model; usage counts the whole answer and the original prompt), ending in [DONE]."""
    doomed = Upstream.start("A", token_delay=0.02)
    rescue = None
    try:

        async def body():
            nonlocal rescue
            on_timings = (lambda n, a: None) if live_timings else None
            async with running_proxy(doomed.url, queue_timeout=30, recover_interval=60, on_timings=on_timings) as proxy:
                path, payload = request(chat, stream_options={"include_usage": True})
                client = asyncio.ensure_future(
                    stream_through(proxy, path, payload, {"X-Test-Exit-After": f"A:{DIES_AT}"})
                )
                await wait_until(lambda: proxy.state == "down" or client.done(), "the proxy to see the engine die")
                rescue = await asyncio.to_thread(Upstream.start, "B", token_delay=0.001)
                proxy.release(rescue.url)
                return await client, proxy.stats()

        text, st = run(body())
    finally:
        doomed.stop()
        if rescue is not None:
            rescue.stop()
    events = parse_sse(text)
    assert stream_error(events) is None and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    assert answer(events, chat) == expected_text(TOKENS)
    chunks = [e for e in events[:-1]]
    assert [c["system_fingerprint"] for c in chunks].count("A") >= DIES_AT  # it began on A ...
    assert chunks[-1]["system_fingerprint"] == "B"  # ... and ended on B, as one stream:
    assert len({c["id"] for c in chunks}) == 1 and len({c["model"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0].get("delta", {})]
    assert len(roles) == chat  # chat's opening role chunk once, the continuation's dropped
    [usage] = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["completion_tokens"] == TOKENS and usage["prompt_tokens"] == len("count for me".split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + TOKENS
    assert (st["continued_streams"], st["broken_streams"]) == (1, 0)
    # one continuation, or two when the first reached the dead engine before its port closed
    assert 1 <= st["stream_continuations"] <= 2


def test_a_stream_cut_by_a_drain_goes_on_on_the_next_engine():
    """A switch's drain timeout cuts a long stream: it is continued on the engine released after the switch."""

    async def body():
        with Upstream.start("OLD", token_delay=0.03) as old, Upstream.start("NEW") as new:
            async with running_proxy(old.url) as proxy:
                path, payload = request(chat=False)
                client = asyncio.ensure_future(stream_through(proxy, path, payload, {}))
                await wait_until(lambda: proxy.stats()["in_flight"] == 1, "the stream")
                await asyncio.sleep(0.15)
                proxy.hold()
                result = await proxy.drain(0.01)
                proxy.release(new.url)
                return result, await client, proxy.stats()

    result, text, st = run(body())
    events = parse_sse(text)
    assert result.cut_streams == 1
    assert events[-1] == "[DONE]" and stream_error(events) is None and answer(events, False) == expected_text(TOKENS)
    assert {e["system_fingerprint"] for e in events[:-1]} == {"OLD", "NEW"}
    assert (st["continued_streams"], st["cut_streams"]) == (1, 0)


@pytest.mark.parametrize(
    "option, says",
    [
        ({"n": 2}, "the request asks for n=2"),
        ({"logprobs": 2}, "the request asks for logprobs"),
        ({"response_format": {"type": "json_object"}}, "the request constrains the output (response_format)"),
    ],
    ids=["n", "logprobs", "json"],
)
def test_a_stream_that_cannot_be_continued_soundly_ends_with_an_error_event(option, says):
    """Options that make a continuation unsound: the stream ends with an OpenAI-style error event (no [DONE]),
    counted as uncontinued for its options; the engine is not asked."""
    doomed = Upstream.start("A", token_delay=0.02)
    try:
        with Upstream.start("B") as spare:

            async def body():
                async with running_proxy(doomed.url, queue_timeout=30, recover_interval=60) as proxy:
                    proxy_task = asyncio.ensure_future(
                        stream_through(proxy, *request(False, **option), {"X-Test-Exit-After": f"A:{DIES_AT}"})
                    )
                    await wait_until(lambda: proxy.state == "down" or proxy_task.done(), "the engine to die")
                    proxy.release(spare.url)
                    return await proxy_task, proxy.stats()

            text, st = run(body())
            assert spare.stats()["started"] == 0
    finally:
        doomed.stop()
    events = parse_sse(text)
    err = stream_error(events)
    assert err is not None and "[DONE]" not in events, events[-2:]
    assert err["type"] == "specops_stream_broken" and err["message"].endswith("not continued: " + says), err
    assert answer(events, False) == expected_text(DIES_AT)
    assert (st["uncontinued_options"], st["broken_streams"], st["continued_streams"]) == (1, 1, 0)


def test_no_live_engine_within_the_queue_timeout_ends_the_stream_with_an_error_event():
    doomed = Upstream.start("A", token_delay=0.02)
    try:

        async def body():
            async with running_proxy(doomed.url, queue_timeout=0.5, recover_interval=60) as proxy:
                path, payload = request(chat=True)
                text = await stream_through(proxy, path, payload, {"X-Test-Exit-After": f"A:{DIES_AT}"})
                return text, proxy.stats(), proxy.metrics_text().decode()

        text, st, metrics = run(body())
    finally:
        doomed.stop()
    events = parse_sse(text)
    err = stream_error(events)
    assert err is not None and "not continued" in err["message"] and "queue timeout" in err["message"], events[-2:]
    assert st["uncontinued_no_engine"] == 1 and 1 <= st["stream_continuations"] <= 2
    assert 'specops_proxy_uncontinued_streams_total{reason="no_engine"} 1.0' in metrics


def test_a_stream_whose_speculating_engine_dies_goes_on_on_its_twin(tmp_path):
    """`specops up` with a `none` twin (the stand-in engines): the speculating primary dies mid-stream; the stream
    goes on at once on the twin, and the primary is restarted by its supervisor."""
    from support_ports import free_port
    from support_procs import stop_group
    from support_up import standin_up, write_profile

    state_dir, port = tmp_path / "state", free_port()
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    profile = write_profile(
        tmp_path / "twins.yaml",
        {
            "name": "twins",
            "backend": "llamacpp",
            "model": {"id": str(tmp_path / "target.gguf")},
            "speculative": {"method": "ngram"},
            "gpus": {"devices": []},
            "server": {"port": port},
            "fallback": {"enabled": False, "chain": ["none"]},
            "monitor": {"interval": 0.1, "timeout": 1},
            "supervisor": {"state_dir": str(state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
            "routing": {"twins": ["none"]},
        },
    )

    def state() -> dict:
        try:
            return json.loads((state_dir / "twins" / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    async def body():
        await wait_until(
            lambda: len(state().get("engines", [])) == 2 and all(e["live"] for e in state()["engines"]),
            "two engines",
            timeout=60,
        )
        async with aiohttp.ClientSession() as s:
            path, payload = request(chat=True, x_token_delay=0.02)
            headers = {"X-Specops-Speculation": "on", "X-Test-Exit-After": f"ngram:{DIES_AT}"}
            async with s.post(f"http://127.0.0.1:{port}{path}", json=payload, headers=headers) as r:
                text = await r.text()
            async with s.get(f"http://127.0.0.1:{port}/specops/status") as r:
                return text, await r.json()

    proc = standin_up(tmp_path, profile, "support_standin.py")
    try:
        text, status = run(body(), timeout=80)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        finally:
            stop_group(proc, timeout=5)
    events = parse_sse(text)
    assert events[-1] == "[DONE]" and stream_error(events) is None, events[-3:]
    assert answer(events, True) == expected_text(TOKENS)
    assert {e["system_fingerprint"] for e in events[:-1]} == {"ngram", "none"}
    assert status["proxy"]["continued_streams"] == 1
