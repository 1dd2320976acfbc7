"""contrib/prometheus: the scrape config and the alert rules, checked by the real promtool (check config,
check rules, the rule unit tests, which make every alert fire and stay quiet), their metric names against
what specops' proxy really serves and what the engines export, and a real Prometheus scraping a real
in-process specops proxy with the config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, unavailable
from prometheus_client.parser import text_string_to_metric_families
from support_prometheus import InProcessSpecops
from support_twin_metrics import twin_metrics_text

CONTRIB = ROOT / "contrib" / "prometheus"
SCRAPE, ALERTS, ALERT_TESTS = CONTRIB / "scrape.yml", CONTRIB / "alerts.yml", CONTRIB / "alerts_test.yml"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        unavailable("promtool is not installed (apt-get install prometheus)")
    return exe


def run_promtool(*args, cwd: Path = CONTRIB) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=60)


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


# ----------------------------------------------------------------------------------------------- promtool


def test_promtool_checks_the_scrape_config():
    res = run_promtool("check", "config", SCRAPE)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout and "alerts.yml" in res.stdout  # it read the rule file too


def test_promtool_checks_the_rules():
    res = run_promtool("check", "rules", ALERTS)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in res.stdout


def test_promtool_rule_unit_tests_pass():
    res = run_promtool("test", "rules", ALERT_TESTS)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_is_tested_firing_and_quiet():
    tests = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it stays quiet"


@pytest.mark.parametrize("alert", [r["alert"] for r in alert_rules()])
def test_the_unit_tests_notice_an_alert_that_never_fires(tmp_path, alert):
    """Replace one alert's expression with one that never fires: promtool's unit tests must fail."""
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = "vector(1) == 0"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    shutil.copy(ALERT_TESTS, tmp_path / "alerts_test.yml")
    res = run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert res.returncode != 0, f"{alert}: the unit tests pass even when it never fires"
    assert f"alertname: {alert}," in res.stdout + res.stderr


# ---------------------------------------------------------------------------------- the names in the rules

_PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
}
PROMETHEUS_OWN = {"up"}  # written by Prometheus for every target


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, grouping lists, ranges, functions and
    keywords removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\boffset\s+\w+", "", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def test_metric_names_are_read_from_the_expressions():
    expr = 'sum by (job, instance) (rate(vllm:x_total{a="b"}[1m])) / on (job) y offset 5m > 0.6 and time() - z < 900'
    assert metric_names(expr) == {"vllm:x_total", "y", "z"}


def sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def flap_guard_decision():
    """A real flap-guard hold from the policy (three switches in an hour with max_switches_per_hour=3)."""
    from specops.config.profile import ChainStep
    from specops.methods import Method
    from specops.watch.decision import KEEP, PolicyConfig
    from specops.watch.policy import Policy
    from specops.watch.window import OK, WindowStats

    steps = [ChainStep(method=m) for m in (Method.EAGLE3, Method.EAGLE, Method.MTP, Method.DRAFT_MODEL, Method.NONE)]
    cfg = PolicyConfig(
        window_s=60.0, min_draft_tokens=200, consecutive_windows=1, cooldown_s=0, max_switches_per_hour=3
    )
    p = Policy(cfg, steps)
    t = 0.0
    for _ in range(40):
        t += 60.0
        low = WindowStats(
            OK, window_s=60.0, start=t - 60, end=t, acceptance=0.3, draft_tokens=1000, accepted=300, full=True
        )
        d = p.observe(low, t)
        if d.acts:
            p.on_switched(d.to_index, t)
        elif d.action is not KEEP:
            return d
    raise AssertionError("the policy never held")


def test_every_metric_in_the_rules_is_one_specops_or_the_engines_export():
    from support_prometheus import llamacpp_text

    from specops.backends.counters import series_names
    from specops.run.events import State

    decision = flap_guard_decision()
    assert decision.rule == "flap-guard"
    with InProcessSpecops(llamacpp_text(10, 40, 30)) as specops:
        # what the watcher records under `specops up` (Watcher.handle, Watcher.on_event)
        specops.metrics.decisions.labels(decision.action.value, decision.rule).inc()
        specops.metrics.fallbacks.labels("eagle3", "ngram", "threshold").inc()
        specops.metrics.set_state(State.BACKOFF.value)
        specops.metrics.set_method("ngram", ["eagle3", "ngram", "none"])
        own_text = specops.get("/specops/metrics")
        engine_text = specops.get("/metrics")  # through the proxy, as the specops-engine job scrapes it
    own = sample_names(own_text)
    assert "llamacpp:spec_decode_num_draft_tokens_total" in sample_names(engine_text)
    engines = {
        name for prefix in ("vllm:", "llamacpp:") for name in series_names(prefix).values()
    }  # what specops reads from real engines (tests/test_metrics.py, the engine tests)
    known = own | engines | PROMETHEUS_OWN | sample_names(twin_metrics_text())  # with twins and classes
    used: dict[str, set[str]] = {r["alert"]: metric_names(r["expr"]) for r in alert_rules()}
    for alert, names in used.items():
        assert names, alert
        assert names <= known, f"{alert} uses {sorted(names - known)}, which nothing exports"
    # the label values the rules match on are ones specops writes
    assert 'rule="flap-guard"' in own_text
    for reason in ("queue_full", "queue_timeout"):
        assert f'specops_proxy_rejected_total{{reason="{reason}"}}' in own_text
    assert {n for names in used.values() for n in names if n.startswith("specops_")} >= {
        "specops_acceptance_rate",
        "specops_fallbacks_total",
        "specops_fallbacks_created",
        "specops_decisions_created",
        "specops_engine_restarts",
        "specops_proxy_queue_depth",
    }


# ---------------------------------------------------------------------------- a real Prometheus scrapes it


@pytest.mark.prometheus
def test_prometheus_scrapes_specops_and_the_engine_with_the_contrib_config(tmp_path):
    from support_prometheus import PrometheusServer, llamacpp_text

    with InProcessSpecops(llamacpp_text(10, 40, 30)) as specops:
        specops.metrics.fallbacks.labels("eagle3", "ngram", "threshold").inc()
        config = yaml.safe_load(SCRAPE.read_text(encoding="utf-8"))
        config["global"] = {"scrape_interval": "500ms", "scrape_timeout": "500ms", "evaluation_interval": "500ms"}
        for job in config["scrape_configs"]:
            job["static_configs"][0]["targets"] = [specops.address]
        shutil.copy(ALERTS, tmp_path / "alerts.yml")

        class ContribPrometheus(PrometheusServer):
            def config_text(self) -> str:
                return json.dumps(config, indent=2) + "\n"

        with ContribPrometheus(tmp_path, [specops.address]) as prom:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if prom.value('sum(up{job=~"specops|specops-engine"})') == 2.0 and prom.query(
                    'ALERTS{alertname="SpecopsFallback"}'
                ):
                    break
                time.sleep(0.2)
            ups = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
            assert ups == {"specops": "1", "specops-engine": "1"}, ups
            q = prom.query('specops_proxy_queue_capacity{deployment="llama31-8b-eagle3"}')
            assert q and q[0]["value"][1] == "16"
            assert prom.value('llamacpp:spec_decode_num_draft_tokens_total{job="specops-engine"}') == 40.0
            # the rules loaded and evaluate without errors, and the fallback alert fired from the real series
            with NO_PROXY.open(prom.url + "/api/v1/rules", timeout=5) as resp:
                groups = json.load(resp)["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
            assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            fired = prom.query('ALERTS{alertname="SpecopsFallback"}')
            assert fired and fired[0]["metric"]["to_method"] == "ngram"


@pytest.mark.engines
@pytest.mark.prometheus
@pytest.mark.timeout(600)
def test_a_real_fallback_fires_the_alert(tmp_path, tiny_gguf_models):
    """The whole path: `specops up` on llama-server with a noisy draft (acceptance ≈ 0.5), traffic through
    its proxy, a real Prometheus with the contrib config and rules: the fallback to n-gram fires
    SpecopsFallback and SpecopsMethodChanged."""
    from support_engines import need_llama_server
    from support_load import one_client
    from support_ports import free_port
    from support_prometheus import PrometheusServer
    from support_up import UpRun, write_profile

    need_llama_server()
    tiny_models = tiny_gguf_models
    port = free_port()
    profile = write_profile(
        tmp_path / "noisy.yaml",
        {
            "name": "noisy",
            "backend": "llamacpp",
            "model": {"id": str(tiny_models / "gguf-target.gguf"), "max_model_len": 1024},
            "speculative": {
                "method": "draft_model",
                "draft": str(tiny_models / "gguf-draft-noisy.gguf"),
                "num_speculative_tokens": 8,
            },
            "gpus": {"devices": []},
            "server": {"port": port, "parallel": 2},
            "fallback": {"window": "4s", "min_draft_tokens": 100, "consecutive_windows": 2, "chain": ["ngram", "none"]},
            "monitor": {"interval": "500ms"},
        },
    )
    config = yaml.safe_load(SCRAPE.read_text(encoding="utf-8"))
    config["global"] = {"scrape_interval": "500ms", "scrape_timeout": "500ms", "evaluation_interval": "500ms"}
    for job in config["scrape_configs"]:
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
        job["static_configs"][0]["labels"] = {"deployment": "noisy"}
    (tmp_path / "prom").mkdir()
    shutil.copy(ALERTS, tmp_path / "prom" / "alerts.yml")  # beside the config: rule_files is relative to it

    class ContribPrometheus(PrometheusServer):
        def config_text(self) -> str:
            return json.dumps(config, indent=2) + "\n"

    with UpRun(profile, tmp_path / "state", "noisy") as up, ContribPrometheus(tmp_path / "prom", []) as prom:
        up.wait_for(lambda st: st.get("state") == "ready", 60, "ready")
        with NO_PROXY.open(prom.url + "/api/v1/rules", timeout=5) as resp:
            assert json.load(resp)["data"]["groups"], "the rules did not load"
        with one_client(f"http://127.0.0.1:{port}", request_timeout=60) as load:
            fired: dict = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and len(fired) < 2:
                for r in prom.query('ALERTS{alertstate="firing",deployment="noisy"}'):
                    fired[r["metric"]["alertname"]] = r["metric"]
                time.sleep(0.5)
        assert load.lost == 0 and load.ok > 0, load.failures[:3]  # the switch lost no request
        assert "SpecopsFallback" in fired, (fired, up.output())
        fb = fired["SpecopsFallback"]
        assert (fb["from_method"], fb["to_method"], fb["severity"]) == ("draft_model", "ngram", "warning")
        assert "SpecopsMethodChanged" in fired
        assert up.stop() == 0
