"""The Grafana dashboard and the Prometheus alert rules cover twins and request classes.

The series come from a real exposition of a deployment with a twin and learned classes (tests/support_twin_metrics.py:
the real TwinEngines, router and class windows behind the watcher's registry); the rules are run by the real
promtool on their unit tests (contrib/prometheus/alerts_test.yml), as tests/test_alerts.py runs the others.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from conftest import ROOT, unavailable
from prometheus_client.parser import text_string_to_metric_families
from support_twin_metrics import twin_metrics_text

DASHBOARD = ROOT / "contrib" / "grafana" / "specops.json"
CONTRIB = ROOT / "contrib" / "prometheus"
TWIN_ALERTS = ("SpecopsTwinDown", "SpecopsClassAcceptanceLow")


def twin_series() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(twin_metrics_text()):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_the_dashboard_shows_each_engine_and_each_class():
    """A panel for the engines live, the routed share per engine, per-class acceptance, share, tokens/s and mean
    acceptance length; every twin series they read is one a deployment with twins exports, grouped by labels it
    has."""
    series = twin_series()
    doc = json.loads(DASHBOARD.read_text())
    exprs = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in doc["panels"]}
    share = " ".join(exprs["Routed share per engine"])
    assert "sum by (engine) (rate(specops_routed_requests_total" in share and "group_left()" in share
    assert "specops_engine_live" in " ".join(exprs["Engines live"])
    assert "max by (cls) (specops_class_acceptance" in " ".join(exprs["Acceptance per request class"])
    assert "specops_class_on_share" in " ".join(exprs["Share of each class served speculating"])
    speed = " ".join(exprs["Tokens/s per request class"])
    assert "max by (cls, speculation) (specops_class_tokens_per_second" in speed
    assert "specops_class_mean_acceptance_length" in " ".join(exprs["Mean acceptance length per request class"])
    for expr in (e for es in exprs.values() for e in es):
        for name in re.findall(r"specops_(?:engine_live|routed_requests_total|class_\w+)", expr):
            assert name in series, name
            groups = {g.strip() for m in re.findall(r"by \(([^)]*)\)", expr) for g in m.split(",")}
            assert groups <= series[name] | {"job", "instance"}, (expr, groups)


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        unavailable("promtool is not installed (apt-get install prometheus)")
    return exe


def test_the_twin_alerts_fire_and_stay_quiet():
    """`SpecopsTwinDown` and `SpecopsClassAcceptanceLow` exist, read only series a deployment with twins exports,
    and have promtool unit tests where they fire and where they stay quiet; the tests pass."""
    doc = yaml.safe_load((CONTRIB / "alerts.yml").read_text(encoding="utf-8"))
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    series = twin_series()
    for name in TWIN_ALERTS:
        assert name in rules, name
        used = set(re.findall(r"specops_\w+", rules[name]["expr"]))
        assert used and used <= set(series), (name, used - set(series))
    tests = yaml.safe_load((CONTRIB / "alerts_test.yml").read_text(encoding="utf-8"))["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for name in TWIN_ALERTS:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine) and any(not c["exp_alerts"] for c in mine), name
    res = subprocess.run(
        [_promtool(), "test", "rules", "alerts_test.yml"], capture_output=True, text=True, cwd=CONTRIB, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("alert", TWIN_ALERTS)
def test_a_twin_alert_that_never_fires_is_noticed(tmp_path, alert):
    doc = yaml.safe_load((CONTRIB / "alerts.yml").read_text(encoding="utf-8"))
    found = False
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"], found = "vector(1) == 0", True
    assert found, alert
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    shutil.copy(CONTRIB / "alerts_test.yml", tmp_path / "alerts_test.yml")
    res = subprocess.run(
        [_promtool(), "test", "rules", "alerts_test.yml"], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert res.returncode != 0 and f"alertname: {alert}," in res.stdout + res.stderr
