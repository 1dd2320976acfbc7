"""Metric sources against real servers: a static exporter on loopback, and a real Prometheus scraping it."""

from __future__ import annotations

import socket
import threading

import pytest
from support_ports import free_port
from support_prometheus import (
    PrometheusServer,
    StaticExporter,
    llamacpp_text,
    require_prometheus,
    vllm_one,
    vllm_v1_text,
    wait_until,
)

from specops.backends.counters import SpecCounters
from specops.config.profile import ChainStep
from specops.methods import Method
from specops.plugins import get_registry
from specops.watch.decision import KEEP, SWITCH, PolicyConfig
from specops.watch.policy import Policy
from specops.watch.sources import (
    ACCEPTANCE_LINE,
    LogLineSource,
    PromQLSource,
    ScrapeSource,
    SourceError,
    promql_duration,
    promql_labels,
    selector,
)
from specops.watch.window import NO_DATA, OK, SPEC_OFF, UNAVAILABLE, Sample, SampleBuffer, WindowStats, window_stats

CHAIN = [
    ChainStep(method=Method.EAGLE3, draft="org/head"),
    ChainStep(method=Method.NGRAM),
    ChainStep(method=Method.NONE),
]


def tick(source, buf: SampleBuffer, now: float) -> WindowStats:
    """What the watcher does each interval: read, and on failure say so instead of deciding."""
    try:
        counters = source.read()
    except SourceError as exc:
        return WindowStats.unavailable(now, str(exc), buf.window_s)
    buf.add(Sample(now, counters))
    return buf.stats(now)


# ---------------------------------------------------------------------------------------------------
# scrape source against a real HTTP server


def test_scrape_reads_vllm_and_llamacpp():
    with StaticExporter(vllm_v1_text({"tiny": {"0": (10, 40, 30, [9, 8, 7, 6])}, "x": {"0": (1, 4, 0, [])}})) as ex:
        c = ScrapeSource(ex.url, "vllm:", "tiny", timeout=3).read()
        assert (c.drafts, c.draft_tokens, c.accepted, c.per_position) == (10, 40, 30, (9, 8, 7, 6))
        ex.set(llamacpp_text(40, 115, 80))
        c = ScrapeSource(ex.url, "llamacpp:").read()
        assert (c.draft_tokens, c.accepted, c.source) == (115, 80, "llamacpp")
        ex.set("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")
        assert ScrapeSource(ex.url, "vllm:").read() is None  # speculation off: None, not an error


def test_scrape_openmetrics_answer():
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST, generate_latest

    reg = CollectorRegistry()
    for name, v in (("num_drafts", 5), ("num_draft_tokens", 20), ("num_accepted_tokens", 13)):
        Counter(f"vllm:spec_decode_{name}", name, ["model_name"], registry=reg).labels("m").inc(v)
    with StaticExporter(generate_latest(reg, escaping="allow-utf-8").decode()) as ex:
        ex.content_type = CONTENT_TYPE_LATEST
        c = ScrapeSource(ex.url, "vllm:", "m").read()
        assert (c.drafts, c.draft_tokens, c.accepted) == (5, 20, 13)


def test_scrape_failures_raise_source_error():
    with StaticExporter(vllm_one(1, 4, 3)) as ex:
        src = ScrapeSource(ex.url, "vllm:", timeout=3)
        ex.set("internal error\n", status=500)
        with pytest.raises(SourceError, match="HTTP 500"):
            src.read()
        ex.set("<html>Bad Gateway</html>\n")
        with pytest.raises(SourceError, match="not a Prometheus exposition"):
            src.read()
        ex.set(b"\xff\xfe\x00garbage")
        with pytest.raises(SourceError, match="UTF-8"):
            src.read()
        with pytest.raises(SourceError, match="HTTP 404"):
            ScrapeSource(ex.url.replace("/metrics", "/nope"), "vllm:").read()
        port = ex.port
    with pytest.raises(SourceError, match="127.0.0.1"):
        ScrapeSource(f"http://127.0.0.1:{port}/metrics", "vllm:", timeout=3).read()  # nothing listens


def test_scrape_timeout_raises_source_error():
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
        with pytest.raises(SourceError):
            ScrapeSource(url, "vllm:", timeout=0.3).read()


def test_endpoint_down_no_switch_warning_then_recovery():
    """The watcher loop over a real endpoint that goes away for a while, acceptance low throughout."""
    config = PolicyConfig(window_s=20, consecutive_windows=2, min_draft_tokens=100, cooldown_s=0)
    policy = Policy(config, CHAIN)
    buf = SampleBuffer(config.window_s)
    ex = StaticExporter(vllm_one(0, 0, 0)).start()
    port = ex.port
    src = ScrapeSource(ex.url, "vllm:", "tiny", timeout=3)
    decisions = []
    try:
        down = range(3, 12)  # ticks 3..11 the endpoint is gone
        for i in range(0, 30):
            now = 5.0 * i
            n = i + 1
            if i == down.start:
                ex.stop()
            if i == down.stop:
                ex = StaticExporter(vllm_one(25 * n, 100 * n, 30 * n), port=port).start()
            if i not in down:
                ex.set(vllm_one(25 * n, 100 * n, 30 * n))  # acceptance 0.3, 100 tokens per tick
            stats = tick(src, buf, now)
            d = policy.observe(stats, now)
            decisions.append((i, stats, d))
            if d.acts:
                break
    finally:
        ex.stop()
    during = [(s, d) for i, s, d in decisions if i in down]
    assert all(s.status == UNAVAILABLE and d.action == KEEP for s, d in during)
    assert sum(1 for _, d in during if d.warning) == 1 and "127.0.0.1" in during[0][1].warning
    first_back = next(d for i, s, d in decisions if i == down.stop)
    assert "recovered" in first_back.reason
    last_i, last_stats, last = decisions[-1]
    assert last.action == SWITCH and last.to_step.method is Method.NGRAM and last_i > down.stop
    assert last.numbers["acceptance"] == pytest.approx(0.3)


def test_counter_reset_seen_through_scrape():
    with StaticExporter(vllm_one(2500, 10_000, 9_000)) as ex:
        src = ScrapeSource(ex.url, "vllm:")
        buf = SampleBuffer(60)
        buf.add(Sample(0, src.read()))
        ex.set(vllm_one(2600, 10_400, 9_100))
        buf.add(Sample(20, src.read()))
        ex.set(vllm_one(25, 100, 20))  # the engine restarted
        buf.add(Sample(40, src.read()))
        ex.set(vllm_one(75, 300, 60))
        buf.add(Sample(60, src.read()))
    s = buf.stats(60)
    assert s.status == OK and s.resets == 1
    assert (s.draft_tokens, s.accepted) == (700, 160)


def test_idle_engine_through_scrape_never_decides():
    policy = Policy(PolicyConfig(window_s=20, consecutive_windows=1, min_draft_tokens=1), CHAIN)
    buf = SampleBuffer(20)
    with StaticExporter(vllm_one(250, 1000, 100)) as ex:  # acceptance 0.1 in the past, nothing new
        src = ScrapeSource(ex.url, "vllm:")
        for i in range(12):
            d = policy.observe(tick(src, buf, 5.0 * i), 5.0 * i)
            assert d.action == KEEP and d.rule == "no-data"


# ---------------------------------------------------------------------------------------------------
# llama-server log lines

LINES = [
    "slot print_timing: id  0 | task 12 | prompt eval time =      10.53 ms /    12 tokens",
    "slot print_timing: id  0 | task 12 | draft acceptance = 0.69565 (   80 accepted /   115 generated), mean len = 2.40",
    "slot print_timing: id  1 | task 13 | draft acceptance rate = 0.50000 (   10 accepted /    20 generated)",
    "slot print_timing: id  1 | task 14 | draft acceptance = nan (    0 accepted /     0 generated)",
    "srv  log_server_r: request: POST /v1/completions 127.0.0.1 200",
]


def test_log_line_source_adds_up_requests():
    src = LogLineSource()
    assert src.read() == SpecCounters(0.0, 0.0, source="llamacpp-log")  # zero, not None, before any request
    took = [src.feed(line) for line in LINES]
    assert took == [False, True, True, True, False]
    c = src.read()
    assert (c.draft_tokens, c.accepted, c.drafts) == (135.0, 90.0, None) and src.lines == 3
    assert not src("draft acceptance = 1.5 (   30 accepted /    20 generated)")  # impossible: ignored
    # used exactly like a scrape source
    s = window_stats([Sample(0, SpecCounters(0.0, 0.0)), Sample(60, c)], now=60, window_s=60)
    assert s.status == OK and s.acceptance == pytest.approx(90 / 135)
    src.reset()
    assert src.read().draft_tokens == 0.0
    assert ACCEPTANCE_LINE.search(LINES[1]).groups() == ("80", "115")


def test_log_line_source_is_thread_safe():
    src = LogLineSource()
    line = "draft acceptance = 0.5 (  1 accepted /  2 generated)"

    def feed():
        for _ in range(2000):
            src.feed(line)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert src.read() == SpecCounters(16000.0, 8000.0, source="llamacpp-log")


# ---------------------------------------------------------------------------------------------------
# PromQL building blocks


def test_selector_and_duration():
    assert selector({}) == ""
    assert selector({"model_name": 'a"b\\c', "job": "e"}) == '{job="e",model_name="a\\"b\\\\c"}'
    with pytest.raises(ValueError):
        selector({"bad-name": "x"})
    assert promql_duration(60) == "60s" and promql_duration(1.5) == "1500ms"
    q = PromQLSource("http://127.0.0.1:1", "vllm:", {"model_name": "m", "job": "engine"}, 120)
    assert q.acceptance_query() == (
        'sum(rate(vllm:spec_decode_num_accepted_tokens_total{job="engine",model_name="m"}[120s])) / '
        'sum(rate(vllm:spec_decode_num_draft_tokens_total{job="engine",model_name="m"}[120s]))'
    )
    assert 'min(up{job="engine"})' in q.query()
    assert "up{" not in PromQLSource("http://127.0.0.1:1", "vllm:", {"model_name": "m"}, 60).query()
    # model_name defaults to the served model on vLLM only (llama-server labels nothing)
    vllm, llamacpp = get_registry().backend("vllm"), get_registry().backend("llamacpp")
    assert promql_labels(vllm.model_name_label, {"job": "j"}, "tiny") == {"job": "j", "model_name": "tiny"}
    assert promql_labels(vllm.model_name_label, {"model_name": "x"}, "tiny") == {"model_name": "x"}
    assert promql_labels(llamacpp.model_name_label, {"job": "j"}, "tiny") == {"job": "j"}


def test_bad_labels_and_windows_are_clean_source_errors():
    """A label name PromQL does not allow, or a window that is not a finite number of seconds, is a one-line
    SourceConfigError (a SpecopsError, so the CLI prints it) — never an OverflowError or a traceback."""
    from specops.errors import SpecopsError
    from specops.watch.sources import SourceConfigError

    for labels in ({"bad-name": "x"}, {"1x": "y"}, {"": "z"}, {"a b": "c"}):
        with pytest.raises(SourceConfigError) as exc:
            PromQLSource("http://127.0.0.1:1", "vllm:", labels, 60)
        assert isinstance(exc.value, SpecopsError) and "monitor.labels" in str(exc.value)
    for window in (float("inf"), float("-inf"), float("nan"), 0, -5, 1e308 * 10):
        with pytest.raises(SourceConfigError) as exc:
            promql_duration(window)
        assert "finite" in str(exc.value)
        with pytest.raises(SourceConfigError):
            PromQLSource("http://127.0.0.1:1", "vllm:", {}, window)
    with pytest.raises(SourceConfigError):
        promql_duration(10**400)  # an int too large for a float


def test_source_errors_never_show_credentials_or_query_values():
    port = free_port()
    src = ScrapeSource(f"http://user:s3cretpw@127.0.0.1:{port}/metrics?token=tok3n", "vllm:", timeout=1)
    with pytest.raises(SourceError) as exc:
        src.read()
    assert "s3cretpw" not in str(exc.value) and "tok3n" not in str(exc.value)
    assert "s3cretpw" not in repr(src)
    prom = PromQLSource(f"http://user:s3cretpw@127.0.0.1:{port}/?key=tok3n", "vllm:", {}, 60, timeout=1)
    try:
        with pytest.raises(SourceError) as exc:
            prom.read()
    finally:
        prom.close()
    assert "s3cretpw" not in str(exc.value) and "tok3n" not in str(exc.value) and "***@127.0.0.1" in str(exc.value)
    assert "s3cretpw" not in repr(prom)


def test_watcher_reading_of_a_credentialed_url_is_redacted():
    from specops.plugins import get_registry
    from specops.watch.watcher import AcceptanceReader

    reader = AcceptanceReader("scrape", get_registry().backend("llamacpp"), 5.0, 1.0)
    reader.attach(f"http://u:s3cretpw@127.0.0.1:{free_port()}/metrics?sig=tok3n", None)
    stats = reader.read_blocking(1.0).stats
    assert stats.status == UNAVAILABLE
    assert "s3cretpw" not in stats.reason and "tok3n" not in stats.reason


# ---------------------------------------------------------------------------------------------------
# a real Prometheus

T0 = {
    "tiny": {"0": (250, 1000, 900, [240, 220, 240, 200]), "1": (100, 400, 300, [90, 80, 70, 60])},
    "other": {"0": (100, 400, 360, [100, 90, 90, 80])},
}
# in the next state "tiny" drafted 1000 more tokens (600 on engine 0, 400 on engine 1), accepted 400 → 0.4;
# "other" drafted 400 more and accepted 360 → 0.9
T1 = {
    "tiny": {"0": (400, 1600, 1140, [330, 280, 290, 240]), "1": (200, 800, 460, [150, 110, 100, 100])},
    "other": {"0": (200, 800, 720, [200, 180, 180, 160])},
}


class World:
    def __init__(self, tmp):
        self.a = StaticExporter(vllm_v1_text(T0)).start()
        self.b = StaticExporter(llamacpp_text(10, 40, 30)).start()
        self.prom = PrometheusServer(tmp, [self.a.address, self.b.address], scrape_interval=1.0).start()

    def close(self):
        self.prom.stop()
        self.a.stop()
        self.b.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    require_prometheus()
    w = World(tmp_path_factory.mktemp("prometheus"))
    try:
        yield w
    finally:
        w.close()


@pytest.mark.prometheus
def test_promql_reaches_the_same_decision_as_scrape(world):
    ex, prom = world.a, world.prom
    tiny = f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny",instance="{ex.address}"}}'
    wait_until(lambda: (prom.value(f"min(count_over_time({tiny}[1m]))") or 0) >= 5, 60, "five scrapes of state 0")
    window = 3.0
    config = PolicyConfig(window_s=window, consecutive_windows=1, min_draft_tokens=500)

    # the scrape source: two readings of the same exporter, one window apart on the policy's clock
    scrape = ScrapeSource(ex.url, "vllm:", "tiny")
    c0 = scrape.read()
    ex.set(vllm_v1_text(T1))
    c1 = scrape.read()
    wait_until(lambda: prom.value(f"sum({tiny})") == 2400.0, 30, "Prometheus to scrape state 1")
    scrape_stats = window_stats([Sample(0.0, c0), Sample(window, c1)], now=window, window_s=window)

    # the PromQL source, evaluated just after Prometheus' first scrape of state 1 (found in the raw samples,
    # so a slow test machine that lets more scrapes pass still evaluates the window that holds the change)
    engine0 = tiny.replace("{", '{engine="0",')
    raw = prom.query(f"{engine0}[30s]")[0]["values"]
    t1 = min(float(ts) for ts, v in raw if float(v) == 1600.0)
    labels = {"model_name": "tiny", "job": "engine", "instance": ex.address}
    promql = PromQLSource(prom.url, "vllm:", labels, window_s=window, timeout=3)
    promql_stats = promql.read(now=window, eval_time=t1 + 0.01)

    assert scrape_stats.status == promql_stats.status == OK and promql_stats.full
    assert scrape_stats.acceptance == pytest.approx(0.4)
    assert promql_stats.acceptance == pytest.approx(scrape_stats.acceptance, rel=1e-9)
    assert promql_stats.mean_acceptance_length == pytest.approx(scrape_stats.mean_acceptance_length, rel=1e-9)
    assert promql_stats.per_position == pytest.approx(scrape_stats.per_position, rel=1e-9)
    assert promql_stats.draft_tokens >= 1000 - 1e-6  # Prometheus extrapolates over the window
    # the ratio-of-rates, evaluated by Prometheus itself, is the same number
    assert prom.value(promql.acceptance_query(), at=t1 + 0.01) == pytest.approx(promql_stats.acceptance, rel=1e-9)

    by_scrape = Policy(config, CHAIN).observe(scrape_stats, window)
    by_promql = Policy(config, CHAIN).observe(promql_stats, window)
    assert by_scrape.action == by_promql.action == SWITCH
    assert (by_scrape.rule, by_scrape.to_step) == (by_promql.rule, by_promql.to_step) == ("threshold", CHAIN[1])
    assert by_scrape.numbers["acceptance"] == pytest.approx(by_promql.numbers["acceptance"])

    # one Prometheus, many deployments: the other model's matchers see its own acceptance
    other = PromQLSource(prom.url, "vllm:", {**labels, "model_name": "other"}, window_s=window)
    other_stats = other.read(now=window, eval_time=t1 + 0.01)
    assert other_stats.acceptance == pytest.approx(0.9)
    assert Policy(config, CHAIN).observe(other_stats, window).rule == "above-threshold"
    # labels that match no series: speculation off for that deployment, not an error
    none = PromQLSource(prom.url, "vllm:", {**labels, "model_name": "nobody"}, window_s=window)
    assert none.read(eval_time=t1 + 0.01).status == SPEC_OFF


@pytest.mark.prometheus
def test_promql_idle_and_target_down(world):
    ex, prom = world.b, world.prom
    labels = {"job": "engine", "instance": ex.address}
    sel = f'llamacpp:spec_decode_num_draft_tokens_total{{instance="{ex.address}"}}'
    # three scrapes, the latest answered: under load one scrape can miss its 1 s timeout, and the target then reads down
    up = f'up{{instance="{ex.address}"}}'
    wait_until(
        lambda: (prom.value(f"count_over_time({sel}[1m])") or 0) >= 3 and prom.value(up) == 1,
        60,
        "three scrapes of exporter b, the latest answered",
    )
    src = PromQLSource(prom.url, "llamacpp:", labels, window_s=3, timeout=3)
    idle = src.read(now=100.0)
    assert idle.status == NO_DATA and "idle" in idle.reason  # counters unchanged: no data, never 0
    assert Policy(PolicyConfig(window_s=3, consecutive_windows=1), CHAIN).observe(idle, 100).rule == "no-data"

    port = ex.port
    ex.stop()
    try:
        wait_until(lambda: prom.value(up) == 0, 30, "Prometheus to see the target down")
        down = src.read(now=101.0)
        assert down.status == NO_DATA and "down" in down.reason
    finally:
        world.b = StaticExporter(llamacpp_text(10, 40, 30), port=port).start()
    wait_until(lambda: prom.value(f'up{{instance="{world.b.address}"}}') == 1, 30, "the target back up")
    back = src.read(now=102.0)
    assert back.status in (NO_DATA, OK) and "down" not in back.reason


@pytest.mark.prometheus
def test_prometheus_unreachable_then_back(world, tmp_path):
    port = free_port()
    src = PromQLSource(f"http://127.0.0.1:{port}", "vllm:", {"model_name": "tiny"}, window_s=3, timeout=2)
    with pytest.raises(SourceError, match="unreachable"):
        src.read()
    policy = Policy(PolicyConfig(window_s=3, consecutive_windows=1), CHAIN)

    def read_tick(now):
        try:
            return src.read(now=now)
        except SourceError as exc:
            return WindowStats.unavailable(now, str(exc))

    d1 = policy.observe(read_tick(10.0), 10.0)
    d2 = policy.observe(read_tick(11.0), 11.0)
    assert (d1.rule, d2.rule) == ("source-unavailable", "source-unavailable")
    assert d1.warning and "unreachable" in d1.warning and d2.warning is None
    with PrometheusServer(tmp_path, [world.a.address], port=port):
        stats = read_tick(12.0)
        assert stats.status != UNAVAILABLE
        d3 = policy.observe(stats, 12.0)
        assert "recovered after 2s" in d3.reason and not d3.acts
