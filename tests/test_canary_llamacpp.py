"""A canary for a new draft on a real llama-server, under load: a reload to a draft that disagrees with the target
(``gguf-draft-noisy``) is measured on a share of live traffic and rolled back, and the primary never restarts; a
reload to a draft that agrees (a copy of ``gguf-draft-same``) passes and the primary restarts on it. No client
request is lost over the whole run."""

from __future__ import annotations

import shutil
import time

import pytest
import yaml
from support_load import Load
from support_up import UpRun, llama_profile

from specops.run.process import group_members

pytestmark = [pytest.mark.engines, pytest.mark.timeout(420)]

CLIENTS = 8


def engines_ready(run: UpRun, n: int, timeout: float = 180) -> dict:
    st = run.wait_for(
        lambda s: s.get("state") == "ready" and len(s.get("engines", [])) == n and all(e["live"] for e in s["engines"]),
        timeout,
        f"{n} engines live",
    )
    for e in st["engines"]:  # the test's cleanup kills every engine group it saw
        if e.get("engine_pid"):
            run.engine_groups.add(e["engine_pid"])
    return st


def set_draft(profile, draft) -> None:
    data = yaml.safe_load(profile.read_text())
    data["speculative"]["draft"] = str(draft)
    profile.write_text(yaml.safe_dump(data, sort_keys=False))


def test_a_worse_draft_is_rolled_back_and_a_good_one_rolled_out_under_load(tmp_path, tiny_gguf_models):
    models = tiny_gguf_models
    good = tmp_path / "draft-good.gguf"
    shutil.copyfile(models / "gguf-draft-same.gguf", good)
    profile = llama_profile(
        tmp_path,
        models,
        "canary-llama",
        chain=["none"],
        routing={
            "twins": ["none"],
            "canary": {"enabled": True, "share": 0.3, "min_draft_tokens": 200, "tolerance": 0.1, "max_duration": "2m"},
        },
        monitor={"interval": "300ms", "timeout": "1s"},
        proxy={"queue_timeout": "2m", "drain_timeout": "30s"},
    )
    with UpRun(profile, tmp_path / "state", "canary-llama") as run:
        st = engines_ready(run, 2)
        primary_pid = st["engine_pid"]
        load = Load(st["url"], clients=CLIENTS, max_tokens=24, request_timeout=120, max_seconds=300).start()
        try:
            load.wait_for_answers(16, timeout=90)

            # (1) the noisy draft: a canary beside the primary, rolled back on its live acceptance
            set_draft(profile, models / "gguf-draft-noisy.gguf")
            # its engine runs from its start to the rollback (seconds: 200 draft tokens on a share of the load)
            seen = run.wait_for(
                lambda s: any(e.get("canary") and e.get("engine_pid") for e in s.get("engines", [])),
                90,
                "the canary's engine",
            )
            canary_pids = [e["engine_pid"] for e in seen["engines"] if e.get("canary") and e.get("engine_pid")]
            assert canary_pids and primary_pid not in canary_pids, seen["engines"]
            run.engine_groups.update(canary_pids)
            back = run.wait_for(
                lambda s: (s.get("canary") or {}).get("outcomes", {}).get("rolled_back") == 1, 150, "the rollback"
            )
            ev = run.events("canary_rolled_back")[0]
            print("rolled back:", ev["reason"], ev["tally"])
            assert ev["tally"]["canary"]["draft_tokens"] >= 200 and ev["tally"]["current"]["draft_tokens"] >= 200
            assert ev["canary_acceptance"] < ev["current_acceptance"] - 0.1, ev
            assert ev["draft"].endswith("gguf-draft-noisy.gguf")
            assert back["engine_pid"] == primary_pid, "the primary restarted for a draft that was rolled back"
            assert "the new draft was refused live" in back["profile_reload"]["rejected"]["message"]
            routed_canary = [e for e in run.events("start") if e.get("engine") == "canary"]
            assert len(routed_canary) == 1 and "gguf-draft-noisy.gguf" in " ".join(routed_canary[0]["argv"])
            deadline = time.monotonic() + 30  # the canary's engine stops once its requests finished
            while any(group_members(p) for p in canary_pids) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not any(group_members(p) for p in canary_pids), "the rolled-back canary's engine still runs"
            load.wait_for_answers(16, timeout=90)

            # (2) a draft that agrees with the target: the canary passes, the primary restarts on it
            set_draft(profile, good)
            out = run.wait_for(
                lambda s: (
                    (s.get("canary") or {}).get("outcomes", {}).get("rolled_out") == 1
                    and s.get("engine_pid") not in (None, primary_pid)
                    and s.get("state") == "ready"
                ),
                180,
                "the rollout",
            )
            run.engine_groups.add(out["engine_pid"])
            passed = run.events("canary_passed")[0]
            print("passed:", passed["reason"], passed["tally"])
            assert passed["canary_acceptance"] >= passed["current_acceptance"] - 0.1
            primary_starts = [e for e in run.events("start") if e.get("engine") is None]
            assert str(good) in " ".join(primary_starts[-1]["argv"])
            assert out["profile_reload"]["rejected"] is None
            engines_ready(run, 2, timeout=60)  # the canary is gone, the primary and its twin serve
            load.wait_for_answers(16, timeout=90)
        finally:
            load.stop()
        print(load.report())
        assert load.lost == 0 and load.counts["stream_error"] == 0, load.report()
        assert run.stop() == 0, run.output()
