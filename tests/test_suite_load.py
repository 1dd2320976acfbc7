"""The suite's one load generator (tests/support_load.py) counts every way a request can end, against a tiny
loopback server that answers each path in one way: a request the generator cannot count would end a client
silently (the old ``Clients``/``Traffic`` threads died on a refused connection or a 200 that is not JSON,
and the test passed on the requests that were left)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from support_load import LOST, Load, classify
from support_ports import free_port

pytestmark = pytest.mark.timeout(60)

GOOD = json.dumps({"choices": [{"text": " over the lazy dog"}]})


def _http(status: str, body: str, content_type: str = "application/json") -> bytes:
    data = body.encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + data


class Loopback:
    """A loopback HTTP server; the first path segment says how it answers (see :meth:`_answer`)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                conn.close()
                return
            data += chunk
        mode = data.split(b" ", 2)[1].decode().split("/")[1]
        if mode == "hang":  # never answers: the client's timeout ends it
            self._held.append(conn)
            return
        if mode == "reset":  # read the request, then close without a byte of answer
            conn.close()
            return
        conn.sendall(
            {
                "ok": _http("200 OK", GOOD),
                "error": _http("503 Service Unavailable", '{"error": "busy"}'),
                "notjson": _http("200 OK", "<html>upstream sent a page</html>", "text/html"),
                "nochoices": _http("200 OK", '{"object": "text_completion"}'),
                "stream": _http(
                    "200 OK", 'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n', "text/event-stream"
                ),
                "cutstream": _http("200 OK", 'data: {"choices": [{"text": "a"}]}\n\n', "text/event-stream"),
            }[mode]
        )
        conn.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture(scope="module")
def server():
    srv = Loopback()
    try:
        yield srv
    finally:
        srv.close()


def run_load(url: str, answers: int = 3, **kw) -> Load:
    kw = {"clients": 2, "stream": False, "request_timeout": 5, "max_seconds": 30, **kw}
    with Load(url, **kw) as load:
        load.wait_for_answers(answers, timeout=30)
    return load


@pytest.mark.parametrize(
    ("mode", "stream", "outcome"),
    [
        ("ok", False, "ok"),
        ("stream", True, "ok"),
        ("error", False, "http_error"),
        ("notjson", False, "malformed"),
        ("nochoices", False, "malformed"),
        ("cutstream", True, "malformed"),
        ("reset", False, "connection_error"),
    ],
)
def test_every_answer_is_counted_as_what_it_is(server, mode, stream, outcome):
    load = run_load(f"{server.url}/{mode}", stream=stream)
    assert load.counts[outcome] == load.total >= 3, load.report()
    assert load.lost == (0 if outcome == "ok" else load.total)
    if outcome != "ok":
        assert len(load.failures) == load.total and f": {outcome}: " in load.failures[0]


def test_a_refused_connection_is_counted_and_the_clients_go_on():
    load = run_load(f"http://127.0.0.1:{free_port()}", answers=6)  # nothing listens there
    assert load.counts["connection_error"] == load.total >= 6 and load.ok == 0
    assert set(load.by_client) == {0, 1}  # both clients still running after their first failure


def test_a_request_with_no_answer_ends_in_a_timeout(server):
    t0 = time.monotonic()
    load = run_load(f"{server.url}/hang", answers=2, request_timeout=0.5)
    assert load.counts["timeout"] == load.total >= 2 and load.lost == load.total
    assert time.monotonic() - t0 < 20


def test_round_robin_spreads_requests_and_a_snapshot_sums_the_lost(server):
    load = run_load([f"{server.url}/ok", f"{server.url}/notjson"], answers=8, clients=1)
    snap = load.snapshot()
    assert snap["ok"] >= 4 and snap["malformed"] >= 4 and abs(snap["ok"] - snap["malformed"]) <= 1
    assert snap["lost"] == snap["malformed"] == load.lost
    assert "malformed=" in load.report() and "connection_error=" in load.report()


def test_classify_names_every_lost_outcome():
    assert classify(200, GOOD, False) == ("ok", "")
    assert classify(502, "bad gateway", False)[0] == "http_error"
    assert classify(200, "[1, 2]", False)[0] == "malformed"
    assert classify(200, '{"choices": ["x"]}', False)[0] == "malformed"
    assert classify(200, 'data: {"error": {"message": "engine died"}}\n\n', True) == ("stream_error", "engine died")
    assert set(LOST) == {"http_error", "connection_error", "timeout", "malformed"}


def test_a_tests_own_requests_and_its_check_of_each_answer(server):
    """``request`` makes each request (path, body; its ``stream`` says how the answer is read), ``check`` labels
    each complete answer, and an answer it refuses is a lost one (``malformed``), said in the failures."""

    def request(i: int, n: int) -> tuple[str, dict]:
        return ("/stream/c" if i == 0 else "/ok/c"), {"prompt": f"c{i}", "stream": i == 0, "n": n}

    def check(payload: dict, text: str) -> str:
        assert payload["prompt"] == "c0" or payload["n"] % 2 == 0, "an odd request of client 1"
        return payload["prompt"]

    load = run_load(server.url, answers=12, request=request, check=check)
    assert load.labels["c0"] >= 2 and load.labels["c1"] >= 1 and sum(load.labels.values()) == load.ok
    assert load.counts["malformed"] == load.lost >= 1, load.report()
    assert "the check refused it: AssertionError: an odd request of client 1" in load.failures[0]
    assert "(c0=" in load.report()
