"""A local fleet: three `specops up` on real llama-server share a (fake) Kubernetes API server for their switch
slots, all run a draft that falls back, and clients round-robin over them under load. Never more than
``deploy.max_switching`` = 1 replica switches at once, every replica switches in the end, no request fails.

The test holds the one slot itself at first (as an operator's replica would), so all three replicas decide to
switch while it is taken: each shows that it waits (state file, event, metric), and when the slot is given
back they race for it and go one after the other. The timeline (who switched when) is printed.
"""

from __future__ import annotations

import itertools
import time

import pytest
from fakekube import FakeKube
from support_load import Load
from support_ports import free_port
from support_up import UpRun, http_text, write_profile

from specops.k8s.lease import LeaseGate

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]

REPLICAS = 3
NAME = "fleet"


def profile(tmp_path, models, i: int):
    return write_profile(
        tmp_path / f"replica-{i}.yaml",
        {
            "name": NAME,  # one deployment: the same slots
            "backend": "llamacpp",
            "model": {"id": str(models / "gguf-target.gguf"), "max_model_len": 1024},
            "speculative": {
                "method": "draft_model",
                "draft": str(models / "gguf-draft-noisy.gguf"),  # acceptance ≈ 0.5: every replica falls back
                "num_speculative_tokens": 8,
            },
            "gpus": {"devices": []},
            "server": {"port": free_port(), "parallel": 2},
            "fallback": {
                "window": "4s",
                "min_draft_tokens": 100,
                "consecutive_windows": 2,
                "cooldown": "1m",
                "chain": ["ngram", "none"],
            },
            "monitor": {"interval": "500ms"},
            "supervisor": {"stop_timeout": 10},
            "deploy": {"replicas": REPLICAS, "coordination": "lease", "max_switching": 1, "lease_duration": "10s"},
        },
    )


def switch_spans(run: UpRun) -> list[tuple[float, float]]:
    """(start, end) of each switch, from the supervisor's own events: from entering ``stopping`` (the proxy
    holds, the probe fails) to the next engine's ``ready``."""
    spans, start = [], None
    for e in run.events():
        if e["event"] == "state" and e.get("state") == "stopping":
            start = e["ts"]
        elif e["event"] == "switch" and start is not None:
            spans.append([start, None])
        elif e["event"] == "ready" and spans and spans[-1][1] is None:
            spans[-1][1] = e["ts"]
    return [(a, b) for a, b in spans if b is not None]


def test_three_replicas_switch_one_at_a_time_under_load(tmp_path, tiny_gguf_models):
    kube = FakeKube().start()
    config = kube.kubeconfig(tmp_path / "kubeconfig", namespace="fleet")
    runs = [
        UpRun(
            profile(tmp_path, tiny_gguf_models, i),
            tmp_path / f"state-{i}",
            NAME,
            env={"KUBECONFIG": str(config), "POD_NAME": f"replica-{i}", "POD_NAMESPACE": "fleet"},
        )
        for i in range(REPLICAS)
    ]
    # the stand-in holder does not renew its Lease: it lasts long enough for every replica to decide (a 10 s one
    # expired on a loaded machine before the third replica waited, and a replica took the slot)
    operator = LeaseGate.from_environment(NAME, 1, 300, {"KUBECONFIG": str(config), "POD_NAME": "operator"})
    t0 = time.time()
    try:
        for run in runs:
            run.start()
        urls = [run.wait_ready(timeout=150)["url"] for run in runs]
        held, _ = operator.try_enter()  # the slot is taken before any replica decides
        assert held is not None
        with Load(urls, clients=12, max_tokens=24, request_timeout=120, max_seconds=240) as load:
            for run in runs:  # every replica decided to switch and waits for the slot, and says so
                st = run.wait_for(lambda s: (s.get("fleet") or {}).get("waiting_since"), 90, "waiting for a slot")
                assert st["fleet"]["holders"] == ["operator"] and st["fleet"]["wants"] == "ngram", st["fleet"]
                assert st["method"] == "draft_model" and st["state"] == "ready"
                assert "specops_switch_waiting 1.0" in http_text(st["url"] + "/specops/metrics")
            released_at = time.time()
            operator.leave(held)
            for run in runs:
                run.wait_for(lambda s: s.get("method") == "ngram" and s.get("state") == "ready", 120, "ngram")
            load.wait_for_answers(REPLICAS * 4, timeout=60)  # the fleet serves after the last switch
        spans = {i: switch_spans(run) for i, run in enumerate(runs)}
        timeline = sorted(
            (
                e["ts"],
                f"replica-{i}",
                e["event"],
                {k: e[k] for k in ("to", "holders", "slot", "waited_s", "held_s") if k in e},
            )
            for i, run in enumerate(runs)
            for e in run.events()
            if e["event"] in ("switch-waiting", "switch-slot", "switch", "switch-complete", "switch-released")
        )
        print(f"\nfleet timeline (s after start; operator released the slot at {released_at - t0:.1f}):")
        for ts, who, what, extra in timeline:
            print(f"  {ts - t0:7.2f}  {who}  {what:16s} {extra}")
        for i, s in spans.items():
            print(f"  replica-{i} switching: " + ", ".join(f"{a - t0:.2f}–{b - t0:.2f}" for a, b in s))
        print(f"  load: {load.report()}")

        assert load.lost == 0 and load.counts["stream_error"] == 0, load.failures[:5]
        assert all(len(s) == 1 for s in spans.values()), spans  # every replica switched, once
        ordered = sorted(s[0] for s in spans.values())
        for (_, end), (start, _) in itertools.pairwise(ordered):
            assert start >= end, f"two replicas switched at the same time: {ordered}"
        assert all(a >= released_at for a, _ in ordered)  # none switched while the operator held the slot
        assert kube.max_concurrent_holders() == 1
        for i, run in enumerate(runs):  # each replica held the slot around its own switch
            slot = [e for e in run.events("switch-slot")]
            released = [e for e in run.events("switch-released")]
            assert len(slot) == 1 and len(released) == 1 and released[0]["why"] == "ready"
            (start, end) = spans[i][0]
            assert slot[0]["ts"] <= start and released[0]["ts"] >= end
            assert run.events("switch-waiting")
        waits = sorted(run.events("switch-slot")[0]["waited_s"] for run in runs)
        assert waits[-1] > waits[0]  # the last in line waited longer than the first
        for run in runs:
            assert run.stop() == 0
    finally:
        for run in runs:
            if run.proc is not None:
                run.__exit__(None, None, None)
        operator.close()
        kube.stop()
