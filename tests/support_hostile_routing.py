"""`specops up` with a routing profile as the round-three review attacked it, and the raw loopback requests that
attack it (tests/test_security_round3_routing.py, benchmarks/bench_hostile_routing.py).

The profile: the stand-in engine (support_standin.py) with ngram as the primary and a `none` twin, an API key,
learned classes keyed on `X-Task`, one system-prompt rule (:data:`RULE`), `client_choice: forbid`, and a fallback
that moves the default route to the twin once the primary has drafted a little (the stand-in's ngram accepts 0.2).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support_ports import free_port
from support_procs import stop_group
from support_up import write_profile

HERE = Path(__file__).resolve().parent
KEY_VAR = "ROUND3_ROUTING_KEY"
KEY = "sk-round3-routing-5d27a9"
AUTH = f"Authorization: Bearer {KEY}\r\n"
#: the rule of the review: a backtracking engine takes the square of the text's length on a prompt that repeats
#: its opening without ever closing it
RULE = "You are a (.*) assistant"


def system_body(size: int) -> bytes:
    """A chat request whose system prompt repeats the rule's opening, ``size`` bytes in all."""
    text = "You are a " * (size // 10)
    return json.dumps({"messages": [{"role": "system", "content": text}], "max_tokens": 2}).encode()


def raw_request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def read_answer(reader: asyncio.StreamReader, timeout: float) -> tuple[int, dict, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ":" in ln)}
    n = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
    return int(lines[0].split()[1]), headers, body


async def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await read_answer(reader, timeout)
    finally:
        writer.close()


async def bystander_ms(port: int, timeout: float = 5.0) -> float:
    """How long another client's ``GET /health`` takes, in ms (a timeout counts as infinite)."""
    t0 = time.perf_counter()
    try:
        status, _, _ = await exchange(port, raw_request("GET", "/health", headers="Connection: close\r\n"), timeout)
    except asyncio.TimeoutError:
        return float("inf")
    assert status == 200
    return (time.perf_counter() - t0) * 1000


async def attacked(port: int, attack: bytes, timeout: float = 5.0) -> tuple[float, int | None]:
    """A bystander's /health wait (ms) while ``attack`` is being handled, and the attack's status (None when it
    got no answer within ``timeout`` seconds; the bystander's wait is infinite past them)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(attack)
        await writer.drain()
        await asyncio.sleep(0.02)  # the proxy has the request: it reads it now
        waited = await bystander_ms(port, timeout)
        try:
            status = (await read_answer(reader, timeout))[0]
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            status = None
        return waited, status
    finally:
        writer.close()


def chat(port: int, task: str, system: str = "be brief") -> tuple[int, str]:
    """An authenticated chat request of class ``task``: (status, the engine that answered)."""
    body = json.dumps({"messages": [{"role": "system", "content": system}], "max_tokens": 20}).encode()
    status, headers, _ = asyncio.run(
        exchange(port, raw_request("POST", "/v1/chat/completions", body, AUTH + f"X-Task: {task}\r\n"))
    )
    return status, headers.get("x-upstream-name", "")


def get_text(port: int, path: str) -> str:
    status, _, body = asyncio.run(exchange(port, raw_request("GET", path, headers=AUTH + "Connection: close\r\n")))
    assert status == 200, body[:300]
    return body.decode()


class HostileUp:
    """One `specops up` of the attacked profile, its port and state."""

    def __init__(self, tmp: Path):
        self.tmp, self.port, self.state_dir = tmp, free_port(), tmp / "state"
        (tmp / "target.gguf").write_bytes(b"GGUF")  # the stand-in reads no weights; the launch check wants a file
        self.profile = write_profile(
            tmp / "r3.yaml",
            {
                "name": "r3",
                "backend": "llamacpp",
                "model": {"id": str(tmp / "target.gguf")},
                "speculative": {"method": "ngram"},
                "gpus": {"devices": []},
                "server": {"port": self.port, "api_key": "${" + KEY_VAR + "}"},
                # the stand-in's ngram accepts 0.2: the primary falls back to the none twin by a route change
                "fallback": {"chain": ["none"], "window": "1s", "min_draft_tokens": 20, "consecutive_windows": 1},
                "monitor": {"interval": 0.1, "timeout": 1},
                "supervisor": {"state_dir": str(self.state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
                "routing": {
                    "twins": ["none"],
                    "client_choice": "forbid",
                    "rules": [{"match": {"system": RULE}, "speculation": "off"}],
                    "classes": {"key": "header", "header": "X-Task", "min_draft_tokens": 20, "explore": 0},
                },
            },
        )
        self.env = {**os.environ, KEY_VAR: KEY}
        self.log = open(tmp / "up.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "support_standin.py"), "up", str(self.profile)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def state(self) -> dict:
        try:
            return json.loads((self.state_dir / "r3" / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def wait(self, pred, what: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if pred(st):
                return st
            assert self.proc.poll() is None, (self.tmp / "up.log").read_text()[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {self.state()}")

    def classes(self) -> list[str]:
        doc = json.loads(get_text(self.port, "/specops/status"))
        return [row["class"] for row in doc["routing"]["classes"]]

    def stop(self) -> None:
        try:
            stop_group(self.proc, timeout=15)  # SIGTERM: specops up stops its engines too
        finally:
            self.log.close()
