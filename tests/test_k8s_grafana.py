"""The Grafana dashboard (contrib/grafana/specops.json) queries only series that exist.

specops' own names are read from a real exposition (the watcher's registry behind a real, unstarted
proxy, with every labelled series set once), the engines' names from the backends that read them; the
labels a query groups or filters by must exist on its series.
"""

from __future__ import annotations

import json
import re

import pytest
from support_cli import ROOT
from support_twin_metrics import twin_metrics_text

DASHBOARD = ROOT / "contrib" / "grafana" / "specops.json"
#: PromQL words that look like metric names.
KEYWORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "irate", "histogram_quantile", "by", "without",
    "ignoring", "on", "group_left", "group_right", "and", "or", "unless", "bool", "label_values", "offset",
}  # fmt: skip
NAME = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")


def specops_series() -> dict[str, set[str]]:
    """Every series specops exposes on /specops/metrics -> its label names."""
    from prometheus_client.parser import text_string_to_metric_families

    from specops.proxy.server import Proxy
    from specops.watch.watcher import SpecopsMetrics

    m = SpecopsMetrics()
    m.method.labels(method="eagle3").set(1)
    m.state.labels(state="ready").set(1)
    m.decisions.labels(action="switch", rule="low_acceptance").inc()
    m.fallbacks.labels(from_method="eagle3", to_method="ngram", reason="low acceptance").inc()
    proxy = Proxy("127.0.0.1", 1, queue_size=1, queue_timeout=1, drain_timeout=1, metrics_registry=m.registry)
    out: dict[str, set[str]] = {}
    twins = twin_metrics_text()  # a deployment with twins and request classes
    for text in (proxy.metrics_text().decode(), twins):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    # counters with labels the proxy fills only when it happens
    for name, label in (("specops_proxy_rejected_total", "reason"), ("specops_proxy_refused_total", "reason")):
        out.setdefault(name, set()).add(label)
    return out


def engine_series() -> dict[str, set[str]]:
    """The engine series specops itself reads (specops.backends), with the labels the engines give them."""
    from specops.backends.counters import series_names

    out: dict[str, set[str]] = {}
    for prefix in ("vllm:", "llamacpp:"):
        for role, name in series_names(prefix).items():
            out[name] = {"position"} if role == "per_position" else set()
    for module in ("vllm", "llamacpp"):
        text = (ROOT / "specops" / "backends" / f"{module}.py").read_text()
        for name in re.findall(r'counter_total\(metrics_text, "([^"]+)"\)', text):
            out[name] = set()
    vllm = {n: labels | {"model_name", "engine"} for n, labels in out.items() if n.startswith("vllm:")}
    return {**out, **vllm}


def queries(dashboard=DASHBOARD) -> list[tuple[str, set[str]]]:
    """(PromQL, labels it reads besides its own matchers and groupings): panels and variables."""
    doc = json.loads(dashboard.read_text())
    out = [(t["expr"], set()) for p in doc["panels"] for t in p.get("targets", [])]
    for v in doc["templating"]["list"]:
        if v.get("definition"):
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["definition"])
            assert m, v["definition"]
            out.append((m.group(1), {m.group(2)}))
    return out


def names_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, labels or values."""
    text = re.sub(r'"[^"]*"', '""', expr)  # label values
    text = re.sub(r"\$\w+", "", text)  # Grafana variables ($__range, $job)
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges
    text = re.sub(r"\b(by|without|ignoring|on|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    return {n for n in NAME.findall(text) if n not in KEYWORDS}


def test_dashboard_is_grafana_json():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 30
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")") and t["expr"].count("{") == t["expr"].count("}")


def test_every_metric_in_the_dashboard_exists():
    known = {**specops_series(), **engine_series()}
    used = set()
    for expr, _ in queries():
        names = names_in(expr)
        assert names, expr
        for name in names:
            assert name in known, f"{name} (in {expr!r}) is exported by neither specops nor the engines it reads"
        used |= names
    # the promised panels: acceptance, per position, mean length, method, switches, queue/wait, tokens/s
    for name in (
        "specops_acceptance_rate",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "specops_mean_acceptance_length",
        "specops_active_method",
        "specops_fallbacks_total",
        "specops_proxy_queue_depth",
        "specops_proxy_wait_seconds_total",
        "vllm:generation_tokens_total",
        "llamacpp:tokens_predicted_total",
    ):
        assert name in used, name


def test_labels_the_dashboard_uses_exist():
    known = {**specops_series(), **engine_series()}
    common = {"job", "instance", "le"}  # Prometheus' target labels, and histogram buckets
    for expr, extra in queries():
        names = names_in(expr)
        groups = {g.strip() for m in re.findall(r"by \(([^)]*)\)", expr) for g in m.split(",") if g.strip()} | extra
        selectors = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*\"", expr))
        have = set().union(*(known[n] for n in names)) | common
        assert groups <= have, (expr, groups - have)
        assert selectors <= have, (expr, selectors - have)


@pytest.mark.parametrize(
    "expr,names",
    [
        ('sum by (x) (rate(a_total{job=~"$job"}[5m])) / sum(rate(b:c_total[5m]))', {"a_total", "b:c_total"}),
        ("max by (instance, method) (specops_active_method) == 1", {"specops_active_method"}),
        ("histogram_quantile(0.95, sum by (le) (rate(h_bucket[1h])))", {"h_bucket"}),
    ],
)
def test_the_name_extraction(expr, names):
    assert names_in(expr) == names


def test_a_missing_metric_is_caught():
    known = {**specops_series(), **engine_series()}
    assert names_in("rate(specops_acceptance_ratio[5m])") == {"specops_acceptance_ratio"}
    assert "specops_acceptance_ratio" not in known and "vllm:num_requests_running" not in known
    assert "specops_fallbacks" not in known  # a counter is exposed as specops_fallbacks_total


# ------------------------------------------------------------------------------------------- the pools dashboard

POOLS_DASHBOARD = ROOT / "contrib" / "grafana" / "specops-pools.json"


def pool_target_labels() -> set[str]:
    """The labels a pool's PodMonitor copies from its pods onto every series, as Prometheus names them."""
    from support_cli import run
    from support_k8s import objects

    res = run("k8s", "render", str(ROOT / "tests/k8s_profiles/vllm-pools.yaml"), env={"SPECOPS_API_KEY": None})
    assert res.code == 0, res.stderr
    monitors = [o for o in objects(res.stdout) if o["kind"] == "PodMonitor"]
    assert len(monitors) == 2
    return {re.sub(r"[^a-zA-Z0-9_]", "_", label) for m in monitors for label in m["spec"]["podTargetLabels"]}


def test_the_pools_dashboard_reads_series_and_labels_that_exist():
    """Every metric is specops' or an engine's (the two the speculating pool's autoscaler reads); every label it
    groups or filters by is on those series or copied onto them by the pools' PodMonitors (specops_dev_pool)."""
    from specops.plugins import get_registry

    running = {b.running_requests_metric for b in get_registry().backends.values() if b.running_requests_metric}
    doc = json.loads(POOLS_DASHBOARD.read_text())
    assert doc["uid"] == "specops-pools" and len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    known = {**specops_series(), **engine_series(), **{series: set() for series in running}}
    targets = pool_target_labels()
    assert "specops_dev_pool" in targets
    exprs = queries(POOLS_DASHBOARD)
    for expr, _ in exprs:
        assert expr.count("(") == expr.count(")"), expr
        names = names_in(expr)
        assert names, expr
        for name in names:
            assert name in known, f"{name} (in {expr!r}) is exported by neither specops nor the engines"
        groups = {g.strip() for m in re.findall(r"by \(([^)]*)\)", expr) for g in m.split(",") if g.strip()}
        selectors = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*\"", expr))
        have = set().union(*(known[n] for n in names)) | targets
        assert groups | selectors <= have, (expr, (groups | selectors) - have)
    # both pools, and each one's share of the requests
    text = json.dumps(doc)
    assert 'specops_dev_pool=\\"speculating\\"' in text and 'specops_dev_pool=\\"plain\\"' in text
    shares = [t for p in doc["panels"] if "Share" in p["title"] for t in p["targets"]]
    assert [t["legendFormat"] for t in shares] == ["speculating", "plain"]
