"""Live spot checks in `specops up` on real llama-servers (tiny GGUF models): the clients' greedy requests
are kept by the proxy and replayed against a second llama-server without speculation. Against the same
model they are identical; against a reference serving another model they diverge, and the divergence is
recorded (events, metrics, status) while every client request is answered normally."""

from __future__ import annotations

import subprocess
import time

import pytest
from support_up import SPECOPS, UpRun, http_json, http_text, llama_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(240)]


def profile(tmp_path, models, name, target, draft=None, spot=None):
    """The deployment (``draft``: speculation with it, else none) and its spot checks (``spot``)."""
    method = "draft_model" if draft else "none"
    extra = {"certify": {"spot_check": spot}} if spot else {}
    return llama_profile(tmp_path, models, name, method=method, draft=draft or "", target=target, **extra)


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{line_start} not in /specops/metrics")


def compared(run: UpRun) -> int:
    return sum(c["requests"] for c in run.events("spot_check"))


def test_up_spot_checks_live_greedy_requests_against_a_reference(tmp_path, tiny_gguf_models):
    from support_engines import need_llama_server

    need_llama_server()
    models, state = tiny_gguf_models, tmp_path / "state"
    ref_p = profile(tmp_path, models, "spot-ref", "gguf-target.gguf")
    wrong_p = profile(tmp_path, models, "spot-wrong", "gguf-draft-other.gguf")  # another model: a broken reference
    with UpRun(ref_p, state, "spot-ref") as ref, UpRun(wrong_p, state, "spot-wrong") as wrong:
        ref_url, wrong_url = ref.wait_ready(90)["url"], wrong.wait_ready(90)["url"]
        spot = {"enabled": True, "every": "10s", "sample": 3, "max_tokens": 16}
        good_p = profile(
            tmp_path, models, "spot-good", "gguf-target.gguf", "gguf-draft-same.gguf", {**spot, "reference": ref_url}
        )
        bad_p = profile(
            tmp_path, models, "spot-bad", "gguf-target.gguf", "gguf-draft-same.gguf", {**spot, "reference": wrong_url}
        )
        with UpRun(good_p, state, "spot-good") as good, UpRun(bad_p, state, "spot-bad") as bad:
            urls = [good.wait_ready(90)["url"], bad.wait_ready(90)["url"]]
            statuses = []
            for url in urls:
                bodies = [
                    {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0},  # capped to 16 in replay
                    {"prompt": "The capital of France", "max_tokens": 12, "temperature": 0, "logprobs": 2},
                    {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9},  # not greedy: not kept
                    {"prompt": "1, 2, 3, 4,", "max_tokens": 10, "top_k": 1},
                ]
                for body in bodies:
                    status, answer = http_json(url + "/v1/completions", body)
                    statuses.append(status)
            deadline = time.monotonic() + 60
            # a check may come between two requests: wait until the 3 greedy ones of each were compared
            while time.monotonic() < deadline and not (compared(good) >= 3 and compared(bad) >= 3):
                time.sleep(0.5)
            good_checks, bad_checks = good.events("spot_check"), bad.events("spot_check")
            divergences = bad.events("spot_divergence")
            good_metrics, bad_metrics = http_text(urls[0] + "/specops/metrics"), http_text(urls[1] + "/specops/metrics")
            good_state = good.wait_for(
                lambda st: (st.get("spot_check") or {}).get("checks") == len(good_checks), 10, "the state file"
            )
            text = subprocess.run(
                SPECOPS + ["status", "spot-bad"], capture_output=True, text=True, env=bad.env, timeout=30
            ).stdout
            assert good.stop() == 0 and bad.stop() == 0

    assert statuses == [200] * 8  # every client request answered normally
    assert good_checks, good.output()
    # the same model without speculation: the 3 greedy requests are identical (one by token ids, as its
    # client asked for log-probabilities; the others by text), the sampled one was never kept
    totals = {k: sum(c[k] for c in good_checks) for k in ("requests", "identical", "diverged", "failed", "live")}
    assert totals == {"requests": 3, "identical": 3, "diverged": 0, "failed": 0, "live": 3}, good_checks
    assert {c["verdict"] for c in good_checks} == {"exact"}
    assert {u for c in good_checks for u in c["compared_by"]} == {"token", "character"}
    assert metric(good_metrics, 'specops_spot_check_requests_total{result="identical"}') == 3
    assert metric(good_metrics, "specops_spot_checks_total") >= 1
    spot_state = good_state["spot_check"]
    assert spot_state["last"]["verdict"] == "exact" and spot_state["sampler"]["not_greedy"] == 1
    # a reference serving another model: diverged, recorded where (not what: the client's text), counted
    assert sum(c["diverged"] for c in bad_checks) >= 1 and "diverged" in {c["verdict"] for c in bad_checks}, (
        bad.output()
    )
    d = divergences[0]
    assert d["source"] == "live" and isinstance(d["position"], int) and d["id"]
    assert not {"common_prefix", "spec_continuation", "base_continuation", "spec_token", "base_token"} & set(d)
    assert metric(bad_metrics, 'specops_spot_check_requests_total{result="diverged"}') >= 1
    assert metric(bad_metrics, "specops_spot_check_last_divergence_timestamp_seconds") > 0
    assert "spot       last diverged" in text and "diverged   live at" in text, text
