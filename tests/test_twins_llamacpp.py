"""Twins on a real llama-server: a `none` engine kept warm beside the speculating primary, behind one proxy.

Which engine answered is read from the answer itself: llama-server's ``timings`` carry ``draft_n`` only when the
engine drafted. A route header and a model alias land on the engine they name; a twin killed under load loses no request and is
restarted while the primary serves; a fallback to the twin's step is a route change (no restart of the primary,
no hold) under load with nothing lost."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import pytest
from support_load import Load
from support_up import UpRun, llama_profile

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def models(tiny_gguf_models):
    return tiny_gguf_models


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def drafted(answer: dict) -> int:
    return int(answer.get("timings", {}).get("draft_n", 0) or 0)


def completion(url: str, headers: dict | None = None) -> tuple[int, dict]:
    return post(url + "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}, headers)


def twins_ready(run: UpRun, timeout: float = 180) -> dict:
    st = run.wait_for(
        lambda s: s.get("state") == "ready" and len(s.get("engines", [])) == 2 and all(e["live"] for e in s["engines"]),
        timeout,
        "the primary and its twin live",
    )
    for e in st["engines"]:  # the test's cleanup kills every engine group it saw
        if e.get("engine_pid"):
            run.engine_groups.add(e["engine_pid"])
    return st


def test_route_header_lands_on_the_engine_it_names(tmp_path, models):
    aliases = {"tiny-fast": "on", "tiny-exact": "off"}
    profile = llama_profile(
        tmp_path,
        models,
        "twin-header",
        chain=["none"],
        routing={"twins": ["none"], "aliases": aliases},
        monitor={"interval": "500ms"},
    )
    with UpRun(profile, tmp_path / "state", "twin-header") as run:
        st = twins_ready(run)
        url = st["url"]
        primary, twin = st["engines"]
        assert (primary["method"], twin["method"]) == ("draft_model", "none")
        assert twin["engine_pid"] and twin["engine_pid"] != st["engine_pid"]
        status, on = completion(url, {"X-Specops-Speculation": "on"})
        assert status == 200 and drafted(on) > 0, on.get("timings")
        status, off = completion(url, {"X-Specops-Speculation": "off"})
        assert status == 200 and drafted(off) == 0, off.get("timings")
        assert off["choices"][0]["text"] == on["choices"][0]["text"]  # greedy: speculation never changes output
        status, default = completion(url)
        assert status == 200 and drafted(default) > 0  # the step in effect: the primary
        status, bad = completion(url, {"X-Specops-Speculation": "sometimes"})
        assert status == 400 and "not one of on, off, auto" in bad["error"]["message"]
        # a client that can only set `model`: the alias chooses, the engine gets its own name (chat, streamed too)
        ask = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}
        status, exact = post(url + "/v1/completions", {**ask, "model": "tiny-exact"})
        assert status == 200 and drafted(exact) == 0 and exact["model"] != "tiny-exact", exact
        status, fast = post(url + "/v1/completions", {**ask, "model": "tiny-fast"})
        assert status == 200 and drafted(fast) > 0 and fast["model"] == exact["model"], fast
        assert fast["choices"][0]["text"] == exact["choices"][0]["text"] == on["choices"][0]["text"]
        chat = {"model": "tiny-exact", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=json.dumps(chat).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("data: {")]
        last = json.loads(lines[-1][6:])
        assert r.status == 200 and int(last.get("timings", {}).get("draft_n", 0) or 0) == 0, last
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        assert ids[-2:] == ["tiny-fast", "tiny-exact"] and exact["model"] in ids, ids
        st = run.wait_for(lambda s: sum(e["routed"] for e in s.get("engines", [])) >= 7, 30, "routed counts")
        assert [e["routed"] for e in st["engines"]] == [4, 3]
        assert run.stop() == 0


def test_twin_crash_under_load_loses_nothing_and_restarts(tmp_path, models):
    profile = llama_profile(
        tmp_path,
        models,
        "twin-crash",
        chain=["none"],
        routing={"twins": ["none"], "rules": [{"match": {"path": "/v1/completions"}, "speculation": "off"}]},
    )
    with UpRun(profile, tmp_path / "state", "twin-crash") as run:
        st = twins_ready(run)
        twin = st["engines"][1]
        with Load(st["url"], clients=4, max_tokens=32) as load:
            load.wait_for_answers(8, 120)
            os.killpg(twin["engine_pid"], signal.SIGKILL)
            st = run.wait_for(
                lambda s: s["engines"][1]["restarts"] >= 1 and s["engines"][1]["live"], 120, "the twin restarted"
            )
            load.wait_for_answers(8, 120)  # served again, by either engine
        assert load.lost == 0 and load.ok > 0, (load.report(), load.failures[:3])
        assert st["restarts"] == 0 and st["state"] == "ready"  # the primary never stopped
        exits = [e for e in run.events("exit") if e.get("engine") == "twin-none"]
        assert exits, run.events()[-10:]
        assert run.stop() == 0


def test_fallback_to_the_twin_is_a_route_change_under_load(tmp_path, models):
    profile = llama_profile(
        tmp_path,
        models,
        "twin-switch",
        draft="gguf-draft-noisy.gguf",
        routing={"twins": ["none"]},
        fallback={  # the noisy draft accepts ~0.5-0.65 on this traffic: held to 0.9, it is certain to be left
            "window": "4s",
            "min_acceptance": 0.9,
            "min_draft_tokens": 100,
            "consecutive_windows": 2,
            "chain": ["none"],
        },
        monitor={"interval": "500ms"},
    )
    with UpRun(profile, tmp_path / "state", "twin-switch") as run:
        st = twins_ready(run)
        primary_pid = st["engine_pid"]
        with Load(st["url"], clients=4, max_tokens=32) as load:
            st = run.wait_for(lambda s: s.get("routing", {}).get("current") == 1, 120, "the route change")
            load.wait_for_answers(8, 120)
        assert load.lost == 0 and load.counts["stream_error"] == 0, (load.report(), load.failures[:3])
        route = run.events("route")
        assert route and route[0]["from"] == "draft_model" and route[0]["to"] == "none"
        assert "below" in route[0]["reason"]
        # no restart, no hold: the primary kept running and nothing was drained
        assert st["engine_pid"] == primary_pid and st["state"] == "ready" and st["restarts"] == 0
        assert not run.events("switch") and not run.events("stopping")
        assert st["last_decision"]["route_change"] is True and st["last_decision"]["to"] == "none"
        status, answer = completion(st["url"])
        assert status == 200 and drafted(answer) == 0  # new requests go to the twin
        assert run.stop() == 0
