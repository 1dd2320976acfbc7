"""`specops certify`: the token-by-token comparison and its tolerance on engine-shaped answers, certificate
staleness on real files (validate --require-certificate, up's warning), and real runs on the CPU engines
(llama-server: lossless, acceptance per position consistent with the engine's counters and its per-response
timings; a draft that does not fit is refused; one short vLLM-CPU run)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support_engines import need_llama_server, need_vllm_python

from specops.config.profile import load_profile
from specops.errors import SpecopsError
from specops.perf.certify import Generation, _parse_logprobs, compare_outputs, lossless_summary, messages_for, verdict
from specops.perf.certify_file import (
    CERT_VERSION,
    cert_path,
    certificate_report,
    current_identity,
    dumps,
    read_cert,
    write_cert,
)
from specops.perf.workload import RequestResult
from specops.plugins import get_registry

SPECOPS = [sys.executable, "-m", "specops.cli"]


# ---------------------------------------------------------------------------------------------------
# comparison


def gen_from(choice: dict, set_name: str = "code", ok: bool = True) -> Generation:
    g = Generation(RequestResult(set=set_name, ok=ok, start=0.0, end=1.0, error=None if ok else "HTTP 500: boom"))
    g.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    _parse_logprobs(choice, g)
    return g


def llama_choice(ids: list[int], top0: list[tuple[int, float]] | None = None) -> dict:
    """A llama-server completions choice: logprobs.content with ids (top log-probs at the first position)."""
    content = []
    for i, t in enumerate(ids):
        top = [{"id": a, "token": f"t{a}", "logprob": lp} for a, lp in (top0 or [])] if i == 0 else []
        content.append({"id": t, "token": f"t{t}", "logprob": 0.0, "top_logprobs": top})
    return {"text": "".join(f"t{t}" for t in ids), "logprobs": {"content": content}, "finish_reason": "length"}


def vllm_choice(tokens: list[str], ids: list[int], tops: list[dict]) -> dict:
    """A vLLM completions choice: the legacy logprobs shape plus token_ids."""
    return {
        "text": "".join(tokens),
        "logprobs": {"tokens": tokens, "token_logprobs": [0.0] * len(tokens), "top_logprobs": tops},
        "token_ids": ids,
        "finish_reason": "length",
    }


def test_identical_outputs_compare_by_token_id():
    c = compare_outputs(gen_from(llama_choice([5, 6, 7])), gen_from(llama_choice([5, 6, 7])))
    assert c == {"set": "code", "status": "identical", "tokens": 3, "unit": "token"}


def test_first_divergence_with_both_continuations_and_margin():
    base = gen_from(llama_choice([9, 6, 7, 8], top0=[(9, -0.10), (5, -0.30)]))
    spec = gen_from(llama_choice([5, 6, 1, 2]))
    c = compare_outputs(spec, base)
    assert c["status"] == "diverged" and c["position"] == 0 and c["unit"] == "token"
    assert c["spec_token"] == "t5" and c["base_token"] == "t9"
    assert c["spec_continuation"] == "t5t6t1t2" and c["base_continuation"] == "t9t6t7t8"
    assert c["margin"] == pytest.approx(0.2)
    # the same near tie within a stated tolerance is accepted, and a larger margin is not
    assert compare_outputs(spec, base, tolerance=0.25)["status"] == "tolerated"
    assert compare_outputs(spec, base, tolerance=0.15)["status"] == "diverged"


def test_a_token_outside_the_baselines_top_logprobs_has_no_margin_and_is_never_tolerated():
    base = gen_from(llama_choice([9, 6], top0=[(9, -0.1), (4, -0.2)]))
    c = compare_outputs(gen_from(llama_choice([5, 6])), base, tolerance=10.0)
    assert c["status"] == "diverged" and c["margin"] is None


def test_vllm_shape_compares_by_token_ids_and_margin_by_text():
    tops = [{"a": -0.5, "b": -0.52}, {"c": -0.1}]
    base = gen_from(vllm_choice(["a", "c"], [10, 12], tops))
    spec = gen_from(vllm_choice(["b", "c"], [11, 12], [{}, {}]))
    assert base.by_id and base.tokens == [10, 12]
    c = compare_outputs(spec, base, tolerance=0.05)
    assert c["status"] == "tolerated" and c["margin"] == pytest.approx(0.02) and c["position"] == 0


def test_an_output_that_stops_early_diverges_where_it_stops():
    c = compare_outputs(gen_from(llama_choice([1, 2])), gen_from(llama_choice([1, 2, 3])))
    assert c["status"] == "diverged" and c["position"] == 2 and c["spec_token"] is None and c["base_token"] == "t3"


def test_lossless_summary_verdicts():
    ok = {"status": "identical", "unit": "token", "set": "a"}
    tol = {"status": "tolerated", "unit": "token", "set": "a", "margin": 0.01}
    bad = {"status": "diverged", "unit": "token", "set": "b", "margin": None}
    assert lossless_summary([ok, ok], 0.0)["verdict"] == "exact"
    s = lossless_summary([ok, tol], 0.05)
    assert s["verdict"] == "within-tolerance" and s["lossless"] and s["largest_margin_nats"] == 0.01
    s = lossless_summary([ok, tol, bad], 0.05)
    assert s["verdict"] == "diverged" and not s["lossless"] and s["diverged"] == 1
    failed = compare_outputs(gen_from({}, ok=False), gen_from(llama_choice([1])))
    assert lossless_summary([ok, failed], 0.0)["verdict"] == "incomplete"


def test_reports_name_the_draft_length_the_engine_ran_never_an_ignored_k():
    from specops.perf.certify_report import drafts_text

    ngram = {"method": "ngram", "k": None, "draft_length": {"most": 12, "length": "up to 12"}}
    assert drafts_text(ngram) == "ngram, drafts up to 12"
    assert drafts_text({"method": "draft_model", "k": 4}) == "draft_model k=4"  # a certificate from before


def test_verdict_refuses_a_draft_that_does_not_fit_even_when_lossless():
    lossless = lossless_summary([{"status": "identical", "unit": "token", "set": "code"}], 0.0)
    greedy = {"acceptance": 0.02, "draft_tokens": 400, "accepted": 8, "drafts": 100}
    sets = {"code": {"acceptance": 0.02, "mean_acceptance_length": 1.08, "draft_tokens": 400, "greedy": greedy}}
    v = verdict(lossless, sets, {"1": {"speedup": 0.7}}, 0.6)
    assert v["lossless"] and v["speculating"] and not v["draft_fits"] and not v["certified"]
    assert any("does not fit" in f for f in v["findings"]) and any("slower" in f for f in v["findings"])


def test_chat_prompts_become_one_user_turn():
    assert messages_for("User: Why is the sky blue?\nAssistant:") == [
        {"role": "user", "content": "Why is the sky blue?"}
    ]
    assert messages_for("def f():\n") == [{"role": "user", "content": "def f():\n"}]


def test_both_at_once_stops_the_other_start_up_when_one_fails():
    import asyncio
    import contextlib

    from specops.perf.certify import _both

    stopped: list[str] = []

    def launch(mode):
        @contextlib.asynccontextmanager
        async def cm():
            try:
                if mode == "none":
                    await asyncio.sleep(0.05)
                    raise SpecopsError("none: not ready")
                await asyncio.sleep(30)  # still starting when the other fails
                yield mode
            finally:
                stopped.append(mode)

        return cm()

    async def main():
        async with _both(launch, lambda mode, eng: None):
            raise AssertionError("never reached")

    with pytest.raises(SpecopsError, match="none: not ready"):
        asyncio.run(asyncio.wait_for(main(), 5))
    assert sorted(stopped) == ["none", "spec"]


# ---------------------------------------------------------------------------------------------------
# the certificate file and staleness (real files, no engine)


@pytest.fixture
def hf_profile(tmp_path):
    """A vLLM profile on local copies of a small HF folder (target) and a draft folder, engine pinned."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    for d in (target, draft):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 380}))
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        (d / "model.safetensors").write_bytes(b"weights-" + d.name.encode())
    profile = tmp_path / "p.yaml"
    profile.write_text(
        "name: cert-test\nbackend: vllm\nengine:\n  version: 0.32.0\n"
        f"model:\n  id: {target}\n  max_model_len: 256\n"
        f"speculative:\n  method: draft_model\n  draft: {draft}\n  num_speculative_tokens: 3\n"
    )
    return profile, target, draft


def certify_now(profile: Path, certified: bool = True) -> dict:
    """A certificate for the profile as it is now (what `specops certify` writes around the figures)."""
    loaded = load_profile(profile)
    cert = {
        "certificate_version": CERT_VERSION,
        "created": "2026-12-01T00:00:00+00:00",
        "profile": profile.name,
        "identity": current_identity(loaded, get_registry()),
        "settings": {"step": 0},
        "verdict": {"certified": certified, "findings": [] if certified else ["NOT LOSSLESS: 1 of 2 differ"]},
        "lossless": {"verdict": "exact", "ratio": 2 / 3},
    }
    write_cert(cert_path(profile), cert)
    return cert


def validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(SPECOPS + ["validate", *args], capture_output=True, text=True, timeout=60)


def test_certificate_is_deterministic_json_beside_the_profile(hf_profile):
    profile, _, _ = hf_profile
    cert = certify_now(profile)
    path = cert_path(profile)
    assert path == profile.with_name("p.cert.json")
    text = path.read_text()
    assert text == dumps(cert) and text.endswith("}\n") and '"ratio": 0.6667' in text
    keys = list(json.loads(text))
    assert keys == sorted(keys)
    ident = read_cert(path)["identity"]
    assert ident["engine_version"] == "0.32.0" and ident["draft_revision"].startswith("local-sha256:")
    assert ident["chat_template_sha256"] is None and "has no chat template" in ident["chat_template_source"]
    assert validate("--require-certificate", str(profile)).returncode == 0


def test_validate_requires_a_certificate(hf_profile):
    profile, _, _ = hf_profile
    r = validate("--require-certificate", str(profile))
    assert r.returncode == 1 and f"{profile}:1:1: no certificate: p.cert.json is missing" in r.stdout
    assert validate(str(profile)).returncode == 0  # only when asked
    certify_now(profile, certified=False)
    r = validate("--require-certificate", str(profile))
    assert r.returncode == 1 and "p.cert.json does not certify this deployment: NOT LOSSLESS" in r.stdout


def test_engine_version_change_makes_it_stale_at_the_pinned_line(hf_profile):
    profile, _, _ = hf_profile
    certify_now(profile)
    profile.write_text(profile.read_text().replace("version: 0.32.0", "version: 0.33.0"))
    r = validate("--require-certificate", "--format", "json", str(profile))
    assert r.returncode == 1
    err = json.loads(r.stdout)["profiles"][0]["errors"]
    eng = next(e for e in err if e["field"] == "engine.version")
    assert eng["line"] == 4 and "certified '0.32.0', now '0.33.0'" in eng["message"]
    assert any("profile hash changed" in e["message"] for e in err)  # the pin is a profile input too


def test_draft_revision_and_template_changes_make_it_stale(hf_profile):
    profile, target, draft = hf_profile
    certify_now(profile)
    (draft / "model.safetensors").write_bytes(b"retrained weights")
    r = validate("--require-certificate", str(profile))
    assert r.returncode == 1 and "draft revision changed since certification" in r.stdout
    assert f"{profile}:10:" in r.stdout  # located at speculative.draft
    certify_now(profile)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ messages }}"}))
    r = validate("--require-certificate", str(profile))
    assert r.returncode == 1 and "chat template hash changed since certification: certified None" in r.stdout
    assert "draft revision" not in r.stdout


def test_a_pinned_hub_revision_is_the_revision(hf_profile):
    profile, _, _ = hf_profile
    text = profile.read_text()
    profile.write_text(
        text.replace("  num_speculative_tokens: 3\n", "  num_speculative_tokens: 3\n  draft_revision: abc123\n")
    )
    assert current_identity(load_profile(profile), get_registry())["draft_revision"] == "abc123"


def test_up_warns_on_a_stale_certificate_and_refuses_when_required(hf_profile):
    from specops.serve.up import _check_certificate

    profile, _, draft = hf_profile
    certify_now(profile)
    said: list[str] = []
    loaded = load_profile(profile)
    _check_certificate(loaded, get_registry(), "0.32.0", False, said.append)
    assert said and "current" in said[0]
    said.clear()
    (draft / "model.safetensors").write_bytes(b"other weights")
    _check_certificate(loaded, get_registry(), "0.32.1", False, said.append)
    assert said[0].startswith("warning: certificate p.cert.json: ")
    assert "engine version changed" in said[0] and "draft revision changed" in said[0]
    with pytest.raises(SpecopsError, match="--require-certificate: certificate p.cert.json: engine version"):
        _check_certificate(loaded, get_registry(), "0.32.1", True, said.append)
    cert_path(profile).unlink()
    said.clear()
    _check_certificate(loaded, get_registry(), "0.32.1", False, said.append)
    assert said == []  # no certificate, not required: nothing to compare
    with pytest.raises(SpecopsError, match="p.cert.json is missing"):
        _check_certificate(loaded, get_registry(), "0.32.1", True, said.append)


def test_chat_template_of_a_gguf_model_and_of_an_explicit_argument(tmp_path):
    import gguf

    from specops.perf.certify_file import chat_template

    model = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    profile = tmp_path / "g.yaml"
    profile.write_text(f"name: g\nbackend: llamacpp\nmodel:\n  id: {model}\nspeculative:\n  method: ngram\n")
    backend = get_registry().backend("llamacpp")
    tpl = chat_template(load_profile(profile).profile, backend)
    assert tpl.sha256 == "sha256:" + hashlib.sha256(b"{{ messages }}").hexdigest()
    assert tpl.source.endswith("tokenizer.chat_template")
    (tmp_path / "t.jinja").write_text("{{ other }}")
    profile.write_text(profile.read_text() + f"server:\n  extra_args: [--chat-template-file, {tmp_path / 't.jinja'}]\n")
    tpl = chat_template(load_profile(profile).profile, backend)
    assert tpl.sha256 == "sha256:" + hashlib.sha256(b"{{ other }}").hexdigest()


def test_a_broken_certificate_file_is_a_clear_error(hf_profile):
    profile, _, _ = hf_profile
    cert_path(profile).write_text("{not json")
    with pytest.raises(SpecopsError, match="not a valid certificate"):
        certificate_report(load_profile(profile), get_registry())


# ---------------------------------------------------------------------------------------------------
# real engines


def run_certify(profile: Path, *args: str, timeout: float, expect_rc: int = 0) -> dict:
    proc = subprocess.run(
        SPECOPS + ["certify", str(profile), "--json", "-q", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "SPECOPS_STATE": str(profile.parent / "state")},
    )
    assert proc.returncode == expect_rc, (proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(proc.stdout)


def check_counters_consistent(row: dict, k: int) -> None:
    """Acceptance per position is the engine's per-position counter over its draft counter, and adds up."""
    per, raw = row["per_position"], row["per_position_accepted"]
    assert len(per) == len(raw) == k
    assert sum(raw) == pytest.approx(row["accepted"])
    assert per == pytest.approx([x / row["drafts"] for x in raw])
    assert all(a >= b for a, b in zip(raw, raw[1:], strict=False))  # a position is reached only through the ones before
    assert row["mean_acceptance_length"] == pytest.approx(1 + row["accepted"] / row["drafts"])
    assert row["acceptance"] == pytest.approx(row["accepted"] / row["draft_tokens"])


def llama_profile(tmp_path: Path, draft: str) -> Path:
    from specops.devenv.testmodels import ensure_tiny_models

    need_llama_server()
    models = ensure_tiny_models(["gguf"])
    profile = tmp_path / "llama.yaml"
    profile.write_text(
        f"name: certify-llama\nbackend: llamacpp\nmodel:\n  id: {models['gguf-target.gguf']}\n  max_model_len: 2048\n"
        f"speculative:\n  method: draft_model\n  draft: {models[draft]}\n  num_speculative_tokens: 4\n"
        "gpus:\n  devices: []\nserver:\n  parallel: 2\n"
        '  extra_args: ["-t", "1", "-td", "1"]\n'  # one thread each: two collapse when the 2 cores are shared
        "supervisor:\n  stop_timeout: 10\n"
    )
    return profile


@pytest.mark.engines
@pytest.mark.timeout(240)
def test_certify_llama_server_end_to_end(tmp_path):
    profile = llama_profile(tmp_path, "gguf-draft-same.gguf")
    cert = run_certify(
        profile,
        "-w",
        "code,chat",
        "-n",
        "2",
        "--max-tokens",
        "32",
        "--rounds",
        "2",
        "--plots",
        str(tmp_path),
        timeout=200,
    )
    assert cert["endpoint"] == "/v1/completions" and "no chat template" in cert["endpoint_note"]
    lo = cert["lossless"]
    assert lo["verdict"] == "exact" and lo["identical"] == lo["requests"] == 4 and lo["compared_by"] == ["token"]
    assert cert["verdict"]["certified"] and cert["settings"]["concurrency"] == [1, 2]
    for row in cert["sets"].values():
        check_counters_consistent(row, 4)
        # the engine's counters and its per-response timings are two sources: they agree
        assert row["response_accepted"] == row["accepted"] and row["response_draft_tokens"] == row["draft_tokens"]
        assert set(row["speedup"]) == {"1", "2"}
        for cell in row["speedup"].values():
            assert cell["speedup"] == pytest.approx(cell["spec_tokens_per_s"] / cell["base_tokens_per_s"])
    assert cert["settings"]["rounds"] == 2
    # the draft length as llama-server runs it (--draft-max), recorded beside the k it came from
    assert cert["settings"]["k"] == 4 and cert["settings"]["draft_length"]["most"] == 4
    assert cert["sets"]["code"]["greedy"]["acceptance"] > 0.8  # the same-weights draft
    written = cert_path(profile)
    on_disk = json.loads(written.read_text())
    assert on_disk["identity"] == cert["identity"] and written.read_text() == dumps(on_disk)
    assert (tmp_path / "certificate.png").read_bytes().startswith(b"\x89PNG")
    assert validate("--require-certificate", str(profile)).returncode == 0
    # a draft swapped afterwards is caught
    profile.write_text(profile.read_text().replace("gguf-draft-same", "gguf-draft-noisy"))
    r = validate("--require-certificate", str(profile))
    assert r.returncode == 1 and "draft revision changed" in r.stdout


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_certify_llama_server_through_chat_completions(tmp_path):
    """--endpoint chat on a model without a template: llama-server applies its built-in one, and says so."""
    profile = llama_profile(tmp_path, "gguf-draft-same.gguf")
    cert = run_certify(
        profile, "-w", "chat", "-n", "2", "--max-tokens", "24", "-c", "1", "--endpoint", "chat", timeout=100
    )
    assert cert["endpoint"] == "/v1/chat/completions" and "the engine's default template" in cert["endpoint_note"]
    assert cert["lossless"]["verdict"] == "exact" and cert["lossless"]["identical"] == 2
    check_counters_consistent(cert["sets"]["chat"], 4)


@pytest.mark.engines
@pytest.mark.timeout(180)
def test_certify_refuses_a_draft_that_does_not_fit(tmp_path):
    """A deliberately wrong draft (other weights, same vocab, under checks: warn): still lossless — the target
    verifies every token — but its acceptance collapses, and the certificate says so and refuses."""
    profile = llama_profile(tmp_path, "gguf-draft-other.gguf")
    profile.write_text(
        profile.read_text().replace("  num_speculative_tokens: 4\n", "  num_speculative_tokens: 4\n  checks: warn\n")
    )
    cert = run_certify(profile, "-w", "code", "-n", "2", "--max-tokens", "32", "-c", "1", timeout=150, expect_rc=1)
    v = cert["verdict"]
    assert v["lossless"] and v["speculating"] and not v["draft_fits"] and not v["certified"]
    assert v["greedy_acceptance"] < 0.3
    assert any("does not fit the target" in f for f in v["findings"])
    check_counters_consistent(cert["sets"]["code"], 4)
    r = validate("--require-certificate", str(profile))
    assert r.returncode == 1 and "does not certify this deployment" in r.stdout


@pytest.mark.engines
@pytest.mark.timeout(420)
def test_certify_vllm_cpu(tmp_path):
    """One short vLLM-CPU run: a draft model that is the target itself, fp32, greedy: token-identical."""
    from specops.devenv.testmodels import ensure_tiny_models

    need_vllm_python()
    models = ensure_tiny_models(["hf"])
    target = tmp_path / "hf-target"
    shutil.copytree(models["hf-target"], target)
    # give the copy a chat template: certify must find it, send chat completions and record its hash
    template = "{% for m in messages %}<s>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    profile = tmp_path / "v.yaml"
    profile.write_text(
        f"name: certify-vllm\nbackend: vllm\nmodel:\n  id: {target}\n  dtype: float32\n  max_model_len: 256\n"
        f"speculative:\n  method: draft_model\n  draft: {target}\n  num_speculative_tokens: 2\n"
        'server:\n  extra_args: ["--enforce-eager"]\n  env:\n    VLLM_CPU_KVCACHE_SPACE: "1"\n'
        "supervisor:\n  stop_timeout: 20\n"
    )
    cert = run_certify(profile, "-w", "code,chat", "-n", "1", "--max-tokens", "12", "--both-at-once", timeout=400)
    assert cert["endpoint"] == "/v1/chat/completions"
    assert cert["identity"]["chat_template_sha256"] == "sha256:" + hashlib.sha256(template.encode()).hexdigest()
    lo = cert["lossless"]
    assert lo["verdict"] == "exact" and lo["requests"] == 2 and lo["compared_by"] == ["token"], lo
    for row in cert["sets"].values():
        check_counters_consistent(row, 2)
        assert row["greedy"]["acceptance"] == pytest.approx(1.0)
    assert cert["verdict"]["certified"]
    assert cert["settings"]["concurrency"] == [1] and cert["identity"]["engine_version"] == "0.32.0"
    assert [x["mode"] for x in cert["launches"]] == ["spec", "none"]
