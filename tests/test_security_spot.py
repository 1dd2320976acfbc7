"""Live spot checks never show one client's text to others (issue 25, item 4).

A divergence used to carry ``common_prefix`` and both continuations (a client's answer, and so much of what
the client sent) into ``/specops/status`` (which answers without a key when no ``api_key``/``admin_port`` is
set), ``events.jsonl`` and the printed lines. Now those carry positions and token ids; the text goes only
to ``spot-divergences.jsonl`` (0600) when the profile opts in with ``certify.spot_check.keep_text``.

The clients' requests go through the real proxy and its sampler (as in tests/test_certify_spot.py); the two
engines are small stand-ins speaking the OpenAI protocol (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` with ``logprobs.content`` token ids) that repeat the prompt, as a model asked to
repeat does: the deployment gets one word wrong, the reference refuses prompts with ``REFUSE`` in them
with an error body that quotes the prompt (as engines' validation errors do).
"""

from __future__ import annotations

import asyncio
import json
import stat
import zlib
from pathlib import Path

from support_upstream import running_proxy

from specops.config.profile import load_profile
from specops.perf.certify import Endpoint
from specops.perf.certify_spot import TEXT_FILE, LiveSpotChecks, SpotChecker, SpotConfig
from specops.plugins import get_registry
from specops.proxy.sample import LiveSampler
from specops.run.instance import EventLog

#: what the clients send; none of it (nor of the answers, which repeat it) may reach status/events/stdout
CHAT = "Quarterly numbers for Initech: revenue 4.1M, layoffs planned in Austin next week"
PLAIN = "Patient Jane Roe, born 1971, diagnosis confidential until the biopsy returns"
REFUSED = "REFUSE this: the password reminder for Bob is his dog's name"
#: pieces of the client text a divergence record would quote (the shared start, the continuations)
PIECES = ("Quarterly numbers", "Initech", "Patient Jane", "Jane Roe", "diagnosis", "password reminder")


def _tokens(text: str, limit: int) -> list[str]:
    return [" " + w for w in text.split()][:limit]


def _engine(kind: str):
    """An engine that repeats the prompt word by word; ``deployment`` gets the fourth word wrong."""
    from aiohttp import web

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": f"{kind}-model", "object": "model"}]})

    async def complete(request):
        body = await request.json()
        chat = request.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if kind == "reference" and "REFUSE" in prompt:
            message = f"cannot serve the prompt {prompt!r}"
            return web.json_response({"error": {"message": message, "type": "BadRequestError"}}, status=400)
        limit = int(body.get("max_tokens") or 16)
        tokens = _tokens(prompt, limit)
        if kind == "deployment" and len(tokens) > 3:
            tokens[3] = tokens[3].upper()
        text = "".join(tokens)
        finish = "length" if len(prompt.split()) > limit else "stop"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if body.get("logprobs"):
                ids = [zlib.crc32(t.encode()) % 50_000 for t in tokens]
                choice["logprobs"] = {
                    "content": [{"id": i, "token": t, "logprob": -0.1, "top_logprobs": []} for i, t in zip(ids, tokens)]
                }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return web.json_response({"id": "x", "object": "text_completion", "model": kind, "choices": [choice]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


async def _serve(app):
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _spot_profile(tmp_path: Path, keep_text: bool):
    path = tmp_path / f"spot-{keep_text}.yaml"
    path.write_text(
        f"name: spot\nbackend: llamacpp\nmodel:\n  id: m.gguf\nproxy:\n  enabled: true\nsupervisor:\n"
        f"  state_dir: {tmp_path / 'state'}\ncertify:\n  spot_check:\n    enabled: true\n"
        f"    reference: http://127.0.0.1:9\n    keep_text: {str(keep_text).lower()}\n"
    )
    return load_profile(path, env={})


async def _one_check(tmp_path: Path, keep_text: bool):
    """Client requests through the real proxy, one live check, and what others then read."""
    import aiohttp

    events = EventLog(tmp_path / "state" / "spot" / "events.jsonl")
    loaded = _spot_profile(tmp_path, keep_text)
    live_runner, live_url = await _serve(_engine("deployment"))
    ref_runner, ref_url = await _serve(_engine("reference"))
    said: list[str] = []
    holder: dict = {}
    try:
        sampler = LiveSampler(max_entries=8)
        status = lambda: holder["checker"].snapshot() if "checker" in holder else {}  # noqa: E731
        async with running_proxy(live_url, sampler=sampler, status_provider=status) as proxy:
            spot = LiveSpotChecks(
                loaded.profile,
                get_registry().backend("llamacpp"),
                proxy,
                "http://127.0.0.1:1",
                events=events,
                registry=None,
                say=said.append,
                on_check=lambda: None,
            )
            holder["checker"] = checker = SpotChecker(
                None,
                Endpoint(ref_url, "reference-model"),
                [],
                SpotConfig(every=10, sample=4, max_tokens=64, source="live"),
                events=events,
                say=said.append,
                sampler=sampler,
                text_file=spot.text_file,  # as LiveSpotChecks builds it from the profile
            )
            answers = []
            async with aiohttp.ClientSession() as s:
                for path, body in (
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT}], "logprobs": True}),
                    ("/v1/completions", {"prompt": PLAIN}),
                    ("/v1/completions", {"prompt": REFUSED}),
                ):
                    async with s.post(proxy.url + path, json={**body, "max_tokens": 32, "temperature": 0}) as r:
                        answers.append((r.status, await r.text()))
                await asyncio.sleep(0)  # the sampler admits on the next loop turn
                summary = await checker.check_once()
                async with s.get(proxy.url + "/specops/status") as r:  # no key: anyone who reaches the port
                    status_code, status_text = r.status, await r.text()
    finally:
        await live_runner.cleanup()
        await ref_runner.cleanup()
    return spot, summary, answers, status_code, status_text, said


def _events(tmp_path: Path) -> str:
    return (tmp_path / "state" / "spot" / "events.jsonl").read_text()


def test_status_events_and_printed_lines_carry_no_client_text_and_the_opt_in_file_does(tmp_path):
    spot, summary, answers, status_code, status_text, said = asyncio.run(_one_check(tmp_path, keep_text=True))
    # the clients were answered (their own text, repeated, with one word wrong) and all three were kept
    assert [a[0] for a in answers] == [200, 200, 200] and "INITECH:" in answers[0][1], answers
    assert summary["requests"] == 3 and summary["diverged"] == 2 and summary["failed"] == 1, summary
    events, printed = _events(tmp_path), "\n".join(said)
    assert status_code == 200
    for where, text in (("status", status_text), ("events", events), ("stdout", printed), ("summary", str(summary))):
        for piece in PIECES:
            assert piece not in text, (where, piece, text)
    # what they say instead: where (position, token ids) and an id into the opt-in file
    divergences = [json.loads(x) for x in events.splitlines() if json.loads(x)["event"] == "spot_divergence"]
    by_unit = {d["unit"]: d for d in divergences}
    assert set(by_unit) == {"token", "character"} and by_unit["token"]["position"] == 3, divergences
    token = by_unit["token"]
    assert isinstance(token["spec_token_id"], int) and token["spec_token_id"] != token["base_token_id"]
    assert f"at token 3: token id {token['spec_token_id']} vs reference {token['base_token_id']}" in printed
    last = json.loads(status_text)["spot_check"]["last_divergence"]
    # the newest kept request is compared first: the plain one, by characters (" born" vs " BORN")
    assert last["unit"] == "character" and last["position"] == len(" Patient Jane Roe, ") and "spec_token" not in last
    [failed] = [d for d in summary["divergences"] if d["status"] == "failed"]
    assert failed["status"] == "failed" and failed["error"] == "reference: HTTP 400", failed
    # the opt-in file: the text, under the same ids, readable by its owner only
    text_file = tmp_path / "state" / "spot" / TEXT_FILE
    assert spot.text_file == text_file and json.loads(status_text)["spot_check"]["text_file"] == str(text_file)
    assert stat.S_IMODE(text_file.stat().st_mode) == 0o600
    kept = {r["id"]: r for r in map(json.loads, text_file.read_text().splitlines())}
    assert set(kept) == {d["id"] for d in divergences} | {failed["id"]}
    assert kept[token["id"]]["common_prefix"] == " Quarterly numbers for"
    assert kept[token["id"]]["spec_continuation"].startswith(" INITECH:")
    assert kept[token["id"]]["base_continuation"].startswith(" Initech:")
    assert "password reminder" in kept[failed["id"]]["error_detail"]


def test_without_the_opt_in_no_text_is_written_anywhere(tmp_path):
    spot, summary, answers, status_code, status_text, said = asyncio.run(_one_check(tmp_path, keep_text=False))
    assert summary["diverged"] == 2 and spot.text_file is None
    assert json.loads(status_text)["spot_check"]["text_file"] is None
    assert sorted(p.name for p in (tmp_path / "state" / "spot").iterdir()) == ["events.jsonl"]
    for text in (status_text, _events(tmp_path), "\n".join(said)):
        assert not any(piece in text for piece in PIECES), text


def test_keep_text_is_off_by_default(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nbackend: llamacpp\nmodel:\n  id: m.gguf\n")
    assert load_profile(path, env={}).profile.certify.spot_check.keep_text is False
