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

from specops.config.profile import load_profile
from specops.errors import SpecopsError
from specops.perf.certify import Endpoint
from specops.perf.certify_spot import SpotChecker, SpotConfig, SpotMetrics
from specops.perf.workload import Prompt, load_prompts
from specops.plugins import get_registry
from specops.run.instance import EventLog


def test_spot_checks_are_rate_limited():
    with pytest.raises(SpecopsError, match="at most every 10s"):
        SpotChecker(Endpoint("http://a", "m"), Endpoint("http://b", "m"), [Prompt("x")], SpotConfig(every=1))


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


def sample(metrics: SpotMetrics, result: str) -> float:
    return metrics.registry.get_sample_value("specops_spot_check_requests_total", {"result": result})


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_spot_checks_on_llama_server(tmp_path):
    from specops.devenv.testmodels import ensure_tiny_models
    from specops.perf.launch import launched
    from specops.run.start import free_port

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
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            return good, first, second, bad, broken, proc.returncode, out.decode(), err.decode()

    good, first, second, bad, broken, rc, out, err = asyncio.run(main())
    # a lossless deployment checks clean, probe after probe (the sample moves through the set)
    assert first["verdict"] == second["verdict"] == "exact" and first["identical"] == second["identical"] == 2
    assert sample(good.metrics, "identical") == 4 and sample(good.metrics, "diverged") == 0
    assert good.metrics.registry.get_sample_value("specops_spot_checks_total") == 2
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["spot_check", "spot_check"] and lines[0]["identical"] == 2
    # a reference serving another model diverges at once, and says where, with both continuations
    assert broken["verdict"] == "diverged" and broken["diverged"] == 2
    d = broken["divergences"][0]
    assert d["status"] == "diverged" and d["spec_continuation"] != d["base_continuation"] and d["unit"] == "token"
    assert sample(bad.metrics, "diverged") == 2
    assert bad.metrics.registry.get_sample_value("specops_spot_check_last_divergence_timestamp_seconds") > 0
    # the CLI: exit 1 on a divergence, events in the deployment's events.jsonl, metrics in the text file
    assert rc == 1, err[-2000:]
    assert json.loads(out)[0]["diverged"] == 1 and "spot check: diverged" in err
    ev = [json.loads(x) for x in (tmp_path / "state" / "live" / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in ev] == ["spot_check", "spot_divergence"]
    assert ev[1]["spec_continuation"] and ev[1]["base_continuation"]
    prom = (tmp_path / "spot.prom").read_text()
    assert 'specops_spot_check_requests_total{result="diverged"} 1.0' in prom
