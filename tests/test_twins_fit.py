"""Twins' memory, accounted for before launch: the engines beside each other against the memory they share.

Real parts: profiles loaded from YAML by the real loader, `specops validate`, `specops doctor` and `specops up` run
as the CLI in subprocesses, a real (tiny, header-only) GGUF written with the ``gguf`` package whose attention shape
sizes llama-server's KV cache, weight files whose size is real (sparse). No engine starts: every refusal here comes
before any launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from specops.config.profile import load_profile
from specops.errors import ProfileError

MIB = 1024**2
GIB = 1024**3


def _gguf(dst: Path, *, layers: int = 16, hidden: int = 768, heads: int = 12, context: int = 2048) -> Path:
    """A llama GGUF with the attention shape of the layer-skip fixture (48 KiB of f16 KV cache per context token)
    and 4 MiB of weights."""
    writer = gguf.GGUFWriter(str(dst), arch="llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_context_length(context)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    import numpy as np

    writer.add_tensor("token_embd.weight", np.zeros((1024, 1024), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _llama_profile(tmp_path: Path, *, twins: bool, memory_gb: float | None, ctx: int = 2048) -> Path:
    target = _gguf(tmp_path / "target.gguf")
    lines = [
        "name: fit",
        "backend: llamacpp",
        f"model: {{id: '{target}', max_model_len: {ctx}}}",
        "speculative: {method: ngram}",
        "gpus:",
        "  devices: []",
        *([f"  memory_gb: {memory_gb}"] if memory_gb else []),
        "server: {port: 18931, parallel: 2}",
        "fallback: {chain: [none]}",
        *(["routing:", "  twins: [none]"] if twins else []),
    ]
    path = tmp_path / ("twins.yaml" if twins else "one.yaml")
    path.write_text("\n".join(lines) + "\n")
    return path


def _vllm_dir(tmp_path: Path, weight_bytes: int) -> Path:
    """A local model folder whose safetensors file has ``weight_bytes`` of (sparse) size."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)
    return model


def _vllm_profile(tmp_path: Path, weight_bytes: int, extra: str = "") -> Path:
    model = _vllm_dir(tmp_path, weight_bytes)
    path = tmp_path / "vllm.yaml"
    path.write_text(
        "name: fitv\nbackend: vllm\nengine: {version: 0.11.0}\n"
        f"model: {{id: '{model}'}}\n"
        "speculative: {method: ngram}\n"
        "gpus: {devices: [0], memory_gb: 24}\n"
        "fallback: {chain: [none]}\n"
        "routing:\n  twins: [none]\n" + extra
    )
    return path


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------------------------------------- llama.cpp


def test_validate_refuses_llamacpp_twins_that_do_not_fit_memory_gb(tmp_path):
    """One engine: 4 MiB of weights + a 96 MiB KV cache (2048 tokens × 48 KiB) fits 0.15 GiB; with a `none` twin
    the GGUF is mapped once but each engine has its own KV cache: 196 MiB, refused at routing.twins."""
    one = _llama_profile(tmp_path, twins=False, memory_gb=0.15)
    twin = _llama_profile(tmp_path, twins=True, memory_gb=0.15)
    ok = _cli("validate", str(one))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _cli("validate", str(twin))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    # located at the `twins:` line of the file, naming what the engines need and the budget
    assert f"{twin}:11:" in bad.stdout and "routing.twins:" in bad.stdout, bad.stdout
    assert "4 MiB mapped once" in bad.stdout and "KV cache 96 MiB at -c 2048" in bad.stdout
    assert "over 154 MiB (gpus.memory_gb)" in bad.stdout
    # the same pair with half the context (48 MiB of KV cache each) fits: nothing refused, nothing made up
    twin.write_text(twin.read_text().replace("max_model_len: 2048", "max_model_len: 1024"))
    fits = _cli("validate", str(twin))
    assert fits.returncode == 0, fits.stdout + fits.stderr


def test_a_canary_counts_as_one_more_engine_in_the_fit(tmp_path):
    """With `routing.canary` on, a new draft runs beside the primary and its twin while it is measured: at half the
    context the pair fits 0.14 GiB (4 MiB mapped once + 2 × 48 MiB of KV cache), the pair and a canary (one more
    KV cache: 148 MiB) do not, and the line names the canary."""
    twin = _llama_profile(tmp_path, twins=True, memory_gb=0.14, ctx=1024)
    assert _cli("validate", str(twin)).returncode == 0
    twin.write_text(twin.read_text() + "  canary: {enabled: true}\n")
    bad = _cli("validate", str(twin))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "3 engines need 148 MiB" in bad.stdout and "canary 48 MiB" in bad.stdout, bad.stdout
    assert "over 143 MiB (gpus.memory_gb)" in bad.stdout, bad.stdout


def test_up_refuses_twins_beyond_available_memory_before_any_launch(tmp_path):
    """`specops up` with KV caches no machine here holds (4 Mi tokens × 48 KiB, twice): refused before anything
    starts, against this machine's MemAvailable, with the field to change; no engine log, exit 1 or 2."""
    twin = _llama_profile(tmp_path, twins=True, memory_gb=None, ctx=4 * 1024 * 1024)
    state = tmp_path / "state"
    res = _cli("up", str(twin), env={"SPECOPS_STATE": str(state)})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "routing.twins" in out and "available memory (MemAvailable)" in out, out
    assert "KV cache 192.0 GiB at -c 4194304" in out, out
    assert not (state.exists() and list(state.rglob("engine*.log"))), "an engine was launched"


def test_doctor_reports_twins_that_do_not_fit(tmp_path):
    twin = _llama_profile(tmp_path, twins=True, memory_gb=0.15)
    res = _cli("doctor", str(twin), "--offline")
    assert res.returncode != 0, res.stdout
    line = next(x for x in res.stdout.splitlines() if "2 engines need" in x)
    assert line.split()[0] == "error" and "over 154 MiB (gpus.memory_gb)" in line
    assert "fix: see routing.twins" in res.stdout


# ---------------------------------------------------------------------------------------------- vLLM


def test_vllm_twins_split_the_gpu_evenly_and_are_refused_when_a_share_is_too_small(tmp_path):
    """11 GiB of weights per engine; by default each of the two engines gets 0.9 / 2 = 0.45 of 24 GiB = 10.8 GiB:
    both refused, each with its own message."""
    path = _vllm_profile(tmp_path, 11 * GIB)
    res = _cli("validate", str(path))
    assert res.returncode == 1, res.stdout + res.stderr
    errors = [x for x in res.stdout.splitlines() if x.startswith("error")]
    assert len(errors) == 2, res.stdout
    assert "the primary holds 11.0 GiB" in errors[0] and "its share 0.45 of 24.0 GiB" in errors[0]
    assert "the none twin holds 11.0 GiB" in errors[1]


def test_vllm_twins_with_their_own_shares_fit_or_are_located(tmp_path):
    """`routing.memory_utilization` gives each engine its share: 0.5 / 0.5 of 24 GiB holds 11 GiB each; 0.3 for
    the primary is refused at that very key."""
    fits = _vllm_profile(tmp_path, 11 * GIB, "  memory_utilization: {primary: 0.5, none: 0.5}\n")
    assert _cli("validate", str(fits)).returncode == 0
    small = tmp_path / "small.yaml"
    small.write_text(fits.read_text().replace("primary: 0.5, none: 0.5", "primary: 0.3, none: 0.6"))
    res = _cli("validate", str(small))
    assert res.returncode == 1, res.stdout
    assert f"{small}:10:" in res.stdout and "routing.memory_utilization.primary: the primary holds" in res.stdout


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("  memory_utilization: {primary: 0.6, none: 0.5}\n", "add up to 1.1, over 1 (a whole GPU)"),
        ("  memory_utilization: {primary: 0.6}\n", "name every engine: none missing"),
        ("  memory_utilization: {primary: 0.5, none: 0.3, ngram: 0.1}\n", "memory_utilization.ngram: not an engine"),
    ],
)
def test_gpu_shares_are_checked_as_the_profile_loads(tmp_path, extra, says):
    path = _vllm_profile(tmp_path, GIB, extra)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert says in str(err.value) and f"{path}:10:" in str(err.value)


def test_gpu_shares_are_refused_on_llamacpp(tmp_path):
    path = _llama_profile(tmp_path, twins=True, memory_gb=None)
    path.write_text(path.read_text().replace("  devices: []\n", "  devices: [0]\n") + "  memory_utilization: {}\n")
    load_profile(path)  # an empty map is no share
    path.write_text(path.read_text().replace("memory_utilization: {}", "memory_utilization: {primary: 0.5, none: 0.4}"))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert "llamacpp does not size GPU memory by a share" in str(err.value)


def test_each_vllm_engine_is_rendered_with_its_share(tmp_path):
    """The primary's launch plan (what `specops up` runs) and the twin's carry their own
    --gpu-memory-utilization: the even split of gpus.memory_utilization 0.8."""
    from specops.backends.render import render_plan
    from specops.config.engines import with_gpu_share
    from specops.config.profile import LoadedProfile
    from specops.plugins import get_registry
    from specops.serve.up import _step_renderer

    path = _vllm_profile(tmp_path, GIB)
    path.write_text(path.read_text().replace("memory_gb: 24", "memory_gb: 24, memory_utilization: 0.8"))
    loaded = load_profile(path)
    registry = get_registry()
    primary = _step_renderer(loaded, registry, None, "127.0.0.1", 18000)(0)
    argv = list(primary.argv)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    twin = with_gpu_share(loaded.profile, "none").at_step(1)
    argv = list(render_plan(LoadedProfile(twin, loaded.document, loaded.path), registry, port=18001).argv)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
