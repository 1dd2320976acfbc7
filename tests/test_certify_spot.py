"""Live spot checks on real llama-server engines: a lossless deployment checks clean; a reference that serves
another model really diverges, and the divergence is recorded as events and metrics; the CLI writes both."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from support_engines import need_llama_server
from support_procs import stop_group_async

from specops.config.profile import load_profile
from specops.errors import ProfileError, SpecopsError
from specops.perf.certify import Endpoint
from specops.perf.certify_spot import SpotChecker, SpotConfig, SpotMetrics
from specops.perf.workload import Prompt, load_prompts
from specops.plugins import get_registry
from specops.proxy.sample import PROBE_HEADER, LiveSampler, is_greedy
from specops.run.instance import EventLog


def test_spot_checks_are_rate_limited():
    with pytest.raises(SpecopsError, match="at most every 10s"):
        SpotChecker(Endpoint("http://a", "m"), Endpoint("http://b", "m"), [Prompt("x")], SpotConfig(every=1))


# ------------------------------------------------------------------------------------ the proxy's sampler

GREEDY = b'{"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0}'
ANSWER = b'{"choices": [{"text": " a b", "finish_reason": "length"}]}'


def offer(s: LiveSampler, body=GREEDY, answer=ANSWER, path="/v1/completions", status=200, headers=None, method="POST"):
    s.offer(method, path, headers or {}, body, status, answer)


@pytest.mark.parametrize(
    "req, greedy",
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "max_tokens": 3}, True),
        ({"top_k": 1, "temperature": 0.8}, True),
        ({"temperature": 0.7}, False),
        ({}, False),  # the engine's default temperature is not greedy
        ({"temperature": 0, "n": 2}, False),
        ({"temperature": 0, "stream": True}, False),
        ({"temperature": False}, False),
        ({"top_k": True}, False),
        ([], False),
    ],
)
def test_greedy_means_one_deterministic_choice(req, greedy):
    assert is_greedy(req) is greedy


def test_the_sampler_keeps_only_completed_greedy_non_streamed_completions():
    s = LiveSampler(max_entries=8)
    offer(s, headers={"Authorization": "Bearer sk-secret-1234567890"})
    offer(s, body=b'{"prompt": "x", "temperature": 0.7}')
    offer(s, body=b'{"prompt": "x"}')
    offer(s, body=b'{"prompt": "x", "temperature": 0, "stream": true}')
    offer(s, body=b'{"prompt": "x", "temperature": 0, "n": 3}')  # passes the byte check, refused by the parse
    offer(s, path="/v1/embeddings")
    offer(s, status=500)
    offer(s, method="GET")
    offer(s, answer=None)  # a streamed answer: nothing to copy
    offer(s, headers={PROBE_HEADER: "1"})  # the checker's own probe
    offer(s, answer=b"not json")
    offer(s, path="/v1/chat/completions?x=1", body=b'{"messages": [], "top_k": 1}')
    assert len(s) == 2 and s.counts["not_greedy"] == 5
    kept = s.take(8)
    assert [k.path for k in kept] == ["/v1/chat/completions", "/v1/completions"]  # newest first
    # the body and the answer only: no header (never the client's key) is kept anywhere
    assert not hasattr(kept[1], "headers") and all(b"sk-secret" not in k.body + k.answer for k in kept)
    assert len(s) == 0 and s.bytes == 0


def test_the_sampler_is_bounded_in_entries_and_bytes_and_drops_when_full():
    s = LiveSampler(max_entries=3, max_entry_bytes=200, max_bytes=300)
    big = b'{"temperature": 0, "prompt": "' + b"x" * 200 + b'"}'
    offer(s, body=big)  # over max_entry_bytes
    assert len(s) == 0 and s.counts["dropped_size"] == 1
    for _ in range(5):
        offer(s)
    # 3 fit in count, but their bytes (3 x 108) would pass max_bytes: the third is dropped for its size
    size = len(GREEDY) + len(ANSWER)
    assert len(s) == 300 // size and s.bytes == len(s) * size <= 300
    assert s.counts["dropped_size"] == 1 + 5 - len(s) - s.counts["dropped_full"]
    s2 = LiveSampler(max_entries=2)
    for _ in range(5):
        offer(s2)
    assert len(s2) == 2 and s2.counts["dropped_full"] == 3
    # a check takes the newest and empties the sampler: it fills again with requests that come later
    assert len(s2.take(1)) == 1 and len(s2) == 0 and s2.counts["discarded"] == 1 and s2.bytes == 0
    offer(s2)
    assert len(s2) == 1


def test_the_sampler_parses_after_the_handler_returns():
    """Inside the loop, offer() only reserves room; the JSON parse runs on a later loop turn."""

    async def main():
        s = LiveSampler(max_entries=1)
        offer(s)
        before = (len(s), s.bytes)
        offer(s)  # the pending one already fills the sampler
        await asyncio.sleep(0)
        return before, len(s), s.counts["dropped_full"]

    before, after, full = asyncio.run(main())
    assert before == (0, len(GREEDY) + len(ANSWER)) and after == 1 and full == 1


# ------------------------------------------------------------------------------------ the profile section


def spot_profile(tmp_path: Path, spot: str) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(f"name: p\nbackend: llamacpp\nmodel:\n  id: m.gguf\ncertify:\n  spot_check:\n{spot}")
    return p


@pytest.mark.parametrize(
    "spot, line, field, needle",
    [
        ("    enabled: true\n", 7, "certify.spot_check", "spot checks need `reference`"),
        ("    enabled: true\n    reference: ftp://x\n", 8, "certify.spot_check.reference", "http"),
        (
            "    reference: http://u:pw@127.0.0.1:9\n",
            7,
            "certify.spot_check.reference",
            "no credentials in the URL",
        ),
        ("    every: 5s\n", 7, "certify.spot_check.every", "greater than or equal to 10"),
        ("    api_key_env: 'my key'\n", 7, "certify.spot_check.api_key_env", "environment variable name"),
        ("    source: lvie\n", 7, "certify.spot_check.source", "did you mean 'live'"),
        ("    sample: 0\n", 7, "certify.spot_check.sample", "greater than or equal to 1"),
        ("    every_s: 10\n", 7, "certify.spot_check.every_s", "did you mean 'every'"),
    ],
)
def test_the_spot_check_section_is_validated_with_located_errors(tmp_path, spot, line, field, needle):
    with pytest.raises(ProfileError) as info:
        load_profile(spot_profile(tmp_path, spot))
    (problem,) = info.value.problems
    assert problem.field == field and needle in problem.message, str(info.value)
    assert problem.location.line == line and str(info.value).startswith(f"{tmp_path / 'p.yaml'}:{line}:")


def test_a_valid_spot_check_section_loads(tmp_path):
    p = load_profile(
        spot_profile(
            tmp_path, "    enabled: true\n    reference: http://127.0.0.1:9/\n    every: 2m\n    source: both\n"
        )
    ).profile
    spot = p.certify.spot_check
    assert (spot.enabled, spot.every, spot.source, spot.sample, spot.max_in_flight) == (True, 120.0, "both", 2, 0)
    assert load_profile(spot_profile(tmp_path, "    sample: 3\n")).profile.certify.spot_check.enabled is False


def test_validate_refuses_spot_checks_without_the_proxy(tmp_path):
    from support_cli import run

    p = spot_profile(tmp_path, "    enabled: true\n    reference: http://127.0.0.1:9/\n")
    p.write_text(p.read_text() + "proxy:\n  enabled: false\n")
    res = run("validate", str(p))
    assert res.code == 1, res.stdout + res.stderr
    assert f"{p}:7:" in res.stdout + res.stderr and "need specops' proxy" in res.stdout + res.stderr
    p.write_text(p.read_text().replace("enabled: false", "enabled: true"))
    assert run("validate", str(p)).code == 0


def profile_file(tmp_path: Path, name: str, target: str, draft: str | None, port: int | None = None) -> Path:
    spec = (
        f"speculative:\n  method: draft_model\n  draft: {draft}\n  num_speculative_tokens: 4\n"
        if draft
        else "speculative:\n  method: none\n"
    )
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"name: {name}\nbackend: llamacpp\nmodel:\n  id: {target}\n  max_model_len: 1024\n{spec}"
        "gpus:\n  devices: []\n" + (f"server:\n  port: {port}\n" if port else "") + "supervisor:\n  stop_timeout: 10\n"
    )
    return p


def drafted_tokens(base_url: str) -> dict:
    """llama-server's drafted tokens (``timings.draft_n``) for one greedy request, plain and with a
    per-request ``speculative.n_max: 0``."""
    import urllib.request

    out = {}
    for name, extra in (("plain", {}), ("n_max_0", {"speculative.n_max": 0})):
        body = {"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0, **extra}
        req = urllib.request.Request(
            base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            out[name] = json.loads(resp.read())["timings"]["draft_n"]
    return out


def sample(metrics: SpotMetrics, result: str) -> float:
    return metrics.registry.get_sample_value("specops_spot_check_requests_total", {"result": result})


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_spot_checks_on_llama_server(tmp_path):
    from support_ports import free_port

    from specops.devenv.testmodels import ensure_tiny_models
    from specops.perf.launch import launched

    need_llama_server()
    models = ensure_tiny_models(["gguf"])
    target, same, other = (
        str(models[m]) for m in ("gguf-target.gguf", "gguf-draft-same.gguf", "gguf-draft-other.gguf")
    )
    live_port = free_port()
    live_p = load_profile(profile_file(tmp_path, "live", target, same, live_port))
    ref_p = load_profile(profile_file(tmp_path, "ref", target, None))
    wrong_p = load_profile(profile_file(tmp_path, "wrong", other, None))  # another model: a broken reference
    prompts = load_prompts("code")
    registry = get_registry()

    async def main():
        async with (
            launched(live_p, registry, port=live_port) as live,
            launched(ref_p, registry) as ref,
            launched(wrong_p, registry) as wrong,
        ):
            cfg = SpotConfig(every=10, sample=2, max_tokens=24)
            events = EventLog(tmp_path / "events.jsonl")
            good = SpotChecker(
                Endpoint(live.base_url, live.model_name),
                Endpoint(ref.base_url, ref.model_name),
                prompts,
                cfg,
                events=events,
            )
            first, second = await good.check_once(), await good.check_once()
            drafted = await asyncio.to_thread(drafted_tokens, live.base_url)
            bad = SpotChecker(
                Endpoint(live.base_url, live.model_name), Endpoint(wrong.base_url, wrong.model_name), prompts, cfg
            )
            broken = await bad.check_once()
            # the CLI against the running deployment (the profile's port) and the reference
            env = {**os.environ, "SPECOPS_STATE": str(tmp_path / "state")}
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "specops.cli",
                "certify",
                live_p.path,
                "--spot-reference",
                wrong.base_url,
                "--checks",
                "1",
                "--sample",
                "1",
                "-w",
                "code",
                "--max-tokens",
                "16",
                "--metrics-file",
                str(tmp_path / "spot.prom"),
                "--json",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 60)
            finally:
                await stop_group_async(proc, 5)  # its group, also when it ran past the 60 s
            return good, first, second, bad, broken, proc.returncode, out.decode(), err.decode(), drafted

    good, first, second, bad, broken, rc, out, err, drafted = asyncio.run(main())
    # why the reference must be a second instance: llama-server drafts as much with a per-request
    # `speculative.n_max: 0` as without it (speculation cannot be turned off for one request)
    assert drafted["plain"] > 0 and drafted["n_max_0"] == drafted["plain"], drafted
    # a lossless deployment checks clean, probe after probe (the sample moves through the set)
    assert first["verdict"] == second["verdict"] == "exact" and first["identical"] == second["identical"] == 2
    assert sample(good.metrics, "identical") == 4 and sample(good.metrics, "diverged") == 0
    assert good.metrics.registry.get_sample_value("specops_spot_checks_total") == 2
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["spot_check", "spot_check"] and lines[0]["identical"] == 2
    # a reference serving another model diverges at once, and says where (position, token ids; no text)
    assert broken["verdict"] == "diverged" and broken["diverged"] == 2
    d = broken["divergences"][0]
    assert d["status"] == "diverged" and d["spec_token_id"] != d["base_token_id"] and d["unit"] == "token"
    assert "spec_continuation" not in d and "common_prefix" not in d
    assert sample(bad.metrics, "diverged") == 2
    assert bad.metrics.registry.get_sample_value("specops_spot_check_last_divergence_timestamp_seconds") > 0
    # the CLI: exit 1 on a divergence, events in the deployment's events.jsonl, metrics in the text file
    assert rc == 1, err[-2000:]
    assert json.loads(out)[0]["diverged"] == 1 and "spot check: diverged" in err
    ev = [json.loads(x) for x in (tmp_path / "state" / "live" / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in ev] == ["spot_check", "spot_divergence"]
    assert isinstance(ev[1]["position"], int) and "spec_continuation" not in ev[1]
    prom = (tmp_path / "spot.prom").read_text()
    assert 'specops_spot_check_requests_total{result="diverged"} 1.0' in prom


# ------------------------------------------------------------------- live requests through a real proxy


def test_live_greedy_requests_are_sampled_by_the_proxy_and_replayed_against_the_reference(tmp_path):
    """The real proxy in front of the protocol stand-in (tests/support_upstream.py): what a client got is kept
    (no header), replayed against a second stand-in (the reference) capped at max_tokens, and compared."""
    import aiohttp
    from support_upstream import Upstream, running_proxy

    from specops.perf.certify_spot import proxy_gate
    from specops.proxy.sample import Sample

    key = "sk-client-key-0123456789"
    with Upstream.start("live") as eng, Upstream.start("ref") as ref:

        async def main():
            sampler = LiveSampler(max_entries=8)
            async with running_proxy(eng.url, sampler=sampler, api_key=key) as proxy:
                url = proxy.url
                auth = {"Authorization": f"Bearer {key}"}
                async with aiohttp.ClientSession() as s:
                    bodies = [
                        ("/v1/completions", {"model": "x", "prompt": "p", "max_tokens": 40, "temperature": 0}),
                        ("/v1/completions", {"model": "x", "prompt": "p", "max_tokens": 5, "temperature": 0.9}),
                        ("/v1/completions", {"prompt": "p", "max_tokens": 5, "temperature": 0, "stream": True}),
                        (
                            "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "top_k": 1},
                        ),
                    ]
                    statuses = []
                    for path, body in bodies:
                        async with s.post(url + path, json=body, headers=auth) as r:
                            await r.read()
                            statuses.append(r.status)
                await asyncio.sleep(0)
                kept = (len(sampler), sampler.snapshot())
                events = EventLog(tmp_path / "events.jsonl")
                cfg = SpotConfig(every=10, sample=4, max_tokens=8, source="live")
                checker = SpotChecker(
                    None,
                    Endpoint(ref.url, "ref-model"),
                    [],
                    cfg,
                    events=events,
                    sampler=sampler,
                    gate=proxy_gate(proxy, 0),
                )
                assert checker.gate() is None  # serving and idle
                good = await checker.check_once()
                empty = await checker.check_once()  # nothing new since: no comparison, no event
                # a client answer that differs from the reference (what a lossy deployment would have sent)
                sampler._kept.append(
                    Sample(
                        "/v1/completions",
                        b'{"prompt": "p", "max_tokens": 4, "temperature": 0}',
                        b'{"choices": [{"text": " t0 t1 x2 t3", "finish_reason": "length"}]}',
                        0.0,
                    )
                )
                bad = await checker.check_once()
                proxy.hold()
                held = checker.gate()
            return statuses, kept, good, empty, bad, held, checker

        statuses, kept, good, empty, bad, held, checker = asyncio.run(main())
        live_stats, ref_stats = eng.stats(), ref.stats()
    assert statuses == [200, 200, 200, 200]
    # kept: the greedy non-streamed completion and chat; not the sampled one, not the stream
    assert kept[0] == 2 and kept[1]["not_greedy"] == 1
    # the live engine got the 4 client requests only; the reference got the 2 replays + 1 for the bad sample
    assert live_stats["started"] == 4 and ref_stats["started"] == 3
    # the client asked 40 tokens: the replay was capped at 8 and the comparison ran on the first 8
    assert good["verdict"] == "exact" and good["identical"] == 2 and good["compared_by"] == ["character"]
    assert empty["verdict"] == "no-sample"
    assert bad["verdict"] == "diverged"
    d = bad["divergences"][0]
    # where (" t0 t1 x2" vs " t0 t1 t2"), not what: the text of a client's answer is no part of the record
    assert d["source"] == "live" and d["unit"] == "character" and d["position"] == len(" t0 t1 ")
    assert not {"common_prefix", "spec_continuation", "base_continuation", "spec_token"} & set(d)
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["spot_check", "spot_check", "spot_divergence"]
    assert lines[0]["live"] == 2 and lines[2]["position"] == d["position"] and "base_continuation" not in lines[2]
    assert key not in (tmp_path / "events.jsonl").read_text()
    assert sample(checker.metrics, "identical") == 2 and sample(checker.metrics, "diverged") == 1
    assert held is not None and held[0] == "held"
    snap = checker.snapshot()["spot_check"]
    assert snap["checks"] == 2 and snap["last"]["verdict"] == "diverged" and snap["last_divergence"]["position"]


def test_a_check_that_finds_the_deployment_busy_for_its_interval_is_skipped_and_recorded(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    checker = SpotChecker(
        None,
        Endpoint("http://127.0.0.1:9", "m"),
        [],
        SpotConfig(every=10, source="live"),
        events=events,
        sampler=LiveSampler(),
        gate=lambda: ("busy", "3 client requests in flight or waiting (max_in_flight 0)"),
    )
    checker.cfg.every = 0.2  # the interval's length is not what is tested here

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(checker.run(stop))
        while checker.skipped == 0:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "spot_check_skipped" and lines[0]["reason"] == "busy"
    assert checker.results == [] and checker.last is None  # no request was sent
    assert checker.metrics.registry.get_sample_value("specops_spot_checks_skipped_total", {"reason": "busy"}) >= 1
