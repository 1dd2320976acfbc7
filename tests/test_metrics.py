"""Parsing engine /metrics text into spec-decode counters (vLLM V1, vLLM V0, llama-server)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from support_prometheus import llamacpp_text, vllm_one, vllm_v1_text

from specops.backends.counters import (
    MetricsError,
    SpecCounters,
    normalize_prefix,
    parse_spec_counters,
    series_names,
    spec_counters_from_families,
)

V0_TEXT = """\
# HELP vllm:spec_decode_draft_acceptance_rate Speulative token acceptance rate.
# TYPE vllm:spec_decode_draft_acceptance_rate gauge
vllm:spec_decode_draft_acceptance_rate{model_name="m"} 0.71
# HELP vllm:spec_decode_efficiency Speculative decoding system efficiency.
# TYPE vllm:spec_decode_efficiency gauge
vllm:spec_decode_efficiency{model_name="m"} 0.52
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 71000.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 100000.0
# HELP vllm:spec_decode_num_emitted_tokens_total Number of emitted tokens.
# TYPE vllm:spec_decode_num_emitted_tokens_total counter
vllm:spec_decode_num_emitted_tokens_total{model_name="m"} 90000.0
"""


def test_vllm_v1_sums_engines_and_keeps_positions():
    text = vllm_v1_text({"tiny": {"0": (10, 30, 20, [9, 7, 4]), "1": (5, 15, 6, [4, 2, 0])}})
    c = parse_spec_counters(text, "vllm:")
    assert c == SpecCounters(
        draft_tokens=45.0, accepted=26.0, drafts=15.0, per_position=(13.0, 9.0, 4.0), source="vllm-v1"
    )
    assert c.acceptance == pytest.approx(26 / 45)


def test_vllm_v1_skips_created_gauges():
    # the *_created gauges hold epoch seconds: summing them in would make acceptance nonsense
    text = vllm_v1_text({"tiny": {"0": (10, 40, 30, [])}}, created=1.7e9)
    assert "vllm:spec_decode_num_draft_tokens_created" in text
    c = parse_spec_counters(text, "vllm:")
    assert (c.drafts, c.draft_tokens, c.accepted) == (10.0, 40.0, 30.0)


def test_vllm_v1_filters_on_model_name():
    text = vllm_v1_text({"a": {"0": (10, 40, 30, [])}, "b": {"0": (100, 400, 100, [])}})
    assert parse_spec_counters(text, "vllm:", "a").accepted == 30.0
    assert parse_spec_counters(text, "vllm:", "b").accepted == 100.0
    assert parse_spec_counters(text, "vllm:").accepted == 130.0
    assert parse_spec_counters(text, "vllm:", "nobody") is None


def test_real_prometheus_client_exposition_parses():
    # the same library vLLM uses to write its /metrics, with the same colon names and labels
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "drafts", labels, registry=reg)
    tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens", labels, registry=reg)
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", labels, registry=reg)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", labels + ["position"], registry=reg)
    Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=reg).labels("m", "0").set(0.5)
    for engine, (d, t, a, pp) in {"0": (8, 32, 20, [8, 6, 4, 2]), "1": (2, 8, 1, [1, 0, 0, 0])}.items():
        drafts.labels("m", engine).inc(d)
        tokens.labels("m", engine).inc(t)
        accepted.labels("m", engine).inc(a)
        for pos, v in enumerate(pp):
            per_pos.labels("m", engine, str(pos)).inc(v)
    text = generate_latest(reg).decode()
    assert "vllm:spec_decode_num_drafts_created" in text
    c = parse_spec_counters(text, "vllm", "m")
    assert (c.drafts, c.draft_tokens, c.accepted, c.per_position) == (10.0, 40.0, 21.0, (9.0, 6.0, 4.0, 2.0))
    # the OpenMetrics rendering of the same registry, names unescaped, gives the same counters
    om = generate_openmetrics(reg, escaping="allow-utf-8").decode()
    assert om.rstrip().endswith("# EOF")
    assert parse_spec_counters(om, "vllm:", "m", openmetrics=True) == c
    # prometheus/client_python#1177: with the default escaping prometheus_client >= 0.23 writes `vllm_...` samples under
    # `vllm:...` families; that is refused loudly, never read as "no series"
    escaped = generate_openmetrics(reg).decode()
    assert "vllm_spec_decode_num_drafts_total" in escaped
    with pytest.raises(MetricsError):
        parse_spec_counters(escaped, "vllm:", "m", openmetrics=True)


def test_llamacpp_counters_without_labels():
    c = parse_spec_counters(llamacpp_text(40, 115, 80, [30, 25, 15, 10]), "llamacpp:")
    assert c == SpecCounters(
        draft_tokens=115.0, accepted=80.0, drafts=40.0, per_position=(30.0, 25.0, 15.0, 10.0), source="llamacpp"
    )
    # llama-server writes no model_name label: a model filter does not hide its series
    assert parse_spec_counters(llamacpp_text(40, 115, 80), "llamacpp:", "any-model").accepted == 80.0
    # the other engine's prefix finds nothing
    assert parse_spec_counters(llamacpp_text(40, 115, 80), "vllm:") is None


def test_absent_series_is_none_not_zero():
    text = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    assert parse_spec_counters(text, "vllm:") is None
    assert parse_spec_counters("", "llamacpp:") is None


def test_zero_counters_are_not_none():
    c = parse_spec_counters(vllm_one(0, 0, 0), "vllm:")
    assert c is not None and c.draft_tokens == 0.0 and c.acceptance is None


def test_vllm_v0_is_coarse_with_lifetime_ratio():
    c = parse_spec_counters(V0_TEXT, "vllm:", "m")
    assert c.coarse and c.source == "vllm-v0"
    assert c.lifetime_acceptance == pytest.approx(0.71)
    assert c.acceptance == pytest.approx(0.71)  # the engine's lifetime gauge, not the over-counted counters
    assert c.drafts is None


def test_vllm_v0_nan_gauge_before_first_draft():
    text = V0_TEXT.replace("} 0.71", "} NaN")
    c = parse_spec_counters(text, "vllm:")
    assert c.coarse and c.lifetime_acceptance is None and c.acceptance is None


def test_garbage_raises():
    with pytest.raises(MetricsError, match="not a Prometheus exposition"):
        parse_spec_counters("<html><body>502 Bad Gateway</body></html>", "vllm:")
    with pytest.raises(MetricsError):
        parse_spec_counters('vllm:spec_decode_num_draft_tokens_total{model_name="m" 12\n', "vllm:")


def test_incomplete_series_raise():
    text = "# TYPE vllm:spec_decode_num_draft_tokens_total counter\nvllm:spec_decode_num_draft_tokens_total 10\n"
    with pytest.raises(MetricsError, match="num_accepted_tokens_total missing"):
        parse_spec_counters(text, "vllm:")


def test_non_finite_counter_raises():
    with pytest.raises(MetricsError, match="non-finite"):
        parse_spec_counters(
            llamacpp_text(1, 4, 2).replace("num_accepted_tokens_total 2", "num_accepted_tokens_total NaN"), "llamacpp:"
        )


def test_bad_position_label_raises():
    text = vllm_one(1, 3, 2, [1, 1]).replace('position="1"', 'position="x"')
    with pytest.raises(MetricsError, match="position"):
        parse_spec_counters(text, "vllm:")


def test_untyped_samples_still_count():
    # an exporter without HELP/TYPE lines (hand-made or a proxy): keyed on sample names, so still read
    text = "llamacpp:spec_decode_num_draft_tokens_total 9\nllamacpp:spec_decode_num_accepted_tokens_total 3\n"
    c = parse_spec_counters(text, "llamacpp:")
    assert (c.draft_tokens, c.accepted, c.drafts) == (9.0, 3.0, None)


def test_families_entry_point_and_names():
    from prometheus_client.parser import text_string_to_metric_families

    fams = list(text_string_to_metric_families(vllm_one(2, 8, 5)))
    assert spec_counters_from_families(fams, "vllm:").accepted == 5.0
    assert normalize_prefix("llamacpp") == "llamacpp:"
    assert series_names("vllm:")["drafts"] == "vllm:spec_decode_num_drafts_total"
    with pytest.raises(ValueError):
        normalize_prefix("  ")
