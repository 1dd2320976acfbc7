"""`specops watch` options and notifications: bounds, quoting, webhook schemes, redaction.

Every server is on 127.0.0.1 and started by the test (a growing /metrics exporter, a webhook receiver);
every `specops watch` run is bounded by --once or a kill after a short time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support_ports import free_port
from support_procs import stop_group
from support_prometheus import llamacpp_text

from specops.errors import SpecopsError
from specops.urls import check_http_url, redact_text, redact_url, split_userinfo, url_problem

pytestmark = pytest.mark.timeout(120)

SPECOPS_BIN = Path(sys.executable).with_name("specops")
SPECOPS = [str(SPECOPS_BIN)] if SPECOPS_BIN.exists() else [sys.executable, "-m", "specops.cli"]
SECRETS = ("s3cretpw", "tok3n-value", "hunter2", "QUERYSECRET")


def watch(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        SPECOPS + ["watch", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, "NO_COLOR": "1"}
    )


class GrowingExporter:
    """/metrics of a llama-server whose counters grow on every scrape (acceptance 0.1: a switch is due)."""

    def __init__(self):
        self.requests = 0
        exporter = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                exporter.requests += 1
                n = exporter.requests
                body = llamacpp_text(10 * n, 100 * n, 10 * n).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Hook:
    """A webhook receiver: records path, Authorization header and body of each POST."""

    def __init__(self, status: int = 204):
        self.calls: list[dict] = []
        hook = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                hook.calls.append(
                    {
                        "path": self.path,
                        "auth": self.headers.get("Authorization"),
                        "body": json.loads(self.rfile.read(n)),
                    }
                )
                self.send_response(status)
                if status in (301, 302, 307):
                    self.send_header("Location", "file:///etc/hostname")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.port = self.server.server_address[1]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter():
    e = GrowingExporter()
    try:
        yield e
    finally:
        e.close()


SWITCH_NOW = [
    "--backend",
    "llamacpp",
    "--method",
    "draft_model",
    "--window",
    "0.3",
    "--min-draft-tokens",
    "10",
    "--consecutive-windows",
    "1",
    "--once",
    "--json",
]


# ------------------------------------------------------------------------------------------ option bounds


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--window", "0"], "--window"),
        (["--window", "-1"], "--window"),
        (["--window", "nan"], "--window"),
        (["--window", "inf"], "--window"),
        (["--window", "1e400"], "--window"),
        (["--window", "30d"], "--window"),
        (["--window", "soon"], "--window"),
        (["--interval", "0"], "--interval"),
        (["--interval", "-5"], "--interval"),
        (["--interval", "nan"], "--interval"),
        (["--interval", "0.01"], "--interval"),
        (["--interval", "2h"], "--interval"),
        (["--min-acceptance", "5"], "--min-acceptance"),
        (["--min-acceptance", "-0.1"], "--min-acceptance"),
        (["--min-acceptance", "nan"], "--min-acceptance"),
        (["--min-draft-tokens", "0"], "--min-draft-tokens"),
        (["--consecutive-windows", "0"], "--consecutive-windows"),
        (["--on-decision", "echo 'x"], "--on-decision"),
        (["--on-decision", ""], "--on-decision"),
        (["--on-decision", "no-such-program-specops-test"], "--on-decision"),
        (["--webhook", "file:///etc/hostname"], "--webhook"),
        (["--webhook", "http://"], "--webhook"),
        (["--webhook", "ftp://127.0.0.1/x"], "--webhook"),
        (["--webhook", "http://127.0.0.1:99999/"], "--webhook"),
        (["--webhook", "javascript:alert(1)"], "--webhook"),
        (["--webhook", "http://h/a b"], "--webhook"),
        (["--prometheus-url", "file:///tmp/x"], "--prometheus-url"),
        (["--url", "gopher://x"], "--url"),
        (["--backend", "nope"], "--backend"),
    ],
)
def test_bad_options_are_one_clean_click_error(args, needle):
    port = free_port()  # nothing listens: an option that slipped through would show as a read failure
    r = watch(f"http://127.0.0.1:{port}", "--once", *args, timeout=20)
    assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("target", ["file:///etc/hostname", "http://", "ftp://127.0.0.1/"])
def test_bad_target_url_is_a_clean_error(target):
    r = watch(target, "--once", timeout=20)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "TARGET" in r.stderr


def test_webhook_secret_is_not_echoed_in_its_error():
    r = watch(f"http://127.0.0.1:{free_port()}", "--once", "--webhook", "ftp://user:s3cretpw@h/x?token=tok3n-value")
    assert r.returncode == 2
    assert not any(s in r.stderr + r.stdout for s in SECRETS)
    assert "ftp://***@h/x?token=***" in r.stderr


def test_durations_accept_units(exporter):
    r = watch(exporter.url, "--backend", "llamacpp", "--window", "300ms", "--interval", "100ms", "--once", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["window"]["window_s"] == 0.3


def test_interval_floor_holds_in_the_loop(exporter):
    """--interval 0.1 reads about ten times a second, not hundreds (the old busy loop)."""
    proc = subprocess.Popen(
        SPECOPS + ["watch", exporter.url, "--backend", "llamacpp", "--interval", "0.1", "--window", "1", "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while exporter.requests == 0:  # the first read (after the backend is known)
            assert time.monotonic() < deadline and proc.poll() is None, "watch never read"
            time.sleep(0.05)
        start = exporter.requests
        time.sleep(2.0)
        reads = exporter.requests - start
    finally:
        proc.send_signal(signal.SIGINT)  # watch's own way out (Ctrl-C) ...
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        stop_group(proc, timeout=5)  # ... then its whole group, whatever it left
    assert 5 <= reads <= 30, reads


def test_profile_interval_below_the_floor_is_raised_with_a_warning(exporter, tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text(
        "name: w\nbackend: llamacpp\nmodel: {id: x/y}\nspeculative: {method: ngram}\nmonitor: {interval: 0.001}\n"
    )
    port = exporter.url.rsplit(":", 1)[1]
    r = watch(str(p), "--url", f"http://127.0.0.1:{port}", "--window", "0.3", "--once", "--json")
    assert r.returncode == 0, r.stderr  # the profile is valid: watch raises the interval to its floor
    assert "monitor.interval 1ms is below 100ms" in r.stderr


# ------------------------------------------------------------------------------------------ notifications


def test_on_decision_runs_without_a_shell(exporter, tmp_path):
    record = tmp_path / "argv.json"
    marker = tmp_path / "pwned"
    script = (
        f"import json,os,sys; open({str(record)!r},'w').write(json.dumps("
        f"{{'argv': sys.argv[1:], 'stdin': sys.stdin.read(), 'env': os.environ['SPECOPS_DECISION']}}))"
    )
    cmd = f"{sys.executable} -c \"{script}\" 'two words' '$(touch {marker})' ';' 'rm -rf /nonexistent'"
    r = watch(exporter.url, *SWITCH_NOW, "--on-decision", cmd)
    assert r.returncode == 0, r.stderr
    assert "recommendation: switch draft_model → ngram" in r.stderr
    got = json.loads(record.read_text())
    assert got["argv"] == ["two words", f"$(touch {marker})", ";", "rm -rf /nonexistent"]
    assert json.loads(got["stdin"])["decision"]["to"] == "ngram" and got["env"] == got["stdin"]
    assert not marker.exists()
    assert "on-decision command exited 0" in r.stderr


def test_webhook_with_credentials_gets_basic_auth_and_is_printed_redacted(exporter):
    hook = Hook()
    try:
        url = f"http://user:s3cretpw@127.0.0.1:{hook.port}/hook/abcdefghij0123456789XYZ?token=tok3n-value&k=QUERYSECRET"
        r = watch(exporter.url, *SWITCH_NOW, "--webhook", url)
    finally:
        hook.close()
    assert r.returncode == 0, r.stderr
    assert len(hook.calls) == 1
    call = hook.calls[0]
    assert call["path"] == "/hook/abcdefghij0123456789XYZ?token=tok3n-value&k=QUERYSECRET"
    assert base64.b64decode(call["auth"].split()[1]).decode() == "user:s3cretpw"
    assert call["body"]["decision"]["to"] == "ngram"
    assert "webhook answered 204" in r.stderr
    assert not any(s in r.stdout + r.stderr for s in SECRETS)


def test_failing_webhook_is_a_redacted_warning(exporter):
    url = f"https://user:hunter2@127.0.0.1:{free_port()}/x?sig=QUERYSECRET"
    r = watch(exporter.url, *SWITCH_NOW, "--webhook", url)
    assert r.returncode == 0, r.stderr
    assert "warning: webhook https://***@127.0.0.1:" in r.stderr and "/x?sig=*** failed" in r.stderr
    assert not any(s in r.stdout + r.stderr for s in SECRETS)
    assert "Traceback" not in r.stderr


def test_webhook_redirects_are_not_followed(exporter):
    hook = Hook(status=302)
    try:
        r = watch(exporter.url, *SWITCH_NOW, "--webhook", f"http://127.0.0.1:{hook.port}/h")
    finally:
        hook.close()
    assert r.returncode == 0, r.stderr
    assert len(hook.calls) == 1 and "answered HTTP 302" in r.stderr


def test_engine_url_with_credentials_is_redacted_in_ticks():
    port = free_port()
    r = watch(
        f"http://user:s3cretpw@127.0.0.1:{port}/?token=tok3n-value",
        "--backend",
        "llamacpp",
        "--window",
        "0.2",
        "--once",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    tick = json.loads(r.stdout.splitlines()[-1])
    assert tick["window"]["status"] == "unavailable"
    assert "***@127.0.0.1" in tick["window"]["reason"]
    assert not any(s in r.stdout + r.stderr for s in SECRETS)


# ------------------------------------------------------------------------------------------ labels and windows


def test_bad_label_name_reaching_watch_is_a_clean_error(tmp_path):
    p = tmp_path / "w.yaml"
    p.write_text(
        "name: w\nbackend: vllm\nmodel: {id: x/y}\nspeculative: {method: ngram}\n"
        f"monitor: {{source: promql, prometheus_url: 'http://127.0.0.1:{free_port()}', "
        "labels: {bad-name: x}}\n"
    )
    r = watch(str(p), "--once", timeout=20)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "bad-name" in r.stderr


def test_check_bounds_refuses_what_a_profile_object_may_hold():
    from specops.commands.watch import _check_bounds
    from specops.config.profile import Profile

    base = Profile.model_validate(
        {
            "name": "w",
            "backend": "vllm",
            "model": {"id": "x/y"},
            "speculative": {"method": "ngram"},
            "monitor": {"source": "promql", "prometheus_url": "http://127.0.0.1:1"},
        }
    )
    bad = [
        ("fallback", {"window": math.inf}),
        ("fallback", {"window": math.nan}),
        ("fallback", {"window": 0.0}),
        ("monitor", {"interval": math.inf}),
        ("fallback", {"min_acceptance": 5.0}),
        ("monitor", {"labels": {"bad-name": "x"}}),
        ("monitor", {"prometheus_url": "file:///etc/x"}),
    ]
    for section, update in bad:
        p = base.model_copy(update={section: getattr(base, section).model_copy(update=update)})
        with pytest.raises(SpecopsError) as exc:
            _check_bounds(p)
        assert "\n" not in str(exc.value)
    assert _check_bounds(base) == base


# ------------------------------------------------------------------------------------------ urls


@pytest.mark.parametrize(
    "url,shown",
    [
        ("http://127.0.0.1:9000/hook", "http://127.0.0.1:9000/hook"),
        ("https://u:p@h.example/x?token=abc&a=1#frag", "https://***@h.example/x?token=***&a=***#***"),
        ("https://tok@h/", "https://***@h/"),
        (
            "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXX12XXXXXXXXXXXX",
            "https://hooks.slack.com/services/T00000000/B00000000/***",
        ),
        ("http://h/?secret", "http://h/?***"),
        ("http://[::1/x", "http://***"),
        ("http://h/metrics", "http://h/metrics"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_text_and_userinfo_split():
    assert redact_text("GET https://a:b@x.y/z?k=v: refused.") == "GET https://***@x.y/z?k=***: refused."
    assert split_userinfo("https://us%40r:p%3Aw@h:1/x") == ("https://h:1/x", ("us@r", "p:w"))
    assert split_userinfo("http://h/x") == ("http://h/x", None)
    for bad in ("file:///etc/hostname", "http://", "ftp://h", "//h/x", "http://h:x/", "http://h/\x00", 5, ""):
        assert url_problem(bad) is not None
        with pytest.raises(ValueError):
            check_http_url(bad)
    assert check_http_url("https://h:8443/x") == "https://h:8443/x"
