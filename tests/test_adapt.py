"""``specops adapt`` without an engine: the proxy's capture (what is kept, what never is, the bounds), the
dataset's located errors, capture-stats, promotion's refusal of a worse draft, and no torch in the control plane."""

from __future__ import annotations

import asyncio
import json
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support_cli import run_subprocess
from support_ports import free_port

from specops.adapt.dataset import DatasetError, read_examples, stats
from specops.proxy.capture import Capture, CaptureFiles, CaptureSettings, redactors

pytestmark = pytest.mark.timeout(120)

KEY = "sk-capture-test-key-0123456789"
HEADER_SECRET = "hdr-secret-value-9876"


def _profile(tmp_path: Path, port: int, **capture) -> Path:
    cap = {"enabled": True, "path": str(tmp_path / "cap"), "sample": 1.0, **capture}
    lines = [
        "name: capt",
        "backend: llamacpp",
        "model:",
        f"  id: {tmp_path / 'target.gguf'}",
        "server:",
        "  host: 127.0.0.1",
        f"  port: {port}",
        "  api_key: ${CAPTURE_TEST_KEY}",
        "capture:",
        *(f"  {k}: {json.dumps(v)}" for k, v in cap.items()),
    ]
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    path = tmp_path / "p.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("capture-*.jsonl"))


def _everything_on_disk(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------ through the real proxy


def test_the_proxy_captures_prompts_and_answers_streamed_or_not_and_never_a_header(tmp_path, monkeypatch):
    """The real proxy built from a profile with `capture:` in front of the protocol stand-in: completions and
    chat, whole and streamed, are on disk with the target's text; the key, the Authorization value and the
    other headers never are; an error answer and another path are not kept; files 0600, folder 0700."""
    import aiohttp
    from support_upstream import Upstream, expected_text

    from specops.config.profile import load_profile
    from specops.proxy import Proxy

    monkeypatch.setenv("CAPTURE_TEST_KEY", KEY)
    loaded = load_profile(_profile(tmp_path, free_port()))
    auth = {"Authorization": f"Bearer {KEY}", "X-Team-Secret": HEADER_SECRET}
    requests = [
        ("/v1/completions", {"model": "m", "prompt": "def add(a, b):", "max_tokens": 5}),
        ("/v1/completions", {"model": "m", "prompt": "stream me", "max_tokens": 4, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello chat"}], "max_tokens": 3}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "chat stream"}], "max_tokens": 6, "stream": True},
        ),
    ]
    with Upstream.start("capt") as eng:

        async def main():
            proxy = Proxy.from_profile(loaded.profile)
            await proxy.start()
            proxy.set_upstream(eng.url)
            try:
                async with aiohttp.ClientSession() as s:
                    for path, body in requests:
                        async with s.post(proxy.url + path, json=body, headers=auth) as r:
                            assert r.status == 200, await r.text()
                            await r.read()
                    failing = {**auth, "X-Test-Status": "500"}
                    async with s.post(proxy.url + "/v1/completions", json={"prompt": "fails"}, headers=failing) as r:
                        assert r.status == 500
                    async with s.post(proxy.url + "/v1/embeddings", json={"input": "embed me"}, headers=auth) as r:
                        await r.read()
                await asyncio.sleep(0.05)  # the records are written on the next loop turns
                return proxy.capture.snapshot()
            finally:
                await proxy.stop()

        counts = asyncio.run(main())
    folder = tmp_path / "cap"
    records = [json.loads(line) for p in _files(folder) for line in p.read_text().splitlines()]
    assert counts["kept"] == 4 and len(records) == 4
    by_prompt = {r.get("prompt") or r["messages"][0]["content"]: r for r in records}
    assert by_prompt["def add(a, b):"]["output"] == expected_text(5) and not by_prompt["def add(a, b):"]["stream"]
    assert by_prompt["stream me"]["output"] == expected_text(4) and by_prompt["stream me"]["stream"]
    assert by_prompt["hello chat"]["output"] == expected_text(3)
    assert by_prompt["chat stream"]["output"] == expected_text(6) and by_prompt["chat stream"]["stream"]
    assert {r["class"] for r in records} == {"-"}
    disk = _everything_on_disk(folder)
    for secret in (KEY.encode(), b"Bearer", HEADER_SECRET.encode(), b"X-Team-Secret", b"fails", b"embed me"):
        assert secret not in disk
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in _files(folder))


def test_a_stream_cut_short_or_larger_than_a_record_is_not_kept(tmp_path):
    """A stream without its `[DONE]` (the engine broke off) is incomplete: not kept; an answer past
    `max_record_bytes` stops being copied as it streams, and is not kept."""
    cap = Capture(CaptureFiles(tmp_path / "c", 1 << 20, 1 << 18, 3600), CaptureSettings(1.0, 2048, frozenset()))
    chunk = b'data: {"choices":[{"index":0,"text":"abc"}]}\n\n'
    broken = cap.tap("POST", "/v1/completions", b'{"prompt":"p","stream":true}', None)
    broken.feed(chunk)
    cap.offer(broken, 200, None)
    big = cap.tap("POST", "/v1/completions", b'{"prompt":"p","stream":true}', None)
    for _ in range(100):
        big.feed(chunk)
    big.feed(b"data: [DONE]\n\n")
    assert big.over and not big.chunks
    cap.offer(big, 200, None)
    ok = cap.tap("POST", "/v1/completions?x=1", b'{"prompt":"p","stream":true}', None)
    ok.feed(chunk + b"data: [DONE]\n\n")
    cap.offer(ok, 200, None)
    assert (cap.counts["unusable"], cap.counts["too_large"], cap.counts["kept"]) == (1, 1, 1)
    assert [e.output for e in read_examples(tmp_path / "c")] == ["abc"]


# ------------------------------------------------------------------------------------ bounds


def _record(i: int, size: int = 200) -> bytes:
    return (
        json.dumps(
            {
                "v": 1,
                "at": time.time(),
                "path": "/v1/completions",
                "class": "-",
                "prompt": f"p{i}",
                "output": "x" * size,
                "stream": False,
            }
        )
        + "\n"
    ).encode()


def test_capture_files_rotate_and_never_exceed_max_bytes_oldest_first(tmp_path):
    files = CaptureFiles(tmp_path / "c", max_bytes=64 * 1024, max_file_bytes=16 * 1024, max_age=3600)
    for i in range(1000):
        assert files.write(_record(i), time.time())
        on_disk = sum(p.stat().st_size for p in _files(tmp_path / "c"))
        assert on_disk <= 64 * 1024
    kept = [json.loads(line)["prompt"] for p in _files(tmp_path / "c") for line in p.read_text().splitlines()]
    assert len(_files(tmp_path / "c")) >= 4  # rotated
    assert kept[-1] == "p999" and "p0" not in kept  # the oldest went first
    assert kept == sorted(kept, key=lambda s: int(s[1:]))  # in order, nothing lost in the middle


def test_capture_files_older_than_max_age_are_deleted(tmp_path):
    folder = tmp_path / "c"
    files = CaptureFiles(folder, max_bytes=1 << 20, max_file_bytes=16 * 1024, max_age=60)
    for i in range(200):
        files.write(_record(i), time.time())
    old = _files(folder)[:-1]
    assert old
    for p in old:
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    files.write(_record(1000), time.time())
    assert not any(p.exists() for p in old)
    files.close()
    for p in _files(folder):
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    CaptureFiles(folder, max_bytes=1 << 20, max_file_bytes=16 * 1024, max_age=60)  # a restart prunes too
    assert _files(folder) == []


def test_sampling_rate_excluded_classes_and_the_record_size_limit(tmp_path):
    folder = tmp_path / "c"
    cap = Capture(
        CaptureFiles(folder, 1 << 20, 1 << 18, 3600),
        CaptureSettings(0.25, 4096, frozenset({"secret-team"})),
        rng=random.Random(7),
    )
    answer = json.dumps({"choices": [{"index": 0, "text": "out"}]}).encode()
    for i in range(400):
        tap = cap.tap("POST", "/v1/completions", json.dumps({"prompt": f"ok {i}"}).encode(), "team-a")
        if tap is not None:
            cap.offer(tap, 200, answer)
    for i in range(50):
        tap = cap.tap("POST", "/v1/completions", json.dumps({"prompt": f"classified {i}"}).encode(), "secret-team")
        if tap is not None:
            cap.offer(tap, 200, answer)
    cap.settings.sample = 1.0
    assert cap.tap("POST", "/v1/completions", b'{"prompt":"' + b"y" * 5000 + b'"}', "team-a") is None
    assert 60 <= cap.counts["kept"] <= 140  # a quarter of 400, give or take
    assert b"classified" not in _everything_on_disk(folder) and cap.counts["excluded"] > 0
    assert cap.counts["too_large"] == 1
    assert set(stats(folder).classes) == {"team-a"}


def test_the_redaction_hook_edits_or_drops_records_before_they_reach_the_disk(tmp_path):
    """A plugin's `capture_redact` (through pluggy and specops' hookspecs) rewrites e-mail addresses and drops
    a record outright; a plugin that raises drops the record too."""
    import pluggy

    from specops import hookspecs
    from specops.hookspecs import hookimpl
    from specops.plugins import Plugins

    class Scrubber:
        @hookimpl
        def capture_redact(self, record):
            if "DROP" in record["prompt"]:
                return None
            if "BOOM" in record["prompt"]:
                raise RuntimeError("plugin bug")
            return {**record, "prompt": record["prompt"].replace("alice@example.com", "<email>")}

    pm = pluggy.PluginManager("specops")
    pm.add_hookspecs(hookspecs)
    pm.register(Scrubber(), name="scrubber")
    folder = tmp_path / "c"
    cap = Capture(
        CaptureFiles(folder, 1 << 20, 1 << 18, 3600), CaptureSettings(1.0, 4096, frozenset()), redactors(Plugins(pm))
    )
    answer = json.dumps({"choices": [{"text": "ok"}]}).encode()
    for prompt in ("mail alice@example.com now", "DROP this", "BOOM"):
        cap.offer(cap.tap("POST", "/v1/completions", json.dumps({"prompt": prompt}).encode(), None), 200, answer)
    disk = _everything_on_disk(folder)
    assert b"alice@example.com" not in disk and b"mail <email> now" in disk
    assert b"DROP" not in disk and b"BOOM" not in disk
    assert (cap.counts["kept"], cap.counts["redacted_out"], cap.counts["redact_failed"]) == (1, 1, 1)


# ------------------------------------------------------------------------------------ the dataset


def _write(folder: Path, name: str, data: bytes) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "line", "says"),
    [
        (_record(0) + b'{"v": 1, "at": 1, "path"\n', 2, "not JSON"),
        (_record(0) + _record(1)[:-40], 2, "cut short"),
        (_record(0) + b'{"id": 3, "text": "someone else\'s jsonl"}\n', 2, "not a specops capture record"),
        (_record(0).replace(b'"output"', b'"answer"'), 1, "`output`"),
        (b"\xff\xfe binary\n", 1, "not UTF-8"),
    ],
    ids=["corrupt", "truncated", "foreign", "missing-field", "binary"],
)
def test_a_bad_capture_file_is_a_located_error_from_the_cli(tmp_path, data, line, says):
    folder = tmp_path / "c"
    _write(folder, "capture-00000000000000000001.jsonl", _record(5))
    bad = _write(folder, "capture-00000000000000000002.jsonl", data)
    with pytest.raises(DatasetError, match=f"{bad}:{line}"):
        list(read_examples(folder))
    profile = _profile(tmp_path, 8080)
    res = run_subprocess("adapt", "capture-stats", profile, "--from", folder, env={"CAPTURE_TEST_KEY": KEY})
    assert res.code == 1 and f"error: {bad}:{line}" in res.stderr and says in res.stderr
    assert "Traceback" not in res.stderr


def test_capture_stats_reports_per_class(tmp_path):
    folder = tmp_path / "cap"
    cap = Capture(CaptureFiles(folder, 1 << 20, 1 << 18, 3600), CaptureSettings(1.0, 4096, frozenset()))
    answer = json.dumps({"choices": [{"text": "four"}]}).encode()
    for i in range(30):
        cls = "code" if i % 3 else "chat"
        cap.offer(cap.tap("POST", "/v1/completions", json.dumps({"prompt": f"q{i}"}).encode(), cls), 200, answer)
    cap.close()
    res = run_subprocess("adapt", "capture-stats", _profile(tmp_path, 8080), "--json", env={"CAPTURE_TEST_KEY": KEY})
    assert res.code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["records"] == 30 and doc["classes"]["code"]["records"] == 20 and doc["classes"]["chat"]["records"] == 10
    assert doc["classes"]["code"]["output_chars"] == 80
    assert sum(c["held_out"] for c in doc["classes"].values()) < 30
    text = run_subprocess("adapt", "capture-stats", _profile(tmp_path, 8080), env={"CAPTURE_TEST_KEY": KEY})
    assert "30 records" in text.stdout and "code" in text.stdout


def test_capture_settings_are_checked_where_they_are_written(tmp_path):
    path = _profile(tmp_path, 8080, max_file_bytes=1 << 30, max_bytes=1 << 20)
    res = run_subprocess("validate", path, env={"CAPTURE_TEST_KEY": KEY})
    assert res.code == 1 and f"{path}:10:3: capture: `max_file_bytes`" in res.stdout


# ------------------------------------------------------------------------------------ the control plane


def test_the_control_plane_never_imports_torch():
    code = (
        "import sys, specops.cli, specops.commands.adapt, specops.proxy.capture, specops.adapt.dataset, "
        "specops.config.profile, specops.commands.render, specops.commands.validate; "
        "import specops.adapt.promote, specops.adapt.train; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------ promotion


def _figures(draft: str, mal: float | None, errors: int = 0):
    from specops.adapt.promote import DraftFigures

    return DraftFigures(draft, None if mal is None else mal - 1, mal, None, 10.0, 8, errors)


def test_promote_refuses_a_draft_that_does_not_beat_the_current_by_the_margin():
    from specops.adapt.promote import compare

    assert not compare(_figures("cur", 2.0), _figures("new", 2.05), 0.05)["promote"]
    assert not compare(_figures("cur", 2.0), _figures("new", 1.5), 0.05)["promote"]
    assert not compare(_figures("cur", 2.0), _figures("new", 3.0, errors=1), 0.05)["promote"]
    verdict = compare(_figures("cur", 2.0), _figures("new", 2.2), 0.05)
    assert verdict["promote"] and "2.000 -> 2.200" in verdict["reason"]


def test_promote_refuses_a_draft_that_is_not_lossless_whatever_its_acceptance():
    """A draft whose greedy answers differ from the target's own is refused, and the reason says where."""
    from specops.adapt.promote import compare
    from specops.perf.certify_compare import Generation, compare_outputs, lossless_summary
    from specops.perf.workload import RequestResult

    def gen(tokens):
        g = Generation(RequestResult(set="heldout", ok=True, start=0.0, end=1.0))
        g.tokens, g.texts, g.by_id, g.text = list(tokens), [f"t{t}" for t in tokens], True, ""
        return g

    same = lossless_summary([compare_outputs(gen([5, 6, 7]), gen([5, 6, 7]))], 0.0)
    differs = lossless_summary(
        [compare_outputs(gen([5, 6, 7]), gen([5, 6, 7])), compare_outputs(gen([5, 9, 7]), gen([5, 6, 7]))], 0.0
    )
    better = (_figures("cur", 1.2), _figures("new", 3.0))
    assert compare(*better, 0.05, same)["promote"]
    verdict = compare(*better, 0.05, differs)
    assert not verdict["promote"]
    assert verdict["reason"].startswith("not lossless: 1 of 2 held-out greedy answers")
    assert "token 1 (draft 't9', target 't6')" in verdict["reason"]


def test_promote_writes_the_draft_keeping_comments_and_a_private_certificate(tmp_path, monkeypatch):
    from specops.adapt.promote import certificate_path, write_back
    from specops.config.profile import load_profile

    monkeypatch.setenv("CAPTURE_TEST_KEY", KEY)
    path = _profile(tmp_path, 8080)
    old_draft, new_draft = tmp_path / "old.gguf", tmp_path / "new.gguf"
    old_draft.write_bytes(b"GGUF")
    new_draft.write_bytes(b"GGUF")
    text = path.read_text().replace(
        "server:", f"# the draft we ship\nspeculative:\n  method: draft_model\n  draft: {old_draft}  # v1\nserver:"
    )
    path.write_text(text)
    loaded = load_profile(path)
    diff, cert = write_back(loaded, str(new_draft), {"promote": True}, dry_run=True)
    assert f"-  draft: {old_draft}" in diff and f"+  draft: {new_draft}" in diff
    assert path.read_text() == text and not cert.exists()  # a dry run writes nothing
    write_back(loaded, str(new_draft), {"promote": True}, dry_run=False)
    after = path.read_text()
    assert "# the draft we ship" in after and "# specops adapt " in after and "# # " not in after
    assert load_profile(path).profile.speculative.draft == str(new_draft)
    assert stat.S_IMODE(certificate_path(path).stat().st_mode) == 0o600


# ------------------------------------------------------------------------------------ where a draft starts


def test_a_new_draft_starts_from_the_targets_own_first_layers_by_default(tmp_path):
    """auto (the default) copies the target's embeddings, first blocks, norm and head from its GGUF; scratch
    is random in the target's shape; draft is the current draft; a foreign vocabulary is refused."""
    import numpy as np

    from specops.adapt.train import TrainOptions, initial_draft, read_gguf
    from specops.devenv import testmodels
    from specops.errors import SpecopsError

    target = testmodels.model_path("gguf-target.gguf")
    other = testmodels.model_path("gguf-draft-other.gguf")
    t_dims, t_tensors, _ = read_gguf(target)
    dims, tensors, _, where = initial_draft(target, other, TrainOptions())
    assert where == "the target's first 1 layer(s)" and dims["layers"] == 1 and dims["hidden"] == t_dims["hidden"]
    assert sorted(k for k in tensors if k.startswith("blk.")) == sorted(k for k in t_tensors if k.startswith("blk.0."))
    for name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        assert np.array_equal(tensors[name], t_tensors[name])
    dims2, _, _, _ = initial_draft(target, other, TrainOptions(layers=2))
    assert dims2["layers"] == 2
    _, scratch, _, where = initial_draft(target, other, TrainOptions(init="scratch"))
    assert where.startswith("random weights") and scratch["blk.0.attn_q.weight"].shape == (
        t_tensors["blk.0.attn_q.weight"].shape
    )
    assert not np.array_equal(scratch["blk.0.attn_q.weight"], t_tensors["blk.0.attn_q.weight"])
    _, current, _, where = initial_draft(target, other, TrainOptions(init="draft"))
    assert where == "the current draft gguf-draft-other.gguf"
    assert np.array_equal(current["blk.0.attn_q.weight"], read_gguf(other)[1]["blk.0.attn_q.weight"])
    with pytest.raises(SpecopsError, match="its vocabulary is not the target's"):
        initial_draft(target, testmodels.model_path("gguf-draft-badvocab.gguf"), TrainOptions(init="draft"))


def test_promote_takes_an_eagle3_heads_folder_and_reads_the_held_out_examples_beside_it(tmp_path):
    """`adapt train` writes a vLLM EAGLE-3 head as a folder (config.json + safetensors) with heldout.jsonl beside
    it: promote takes the folder, looks for the examples next to it, and refuses a draft that is not there."""
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"name: p\nbackend: vllm\nmodel: {{id: {tmp_path}/t}}\nspeculative: {{method: eagle3, draft: {tmp_path}/old}}\n"
    )
    (tmp_path / "out" / "head").mkdir(parents=True)
    res = run_subprocess("adapt", "promote", profile, tmp_path / "out" / "head")
    assert res.code == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"{tmp_path}/out/heldout.jsonl: cannot read the held-out examples" in res.stderr
    missing = run_subprocess("adapt", "promote", profile, tmp_path / "out" / "nothere")
    assert missing.code == 2 and "does not exist" in missing.stderr
