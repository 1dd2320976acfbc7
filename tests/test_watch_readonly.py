"""`specops watch` on an engine specops does not run: a llama-server started by the test, with a noisy
draft, under real traffic. The scrape source and the PromQL source (a real Prometheus scraping the same
engine) reach the same recommendation; the webhook and the command receive it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support_engines import need_llama_server
from support_load import one_client
from support_ports import free_port
from support_procs import process_group
from support_prometheus import PrometheusServer
from support_up import SPECOPS

pytestmark = [pytest.mark.engines, pytest.mark.prometheus, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def noisy_engine(tmp_path_factory, tiny_gguf_models):
    """llama-server on the noisy draft (acceptance ≈ 0.5) under one client's traffic; its process group is
    stopped whatever happens (a failed start included)."""
    import urllib.request

    exe, models, port = need_llama_server(), tiny_gguf_models, free_port()
    argv = [str(exe), "-m", str(models / "gguf-target.gguf"), "-md", str(models / "gguf-draft-noisy.gguf")]
    argv += ["--spec-type", "draft-simple", "--spec-draft-n-max", "8", "-c", "1024", "-np", "2"]
    argv += ["-dev", "none", "-devd", "none", "--host", "127.0.0.1", "--port", str(port), "--metrics"]
    url = f"http://127.0.0.1:{port}"
    with (
        open(tmp_path_factory.mktemp("engine") / "llama.log", "w") as log,
        process_group(argv, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "llama-server did not start"
            time.sleep(0.2)
        with one_client(url) as load:
            # the traffic is flowing once llama-server has counted drafts of finished requests
            while "llamacpp:spec_decode_num_draft_tokens_total 0" in (
                urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            ):
                assert time.monotonic() < deadline + 60, f"no request finished: {load.report()}"
                time.sleep(0.2)
            yield url, port
        assert load.lost == 0, load.failures[:3]


class Hook:
    def __init__(self):
        self.bodies: list[dict] = []
        hook = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                hook.bodies.append(json.loads(self.rfile.read(n)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self):
        self.server.shutdown()


def run_watch(*args, timeout=60) -> list[dict]:
    out = subprocess.run(SPECOPS + ["watch", *args, "--json"], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()], out.stderr


def test_scrape_and_promql_sources_recommend_the_same_switch(noisy_engine, tmp_path):
    url, port = noisy_engine
    hook = Hook()
    record = tmp_path / "decision.json"
    cmd = f"{sys.executable} -c \"import sys; open({str(record)!r}, 'w').write(sys.stdin.read())\""
    # llama-server counts a request's drafts when it finishes: a 15 s window holds several finished requests even
    # when the engine runs slower beside other tests
    common = ["--method", "draft_model", "--window", "15", "--min-draft-tokens", "100", "--consecutive-windows", "1"]
    try:
        scrape, err = run_watch(url, *common, "--once", "--webhook", hook.url, "--on-decision", cmd)
        with PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{port}"], scrape_interval=0.5) as prom:
            # the first scrape comes seconds after /-/ready: wait until a whole window of samples is stored
            deadline = time.monotonic() + 60
            while (prom.value("count_over_time(llamacpp:spec_decode_num_draft_tokens_total[15s])") or 0) < 24:
                assert time.monotonic() < deadline, "Prometheus stored no samples of the engine"
                time.sleep(0.5)
            promql, err2 = run_watch(url, *common, "--once", "--prometheus-url", prom.url)
    finally:
        hook.close()
    s, p = scrape[-1], promql[-1]
    assert s["window"]["source"] == "llamacpp" and p["window"]["source"] == "promql"
    for tick in (s, p):
        assert tick["window"]["status"] == "ok" and tick["window"]["draft_tokens"] >= 100, tick
        assert 0.3 < tick["window"]["acceptance"] < 0.6
        assert tick["decision"]["action"] == "switch" and tick["decision"]["to"] == "ngram"
        assert tick["decision"]["rule"] == "threshold"
    assert abs(s["window"]["acceptance"] - p["window"]["acceptance"]) < 0.1
    assert "recommendation: switch draft_model → ngram" in err and "recommendation" in err2
    assert hook.bodies and hook.bodies[0]["decision"]["to"] == "ngram"
    assert json.loads(record.read_text())["decision"]["from"] == "draft_model"


def test_watch_of_an_unreachable_engine_warns_and_decides_nothing(tmp_path):
    ticks, err = run_watch(f"http://127.0.0.1:{free_port()}", "--backend", "llamacpp", "--window", "1", "--once")
    assert ticks[-1]["window"]["status"] == "unavailable"
    assert ticks[-1]["decision"]["action"] == "keep" and ticks[-1]["decision"]["rule"] == "source-unavailable"
