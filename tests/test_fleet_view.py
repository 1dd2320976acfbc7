"""``specops status --fleet``: replicas as Prometheus sees them, and the fleet added up.

The fast tests feed :func:`specops.watch.fleet.aggregate` answers shaped like Prometheus' and check the
sums by hand; the ``prometheus`` test runs the real server scraping three in-process replicas (specops'
real proxy serving the watcher's real metrics registry, an engine stand-in behind it) and a fourth
target that is down, each with its own ``pod`` label, then runs the command.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest
from support_cli import run as run_cli
from support_prometheus import InProcessSpecops, llamacpp_text

from specops.watch.fleet import FleetError, FleetQueries, aggregate, fleet_text, parse_selector, read_fleet

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
Q = FleetQueries("pod", ('namespace="llm"',), 300.0).all()


def vec(value, **labels):
    return {"metric": labels, "value": [1.7e9, str(value)]}


def answers(**extra):
    """Two replicas: a on eagle3 with moving counters, b on ngram with only the watcher's window."""
    base = {
        "up": [vec(1, pod="a"), vec(1, pod="b"), vec(0, pod="c")],
        "method": [vec(1, pod="a", method="eagle3"), vec(1, pod="b", method="ngram")],
        "state": [vec(1, pod="a", state="ready"), vec(1, pod="b", state="switching")],
        "drafted": [vec(1000, pod="a"), vec(0, pod="b")],
        "accepted": [vec(700, pod="a"), vec(0, pod="b")],
        "window_acceptance": [vec(0.5, pod="a"), vec(0.25, pod="b")],
        "window_drafted": [vec(10, pod="a"), vec(3000, pod="b")],
        "mean_acceptance_length": [vec(2.4, pod="a")],
        "tokens_per_s": [vec(10, pod="a"), vec(5.5, pod="b")],
        "in_flight": [vec(2, pod="a"), vec(0, pod="b")],
        "queue": [vec(0, pod="a"), vec(3, pod="b")],
        "switches": [vec(1, pod="b")],
        "switch_gauges": [],
    }
    base.update(extra)
    return base


def test_aggregate_weights_acceptance_by_drafted_tokens():
    view = aggregate("pod", answers(), Q)
    a, b, c = view["replicas"]
    # counters moved on a: they win over its window gauges; b has only the watcher's window
    assert (a["acceptance"], a["draft_tokens"], a["acceptance_from"]) == (0.7, 1000, "counters")
    assert (b["acceptance"], b["draft_tokens"], b["acceptance_from"]) == (0.25, 3000, "watcher window")
    assert (a["method"], b["method"], c["method"]) == ("eagle3", "ngram", None)
    assert (a["state"], b["state"]) == ("ready", "switching")
    assert (a["up"], b["up"], c["up"]) == (True, True, False)
    f = view["fleet"]
    assert f["acceptance"] == pytest.approx((0.7 * 1000 + 0.25 * 3000) / 4000)  # 0.3625, not the mean 0.475
    assert f["methods"] == {"eagle3": 1, "ngram": 1}
    assert (f["replicas"], f["up"], f["down"]) == (3, 2, ["c"])
    assert (f["tokens_per_s"], f["in_flight"], f["queue"], f["switches"]) == (15.5, 2, 3, 1)
    assert view["empty_queries"] == []
    text = "\n".join(fleet_text(view))
    assert "fleet: 2/3 up; methods eagle3 ×1, ngram ×1; acceptance 0.362" in text
    assert "down: c" in text


def test_a_replica_waiting_for_a_switch_slot_is_named_and_absent_gauges_are_fine():
    gauges = [
        {"metric": {"__name__": "specops_switch_waiting", "pod": "b"}, "value": [1.7e9, "1"]},
        {"metric": {"__name__": "specops_switch_slot_held", "pod": "a"}, "value": [1.7e9, "1"]},
        {"metric": {"__name__": "specops_switch_waiting", "pod": "a"}, "value": [1.7e9, "0"]},
    ]
    view = aggregate("pod", answers(switch_gauges=gauges), Q)
    a, b, _ = view["replicas"]
    assert b["waiting_for_switch_slot"] and not a["waiting_for_switch_slot"]
    assert a["holds_switch_slot"] and not b["holds_switch_slot"]
    assert a["switch_gauges"] == {"slot_held": 1.0, "waiting": 0.0}
    assert (view["fleet"]["waiting_for_switch_slot"], view["fleet"]["holding_switch_slot"]) == (["b"], ["a"])
    text = fleet_text(view)
    assert "waiting for a switch slot: b" in text
    assert [line.split()[-1] for line in text[1:3]] == ["held", "waiting"]
    plain = aggregate("pod", answers(), Q)  # coordination off: no specops_switch_* series at all
    assert plain["fleet"]["waiting_for_switch_slot"] == [] and plain["empty_queries"] == []
    # the coordination's counter and the switch-duration histogram are not gauges to show
    assert '__name__!~"specops_switch_duration_seconds.*|.+_total|.+_created"' in Q["switch_gauges"]


def test_label_values_from_the_targets_reach_the_terminal_escaped():
    """A scraped target chooses its label values: none can move the cursor (ESC, CSI U+009B) or reorder the line
    (U+202E) in the table, the fleet line or the lists of names."""
    hostile = "a\x1b[2J\u009b31m\u202eb"
    view = aggregate(
        "pod",
        answers(
            up=[vec(1, pod=hostile), vec(0, pod="c\x1b]0;x\x07")],
            method=[vec(1, pod=hostile, method="eagle3\x1b[1A")],
            state=[vec(1, pod=hostile, state="ready\u202e")],
        ),
        Q,
    )
    text = "\n".join(fleet_text(view))
    assert not any(ch in text for ch in "\x1b\x07\u009b\u202e")
    assert "a\\x1b[2J\\x9b31m\\u202eb" in text and "eagle3\\x1b[1A \u00d71" in text
    assert text.splitlines()[-1].startswith("down: ") and text.endswith(", c\\x1b]0;x\\x07")


def test_empty_answers_say_which_query_returned_nothing():
    with pytest.raises(FleetError, match=r"no scrape target matches: `max by \(pod\) \(up\{namespace=\"llm\"\}\)`"):
        aggregate("pod", answers(up=[]), Q)
    with pytest.raises(FleetError, match="none exports specops' metrics: `max by \\(pod, method\\)"):
        aggregate("pod", answers(method=[], state=[], in_flight=[]), Q)
    no_pod = [vec(1, instance="10.0.0.1:8000", job="specops")]
    with pytest.raises(FleetError, match="the targets have no 'pod' label .*instance, job: pass --by LABEL"):
        aggregate("pod", answers(up=no_pod), Q)
    view = aggregate("pod", answers(tokens_per_s=[]), Q)
    assert view["empty_queries"] == ["tokens_per_s"]
    assert view["fleet"]["tokens_per_s"] is None
    assert f"no data: tokens_per_s (`{Q['tokens_per_s']}` returned nothing)" in fleet_text(view)


def test_selector_is_parsed_into_matchers_or_a_located_error():
    assert parse_selector('namespace="llm", job=~"spec.*",pod!="x"') == ['namespace="llm"', 'job=~"spec.*"', 'pod!="x"']
    assert parse_selector('{a="1"}') == ['a="1"']
    assert parse_selector(None) == [] and parse_selector("  ") == []
    with pytest.raises(FleetError, match=r"--selector: column 11: expected LABEL=\"value\".* at 'job=spec'"):
        parse_selector('a="1",    job=spec')
    assert FleetQueries("replica", ('a="1"',), 90).all()["up"] == 'max by (replica) (up{a="1"})'
    assert FleetQueries("pod", (), 90).all()["drafted"] == (
        "sum by (pod) (increase(specops_draft_tokens_seen_total[90s]))"
    )


def test_unreachable_prometheus_is_one_clear_line():
    from support_ports import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(FleetError, match=rf"Prometheus http://127.0.0.1:{port} unreachable: ConnectionError"):
        read_fleet(f"http://127.0.0.1:{port}", "pod", [], 60)
    res = run_cli("status", "--fleet", f"http://127.0.0.1:{port}")
    assert res.code == 1
    assert f"error: Prometheus http://127.0.0.1:{port} unreachable" in (res.stdout + res.stderr)
    assert "Traceback" not in (res.stdout + res.stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--by", "x"], "--by, --selector and --window go with --fleet PROMETHEUS_URL"),
        (["--fleet", "prometheus:9090"], "'prometheus:9090' is not an http(s) URL"),
        (["--fleet", "http://127.0.0.1:1", "--window", "soon"], "invalid duration 'soon'"),
        (["--fleet", "http://127.0.0.1:1", "--window", "0s"], "the window must be longer than 0s"),
        (["--fleet", "http://127.0.0.1:1", "--by", "pod-name"], "--by: 'pod-name' is not a Prometheus label name"),
        (["--fleet", "http://127.0.0.1:1", "--selector", "namespace"], "--selector: column 1: expected"),
    ],
)
def test_bad_fleet_options_are_clear_errors(args, message):
    res = run_cli("status", *args)
    assert res.code in (1, 2), res.stdout + res.stderr
    assert message in (res.stdout + res.stderr)
    assert "Traceback" not in (res.stdout + res.stderr)


def test_the_profile_selects_the_label_the_podmonitor_copies():
    """NAME adds the matcher for the pods' app.kubernetes.io/instance as the rendered PodMonitor names it."""
    import yaml

    from specops.commands.status import FLEET_INSTANCE_LABEL

    res = run_cli("k8s", "render", "profiles/llama31-8b-eagle3.yaml")
    assert res.code == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    monitors = [d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")]
    pods = [d for d in docs if d["kind"] == "Deployment"]
    assert monitors and pods
    for m in monitors:
        copied = m["spec"].get("podTargetLabels") or m["spec"].get("targetLabels")
        # Prometheus turns every character a label name cannot hold into '_'
        assert [re.sub(r"[^A-Za-z0-9_]", "_", c) for c in copied] == [FLEET_INSTANCE_LABEL]
        pod_labels = pods[0]["spec"]["template"]["metadata"]["labels"]
        assert pod_labels[copied[0]] == "llama31-8b-eagle3"  # what `status llama31-8b-eagle3 --fleet` matches


# ---------------------------------------------------------------------------------------------------
# a real Prometheus scraping replicas


class Replica(InProcessSpecops):
    """specops' real proxy in a background loop serving the watcher's real metrics, an engine stand-in behind."""

    def __init__(self, method: str):
        super().__init__(llamacpp_text(10, 40, 30), queue_size=4, queue_timeout=60)
        self.metrics.set_method(method, ["eagle3", "ngram", "none"])
        self.metrics.set_state("ready")

    def observe(self, acceptance, draft_tokens, length, tps, counters=None) -> None:
        """What the watcher records each tick (Watcher.handle → SpecopsMetrics.observe)."""
        from specops.watch.watcher import Reading
        from specops.watch.window import OK, WindowStats

        stats = WindowStats(
            OK,
            window_s=60.0,
            start=0.0,
            end=60.0,
            acceptance=acceptance,
            mean_acceptance_length=length,
            draft_tokens=draft_tokens,
            accepted=acceptance * draft_tokens,
            full=True,
        )
        self.metrics.observe(Reading(stats, tps, counters))


@pytest.mark.prometheus
def test_fleet_view_from_a_real_prometheus(tmp_path):
    from support_ports import free_port
    from support_prometheus import labelled_prometheus, require_prometheus, wait_until

    from specops.backends.counters import SpecCounters

    require_prometheus()
    with Replica("eagle3") as a, Replica("eagle3") as b, Replica("ngram") as c:
        # c stands in for a replica whose switch coordination exports a gauge (absent on a and b)
        from prometheus_client import Counter, Gauge

        Gauge("specops_switch_waiting", "waiting for a switch slot", registry=c.metrics.registry).set(1)
        Gauge("specops_switch_slot_held", "holds a switch slot", registry=b.metrics.registry).set(1)
        Counter("specops_switch_slot_waits", "waits", registry=a.metrics.registry).inc(3)  # not a wait now
        a.observe(0.7, 1000, 2.9, 12.5, SpecCounters(draft_tokens=0, accepted=0))
        b.observe(0.4, 600, 1.8, 20.0)  # no counters: a promql-sourced watcher
        c.observe(0.9, 200, 3.1, 30.0)
        targets = {"replica-a": a.address, "replica-b": b.address, "replica-c": c.address}
        targets["replica-d"] = f"127.0.0.1:{free_port()}"  # down
        with labelled_prometheus(tmp_path, targets) as prom:
            wait_until(lambda: prom.value("count(specops_proxy_in_flight)") == 3, 30, "three replicas scraped")
            wait_until(lambda: prom.value("count(up == 0)") == 2, 30, "replica-d down (both jobs)")
            time.sleep(1.2)  # a's zero counters are in Prometheus before they move
            # a's counters move; b falls back eagle3 → ngram; b's proxy holds, one request waits in its queue
            a.observe(0.7, 1000, 2.9, 12.5, SpecCounters(draft_tokens=1000, accepted=700))
            b.metrics.fallbacks.labels("eagle3", "ngram", "threshold").inc()
            b.metrics.set_method("ngram", ["eagle3", "ngram", "none"])
            b.loop.call_soon_threadsafe(b.proxy.hold)
            waiter = threading.Thread(target=_queued_request, args=(b.address,), daemon=True)
            time.sleep(0.3)
            waiter.start()
            wait_until(
                lambda: (
                    prom.value('specops_proxy_queue_depth{pod="replica-b"}') == 1
                    and prom.value('sum(specops_fallbacks_total{pod="replica-b"})') == 1
                    and (prom.value('increase(specops_draft_tokens_seen_total{pod="replica-a"}[5m])') or 0) > 0
                ),
                30,
                "the changes scraped",
            )
            res = run_cli("status", "demo", "--fleet", prom.url, "--selector", 'namespace="llm"', "--json")
            text = run_cli("status", "demo", "--fleet", prom.url, "--selector", 'namespace="llm"')
            none = run_cli("status", "other-profile", "--fleet", prom.url)
            print("\n".join(["", "$ specops status demo --fleet URL --selector 'namespace=\"llm\"'", text.stdout]))
            b.loop.call_soon_threadsafe(b.proxy.release)
            waiter.join(15)
    assert res.code == 0, res.stdout + res.stderr
    view = json.loads(res.stdout)
    rows = {r["replica"]: r for r in view["replicas"]}
    assert set(rows) == {"replica-a", "replica-b", "replica-c", "replica-d"}
    ra, rb, rc, rd = (rows[k] for k in sorted(rows))
    assert [r["method"] for r in (ra, rb, rc, rd)] == ["eagle3", "ngram", "ngram", None]
    assert [r["up"] for r in (ra, rb, rc, rd)] == [True, True, True, False]
    # 700 / 1000: both increase()s are extrapolated alike only because every query runs at one instant
    assert ra["acceptance_from"] == "counters" and ra["acceptance"] == pytest.approx(0.7)
    assert ra["draft_tokens"] >= 1000  # increase() extrapolates, never below what moved
    assert (rb["acceptance"], rb["draft_tokens"], rb["acceptance_from"]) == (0.4, 600, "watcher window")
    assert (rc["acceptance"], rc["draft_tokens"]) == (0.9, 200)
    assert [r["mean_acceptance_length"] for r in (ra, rb, rc)] == [2.9, 1.8, 3.1]
    assert [r["tokens_per_s"] for r in (ra, rb, rc)] == [12.5, 20.0, 30.0]
    assert [r["switches"] for r in (ra, rb, rc)] == [0, 1, 0]
    assert [r["queue"] for r in (ra, rb, rc)] == [0, 1, 0]
    assert [r["state"] for r in (ra, rb, rc)] == ["ready"] * 3
    assert rc["waiting_for_switch_slot"] and rc["switch_gauges"] == {"waiting": 1.0}
    assert rb["holds_switch_slot"] and rb["switch_gauges"] == {"slot_held": 1.0}
    assert not ra["waiting_for_switch_slot"] and ra["switch_gauges"] == {}
    f = view["fleet"]
    d_a = ra["draft_tokens"]
    assert f["acceptance"] == pytest.approx((0.7 * d_a + 0.4 * 600 + 0.9 * 200) / (d_a + 800))
    assert f["methods"] == {"eagle3": 1, "ngram": 2}
    assert (f["replicas"], f["up"], f["down"]) == (4, 3, ["replica-d"])
    assert (f["tokens_per_s"], f["queue"], f["switches"]) == (62.5, 1, 1)
    assert (f["waiting_for_switch_slot"], f["holding_switch_slot"]) == (["replica-c"], ["replica-b"])
    assert 'app_kubernetes_io_instance="demo"' in view["queries"]["up"]
    assert text.code == 0, text.stdout
    lines = text.stdout.splitlines()
    assert lines[0].split()[:4] == ["pod", "up", "method", "state"]
    assert [ln.split()[:3] for ln in lines[1:5]] == [
        ["replica-a", "up", "eagle3"],
        ["replica-b", "up", "ngram"],
        ["replica-c", "up", "ngram"],
        ["replica-d", "DOWN", "-"],
    ]
    assert "fleet: 3/4 up; methods eagle3 ×1, ngram ×2; acceptance" in text.stdout
    assert "waiting for a switch slot: replica-c" in text.stdout
    assert none.code == 1
    assert 'no scrape target matches: `max by (pod) (up{app_kubernetes_io_instance="other-profile"})`' in none.stderr


def _queued_request(address: str) -> None:
    req = urllib.request.Request(f"http://{address}/v1/models")
    try:
        with NO_PROXY.open(req, timeout=20) as resp:
            resp.read()
    except OSError:
        pass


def test_the_watcher_moves_the_active_method_gauge_on_a_switch_and_exports_tokens_per_s():
    """What the fleet view reads per replica: specops_active_method follows every new engine, and
    specops_tokens_per_second is the watcher's reading (NaN, so filtered out, when the engine has no counter)."""
    import math

    from support_upstream import Upstream
    from support_watch import PROFILE, FakeClock, backend, make_watcher, plan_for

    from specops.methods import Method
    from specops.run.events import EngineReady
    from specops.run.instance import EventLog
    from specops.watch.watcher import AcceptanceReader, Reading
    from specops.watch.window import OK, WindowStats

    reader = AcceptanceReader.for_profile(PROFILE, backend())
    watcher, _, _ = make_watcher(reader, FakeClock(10.0), lambda d: True, EventLog(None), [])
    m = watcher.metrics.registry

    def active() -> dict:
        return {s.value: m.get_sample_value("specops_active_method", {"method": s.value}) for s in Method}

    with Upstream.start("engine") as up:
        watcher.on_event(EngineReady(0, Method.DRAFT_MODEL, plan_for(up), 1.0))
        assert {k for k, v in active().items() if v == 1.0} == {"draft_model"}
        watcher.on_event(EngineReady(1, Method.NGRAM, plan_for(up), 1.0))  # the switch's new engine
        assert {k for k, v in active().items() if v == 1.0} == {"ngram"}
        assert active()["draft_model"] == 0.0
    stats = WindowStats(OK, window_s=60.0, acceptance=0.5, draft_tokens=100)
    watcher.metrics.observe(Reading(stats, 41.5))
    assert m.get_sample_value("specops_tokens_per_second") == 41.5
    watcher.metrics.observe(Reading(stats, None))
    assert math.isnan(m.get_sample_value("specops_tokens_per_second"))
