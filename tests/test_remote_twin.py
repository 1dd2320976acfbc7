"""A remote twin: another `specops up` standing for a chain step (`routing.twins: [{url: ...}]`).

Real parts: two `specops up` processes on loopback wired as in production (support_standin.py: the stand-in engine
of support_upstream.py, whose answers name the method that served them in `system_fingerprint`): a speculating
deployment (ngram, which "accepts" 0.2) whose `none` step is the other, plain deployment. Classes learned across
the hop, a client's key replaced by the remote's own, the remote killed under load (its traffic served here, no
request lost) and back (routed again), and the profile errors, each located.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support_load import Load
from support_ports import free_port
from support_up import SPECOPS, UpProcess, write_profile

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
#: what a client sends the speculating deployment, and the plain deployment's own key (only its proxy knows it)
SPEC_KEY, PLAIN_KEY = "client-key-1", "plain-deployment-key-2"
_FINGERPRINT = re.compile(r'"system_fingerprint":\s*"(\w+)"')


class Deployment(UpProcess):
    """One `specops up` of the stand-in, in its own folder and process group."""

    def __init__(self, root: Path, name: str, port: int, extra: dict, env: dict):
        self.root, self.port = root, port
        root.mkdir()
        super().__init__(name, root / "state", {**os.environ, **env})
        (root / "target.gguf").write_bytes(b"GGUF")  # the stand-in reads no weights; the launch check wants a file
        self.profile = write_profile(
            root / f"{name}.yaml",
            {
                "name": name,
                "backend": "llamacpp",
                "model": {"id": str(root / "target.gguf")},
                "gpus": {"devices": []},
                "server": {"port": port, **({"api_key": "${PLAIN_KEY}"} if name == "plain" else {})},
                "monitor": {"interval": 0.1, "timeout": 1},
                "supervisor": {"state_dir": str(self.state_dir), "stop_timeout": 5, "restart_backoff": 0.1},
                "proxy": {"enabled": True},
                **extra,
            },
        )
        self.entry = root / "bin" / "specops"  # `specops up PROFILE`'s command line
        self.entry.parent.mkdir()
        self.entry.symlink_to(HERE / "support_standin.py")

    def argv(self) -> list[str]:
        return [sys.executable, str(self.entry), "up", str(self.profile)]

    @property
    def log_path(self) -> Path:
        return self.root / "up.log"


def ask(port: int, headers: dict | None = None, path: str = "/v1/completions", key: str = SPEC_KEY) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps({"prompt": "x", "max_tokens": 8}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _spec_extra(plain_port: int) -> dict:
    return {
        "speculative": {"method": "ngram"},
        "fallback": {"enabled": False, "chain": ["none"]},
        "routing": {
            "twins": [{"url": f"http://127.0.0.1:{plain_port}", "api_key_env": "PLAIN_KEY", "method": "none"}],
            "classes": {"key": "header", "header": "X-Task", "min_draft_tokens": 20, "explore": 0},
            "aliases": {"tiny-exact": "off"},
        },
    }


@pytest.fixture
def pair(tmp_path):
    env = {"PLAIN_KEY": PLAIN_KEY}
    plain_port, spec_port = free_port(), free_port()
    plain = Deployment(tmp_path / "plain", "plain", plain_port, {"speculative": {"method": "none"}}, env)
    spec = Deployment(tmp_path / "spec", "spec", spec_port, _spec_extra(plain_port), env)
    try:
        yield plain.start(), spec.start()
    finally:
        rcs = spec.stop(), plain.stop()
    assert rcs[0] == 0, (tmp_path / "spec" / "up.log").read_text()[-3000:]


def _remote_row(st: dict) -> dict:
    [row] = [e for e in st.get("engines", []) if e.get("remote")]
    return row


def test_classes_key_failover_and_return_across_the_hop(pair, tmp_path):
    plain, spec = pair
    plain.wait(lambda s: s.get("state") == "ready", "the plain deployment")
    st = spec.wait(lambda s: s.get("state") == "ready" and _remote_row(s)["live"], "the remote twin in the routes")
    row = _remote_row(st)
    assert row["method"] == "none" and row["remote"]["reported_method"] == "none" and row["engine_pid"] is None
    assert len(st["engines"]) == 2  # no local engine started for it

    # the client's key never reaches the other deployment: its own key replaces it
    status, echo = ask(spec.port, {"X-Specops-Speculation": "off"}, path="/debug/echo")
    assert status == 200, echo
    auth = [v for k, v in echo["headers"] if k.lower() == "authorization"]
    assert auth == [f"Bearer {PLAIN_KEY}"], auth
    assert ask(spec.port, {"X-Specops-Speculation": "on"})[1]["system_fingerprint"] == "ngram"
    assert ask(spec.port, {"X-Specops-Speculation": "off"})[1]["system_fingerprint"] == "none"

    # a class learned across the hop: measured here (acceptance 0.2), then sent to the plain deployment
    assert ask(spec.port, {"X-Task": "chat"})[1]["system_fingerprint"] == "ngram"
    st = spec.wait(
        lambda s: any(c["speculate"] is False for c in s["routing"]["classes"]),
        "the class verdict",
        tick=lambda: ask(spec.port, {"X-Task": "chat"}),
    )
    assert [ask(spec.port, {"X-Task": "chat"})[1]["system_fingerprint"] for _ in range(4)] == ["none"] * 4
    st = spec.wait(
        lambda s: (
            s["routing"]["classes"][0]["tokens_per_s_off"] is not None and _remote_row(s)["remote"]["requests"] >= 6
        ),
        "the class's tokens/s off and the hop's latency",
    )
    remote = _remote_row(st)["remote"]
    assert remote["request_p50_ms"] > 0 and remote["request_p99_ms"] >= remote["request_p50_ms"]
    assert remote["health_rtt_ms"] > 0 and remote["checks"] >= 1

    # the remote killed under load: its traffic goes to the engine here, nothing is lost; back: routed again
    def served_by(body: dict, text: str) -> str:
        found = _FINGERPRINT.findall(text)
        return found[-1] if found else "?"

    load = Load(
        f"http://127.0.0.1:{spec.port}", clients=6, model="tiny-exact", stream=False, request_timeout=30,
        max_seconds=90, check=served_by,
    )  # fmt: skip
    with load:
        load.wait_for_answers(30, timeout=30)
        assert load.labels["none"] > 0, load.report()
        plain.kill()
        before = load.labels["ngram"]
        load.wait_for_answers(60, timeout=30)
        assert load.labels["ngram"] > before + 30, load.report()
        st = spec.wait(lambda s: not _remote_row(s)["live"], "the remote out of the routes")
        assert _remote_row(st)["remote"]["outages"] >= 1
        plain.start()
        spec.wait(lambda s: _remote_row(s)["live"], "the remote back in the routes", timeout=40)
        none_before = load.labels["none"]
        load.wait_for_answers(30, timeout=30)
        assert load.labels["none"] > none_before, load.report()
    assert load.lost == 0 and load.ok > 100, load.report()
    lives = [e["live"] for e in spec.events("remote")]
    assert lives[-2:] == [False, True], lives

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{spec.port}/specops/metrics", timeout=10).read().decode()
    assert 'specops_remote_twin_up{engine="1:none"} 1.0' in metrics
    assert re.search(r'specops_remote_twin_outages_total\{engine="1:none"\} [1-9]', metrics)
    assert re.search(r'specops_remote_twin_request_seconds_count\{engine="1:none"\} [1-9]', metrics)
    out = subprocess.run(
        SPECOPS + ["status", "spec", "--state-dir", str(spec.state_dir)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "remote   http://127.0.0.1:" in out.stdout and "(reports none)" in out.stdout
    assert SPEC_KEY not in out.stdout and PLAIN_KEY not in out.stdout


@pytest.mark.parametrize(
    "twin, where, says",
    [
        ({"url": "ftp://h:1"}, "twins[0].url", "only http:// and https://"),
        ({"url": "http://u:pw@127.0.0.1:9"}, "twins[0].url", "a user or password in it"),
        ({"url": "http://127.0.0.1:9?x=1"}, "twins[0].url", "no query or fragment"),
        ({"url": "http://127.0.0.1:9", "api_key_env": "1X"}, "twins[0].api_key_env", "environment variable"),
        ({"url": "http://127.0.0.1:9", "method": "ngram"}, "twins[0].method", "ngram is the primary method"),
        ({"url": "http://127.0.0.1:9", "method": "eagle"}, "twins[0].method", "not a step of the fallback chain"),
        ({"url": "http://127.0.0.1:9", "key": "x"}, "twins[0].key", "unknown field 'key'"),
    ],
)
def test_remote_twin_errors_are_located(tmp_path, twin, where, says):
    profile = _bad_profile(tmp_path, [twin])
    out = subprocess.run(SPECOPS + ["validate", str(profile)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    line = next((ln for ln in out.stdout.splitlines() if f"routing.{where}:" in ln), None)
    assert line is not None and says in line and re.search(r"p\.yaml:1[0-9]:\d+: ", line), out.stdout
    assert "Traceback" not in out.stdout + out.stderr and "pw@" not in out.stdout


def test_duplicates_and_the_deployments_own_address_are_located(tmp_path):
    port = free_port()
    twins = [{"url": "http://127.0.0.1:9100"}, {"url": "http://127.0.0.1:9100/", "method": "ngram"}, "none"]
    out = subprocess.run(SPECOPS + ["validate", str(_bad_profile(tmp_path, twins))], capture_output=True, text=True)
    assert "routing.twins[1].url: http://127.0.0.1:9100 is listed twice" in out.stdout, out.stdout
    assert re.search(r"p\.yaml:14:7: routing.twins\[2\]: none is listed twice", out.stdout), out.stdout
    own = _bad_profile(tmp_path, [{"url": f"http://localhost:{port}"}], port=port)
    out = subprocess.run(SPECOPS + ["validate", str(own)], capture_output=True, text=True)
    assert f"routing.twins[0].url: http://localhost:{port} is this deployment's own address" in out.stdout


def test_up_refuses_a_remote_twin_whose_key_is_not_exported(tmp_path):
    profile = _bad_profile(tmp_path, [{"url": "http://127.0.0.1:9", "api_key_env": "SPECOPS_TEST_UNSET_KEY"}])
    env = {k: v for k, v in os.environ.items() if k != "SPECOPS_TEST_UNSET_KEY"}
    env["SPECOPS_STATE"] = str(tmp_path / "state")
    out = subprocess.run(SPECOPS + ["up", str(profile)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert re.search(
        r"p\.yaml:12:20: routing\.twins\[0\]\.api_key_env: \$SPECOPS_TEST_UNSET_KEY is unset or empty",
        out.stdout + out.stderr,
    ), out.stdout + out.stderr
    assert not (tmp_path / "state" / "bad").exists()  # refused before the instance was created


def _bad_profile(tmp_path: Path, twins: list, port: int = 8000) -> Path:
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    path = tmp_path / "p.yaml"
    lines = [
        "name: bad",
        "backend: llamacpp",
        f"model: {{id: {tmp_path / 'target.gguf'}}}",
        "speculative: {method: ngram}",
        "fallback: {chain: [none]}",
        "gpus: {devices: []}",
        f"server: {{port: {port}}}",
        "proxy: {enabled: true}",
        "routing:",
        "  twins:",
    ]
    for twin in twins:
        if isinstance(twin, str):
            lines.append(f"    - {twin}")
            continue
        first = True
        for k, v in twin.items():
            lines.append(f"    {'- ' if first else '  '}{k}: {json.dumps(v)}")
            first = False
    path.write_text("\n".join(lines) + "\n")
    return path
