"""Model aliases (``routing.aliases``) and the speed each request class saw (tokens/s, mean acceptance length).

Real parts: profiles loaded from YAML by the real loader (errors located at file:line:column), the real router,
and end to end a real Proxy on loopback (both HTTP layers) with the real TwinEngines routing between two stand-in
engine processes (support_upstream.py) that speak llama-server's API and echo the ``model`` they were sent.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from specops.config.profile import load_profile
from specops.errors import ProfileError

pytestmark = pytest.mark.timeout(90)

BASE = """\
name: t
backend: llamacpp
model: {id: /models/target.gguf, served_name: tiny-test-model}
speculative: {method: ngram}
fallback: {chain: [none]}
"""
TWINS = "routing:\n  twins: [none]\n"


def _load(tmp_path, extra: str, base: str = BASE):
    path = tmp_path / "p.yaml"
    path.write_text(base + extra)
    return load_profile(path)


# ------------------------------------------------------------------------------------------------ profile


@pytest.mark.parametrize(
    ("extra", "where", "says"),
    [
        ("routing:\n  aliases: {fast: on}\n", "p.yaml:7:", "model aliases need an engine to route to"),
        (TWINS + "  aliases: {tiny-test-model: on}\n", "p.yaml:8:", "is the model name the engines serve"),
        (TWINS + "  aliases: {'': on}\n", "p.yaml:8:", "'' is not a model name"),
        (TWINS + "  aliases: {' fast': on}\n", "p.yaml:8:", "' fast' is not a model name"),
        (TWINS + "  aliases:\n    fast: on\n    fast: off\n", "p.yaml:10:", "duplicate key 'fast'"),
        (TWINS + "  aliases: {fast: sometimes}\n", "p.yaml:8:", "routing.aliases.fast: invalid value 'sometimes'"),
        (
            TWINS + "  aliases: {fast: on}\n  rules:\n    - {match: {model: fast}, speculation: off}\n",
            "p.yaml:10:",
            "routing.rules[0].match.model: 'fast' is an alias (on)",
        ),
    ],
)
def test_alias_problems_are_located(tmp_path, extra, where, says):
    with pytest.raises(ProfileError) as err:
        _load(tmp_path, extra)
    text = str(err.value)
    line = next((ln for ln in text.splitlines() if says in ln), None)
    assert line is not None and where in line, text


def test_alias_equal_to_the_default_served_name_is_refused(tmp_path):
    """Without model.served_name the engines answer to the id (and llama-server to a local file's name)."""
    base = BASE.replace(", served_name: tiny-test-model", "")
    with pytest.raises(ProfileError) as err:
        _load(tmp_path, TWINS + "  aliases: {target.gguf: on, fast: on}\n", base)
    assert "'target.gguf' is the model name the engines serve" in str(err.value)
    assert "fast" not in str(err.value).replace("target.gguf-fast", "")


def test_aliases_load_with_yaml_on_off_and_auto(tmp_path):
    r = _load(tmp_path, TWINS + "  client_choice: forbid\n  aliases: {fast: on, exact: off, nick: auto}\n")
    assert r.profile.routing.aliases == {"fast": "on", "exact": "off", "nick": "auto"}


# ------------------------------------------------------------------------------------------------ router


def _router(tmp_path, extra: str):
    from specops.proxy.router import EngineInfo, Router

    profile = _load(tmp_path, extra).profile
    router = Router(profile.routing, [EngineInfo(0, "ngram", True), EngineInfo(1, "none", False)])
    router.served = "tiny-test-model"
    return router


BOTH = (True, True)


def test_an_alias_routes_and_is_replaced_by_the_served_name(tmp_path):
    from specops.proxy.router import RouteRefused

    router = _router(
        tmp_path,
        TWINS
        + "  client_choice: forbid\n  aliases: {fast: on, exact: off, nick: auto}\n"
        + "  rules:\n    - {match: {model: nick}, speculation: off}\n",
    )
    body = {"model": "exact", "prompt": "caf\u00e9 \U0001f600", "max_tokens": 3, "temperature": 0.7}
    off = router.route("/v1/completions", {}, json.dumps(body).encode(), BOTH)
    assert (off.engine, off.reason) == (1, "alias")
    assert json.loads(off.body) == {**body, "model": "tiny-test-model"}  # only `model` changed, key order kept
    assert list(json.loads(off.body)) == list(body)
    on = router.route("/v1/chat/completions", {}, b'{"model": "fast", "messages": []}', BOTH)
    assert (on.engine, on.reason) == (0, "alias") and json.loads(on.body)["model"] == "tiny-test-model"
    # `auto`: just a name: the rules and the default decide, the name is still replaced
    nick = router.route("/v1/completions", {}, b'{"model": "nick"}', BOTH)
    assert (nick.engine, nick.reason) == (1, "rule 0") and json.loads(nick.body)["model"] == "tiny-test-model"
    # not an alias: sent as it came; an alias in another field is not a model
    plain = router.route("/v1/completions", {}, b'{"model": "tiny-test-model", "user": "fast"}', BOTH)
    assert plain.body is None and plain.reason == "default"
    # client_choice: forbid refuses the header even with an alias (aliases are the operator's, the header is not)
    with pytest.raises(RouteRefused) as err:
        router.route("/v1/completions", {"X-Specops-Speculation": "on"}, b'{"model": "exact"}', BOTH)
    assert err.value.status == 403


def test_the_header_wins_over_an_alias(tmp_path):
    router = _router(tmp_path, TWINS + "  aliases: {exact: off}\n")
    r = router.route("/v1/completions", {"X-Specops-Speculation": "on"}, b'{"model": "exact"}', BOTH)
    assert (r.engine, r.reason) == (0, "header") and json.loads(r.body)["model"] == "tiny-test-model"
    auto = router.route("/v1/completions", {"X-Specops-Speculation": "auto"}, b'{"model": "exact"}', BOTH)
    assert (auto.engine, auto.reason) == (1, "alias")


def test_models_list_gets_the_aliases(tmp_path):
    router = _router(tmp_path, TWINS + "  aliases: {fast: on, exact: off}\n")
    assert router.route("/v1/models", {}, b"", BOTH).lists_models
    assert not router.route("/v1/models/x", {}, b"", BOTH).lists_models
    engine = {"object": "list", "data": [{"id": "tiny-test-model", "object": "model", "created": 7}]}
    listed = json.loads(router.list_aliases(json.dumps(engine).encode()))
    assert [m["id"] for m in listed["data"]] == ["tiny-test-model", "fast", "exact"]
    assert listed["data"][1] == {
        "id": "fast",
        "object": "model",
        "owned_by": "specops",
        "root": "tiny-test-model",
        "created": 7,
        "specops_speculation": "on",
    }
    for odd in (b"not json", b"[]", b'{"data": 3}'):
        assert router.list_aliases(odd) is None
    without = _router(tmp_path, TWINS)
    assert not without.route("/v1/models", {}, b"", BOTH).lists_models


# ------------------------------------------------------------------------------------------------ class speed


def test_class_speed_and_mean_acceptance_length_from_answers():
    from specops.watch.classes import ClassTable

    table = ClassTable(max_classes=4, window_s=60)
    table.touch("code", 0.0)
    # two answers served speculating: 40 tokens in 2 s with 20 of 30 drafts accepted, 20 tokens in 1 s with 5/10
    table.note("code", 1.0, speculative=True, draft_tokens=30, accepted=20, tokens=40, seconds=2.0)
    table.note("code", 2.0, speculative=True, draft_tokens=10, accepted=5, tokens=20, seconds=1.0)
    table.note("code", 3.0, speculative=False, tokens=30, seconds=3.0)
    table.note("code", 3.0, speculative=False, tokens=None, seconds=1.0)  # no count: in no speed
    [row] = table.snapshot(4.0)
    assert row["tokens_per_s_on"] == 20.0 and row["tokens_per_s_off"] == 10.0
    assert row["tokens_per_s"] == pytest.approx(90 / 6, abs=0.01)
    assert row["mean_acceptance_length"] == pytest.approx(60 / (60 - 25), abs=0.001)  # tokens per target pass
    assert (row["served_on"], row["served_off"]) == (2, 2)
    # past the window nothing is left to divide
    [old] = table.snapshot(200.0)
    assert old["tokens_per_s"] is None and old["mean_acceptance_length"] is None


# ------------------------------------------------------------------------------------------------ end to end


def _twins(tmp_path, loaded):
    from support_goodput import Events

    from specops.serve.twins import TwinEngines
    from specops.watch.decide import FallbackDecider
    from specops.watch.watcher import SpecopsMetrics

    events, metrics = Events(), SpecopsMetrics()
    twins = TwinEngines(
        loaded.profile,
        decider=FallbackDecider.from_profile(loaded.profile, events=events, say=lambda m: None),
        events=events,
        say=lambda m: None,
        render_twin=lambda profile, step, port: lambda index: None,
        log_path=lambda name: tmp_path / f"{name}.log",
        health_interval=0.1,
        launch_problem=None,
        metrics=metrics,
    )
    return twins, metrics


def test_aliases_and_class_speed_through_the_proxy(tmp_path):
    """A client that can only set `model` chooses the engine; the engine gets its own name (whole and streamed,
    chat and completions, the body's length updated); /v1/models lists the aliases; each class's tokens/s and
    mean acceptance length come from the answers (streamed ones through llama-server's timings)."""
    import aiohttp
    from prometheus_client import generate_latest
    from support_upstream import Upstream, check_completion, check_stream, parse_sse, running_proxy

    loaded = _load(
        tmp_path,
        TWINS
        + "  client_choice: forbid\n  aliases: {tiny-fast: on, tiny-exact: off}\n"
        + "  classes: {key: header, header: X-Task}\n",
    )
    delay, n = 0.01, 12

    async def body(primary, twin):
        twins, metrics = _twins(tmp_path, loaded)
        # the live acceptance hook `specops up` sets for llama.cpp: the proxy then reads timings in streams too
        async with running_proxy(primary.url, on_timings=lambda dn, da: None) as proxy:
            twins.attach(proxy)
            twins.upstreams.handle(1).release(twin.url)
            url = proxy.url
            async with aiohttp.ClientSession() as s:

                async def post(path, doc, headers=None):
                    async with s.post(url + path, json=doc, headers=headers or {}) as r:
                        if doc.get("stream"):
                            return r.status, parse_sse(await r.text())
                        return r.status, await r.json()

                for model, engine in (("tiny-exact", "T"), ("tiny-fast", "P")):
                    status, doc = await post("/v1/completions", {"model": model, "prompt": "p", "max_tokens": n})
                    assert status == 200 and check_completion(doc, n) == engine
                    assert doc["model"] == "tiny-test-model"  # the stand-in echoes the model it was sent
                chat = {"model": "tiny-exact", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n}
                status, events = await post("/v1/chat/completions", {**chat, "stream": True})
                assert status == 200 and check_stream(events, n, chat=True) == "T"
                assert {e["model"] for e in events if isinstance(e, dict)} == {"tiny-test-model"}
                streamed = {"model": "tiny-fast", "prompt": "p", "max_tokens": n, "stream": True}
                status, events = await post("/v1/completions", streamed)
                assert status == 200 and check_stream(events, n) == "P"
                # the header stays refused (client_choice: forbid); the alias is not
                forbidden = {"X-Specops-Speculation": "on"}
                status, doc = await post("/v1/completions", {"model": "tiny-exact", "prompt": "p"}, forbidden)
                assert status == 403 and "client_choice: forbid" in doc["error"]["message"]
                # learned classes: `code` is measured where it drafts (whole and streamed answers); `chat` was
                # judged not to speculate (its one answer is streamed)
                plain = {"model": "tiny-test-model", "prompt": "p", "max_tokens": n}
                for doc in (plain, plain, {**plain, "stream": True}):
                    status, _ = await post("/v1/completions", doc, {"X-Task": "code"})
                    assert status == 200
                twins.classes.touch("chat", time.monotonic())
                twins.classes.decide("chat", False, "acceptance below min_acceptance")
                as_served = {**chat, "model": "tiny-test-model", "stream": True}  # an alias would decide instead
                status, events = await post("/v1/chat/completions", as_served, {"X-Task": "chat"})
                assert status == 200 and check_stream(events, n, chat=True) == "T"
                # the engine gets a well-formed body of the right length, every other field as sent
                sent = {"model": "tiny-fast", "prompt": "caf\u00e9", "n": 1, "x": [1.5, None, {"model": "tiny-fast"}]}
                status, echo = await post("/debug/echo", sent)
                got = json.loads(echo["body"])
                assert got == {**sent, "model": "tiny-test-model"}
                assert int(dict(echo["headers"])["Content-Length"]) == echo["body_len"] == len(echo["body"].encode())
                async with s.get(url + "/v1/models") as r:
                    assert r.status == 200
                    listed = await r.json()
                ids = [m["id"] for m in listed["data"]]
                assert ids == ["tiny-test-model", "tiny-fast", "tiny-exact"]

        rows = {row["class"]: row for row in twins.classes.snapshot(time.monotonic())}
        code_row, chat_row = rows["code"], rows["chat"]
        assert (code_row["served_on"], code_row["served_off"], chat_row["served_off"]) == (3, 0, 1)
        # each answer took at least n token delays: its tokens/s is at most 1/delay (and not nothing)
        for value in (code_row["tokens_per_s_on"], chat_row["tokens_per_s_off"]):
            assert value is not None and 0 < value <= 1 / delay
        assert code_row["tokens_per_s_off"] is None and chat_row["tokens_per_s_on"] is None
        # the stand-in primary reports draft_n = n, draft_n_accepted = n/2: n tokens in n - n/2 target passes
        assert code_row["mean_acceptance_length"] == pytest.approx(2.0)
        assert chat_row["mean_acceptance_length"] is None  # served without speculation only
        text = generate_latest(metrics.registry).decode()
        assert 'specops_class_mean_acceptance_length{cls="code"} 2.0' in text
        assert 'specops_class_tokens_per_second{cls="chat",speculation="off"}' in text
        assert 'specops_class_tokens_per_second{cls="chat",speculation="on"}' not in text
        assert twins.snapshot()["routing"]["aliases"] == {"tiny-fast": "on", "tiny-exact": "off"}

    with (
        Upstream.start("P", acceptance=0.5, draft_per_token=1, token_delay=delay) as primary,
        Upstream.start("T", token_delay=delay) as twin,
    ):
        asyncio.run(asyncio.wait_for(body(primary, twin), 60))


def test_status_prints_each_class_speed_and_the_aliases(tmp_path, capsys):
    """`specops status` (text) shows the aliases and, per class, mean acceptance length and tokens/s on/off, from
    the snapshot `specops up` writes (the same one `--json` and /specops/status carry)."""
    from specops.commands.status import _print_twins

    twins, _ = _twins(tmp_path, _load(tmp_path, TWINS + "  aliases: {fast: on}\n  classes: {key: model}\n"))
    now = time.monotonic()
    twins.classes.touch("code", now)
    twins.classes.note("code", now, speculative=True, draft_tokens=30, accepted=20, tokens=40, seconds=2.0)
    twins.classes.note("code", now, speculative=False, tokens=30, seconds=3.0)
    snap = json.loads(json.dumps(twins.snapshot()))  # as the state file holds it
    [row] = snap["routing"]["classes"]
    assert (row["tokens_per_s_on"], row["tokens_per_s_off"], row["mean_acceptance_length"]) == (20.0, 10.0, 2.0)
    _print_twins(snap)
    out = capsys.readouterr().out
    assert "aliases    fast → on" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("code:"))
    assert "length 2.00" in line and "20.0/10.0 tok/s" in line and "1/1" in line


def test_the_served_name_follows_the_launch_plan_and_a_reload_changes_the_aliases(tmp_path):
    """Before any engine is ready an alias becomes `model.served_name` (else the id); an engine's launch plan then
    says the name it serves. A reloaded profile's aliases apply from the next request, the name kept."""
    from types import SimpleNamespace

    from specops.methods import Method
    from specops.run.events import EngineReady

    base = BASE.replace(", served_name: tiny-test-model", "")
    twins, _ = _twins(tmp_path, _load(tmp_path, TWINS + "  aliases: {fast: on}\n", base))
    route = twins.router.route("/v1/completions", {}, b'{"model": "fast"}', BOTH)
    assert json.loads(route.body)["model"] == "/models/target.gguf"  # vLLM's default; llama-server takes any name
    twins.on_primary_event(EngineReady(0, Method.NGRAM, SimpleNamespace(model_name="target.gguf"), 1.0))
    route = twins.router.route("/v1/completions", {}, b'{"model": "fast"}', BOTH)
    assert json.loads(route.body)["model"] == "target.gguf"

    changes = twins.reload(_load(tmp_path, TWINS + "  aliases: {fast: off, exact: off}\n", base).profile)
    assert "model aliases" in changes
    for name in ("fast", "exact"):
        route = twins.router.route("/v1/completions", {}, json.dumps({"model": name}).encode(), BOTH)
        assert (route.engine, route.reason) == (1, "alias") and json.loads(route.body)["model"] == "target.gguf"
