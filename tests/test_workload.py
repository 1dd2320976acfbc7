"""Prompt sets and the workload runner: parsing, derived numbers, and real streamed requests to llama-server."""

from __future__ import annotations

import asyncio
import json

import pytest

from specops.errors import SpecopsError
from specops.perf.workload import (
    BUILTIN_SETS,
    Prompt,
    RequestResult,
    WorkloadResult,
    load_prompts,
    median,
    percentile,
    run_workload,
)

# ------------------------------------------------------------------------------------ prompt sets


def test_builtin_sets_exist_and_differ_where_speculation_differs():
    sets = {name: load_prompts(name) for name in BUILTIN_SETS}
    assert set(sets) == {"code", "summarize", "chat", "creative", "extraction"}
    for name, prompts in sets.items():
        assert len(prompts) >= 6 and all(p.set == name and p.text and p.max_tokens >= 32 for p in prompts)
    assert all(p.temperature == 0 for p in sets["code"] + sets["summarize"])
    assert all(p.temperature >= 1.0 for p in sets["creative"])
    # summarisation prompts carry the text the answer copies from
    assert all(len(p.text) > 250 for p in sets["summarize"])
    # extraction prompts hold the text their answers copy (what prompt-lookup drafting exists for)
    assert all(len(p.text) > 300 and p.temperature == 0 for p in sets["extraction"])


def test_user_jsonl(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('# my traffic\n{"prompt": "a", "max_tokens": 5}\n\n{"text": "b", "temperature": 0.5, "set": "x"}\n')
    prompts = load_prompts(f)
    assert prompts == [Prompt("a", 5, 0.0, "mine"), Prompt("b", 128, 0.5, "x")]


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('["a"]', "expected an object"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": "a", "max_tokens": true}', "max_tokens"),
        ('{"prompt": "a", "temperature": -1}', "temperature"),
        ('{"prompt": "a", "top_p": 0.9}', "unknown key"),
    ],
)
def test_bad_lines_are_located(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(SpecopsError, match=message) as exc:
        load_prompts(f)
    assert f"{f}:2" in str(exc.value)


def test_unknown_set_and_empty_file(tmp_path):
    with pytest.raises(SpecopsError, match="no prompt set 'poetry'"):
        load_prompts("poetry")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n# nothing\n")
    with pytest.raises(SpecopsError, match="no prompts"):
        load_prompts(empty)


# ------------------------------------------------------------------------------------ numbers


def test_percentile_and_median_by_hand():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([7], 90) == 7 and percentile([], 50) is None
    assert median([3, 1, 2]) == 2 and median([]) is None


def test_derived_numbers_by_hand():
    a = RequestResult(
        "s",
        True,
        start=0.0,
        end=2.0,
        output_tokens=11,
        ttft=0.5,
        itl=[0.1, 0.3],
        chunks=3,
        draft_tokens=10,
        accepted=8,
        usage_reported=True,
    )
    b = RequestResult(
        "s",
        True,
        start=1.0,
        end=4.0,
        output_tokens=21,
        ttft=1.0,
        itl=[0.2],
        chunks=2,
        draft_tokens=20,
        accepted=4,
        usage_reported=True,
    )
    err = RequestResult("s", False, start=1.0, end=1.5, error="HTTP 500")
    res = WorkloadResult(2, [a, b, err], wall_s=4.0)
    assert a.tpot == pytest.approx((2.0 - 0.5) / 10) and b.tpot == pytest.approx(2.0 / 20)
    assert res.output_tokens == 32 and res.tokens_per_s == 8.0  # failed requests add nothing
    assert res.ttft_median == 0.75 and res.itl_median == pytest.approx(0.2)
    assert res.acceptance == pytest.approx(12 / 30)
    s = res.summary()
    assert s["errors"] == 1 and s["first_error"] == "HTTP 500" and s["ttft_ms"]["median"] == 750.0


# ------------------------------------------------------------------------------------ real engine


@pytest.fixture(scope="module")
def llama(tiny_gguf_models):
    """A real llama-server (tiny target + same-weights draft) launched by specops.perf.launch for this module."""
    from specops.config.profile import load_profile
    from specops.perf.launch import launched
    from specops.plugins import get_registry

    models = tiny_gguf_models
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix="specops-workload-"))
    prof = tmp / "w.yaml"
    prof.write_text(
        f"name: w\nbackend: llamacpp\nmodel:\n  id: {models / 'gguf-target.gguf'}\n  max_model_len: 1024\n"
        f"speculative:\n  method: draft_model\n  draft: {models / 'gguf-draft-same.gguf'}\n"
        "  num_speculative_tokens: 4\ngpus:\n  devices: []\nserver:\n  parallel: 2\n"
        "supervisor:\n  stop_timeout: 10\n"
    )
    registry = get_registry()
    loaded = load_profile(prof, registry=registry)
    loop = asyncio.new_event_loop()
    cm = launched(loaded, registry, ready_timeout=60)
    eng = loop.run_until_complete(cm.__aenter__())
    try:
        yield loop, eng
    finally:
        loop.run_until_complete(cm.__aexit__(None, None, None))
        loop.close()
        assert not eng.process.running


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_streamed_requests_against_llama_server(llama):
    loop, eng = llama
    prompts = [Prompt("the quick brown fox", 24, 0.0, "a"), Prompt("def hello world", 16, 0.0, "b")]
    seen = []
    res = loop.run_until_complete(
        run_workload(
            eng.base_url,
            eng.model_name,
            prompts,
            concurrency=2,
            requests=6,
            extra_body={"ignore_eos": True},
            on_progress=lambda done, total: seen.append((done, total)),
        )
    )
    assert [r.error for r in res.errors] == []
    assert len(res.requests) == 6 and seen[-1] == (6, 6) and len(seen) == 6
    assert sorted(r.output_tokens for r in res.requests) == [16] * 3 + [24] * 3  # from usage, exact
    assert all(r.usage_reported and r.finish_reason == "length" for r in res.requests)
    assert all(0 < r.ttft <= r.latency for r in res.requests)
    assert all(len(r.itl) == r.chunks - 1 for r in res.requests)
    assert res.tokens_per_s == pytest.approx(res.output_tokens / res.wall_s)
    # llama-server reports its drafts per response
    assert res.draft_tokens > 0 and 0.8 <= res.acceptance <= 1.0
    assert set(res.by_set()) == {"a", "b"}


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_counters_before_and_after_match_the_responses(llama):
    loop, eng = llama
    before = loop.run_until_complete(eng.counters())
    res = loop.run_until_complete(
        run_workload(
            eng.base_url,
            eng.model_name,
            [Prompt("lazy dog over", 32)],
            concurrency=1,
            requests=3,
            extra_body={"ignore_eos": True},
        )
    )
    stats = loop.run_until_complete(eng.acceptance_since(before))
    assert stats.status == "ok"
    assert stats.draft_tokens == res.draft_tokens and stats.accepted == res.accepted  # two views, one truth
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.accepted / stats.drafts)
    assert 1.0 <= stats.mean_draft_length <= 4.0


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_failures_are_recorded_not_raised(llama):
    loop, eng = llama
    too_long = Prompt("fox " * 2000, 8)  # far beyond the context: HTTP 400
    res = loop.run_until_complete(
        run_workload(eng.base_url, eng.model_name, [too_long, Prompt("ok", 4)], concurrency=1, requests=2)
    )
    assert len(res.errors) == 1 and res.errors[0].error.startswith("HTTP 400")
    assert len(res.ok) == 1 and res.output_tokens == res.ok[0].output_tokens
    dead = loop.run_until_complete(
        run_workload("http://127.0.0.1:9", "x", [Prompt("a", 4)], concurrency=1, requests=1, timeout=5)
    )
    assert len(dead.errors) == 1 and "Error" in dead.errors[0].error


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_duration_bound_run_stops_starting_requests(llama):
    loop, eng = llama
    res = loop.run_until_complete(
        run_workload(eng.base_url, eng.model_name, [Prompt("the and of", 8)], concurrency=2, duration=0.5)
    )
    assert len(res.requests) >= 2 and not res.errors
    assert max(r.start for r in res.requests) - min(r.start for r in res.requests) < 0.5 + 0.1
    assert json.dumps(res.summary())  # JSON-ready


# ------------------------------------------------------------------------------------ fitting to the deployment


def words(text: str) -> int:
    return len(text.split())


def test_prompts_that_do_not_fit_are_trimmed_from_the_start_and_said():
    from specops.perf.workload import fit_prompts

    long = " ".join(f"w{i}" for i in range(300))  # 300 tokens by `words`
    prompts = [Prompt(long, 64, 0.0, "code"), Prompt("short one", 64, 0.0, "code"), Prompt(long, 64, 0.7, "chat")]
    fit = asyncio.run(fit_prompts(prompts, 256, words, counted_by="words"))
    # room 256 − 8 = 248; with 64 output tokens a prompt gets at most 184
    assert [words(p.text) + p.max_tokens <= 248 for p in fit.prompts] == [True, True, True]
    assert fit.prompts[1] == prompts[1]
    assert fit.prompts[0].text.endswith("w299") and not fit.prompts[0].text.startswith("w0 ")  # the end is kept
    assert fit.prompts[2].temperature == 0.7
    assert fit.notes == [
        f"1 of 2 code prompt(s) trimmed from the start to fit 256 tokens per request with their max_tokens "
        f"(tokens, counted by words: 300 → {words(fit.prompts[0].text)})",
        f"1 of 1 chat prompt(s) trimmed from the start to fit 256 tokens per request with their max_tokens "
        f"(tokens, counted by words: 300 → {words(fit.prompts[2].text)})",
    ]


def test_max_tokens_shrinks_only_when_it_alone_would_fill_the_context():
    from specops.perf.workload import estimate_tokens, fit_prompts

    fit = asyncio.run(fit_prompts([Prompt("def f():", 512, 0.0, "code")], 128))
    # room 120; the output may take at most 75 % of it: 90
    assert fit.prompts[0].max_tokens == 90 and fit.prompts[0].text == "def f():"
    assert fit.notes == ["max_tokens of set code lowered to 90 to fit 128 tokens per request"]
    assert estimate_tokens("x" * 25) == 11  # 2.5 characters per token, rounded up: more than a tokenizer gives
    with pytest.raises(SpecopsError, match="no room"):
        asyncio.run(fit_prompts([Prompt("x", 1)], 10))


def test_fitting_asks_the_running_engine_for_its_context_and_its_tokenizer():
    from aiohttp import web

    from specops.perf.workload import fit_to_engine

    async def main(style: str):
        app = web.Application()

        async def props(request):
            if style == "llama":
                return web.json_response({"default_generation_settings": {"n_ctx": 96}, "total_slots": 4})
            return web.Response(status=404)

        async def models(request):
            return web.json_response({"data": [{"id": "m", "max_model_len": 96}]})

        async def tokenize(request):
            body = await request.json()
            n = words(body["content"] if style == "llama" else body["prompt"])
            return web.json_response({"tokens": list(range(n))} if style == "llama" else {"count": n, "tokens": []})

        app.router.add_get("/props", props)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/tokenize", tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]

        class Eng:
            base_url = f"http://127.0.0.1:{port}"
            model_name = "m"
            api_key = None

        try:
            return await fit_to_engine(Eng(), [Prompt(" ".join(["a"] * 100), 32, 0.0, "code")])
        finally:
            await runner.cleanup()

    for style in ("llama", "vllm"):
        fit = asyncio.run(main(style))
        assert (fit.context, fit.counted_by) == (96, "the engine's /tokenize")
        assert words(fit.prompts[0].text) + 32 <= 96 - 8  # 56 words at most
        assert "counted by the engine's /tokenize: 100 → " in fit.notes[0]


def test_sse_payloads_joins_a_line_that_came_in_parts_and_skips_other_fields():
    from specops.perf.workload import sse_payloads

    async def body():  # what aiohttp's StreamReader yields: lines, a long one in parts
        for part in (b": ping\n", b'data: {"a"', b": 1}\n", b"\n", b"event: x\n", b"data: [DONE]\n"):
            yield part

    async def collect():
        return [p async for p in sse_payloads(body())]

    assert asyncio.run(collect()) == [b'{"a": 1}', b"[DONE]"]
