"""`specops up` with a real llama-server (built from source) on tiny GGUF models: launch, serve, stop,
restart after a crash, and fall down the chain when a launch fails."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support_up import UpRun, http_json, http_text, llama_profile

from specops.run.process import group_members

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def models(tiny_gguf_models):
    return tiny_gguf_models


def complete(url: str, prompt: str = "the quick brown fox", n: int = 24) -> dict:
    status, body = http_json(url + "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    return body


def spec_counter(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"llamacpp:{name} not in /metrics")


def assert_group_gone(pgid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pgid) == [], f"processes of engine group {pgid} remain"


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_up_serves_with_speculation_and_stops_cleanly(tmp_path, models, method):
    profile = llama_profile(
        tmp_path,
        models,
        f"llama-{method.replace('_', '-')}",
        method=method,
        target="gguf-cycle.gguf" if method == "ngram" else "gguf-target.gguf",
    )
    with UpRun(profile, tmp_path / "state", profile.stem) as run:
        st = run.wait_ready(timeout=120)
        assert st["method"] == method and st["backend"] == "llamacpp"
        # ngram-mod matches long n-grams: the cycling target needs ~100 tokens before its output repeats
        body = complete(
            st["url"],
            "the quick brown fox jumps over the lazy dog the quick brown fox",
            200 if method == "ngram" else 48,
        )
        assert body["usage"]["completion_tokens"] > 0
        metrics = http_text(st["engine_url"] + "/metrics")
        assert spec_counter(metrics, "spec_decode_num_draft_tokens_total") > 0, "speculation did not draft"
        argv = run.events("start")[-1]["argv"]
        assert "--spec-type" in argv and ("draft-simple" if method == "draft_model" else "ngram-mod") in argv
        pgid = st["engine_pid"]
        assert group_members(pgid), "engine group should be alive while up"
        assert run.stop() == 0
        assert_group_gone(pgid)
        assert run.state()["state"] == "stopped"


def test_engine_killed_is_restarted_and_counted(tmp_path, models):
    profile = llama_profile(tmp_path, models, "llama-restart")
    with UpRun(profile, tmp_path / "state", "llama-restart") as run:
        st = run.wait_ready(timeout=120)
        first_pid = st["engine_pid"]
        os.killpg(first_pid, signal.SIGKILL)
        st = run.wait_for(
            lambda s: s.get("state") == "ready" and s.get("engine_pid") not in (None, first_pid),
            60,
            "restart after SIGKILL",
        )
        assert st["restarts"] == 1 and st["method"] == "draft_model"
        complete(st["url"])
        status = run.status_json()
        assert status["restarts"] == 1 and status["running"] is True
        exits = run.events("exit")
        assert exits and "SIGKILL" in exits[-1]["how"]
        assert run.stop() == 0
        assert_group_gone(st["engine_pid"])
        assert_group_gone(first_pid)


def test_missing_draft_is_refused_before_launch_and_the_chain_moves_on(tmp_path, models):
    profile = llama_profile(
        tmp_path, models, "llama-missing-draft", draft=str(tmp_path / "no-such-draft.gguf"), chain=["ngram", "none"]
    )
    with UpRun(profile, tmp_path / "state", "llama-missing-draft") as run:
        st = run.wait_ready(timeout=120, method="ngram")
        decisions = run.events("decision")
        assert decisions[0]["from"] == "draft_model" and decisions[0]["to"] == "ngram"
        assert decisions[0]["rule"] == "refused before launch" and "no-such-draft.gguf" in decisions[0]["reason"]
        assert not [e for e in run.events("start") if e["method"] == "draft_model"], "a refused draft was launched"
        assert st["last_decision"]["to"] == "ngram"
        complete(st["url"])
        assert run.stop() == 0


@pytest.mark.parametrize("checks", ["enforce", "warn"])
def test_incompatible_vocab_draft_falls_back(tmp_path, models, checks):
    """enforce: specops' own vocab check refuses the draft; warn: llama-server itself refuses it at load."""
    profile = llama_profile(
        tmp_path, models, f"llama-badvocab-{checks}", draft="gguf-draft-badvocab.gguf", chain=["ngram", "none"]
    )
    profile.write_text(
        profile.read_text().replace("  method: draft_model\n", f"  method: draft_model\n  checks: {checks}\n")
    )
    with UpRun(profile, tmp_path / "state", f"llama-badvocab-{checks}") as run:
        st = run.wait_ready(timeout=120, method="ngram")
        decision = run.events("decision")[0]
        assert decision["from"] == "draft_model" and decision["to"] == "ngram"
        if checks == "enforce":
            assert decision["rule"] == "refused before launch" and "vocab" in decision["reason"]
        else:
            failed = run.events("launch-failed")
            assert failed and failed[0]["method"] == "draft_model"
            # llama-server does not exit: it logs the error and would serve without speculation
            assert "runs without speculation" in decision["reason"] and "vocab" in decision["reason"]
        assert st["switches"] >= 1
        complete(st["url"])
        assert run.stop() == 0


def test_chain_exhausted_exits_with_code_1(tmp_path, models):
    # the target is no model at all: every method fails, so specops must give up rather than loop (a missing
    # target stops before any launch: tests/test_port_conflict.py)
    corrupt = tmp_path / "corrupt-target.gguf"
    corrupt.write_bytes(b"not a GGUF file\n" * 64)
    profile = llama_profile(
        tmp_path,
        models,
        "llama-hopeless",
        draft=str(tmp_path / "missing.gguf"),
        target=str(corrupt),
        chain=["none"],
    )
    with UpRun(profile, tmp_path / "state", "llama-hopeless") as run:
        rc = run.proc.wait(timeout=120)
        assert rc == 1
        assert run.state()["state"] == "fatal"
        assert run.events("decision")[-1]["action"] == "fatal"
        assert "no method left" in run.output()


def test_sigterm_lets_the_requests_in_flight_finish(tmp_path, models):
    """`specops down` / systemd / Kubernetes stop with SIGTERM: the requests already on the engine finish
    (within proxy.drain_timeout) before the engine is stopped, instead of being cut."""
    import json
    import threading

    # long answers (ignore_eos, a 2048-token slot): still on the engine when SIGTERM arrives, however fast it is
    model = {"id": str(models / "gguf-target.gguf"), "max_model_len": 4096}
    profile = llama_profile(tmp_path, models, "llama-drain", proxy={"drain_timeout": 60}, model=model)
    results: list[tuple[int, object]] = []
    with UpRun(profile, tmp_path / "state", profile.stem) as run:
        st = run.wait_ready(timeout=120)
        url = st["url"]

        def one(i: int) -> None:
            body = {
                "prompt": f"request {i} the quick brown fox",
                "max_tokens": 1500,
                "temperature": 0,
                "ignore_eos": True,
            }
            results.append(http_json(url + "/v1/completions", body, timeout=120))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if json.loads(http_text(url + "/specops/status"))["proxy"]["in_flight"] >= 2:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the requests never reached the engine")
        rc = run.stop()
        for t in threads:
            t.join(timeout=120)
        assert rc == 0, run.output()
        assert [status for status, _ in results] == [200, 200, 200], results
        assert all(body["choices"][0]["finish_reason"] in ("length", "stop") for _, body in results), results
        drains = run.events("shutdown-drain")
        assert drains and drains[0]["in_flight"] >= 2 and drains[0]["cut"] == 0, drains
