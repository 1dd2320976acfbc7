"""`specops advise` against hand-computed values, its limits (α → 1, α = 0), the α / rate / mean-length
inputs, the batch caveat, and live readings from a real llama-server and a real `specops up` instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from specops.errors import SpecopsError
from specops.perf import advise as A
from specops.run.identity import self_identity
from specops.watch.window import WindowStats

SPECOPS = [sys.executable, "-m", "specops.cli"]


def cli(*args, env=None, check=True):
    out = subprocess.run(
        SPECOPS + ["advise", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


# ------------------------------------------------------------------------------------ the numbers


def test_alpha_08_k4_by_hand():
    adv = A.advise(A.from_alpha(0.8), k=4, c=0.05)
    # τ = 1 + .8 + .64 + .512 + .4096
    assert adv.tokens_per_pass == pytest.approx(3.3616, abs=1e-12)
    assert adv.speedup == pytest.approx(3.3616 / 1.2, abs=1e-12)
    # k = 8: (1 − .8^9)/.2 = 4.32891136 → /1.4; k = 7: 4.1611392/1.35 is lower
    assert adv.best_k == 8
    assert adv.best_speedup == pytest.approx(4.32891136 / 1.4, abs=1e-12)
    assert [r["k"] for r in adv.table] == list(range(1, 9))
    row2 = adv.table[1]
    assert row2["tokens_per_pass"] == pytest.approx(2.44) and row2["speedup"] == pytest.approx(2.44 / 1.1)
    assert row2["acceptance_rate"] == pytest.approx((0.8 + 0.64) / 2)
    assert [r["current"] for r in adv.table].count(True) == 1 and adv.table[3]["current"]
    assert adv.warnings == []


def test_best_k_interior_optimum_by_hand():
    # α = .5, c = .1: k=1 1.5/1.1 = 1.364, k=2 1.75/1.2 = 1.458, k=3 1.875/1.3 = 1.442
    adv = A.advise(A.from_alpha(0.5), k=1, c=0.1)
    assert adv.best_k == 2
    assert adv.best_speedup == pytest.approx(1.75 / 1.2)
    assert any("below 0.6" in w for w in adv.warnings)


def test_alpha_one_limit():
    adv = A.advise(A.from_alpha(1.0), k=3, c=0.05)
    assert adv.tokens_per_pass == 4.0  # k + 1, exactly
    assert adv.speedup == pytest.approx(4 / 1.15)
    assert adv.best_k == 8 and adv.best_speedup == pytest.approx(9 / 1.4)
    assert all(r["acceptance_rate"] == 1.0 for r in adv.table)
    near = A.advise(A.from_alpha(1 - 1e-12), k=3, c=0.05)  # stable just below 1 (no 0/0)
    assert near.tokens_per_pass == pytest.approx(4.0, abs=1e-9)


def test_alpha_zero_limit():
    adv = A.advise(A.from_alpha(0.0), k=3, c=0.05)
    assert adv.tokens_per_pass == 1.0
    assert adv.speedup == pytest.approx(1 / 1.15)
    assert adv.best_k == 0 and adv.best_speedup == 1.0
    assert all(r["tokens_per_pass"] == 1.0 and r["acceptance_rate"] == 0.0 for r in adv.table)
    assert any("turn speculation off" in w for w in adv.warnings)
    assert adv.per_batch_size is None


def test_warning_threshold_is_strict():
    assert not any("below 0.6" in w for w in A.advise(A.from_alpha(0.6), k=2, c=0.05).warnings)
    assert any("below 0.6" in w for w in A.advise(A.from_alpha(0.599), k=2, c=0.05).warnings)


def test_acceptance_rate_is_converted_to_alpha():
    # α = .5 at k = 2 gives the rate (.5 + .25) / 2 = .375
    acc = A.from_acceptance_rate(0.375, 2)
    assert acc.alpha == pytest.approx(0.5, abs=1e-9) and acc.given == "acceptance_rate" and acc.measured_k == 2
    assert A.from_acceptance_rate(0.7, 1).alpha == 0.7  # k = 1: the rate is α
    assert A.from_acceptance_rate(1.0, 5).alpha == 1.0 and A.from_acceptance_rate(0.0, 5).alpha == 0.0
    # the same rate means a higher α at a larger k
    assert A.from_acceptance_rate(0.6, 5).alpha > A.from_acceptance_rate(0.6, 2).alpha > 0.6


def test_mean_length_is_a_measurement():
    acc = A.from_mean_length(1.75, 2)  # rate .375 → α .5
    assert acc.alpha == pytest.approx(0.5, abs=1e-9) and acc.acceptance_rate == pytest.approx(0.375)
    adv = A.advise(acc, k=2, c=0.1)
    assert adv.measured_speedup == pytest.approx(1.75 / 1.2)  # τ / (1 + k·c), no α model
    with pytest.raises(SpecopsError, match=r"within \[1, 3\]"):
        A.from_mean_length(3.5, 2)


def test_live_window_prefers_mean_length_and_measured_draft_length():
    stats = WindowStats(
        "ok", 60.0, acceptance=0.5, mean_acceptance_length=3.0, draft_tokens=400.0, accepted=200.0, drafts=100.0
    )
    acc = A.from_window(stats, None, "test")
    assert acc.measured_k == 4 and acc.given == "mean_length"  # 400 drafted / 100 drafts
    assert acc.acceptance_rate == pytest.approx(0.5)
    adv = A.advise(acc, k=4, c=0.05)
    assert adv.measured_speedup == pytest.approx(3.0 / 1.2)
    with pytest.raises(SpecopsError, match="no acceptance"):
        A.from_window(WindowStats("no-data", 60.0, reason="idle"), 4, "test")


def test_invalid_inputs_are_refused():
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(SpecopsError):
            A.from_alpha(bad)
    with pytest.raises(SpecopsError):
        A.from_acceptance_rate(0.5, 0)
    with pytest.raises(SpecopsError):
        A.advise(A.from_alpha(0.5), k=0)
    with pytest.raises(SpecopsError):
        A.advise(A.from_alpha(0.5), k=2, c=1.5)


def test_per_batch_size_schedule():
    assert A.per_batch_size_schedule(6) == [[1, 4, 6], [5, 16, 3], [17, 64, 1], [65, 256, 0]]
    assert A.per_batch_size_schedule(2, 32) == [[1, 4, 2], [5, 32, 1]]  # equal neighbours merged
    assert A.per_batch_size_schedule(1, 8) == [[1, 8, 1]]
    assert A.per_batch_size_schedule(5, 3) == [[1, 3, 5]]
    assert A.per_batch_size_schedule(0, 64) is None
    for sched in (A.per_batch_size_schedule(k, m) for k in (1, 3, 8) for m in (None, 2, 16, 100, 1000)):
        assert sched[0][0] == 1  # vLLM needs the first range at 1
        assert all(a[1] + 1 == b[0] for a, b in zip(sched, sched[1:]))  # contiguous, non-overlapping


def test_batch_caveat_and_schedule_only_for_high_concurrency():
    low = A.advise(A.from_alpha(0.8), k=4, c=0.05, batch_size=1)
    assert "fades" in low.batch_caveat and low.per_batch_size is None
    high = A.advise(A.from_alpha(0.8), k=4, c=0.05, batch_size=16, backend="vllm")
    assert high.per_batch_size == A.per_batch_size_schedule(high.best_k)
    assert any("num_speculative_tokens_per_batch_size" in n for n in high.notes)
    llama = A.advise(A.from_alpha(0.8), k=4, c=0.05, batch_size=16, backend="llamacpp")
    assert llama.per_batch_size is None and any("llama-server has no per-batch" in n for n in llama.notes)
    served = A.advise(A.from_alpha(0.8), k=4, c=0.05, backend="vllm", max_batch=32)  # profile parallel
    assert served.per_batch_size[-1][1] == 32


def test_threshold_note_when_the_rate_would_trigger_a_fallback():
    # α = .7 at k = 8: the rate (α + … + α^8)/8 ≈ .27 is far below .6, yet the model predicts > 2x
    adv = A.advise(A.from_alpha(0.7), k=8, c=0.05, min_acceptance=0.6)
    assert adv.speedup > 2
    assert any("threshold watcher would fall back" in n for n in adv.notes)


# ------------------------------------------------------------------------------------ the command


def test_cli_json_matches_library():
    out = cli("--alpha", "0.8", "-k", "4", "-c", "0.05", "--json")
    data = json.loads(out.stdout)
    assert data["tokens_per_pass"] == pytest.approx(3.3616) and data["best_k"] == 8
    assert data["acceptance"]["given"] == "alpha" and len(data["table"]) == 8
    assert "(1 - alpha^(k+1)) / ((1 - alpha) * (k*c + c_verify(k+1)))" in data["cost_model"]["speedup"]
    assert data["cost_model"]["verify_cost"].startswith("c_verify ≡ 1 (assumed")  # no curve: the fallback, said
    assert data["cost_model"]["verify_cost_curve"] is None


def test_cli_text_states_model_table_and_caveat():
    out = cli("--acceptance-rate", "0.375", "-k", "2", "-c", "0.1", "--batch-size", "16").stdout
    assert "rate 0.3750 (accepted/drafted) at k = 2 → α = 0.5000" in out
    assert "τ(α,k) = (1 − α^(k+1)) / (1 − α)" in out and "S = τ / (k·c + c_verify(k+1))" in out
    assert "verify cost  c_verify ≡ 1 (assumed" in out
    assert "best k: 2 (1.46x)" in out
    assert "   2         1.750" in out and "◀ best" in out
    assert "batch size 16" in out and "per_batch_size" in out
    assert "warning: α = 0.500 is below 0.6" in out


def test_cli_profile_supplies_k_and_cost(repo_root):
    out = cli(str(repo_root / "examples" / "vllm-cpu-draft.yaml"), "--acceptance-rate", "0.5", "--json")
    data = json.loads(out.stdout)
    assert data["k"] == 3 and data["acceptance"]["measured_k"] == 3 and data["backend"] == "vllm"
    assert data["draft_cost_ratio"] == 0.05


def test_cli_usage_errors():
    two = cli("--alpha", "0.5", "--acceptance-rate", "0.5", check=False)
    assert two.returncode == 2 and "one way" in two.stderr
    none = cli(check=False)
    assert none.returncode == 2 and "--alpha" in none.stderr
    bad = cli("--alpha", "1.5", check=False)
    assert bad.returncode == 1 and "within [0, 1]" in bad.stderr


def test_cli_reads_an_instance_state_file(tmp_path):
    """--instance reads the watcher's window from the state file of a running instance (pid alive)."""
    inst = tmp_path / "state" / "demo"
    inst.mkdir(parents=True)
    (inst / "state.json").write_text(
        json.dumps(
            {
                "name": "demo",
                "pid": os.getpid(),
                "identity": self_identity(),
                "state": "ready",
                "method": "draft_model",
                "step": 0,
                "acceptance": {
                    "status": "ok",
                    "window_s": 60.0,
                    "acceptance": 0.5,
                    "mean_acceptance_length": 2.5,
                    "draft_tokens": 600.0,
                    "accepted": 300.0,
                    "drafts": 200.0,
                    "reason": "x",
                },
            }
        )
    )
    data = json.loads(cli("--instance", "demo", "--json", env={"SPECOPS_STATE": str(tmp_path / "state")}).stdout)
    acc = data["acceptance"]
    assert acc["given"] == "mean_length" and acc["measured_k"] == 3 and acc["value"] == 2.5
    assert data["k"] == 3 and data["measured_speedup"] == pytest.approx(2.5 / 1.15)
    gone = cli("--instance", "nope", env={"SPECOPS_STATE": str(tmp_path / "state")}, check=False)
    assert gone.returncode == 1 and "no instance named 'nope'" in gone.stderr
    # a live process that is not the instance (a reused pid: another start time) is stale, not read
    doc = json.loads((inst / "state.json").read_text())
    doc["identity"]["starttime"] = (doc["identity"]["starttime"] or 0) + 1
    (inst / "state.json").write_text(json.dumps(doc))
    stale = cli("--instance", "demo", env={"SPECOPS_STATE": str(tmp_path / "state")}, check=False)
    assert stale.returncode == 1 and "is not running (stale" in stale.stderr


# ------------------------------------------------------------------------------------ live, real engines


@pytest.mark.engines
@pytest.mark.timeout(180)
def test_live_from_llama_server_metrics_and_instance(tmp_path):
    """A real `specops up` (llama-server, same-weights draft): advise reads its /metrics and its watcher."""
    from support_ports import free_port
    from support_up import UpRun, http_json, write_profile

    from specops.devenv.testmodels import ensure_tiny_models
    from specops.paths import tiny_models_dir

    ensure_tiny_models(["gguf"])
    models = tiny_models_dir()
    profile = write_profile(
        tmp_path / "adv.yaml",
        {
            "name": "adv-live",
            "backend": "llamacpp",
            "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 512},
            "speculative": {
                "method": "draft_model",
                "draft": str(models / "gguf-draft-same.gguf"),
                "num_speculative_tokens": 4,
            },
            "gpus": {"devices": []},
            "server": {"port": free_port(), "parallel": 2},
            "proxy": {"enabled": False},
            # a window long enough that the drafts are still in it when `advise PROFILE` (a new process) reads it
            "fallback": {"window": "20s", "min_draft_tokens": 20},
            "monitor": {"interval": "300ms"},
            "supervisor": {"stop_timeout": 10},
        },
    )
    env = {"SPECOPS_STATE": str(tmp_path / "state")}
    with UpRun(profile, tmp_path / "state", "adv-live") as run:
        st = run.wait_ready(timeout=60)
        for i in range(4):
            status, body = http_json(
                st["url"] + "/v1/completions",
                {"prompt": f"the quick brown fox {i}", "max_tokens": 48, "temperature": 0},
            )
            assert status == 200
        scraped = json.loads(cli("--metrics-url", st["url"] + "/metrics", "-c", "0.1", "--json", env=env).stdout)
        acc = scraped["acceptance"]
        assert scraped["backend"] == "llamacpp"  # detected from the series
        assert acc["given"] == "mean_length" and acc["measured_k"] == 4  # llama-server counts drafts
        assert 0.9 <= acc["acceptance_rate"] <= 1.0 and acc["draft_tokens"] > 0
        assert scraped["alpha"] >= acc["acceptance_rate"]  # α ≥ rate for k > 1
        assert scraped["measured_speedup"] == pytest.approx(
            acc["mean_acceptance_length"] / (1 + acc["mean_draft_length"] * 0.1)
        )
        deadline = time.monotonic() + 30
        while (run.state().get("acceptance") or {}).get("status") != "ok":
            assert time.monotonic() < deadline, run.state()
            http_json(st["url"] + "/v1/completions", {"prompt": "lazy dog", "max_tokens": 32, "temperature": 0})
            time.sleep(0.3)
        live = json.loads(cli(str(profile), "--json", env=env).stdout)  # PROFILE alone → its instance
        assert live["acceptance"]["source"].startswith("instance adv-live")
        assert live["k"] == 4 and 0.9 <= live["acceptance"]["acceptance_rate"] <= 1.0
        assert run.stop() == 0


@pytest.mark.engines
@pytest.mark.prometheus
@pytest.mark.timeout(180)
def test_live_from_prometheus_scraping_llama_server(tmp_path):
    """A real Prometheus scraping a real llama-server: advise PROFILE --prometheus reads the increase."""
    from support_ports import free_port
    from support_prometheus import PrometheusServer, require_prometheus, wait_until
    from support_up import UpRun, http_json, write_profile

    from specops.devenv.testmodels import ensure_tiny_models
    from specops.paths import tiny_models_dir

    require_prometheus()
    ensure_tiny_models(["gguf"])
    models = tiny_models_dir()
    port = free_port()
    profile = write_profile(
        tmp_path / "prom.yaml",
        {
            "name": "adv-prom",
            "backend": "llamacpp",
            "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 512},
            "speculative": {
                "method": "draft_model",
                "draft": str(models / "gguf-draft-same.gguf"),
                "num_speculative_tokens": 4,
            },
            "gpus": {"devices": []},
            "server": {"port": port, "parallel": 2},
            "proxy": {"enabled": False},
            "supervisor": {"stop_timeout": 10},
        },
    )
    env = {"SPECOPS_STATE": str(tmp_path / "state")}
    with UpRun(profile, tmp_path / "state", "adv-prom") as run:
        st = run.wait_ready(timeout=60)
        prom = PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{port}"], scrape_interval=1.0).start()
        try:
            series = "llamacpp:spec_decode_num_draft_tokens_total"
            wait_until(lambda: prom.value(f"count(count_over_time({series}[1m]))") is not None, 30, "a first scrape")
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end:
                status, _ = http_json(
                    st["url"] + "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 32, "temperature": 0}
                )
                assert status == 200
            wait_until(lambda: (prom.value(f"sum(increase({series}[15s]))") or 0) > 0, 30, "an increase")
            out = json.loads(cli(str(profile), "--prometheus", prom.url, "--window", "15s", "--json", env=env).stdout)
        finally:
            prom.stop()
        acc = out["acceptance"]
        assert acc["source"].startswith(f"Prometheus {prom.url}")
        assert acc["given"] == "mean_length" and acc["measured_k"] == 4 and out["backend"] == "llamacpp"
        assert 0.9 <= acc["acceptance_rate"] <= 1.0 and acc["draft_tokens"] > 0
        assert run.stop() == 0


# ------------------------------------------------------------------------------------ a measured surface

SURFACE = {
    "date": "2026-12-01",
    "engine_version": "0.32.0",
    "points": [
        {"method": "none", "k": 0, "concurrency": 1, "tokens_per_s": 40},
        {"method": "none", "k": 0, "concurrency": 2, "tokens_per_s": 120},
        {"method": "draft_model", "k": 4, "concurrency": 1, "tokens_per_s": 80},
        {"method": "draft_model", "k": 4, "concurrency": 2, "tokens_per_s": 100},
    ],
}


def test_advise_prints_the_measured_crossover_of_a_recorded_surface(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(
        "name: p\nbackend: vllm\nmodel: {id: a/b}\nspeculative: {method: draft_model, draft: c/d}\n"
        "server: {parallel: 2}\n",
        encoding="utf-8",
    )
    (tmp_path / "p.tune.json").write_text(json.dumps({"surface": SURFACE}), encoding="utf-8")
    out = cli(str(prof), "--alpha", "0.8").stdout
    # 80 + 20t = 40 + 80t at t = 2/3 (log2 c); the first 1/8-octave grid point past it: 2^0.75 = 1.68
    assert (
        "note: draft_model k=4 stops beating no speculation at concurrency 1.68 "
        "(measured 2026-12-01 on 0.32.0, concurrency 1, 2)" in out
    )
    data = json.loads(cli(str(prof), "--alpha", "0.8", "--json").stdout)
    assert data["crossover"] == {"draft_model k=4": 1.68}
    # vLLM takes a k per batch size: the schedule comes from the measurements (k 0 at 2, where none wins)
    assert data["per_batch_size"] == [[1, 1, 4], [2, 2, 0]]
    (tmp_path / "p.tune.json").write_text("{}", encoding="utf-8")
    assert json.loads(cli(str(prof), "--alpha", "0.8", "--json").stdout)["crossover"] is None


def test_a_surface_where_speculation_always_wins_or_never_does():
    from specops.watch.surface import Surface

    s = Surface.from_dict(SURFACE)
    adv = A.advise(A.from_alpha(0.8), k=4, backend="llamacpp", surface=s)
    assert "stops beating no speculation at concurrency 1.68" in " ".join(adv.notes)
    never = Surface.from_dict({"points": [{**p, "tokens_per_s": 10} if p["k"] else p for p in SURFACE["points"]]})
    adv = A.advise(A.from_alpha(0.8), k=4, backend="llamacpp", surface=never)
    assert any("does not beat no speculation even at concurrency 1" in n for n in adv.notes)
    always = Surface.from_dict({"points": [{**p, "tokens_per_s": 500} if p["k"] else p for p in SURFACE["points"]]})
    adv = A.advise(A.from_alpha(0.8), k=4, backend="llamacpp", surface=always)
    assert any("beats no speculation at every measured concurrency up to 2" in n for n in adv.notes)
