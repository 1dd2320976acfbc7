"""A small OpenAI-compatible engine stand-in that runs as its own process, for proxy tests and benchmarks.

It speaks the protocol the way vLLM and llama-server do on the wire: ``/v1/completions`` and
``/v1/chat/completions`` with and without ``stream: true`` (SSE ``data: {...}\\n\\n`` ... ``data: [DONE]``,
chunked transfer), ``/v1/models``, ``/v1/embeddings``, ``/health``, ``/metrics`` (llama.cpp-style
speculative counters, updated when a request finishes), llama-server ``timings`` with ``draft_n`` /
``draft_n_accepted`` in every response and, with ``timings_per_token``, in every streamed chunk (running
totals). It notices client disconnects (the handler is cancelled, or a write fails) and counts them, so a
test can check that a disconnect reached the engine.

It continues a text as a real engine would: a completions prompt ending in the stand-in's own text
`` t0 t1 ... t{k-1}``, or a chat ending in an assistant message holding it with ``continue_final_message: true``,
is answered from `` t{k}`` on (:func:`continued_from`), so a stream continued on another engine reads as one.

Test-only controls, never sent by real clients:

- request headers ``X-Test-Token-Delay`` (seconds per token), ``X-Test-First-Delay`` (seconds before the
  first token), ``X-Test-Status`` (answer with this status and an OpenAI error body),
  ``X-Test-Die-After`` (drop the connection abruptly after this many streamed tokens),
  ``X-Test-Exit-After: NAME:N`` (the stand-in named NAME exits at once, as a SIGKILLed engine does, after N
  streamed tokens: every connection it holds breaks; any other stand-in ignores it, so a continuation sent
  elsewhere carries the header harmlessly),
  ``X-Test-Close-After`` (close the keep-alive connection this many seconds after answering, without a
  ``Connection: close`` header, as llama-server does after a stream and any server does at its keep-alive
  timeout);
- ``/debug/stats`` (JSON counters), ``/debug/echo`` (echoes method, path, query, headers and body);
- every response carries ``X-Upstream-Name`` and every JSON body / chunk ``system_fingerprint`` = name.

Run: ``python tests/support_upstream.py --port 0 --name A --token-delay 0.001 --acceptance 0.75``; it
prints ``LISTENING <port>`` once it accepts connections. From tests, use :class:`Upstream`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support_procs import stop_group

HERE = Path(__file__).resolve().parent


def expected_text(n: int, start: int = 0) -> str:
    """The text the stand-in generates for ``max_tokens=n`` (the same for completions and chat), from token
    ``start`` on (a continuation: :func:`continued_from`)."""
    return "".join(f" t{i}" for i in range(start, start + n))


_OWN_TEXT = re.compile(r"(?: t\d+)+$")


def continued_from(body: dict, chat: bool) -> int:
    """Where a request continues the stand-in's own text: ``k`` when the prompt (or, with
    ``continue_final_message``, the last assistant message) ends in ``expected_text(k)``, else 0."""
    if chat:
        last = body["messages"][-1]
        if not (
            body.get("continue_final_message") is True and isinstance(last, dict) and last.get("role") == "assistant"
        ):
            return 0
        text = last.get("content")
    else:
        prompt = body.get("prompt")
        text = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
    m = _OWN_TEXT.search(text) if isinstance(text, str) else None
    if m is None:
        return 0
    k = m.group(0).count(" t")
    return k if m.group(0) == expected_text(k) else 0


# --------------------------------------------------------------------------------------------- server side


def build_app(name: str, token_delay: float, acceptance: float | None, draft_per_token: int, model: str):
    from aiohttp import web

    stats = {
        "started": 0,
        "finished": 0,
        "cancelled": 0,
        "active": 0,
        "by_path": {},
        "draft_n": 0,
        "draft_n_accepted": 0,
        "died": 0,
        "closed_after": 0,
    }
    created = int(time.time())

    def delays(request, body):
        h = request.headers
        td = float(h.get("X-Test-Token-Delay", body.get("x_token_delay", token_delay)))
        fd = float(h.get("X-Test-First-Delay", "0"))
        die = h.get("X-Test-Die-After")
        exit_name, _, exit_after = h.get("X-Test-Exit-After", "").rpartition(":")
        exits = int(exit_after) if exit_name == name else None
        return td, fd, (int(die) if die is not None else None), exits

    def timings(n_prompt: int, n: int, elapsed: float) -> dict:
        t = {
            "cache_n": 0,
            "prompt_n": n_prompt,
            "prompt_ms": 0.1,
            "prompt_per_token_ms": 0.1,
            "prompt_per_second": 10000.0,
            "predicted_n": n,
            "predicted_ms": round(elapsed * 1000, 3),
            "predicted_per_token_ms": round(elapsed * 1000 / max(n, 1), 3),
            "predicted_per_second": round(n / elapsed, 3) if elapsed > 0 else 0.0,
        }
        if acceptance is not None and n > 0:
            dn = n * draft_per_token
            t["draft_n"] = dn
            t["draft_n_accepted"] = int(dn * acceptance)
        return t

    def error(status: int, message: str):
        return web.json_response(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}},
            status=status,
            headers={"X-Upstream-Name": name},
        )

    async def generate(request, chat: bool):
        stats["started"] += 1
        stats["active"] += 1
        path = request.path
        stats["by_path"][path] = stats["by_path"].get(path, 0) + 1
        finished = False
        try:
            try:
                body = await request.json()
            except ValueError:
                return error(400, "body is not JSON")
            if "X-Test-Status" in request.headers:
                return error(int(request.headers["X-Test-Status"]), "requested test status")
            if chat:
                if not isinstance(body.get("messages"), list) or not body["messages"]:
                    return error(400, "messages must be a non-empty list")
                n_prompt = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
            else:
                if "prompt" not in body:
                    return error(400, "prompt is required")
                n_prompt = len(str(body["prompt"]).split())
            n = int(body.get("max_tokens", 16))
            start = continued_from(body, chat)
            td, fd, die, exits = delays(request, body)
            stream = bool(body.get("stream"))
            per_token = bool(body.get("timings_per_token"))
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{name}-{stats['started']}"
            obj = "chat.completion" if chat else "text_completion"
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
            t0 = time.perf_counter()
            if not stream:
                if fd:
                    await asyncio.sleep(fd)
                if td:
                    for _ in range(n):  # token by token, so a disconnect cancels mid-generation
                        await asyncio.sleep(td)
                text = expected_text(n, start)
                choice = (
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                    if chat
                    else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                )
                out = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": body.get("model", model),
                    "system_fingerprint": name,
                    "choices": [choice],
                    "usage": usage,
                    "timings": timings(n_prompt, n, time.perf_counter() - t0),
                }
                finished = True
                return web.json_response(out, headers={"X-Upstream-Name": name})

            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                    "X-Upstream-Name": name,
                }
            )
            await resp.prepare(request)
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(piece: str | None, finish: str | None, i: int, role: bool = False) -> bytes:
                if chat:
                    delta = (
                        {"role": "assistant", "content": ""}
                        if role
                        else ({"content": piece} if piece is not None else {})
                    )
                    ch = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                else:
                    ch = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
                d = {
                    "id": rid,
                    "object": chunk_obj,
                    "created": created,
                    "model": body.get("model", model),
                    "system_fingerprint": name,
                    "choices": [ch],
                }
                if finish is not None:
                    d["usage"] = usage
                if finish is not None or (per_token and i > 0):
                    d["timings"] = timings(n_prompt, i, time.perf_counter() - t0)
                return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

            try:
                if fd:
                    await asyncio.sleep(fd)
                if chat:
                    await resp.write(chunk(None, None, 0, role=True))
                for i in range(n):
                    if td:
                        await asyncio.sleep(td)
                    if die is not None and i >= die:
                        stats["died"] += 1
                        request.transport.abort()  # crash mid-stream: no terminating chunk
                        return resp
                    if exits is not None and i >= exits:
                        os._exit(1)  # the engine dies: every stream it serves breaks at once
                    await resp.write(chunk(f" t{start + i}", None, i + 1))
                await resp.write(chunk(None, "length", n))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionResetError:  # the client went away between two tokens
                stats["cancelled"] += 1
                raise
            finished = True
            return resp
        except asyncio.CancelledError:
            stats["cancelled"] += 1
            raise
        finally:
            stats["active"] -= 1
            if finished:
                stats["finished"] += 1
                if acceptance is not None:
                    dn = n * draft_per_token
                    stats["draft_n"] += dn
                    stats["draft_n_accepted"] += int(dn * acceptance)

    async def completions(request):
        return await generate(request, chat=False)

    async def chat(request):
        return await generate(request, chat=True)

    async def models(request):
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": created, "owned_by": "specops-tests"}],
            },
            headers={"X-Upstream-Name": name},
        )

    async def embeddings(request):
        body = await request.json()
        inputs = body.get("input", "")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(str(x))), 0.5, -0.25]}
            for i, x in enumerate(inputs)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)},
            },
            headers={"X-Upstream-Name": name},
        )

    async def health(request):
        return web.json_response({"status": "ok"}, headers={"X-Upstream-Name": name})

    async def metrics(request):
        lines = []
        for key, metric in (("draft_n", "num_draft_tokens"), ("draft_n_accepted", "num_accepted_tokens")):
            full = f"llamacpp:spec_decode_{metric}_total"
            lines += [f"# HELP {full} test counter", f"# TYPE {full} counter", f"{full} {stats[key]}"]
        lines += [
            "# HELP llamacpp:requests_processing test gauge",
            "# TYPE llamacpp:requests_processing gauge",
            f"llamacpp:requests_processing {stats['active']}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", headers={"X-Upstream-Name": name})

    async def debug_stats(request):
        return web.json_response(dict(stats, name=name, pid=os.getpid()))

    async def echo(request):
        body = await request.read()
        out = {
            "method": request.method,
            "path": request.path,
            "raw_path": request.raw_path,
            "query": request.query_string,
            "headers": [[k, v] for k, v in request.headers.items()],
            "body": body.decode("utf-8", "replace"),
            "body_len": len(body),
        }
        resp = web.json_response(
            out, status=int(request.headers.get("X-Test-Echo-Status", "200")), headers={"X-Upstream-Name": name}
        )
        resp.headers.add("X-Multi", "one")
        resp.headers.add("X-Multi", "two")
        resp.headers["Connection"] = "keep-alive"  # hop-by-hop: the proxy must not forward it
        resp.set_cookie("upstream_cookie", "c1")
        return resp

    async def big(request):
        n = int(request.query.get("bytes", "2000000"))
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "X-Upstream-Name": name})
        resp.content_length = n
        await resp.prepare(request)
        block = b"x" * 65536
        left = n
        while left > 0:
            piece = block[: min(left, len(block))]
            await resp.write(piece)
            left -= len(piece)
        await resp.write_eof()
        return resp

    @web.middleware
    async def close_after(request, handler):
        delay = request.headers.get("X-Test-Close-After")
        resp = await handler(request)
        if delay is not None and request.transport is not None:
            transport = request.transport
            stats["closed_after"] += 1
            # close() flushes what is buffered first, so the answer itself still arrives whole
            asyncio.get_running_loop().call_later(max(0.0, float(delay)), transport.close)
        return resp

    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[close_after])
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/completion", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/stats", debug_stats)
    app.router.add_route("*", "/debug/echo", echo)
    app.router.add_route("*", "/debug/echo/{tail:.*}", echo)
    app.router.add_get("/debug/big", big)
    return app


async def serve(args) -> None:
    from aiohttp import web

    app = build_app(args.name, args.token_delay, args.acceptance, args.draft_per_token, args.model)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    print(f"LISTENING {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="upstream")
    p.add_argument("--model", default="tiny-test-model")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    p.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help="simulated draft acceptance (unset: no speculation, no draft_n in timings)",
    )
    p.add_argument("--draft-per-token", type=int, default=2, help="draft tokens proposed per generated token")
    asyncio.run(serve(p.parse_args(argv)))


# --------------------------------------------------------------------------------------------- test side


class Upstream:
    """One stand-in engine process. ``Upstream.start(...)`` returns once it accepts connections."""

    def __init__(self, proc: subprocess.Popen, port: int, name: str):
        self.proc = proc
        self.port = port
        self.name = name
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def start(
        cls,
        name: str = "upstream",
        *,
        token_delay: float = 0.0,
        acceptance: float | None = None,
        draft_per_token: int = 2,
        port: int = 0,
        timeout: float = 20.0,
    ) -> Upstream:
        argv = [
            sys.executable,
            str(HERE / "support_upstream.py"),
            "--port",
            str(port),
            "--name",
            name,
            "--token-delay",
            str(token_delay),
            "--draft-per-token",
            str(draft_per_token),
        ]
        if acceptance is not None:
            argv += ["--acceptance", str(acceptance)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = proc.stdout.readline()
            if not line or line.startswith("LISTENING"):
                break
        if not line.startswith("LISTENING"):
            stop_group(proc, 5)
            proc.stdout.close()
            raise RuntimeError(f"upstream {name} did not start within {timeout}s (exit {proc.poll()})")
        return cls(proc, int(line.split()[1]), name)

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/debug/stats", timeout=5) as r:
            return json.loads(r.read())

    async def astats(self, session) -> dict:
        async with session.get(self.url + "/debug/stats") as r:
            return await r.json()

    def kill(self) -> None:
        """SIGKILL: the engine dies at once, mid-whatever it was doing."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        stop_group(self.proc, timeout)  # SIGTERM its group, SIGKILL after ``timeout`` s; after a kill() too
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> Upstream:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------- proxy helpers


def parse_sse(text: str) -> list:
    """SSE body → list of events: parsed JSON objects, or the string ``"[DONE]"``. Raises on junk."""
    events = []
    assert text.endswith("\n\n"), f"stream does not end with a complete event: {text[-200:]!r}"
    for block in text.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if ln]
        assert lines and all(ln.startswith("data: ") for ln in lines), f"malformed SSE event {block!r}"
        data = "\n".join(ln[6:] for ln in lines)
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


def check_stream(events: list, n_tokens: int, chat: bool = False) -> str:
    """Assert a streamed completion is complete and well-formed; returns the upstream name."""
    assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {events[-2:]}"
    assert "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks
    if chat:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == expected_text(n_tokens), text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    names = {c["system_fingerprint"] for c in chunks}
    assert len(names) == 1, names
    return names.pop()


def check_completion(doc: dict, n_tokens: int, chat: bool = False) -> str:
    """Assert a non-streamed completion is complete and well-formed; returns the upstream name."""
    choice = doc["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert text == expected_text(n_tokens), text
    assert choice["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == n_tokens
    return doc["system_fingerprint"]


def stream_error(events: list) -> dict | None:
    """The explicit error event that ends a broken stream (and no [DONE] after it), or None."""
    if events and events[-1] != "[DONE]" and isinstance(events[-1], dict) and "error" in events[-1]:
        return events[-1]["error"]
    return None


class RawResponse:
    """What :func:`raw_http` read back: status, headers (lower-case names), body, and whether the server
    closed the connection after it (``closed``), or None for each when nothing came (``closed`` alone)."""

    def __init__(self, status: int | None, headers: dict, body: bytes, closed: bool, elapsed: float):
        self.status = status
        self.headers = headers
        self.body = body
        self.closed = closed
        self.elapsed = elapsed

    def json(self) -> dict:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"RawResponse({self.status}, {self.body[:200]!r}, closed={self.closed}, {self.elapsed:.2f}s)"


async def raw_http(
    port: int,
    data: bytes,
    *,
    timeout: float = 5.0,
    close_wait: float = 2.0,
    then: bytes | None = None,
    host: str = "127.0.0.1",
) -> RawResponse:
    """Send ``data`` byte for byte on a new loopback connection (so a test sends exactly the request line
    it means, hostile ones included) and read one response. ``then`` is written after the response, to
    see whether the connection is still usable. Bounded by ``timeout`` (to the response) + ``close_wait``.
    """
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        try:
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            return RawResponse(None, {}, b"", True, time.monotonic() - t0)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
        elapsed = time.monotonic() - t0
        if then is not None:
            try:
                writer.write(then)
                await writer.drain()
            except ConnectionError:
                pass
        try:
            rest = await asyncio.wait_for(reader.read(65536), close_wait)
            closed = rest == b""
        except asyncio.TimeoutError:
            closed = False
        except ConnectionError:
            closed = True
        return RawResponse(status, headers, body, closed, elapsed)
    finally:
        writer.close()


class Canary:
    """A loopback listener that counts the connections it gets: start one, point a hostile request at
    it, and check that nothing reached it. ``async with Canary() as c: ... c.port ... c.hits``"""

    def __init__(self):
        self.hits = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def __aenter__(self) -> Canary:
        def on_connect(reader, writer):
            self.hits += 1
            writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()


def running_proxy(upstream_url: str | None = None, **kw):
    """``async with running_proxy(url, queue_size=...) as proxy:`` a started Proxy on a free port."""
    import contextlib

    from specops.proxy import Proxy

    @contextlib.asynccontextmanager
    async def cm():
        opts = {"queue_size": 64, "queue_timeout": 10.0, "drain_timeout": 10.0}
        opts.update(kw)
        proxy = Proxy("127.0.0.1", 0, **opts)
        await proxy.start()
        if upstream_url:
            proxy.set_upstream(upstream_url)
        try:
            yield proxy
        finally:
            await proxy.stop()

    return cm()


if __name__ == "__main__":
    main()
