"""Real Prometheus for tests, and a static-text exporter for it to scrape.

- :class:`StaticExporter` serves whatever exposition text the test sets, in the classic text format, from
  a plain HTTP server on 127.0.0.1 (not prometheus_client's ``start_http_server``: from 0.23 on it answers
  Prometheus 2.x in OpenMetrics and escapes ``:`` in names, prometheus/client_python#1177). It can answer an HTTP error,
  serve garbage, or be stopped and started again on the same port.
- :class:`PrometheusServer` runs the real ``prometheus`` binary on a free loopback port with a generated
  scrape config, waits for ``/-/ready``, and stops it (SIGTERM, then SIGKILL) on exit.

Both are context managers; nothing outlives the test that starts them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import unavailable
from support_ports import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def require_prometheus() -> str:
    if not os.access(PROMETHEUS, os.X_OK):
        unavailable("the prometheus binary is not installed (apt-get install prometheus)")
    return PROMETHEUS


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the condition is not met yet
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))


# ---------------------------------------------------------------------------------------------------
# a static exporter


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True  # restart on the same port right after a stop
    daemon_threads = True


class StaticExporter:
    """An HTTP server on 127.0.0.1 answering ``GET /metrics`` with the text set by the test."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, text: str = "", port: int | None = None):
        self.text = text
        self.status = 200
        self.content_type = self.CONTENT_TYPE
        self.requests = 0
        self.port = port or 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def set(self, text: str, status: int = 200) -> None:
        with self._lock:
            self.text, self.status = text, status

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> StaticExporter:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                with exporter._lock:
                    exporter.requests += 1
                    status, text, ctype = exporter.status, exporter.text, exporter.content_type
                if self.path.split("?")[0] != "/metrics":
                    status, text = 404, "not found\n"
                body = text.encode("utf-8") if isinstance(text, str) else text
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = _Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> StaticExporter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------
# a real Prometheus


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (``host:port`` strings) every ``scrape_interval`` seconds."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        job: str = "engine",
        scrape_interval: float = 1.0,
        port: int | None = None,
    ):
        self.workdir = Path(workdir)
        self.targets = list(targets)
        self.job = job
        self.scrape_interval = scrape_interval
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        interval = f"{int(self.scrape_interval * 1000)}ms"
        # JSON is YAML: no YAML library needed, and the quoting is exact
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": self.job, "metrics_path": "/metrics", "static_configs": [{"targets": self.targets}]}
            ],
        }
        return json.dumps(config, indent=2) + "\n"

    def start(self, ready_timeout: float = 30.0) -> PrometheusServer:
        binary = require_prometheus()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self.config_text())
        fixed = self.port
        for _ in range(3):
            port = fixed or free_port()
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()
            self.port = port
            deadline = time.monotonic() + ready_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if self.ready():
                    return self
                time.sleep(0.05)
            self.stop()
            if fixed:
                break  # a port chosen by the caller: no other port to try
            # else the free port may have been taken meanwhile: try another
        raise RuntimeError(f"prometheus did not become ready; log:\n{self.log_path.read_text()[-3000:]}")

    def ready(self) -> bool:
        try:
            with _NO_PROXY.open(self.url + "/-/ready", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, promql: str, at: float | None = None) -> list:
        """Raw ``/api/v1/query`` result list (for test set-up; the code under test uses its own client)."""
        params = {"query": promql}
        if at is not None:
            params["time"] = repr(at)
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode(params)
        with _NO_PROXY.open(url, timeout=5) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"query failed: {body}")
        return body["data"]["result"]

    def value(self, promql: str, at: float | None = None) -> float | None:
        result = self.query(promql, at)
        return float(result[0]["value"][1]) if result else None

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------
# exposition text as the engines write it (classic text format)


def vllm_v1_text(models: dict[str, dict[str, tuple[float, float, float, list[float]]]], created: float = 1.7e9) -> str:
    """vLLM V1 spec-decode metrics: ``{model_name: {engine: (drafts, draft_tokens, accepted, per_pos)}}``,
    each counter followed by its ``*_created`` gauge, as vLLM's prometheus_client writes them."""
    out: list[str] = []

    def family(name: str, help_: str, rows: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name}_total {help_}")
        out.append(f"# TYPE {name}_total counter")
        out.extend(f"{name}_total{{{labels}}} {float(v)!r}" for labels, v in rows)
        out.append(f"# HELP {name}_created {help_}")
        out.append(f"# TYPE {name}_created gauge")
        out.extend(f"{name}_created{{{labels}}} {created!r}" for labels, _ in rows)

    def rows(i: int) -> list[tuple[str, float]]:
        return [
            (f'engine="{e}",model_name="{m}"', vals[i]) for m, engines in models.items() for e, vals in engines.items()
        ]

    family("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", rows(0))
    family("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", rows(1))
    family("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", rows(2))
    family(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        [
            (f'engine="{e}",model_name="{m}",position="{p}"', v)
            for m, engines in models.items()
            for e, vals in engines.items()
            for p, v in enumerate(vals[3])
        ],
    )
    out.append("# HELP vllm:num_requests_running Number of requests in model execution batches.")
    out.append("# TYPE vllm:num_requests_running gauge")
    out.extend(f'vllm:num_requests_running{{engine="0",model_name="{m}"}} 1.0' for m in models)
    return "\n".join(out) + "\n"


def vllm_one(
    drafts: float, draft_tokens: float, accepted: float, per_pos: list[float] | None = None, model: str = "tiny"
) -> str:
    """One model, one engine."""
    return vllm_v1_text({model: {"0": (drafts, draft_tokens, accepted, per_pos or [])}})


def llamacpp_text(drafts: float, draft_tokens: float, accepted: float, per_pos: list[float] | None = None) -> str:
    """llama-server ``--metrics`` spec-decode counters (no labels but ``position``)."""
    lines = []
    for name, help_, v in (
        ("num_drafts", "Number of speculative drafts.", drafts),
        ("num_draft_tokens", "Number of draft tokens generated.", draft_tokens),
        ("num_accepted_tokens", "Number of draft tokens accepted.", accepted),
    ):
        lines += [
            f"# HELP llamacpp:spec_decode_{name}_total {help_}",
            f"# TYPE llamacpp:spec_decode_{name}_total counter",
            f"llamacpp:spec_decode_{name}_total {v:g}",
        ]
    if per_pos:
        lines += [
            "# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per position.",
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter",
        ]
        lines += [
            f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v:g}'
            for i, v in enumerate(per_pos)
        ]
    lines += [
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
        "# TYPE llamacpp:prompt_tokens_total counter",
        "llamacpp:prompt_tokens_total 1234",
    ]
    return "\n".join(lines) + "\n"


class InProcessSpecops:
    """specops' real front proxy in a background event loop, with the watcher's real metrics registry and
    an engine stand-in (a static /metrics exporter) behind it."""

    def __init__(self, engine_text: str, *, queue_size: int = 16, queue_timeout: float = 5):
        from specops.proxy import Proxy
        from specops.watch.watcher import SpecopsMetrics

        self.metrics = SpecopsMetrics()
        self.engine = StaticExporter(engine_text)
        self.proxy = Proxy(
            "127.0.0.1",
            0,
            queue_size=queue_size,
            queue_timeout=queue_timeout,
            drain_timeout=5,
            metrics_registry=self.metrics.registry,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> InProcessSpecops:
        self.engine.start()
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.proxy.set_upstream, f"http://{self.engine.address}")
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.engine.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.proxy.port}"

    def get(self, path: str) -> str:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://{self.address}{path}", timeout=10
        ) as resp:
            return resp.read().decode("utf-8")


def labelled_prometheus(workdir, targets: dict[str, str]):
    """A real Prometheus with specops' two jobs of contrib/prometheus/scrape.yml, one target per pod."""

    class Labelled(PrometheusServer):
        def config_text(self) -> str:
            interval = f"{int(self.scrape_interval * 1000)}ms"
            statics = [
                {"targets": [addr], "labels": {"pod": pod, "namespace": "llm", "app_kubernetes_io_instance": "demo"}}
                for pod, addr in targets.items()
            ]
            jobs = [("specops", "/specops/metrics"), ("specops-engine", "/metrics")]
            return json.dumps(
                {
                    "global": {"scrape_interval": interval, "scrape_timeout": interval},
                    "scrape_configs": [{"job_name": j, "metrics_path": p, "static_configs": statics} for j, p in jobs],
                }
            )

    return Labelled(workdir, [], scrape_interval=0.5)
