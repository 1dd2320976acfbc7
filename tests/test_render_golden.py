"""Golden renders: every ready-made profile, and a version matrix, rendered byte for byte.

The goldens are what a GitOps reviewer sees in a diff, so they must be *right*, not only stable: besides
the byte comparison, the tests below parse every rendered command and check it against the engine facts
(the vLLM and llama-server facts in specops.backends.versions): the speculative config is valid for the engine version, removed llama-server flags never
appear, secrets never leak.

Update after an intended change with::

    SPECOPS_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_render_golden.py

then review the diff of tests/golden/ by hand.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support_cli import ROOT, ready_made_profiles, run

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("SPECOPS_UPDATE_GOLDEN") == "1"

#: The environment every golden is rendered in: a known secret (that must never appear in the output)
#: and no stray variables from the developer's shell.
SECRET = "sk-golden-MUST-NOT-LEAK-7f3a"
GOLDEN_ENV = {"SPECOPS_API_KEY": SECRET, "PROMETHEUS_URL": None, "HF_TOKEN": None}
#: Version used for profiles that do not pin engine.version.
DEFAULT_VERSION = {"vllm": "0.32.0", "llamacpp": "current"}

JSON_PROFILES = (
    "llama31-8b-eagle3",
    "llama33-70b-eagle3-tp4",
    "qwen25-coder-32b-gguf",
    "llama31-8b-chat-prod",
    "llamacpp-ngram-cpu",
)
ARGS_PROFILES = ("qwen25-coder-32b-gguf", "llama31-8b-draft-1b")
VLLM_VERSIONS = ("0.6.6", "0.8.2", "0.32.0")
VLLM_MATRIX = (
    "llama31-8b-eagle3",
    "llama31-8b-eagle",
    "llama31-8b-draft-1b",
    "llama31-8b-ngram-rag",
    "vicuna-7b-medusa",
    "llama31-8b-mlp-speculator",
)
LLAMA_VERSIONS = ("legacy", "current")
LLAMA_MATRIX = ("qwen25-coder-32b-gguf", "llamacpp-ngram-cpu")


def _profiles() -> dict[str, tuple[Path, dict]]:
    out = {}
    for path in ready_made_profiles():
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        out[data["name"]] = (path, data)
    return out


PROFILE_DATA = _profiles()


def _backend(name: str) -> str:
    """The backend of a profile (following `extends` is not needed: overlays name their base's backend)."""
    path, data = PROFILE_DATA[name]
    if "backend" in data:
        return data["backend"]
    from specops.config.profile import load_profile

    return load_profile(path, env={"SPECOPS_API_KEY": SECRET}).profile.backend


def _cases() -> list[tuple[str, str, str | None, str]]:
    """(golden file, profile name, --backend-version or None, format)."""
    cases = []
    for name, (path, data) in sorted(PROFILE_DATA.items()):
        pinned = (data.get("engine") or {}).get("version") or _pinned_through_extends(path)
        version = None if pinned else DEFAULT_VERSION[_backend(name)]
        formats = ["shell"] + (["json"] if name in JSON_PROFILES else []) + (["args"] if name in ARGS_PROFILES else [])
        for fmt in formats:
            cases.append((f"{name}.{fmt}.txt", name, version, fmt))
    for names, versions in ((VLLM_MATRIX, VLLM_VERSIONS), (LLAMA_MATRIX, LLAMA_VERSIONS)):
        for name in names:
            for version in versions:
                for fmt in ("shell", "json"):
                    cases.append((f"matrix/{name}@{version}.{fmt}.txt", name, version, fmt))
    return cases


def _pinned_through_extends(path: Path) -> str | None:
    from specops.config.profile import load_profile

    return load_profile(path, env={"SPECOPS_API_KEY": SECRET}).profile.engine.version


CASES = _cases()


def _args(name: str, version: str | None, fmt: str) -> list[str]:
    path = PROFILE_DATA[name][0].relative_to(ROOT)
    return ["render", str(path), "--format", fmt] + (["--backend-version", version] if version else [])


def render_text(name: str, version: str | None, fmt: str) -> str:
    """What the golden file holds: stdout on success, else the exit code and stderr (errors are goldens too)."""
    res = run(*_args(name, version, fmt), env=GOLDEN_ENV)
    if res.code == 0:
        assert res.stderr == "", res.stderr
        return res.stdout
    return f"exit {res.code}\n{res.stderr}"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # goldens name profiles by their path relative to the repository


@pytest.mark.parametrize("golden,name,version,fmt", CASES, ids=[c[0] for c in CASES])
def test_golden(golden, name, version, fmt):
    text = render_text(name, version, fmt)
    path = GOLDEN / golden
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden {path.relative_to(ROOT)}: run with SPECOPS_UPDATE_GOLDEN=1 and review it"
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"render of {name} ({version or 'pinned'}, {fmt}) differs from {golden}"


def test_no_stale_goldens():
    """Every file in tests/golden belongs to a case: a removed or renamed profile must take its golden along."""
    expected = {c[0] for c in CASES}
    present = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.txt")}
    if UPDATE:
        for stale in present - expected:
            (GOLDEN / stale).unlink()
        present &= expected
    assert present == expected, f"stale: {sorted(present - expected)}, missing: {sorted(expected - present)}"


def test_every_profile_has_a_shell_golden_that_renders():
    """Each ready-made profile renders successfully for its own pinned (or default) version."""
    for name in PROFILE_DATA:
        text = (GOLDEN / f"{name}.shell.txt").read_text(encoding="utf-8")
        assert not text.startswith("exit "), f"{name} does not render: {text}"


# ------------------------------------------------------------------------------------- determinism


def test_render_twice_is_byte_identical():
    for golden, name, version, fmt in CASES:
        assert render_text(name, version, fmt) == render_text(name, version, fmt), golden


_SUBPROCESS_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from support_cli import run
cases = json.loads(sys.argv[1])
env = json.loads(sys.argv[2])
out = {}
for golden, args in cases:
    res = run(*args, env=env)
    out[golden] = res.stdout if res.code == 0 else f"exit {res.code}\n{res.stderr}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_render_is_identical_under_other_hash_seeds(seed):
    """Set and dict iteration order must not leak into the output: a fresh interpreter per seed."""
    cases = [(g, _args(n, v, f)) for g, n, v, f in CASES]
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_SCRIPT, json.dumps(cases), json.dumps(GOLDEN_ENV)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rendered = json.loads(proc.stdout)
    for golden, *_ in CASES:
        assert rendered[golden] == (GOLDEN / golden).read_text(encoding="utf-8"), (
            f"{golden} under PYTHONHASHSEED={seed}"
        )


# ------------------------------------------------------------------------ are the goldens *right*?


def _successful_renders():
    for golden, name, _version, fmt in CASES:
        if fmt != "json":
            continue
        text = (GOLDEN / golden).read_text(encoding="utf-8")
        if text.startswith("exit "):
            continue
        yield golden, name, json.loads(text)


def _flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _effective(name: str):
    from specops.config.profile import load_profile

    return load_profile(PROFILE_DATA[name][0], env={"SPECOPS_API_KEY": SECRET}).profile


def test_goldens_never_contain_the_secret():
    for path in GOLDEN.rglob("*.txt"):
        assert SECRET not in path.read_text(encoding="utf-8"), path
    prod = (GOLDEN / "llama31-8b-chat-prod.shell.txt").read_text(encoding="utf-8")
    # the key travels in the engine's environment (argv is visible to every user in `ps`), redacted
    assert "VLLM_API_KEY=***" in prod and "--api-key" not in prod


def test_vllm_speculative_config_matches_profile_and_version():
    """Parse --speculative-config the way each vLLM generation does and compare with the profile."""
    from specops.backends.versions import VLLM_SPEC_FIELDS, Version

    checked = 0
    for golden, name, plan in _successful_renders():
        if plan["backend"] != "vllm":
            continue
        profile = _effective(name)
        spec = profile.speculative
        argv = plan["argv"]
        version = Version(plan["engine_version"])
        assert "--disable-log-stats" not in argv, golden  # acceptance is read from the engine's metrics
        assert argv[argv.index("--port") + 1] == str(profile.server.port), golden
        if spec.method.value == "none":
            assert not any(a.startswith("--spec") for a in argv), golden
            continue
        if version < Version("0.8.2"):
            assert "--speculative-config" not in argv, golden
            model = _flag_value(argv, "--speculative-model")
            assert model == ("[ngram]" if spec.method.value == "ngram" else spec.draft), golden
            assert _flag_value(argv, "--num-speculative-tokens") == str(spec.k), golden
            if spec.method.value == "ngram":
                assert _flag_value(argv, "--ngram-prompt-lookup-max") == str(spec.ngram.max), golden
                assert _flag_value(argv, "--ngram-prompt-lookup-min") == str(spec.ngram.min), golden
            checked += 1
            continue
        raw = _flag_value(argv, "--speculative-config")
        assert raw is not None, golden
        # 0.8.2 reads the value with ast.literal_eval; from 0.8.3 it is JSON
        cfg = ast.literal_eval(raw) if version < Version("0.8.3") else json.loads(raw)
        assert cfg["method"] == spec.method.value, golden  # always explicit (EAGLE-1 has no marker)
        assert cfg["num_speculative_tokens"] == spec.k >= 1, golden
        assert "tensor_parallel_size" not in cfg, golden  # vLLM refuses it inside the JSON
        if spec.method.value in ("ngram", "suffix", "mtp"):
            assert "model" not in cfg, golden
        else:
            assert cfg["model"] == spec.draft, golden
        if spec.method.value == "ngram":
            assert cfg["prompt_lookup_min"] <= cfg["prompt_lookup_max"], golden
        if "draft_tensor_parallel_size" in cfg:
            assert cfg["draft_tensor_parallel_size"] in (1, profile.gpus.tensor_parallel_size), golden
        for key in cfg:
            since, until = VLLM_SPEC_FIELDS[key]
            assert Version(since) <= version and (until is None or version < Version(until)), (golden, key)
        tp = profile.gpus.tensor_parallel_size
        assert _flag_value(argv, "--tensor-parallel-size") == (str(tp) if tp > 1 else None), golden
        if profile.gpus.devices:
            assert plan["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, profile.gpus.devices)), golden
        checked += 1
    assert checked >= 10


REMOVED_LLAMA_FLAGS = {
    "--draft",
    "--draft-n",
    "--draft-max",
    "--draft-min",
    "--draft-n-min",
    "-cd",
    "--ctx-size-draft",
    "--spec-replace",
}


def test_llama_server_flags_match_their_generation():
    checked = 0
    for golden, name, plan in _successful_renders():
        if plan["backend"] != "llamacpp":
            continue
        argv = plan["argv"]
        profile = _effective(name)
        gen = plan["notes"][0].rsplit(" ", 1)[-1]
        assert "--metrics" in argv, golden  # acceptance is read from /metrics
        if gen == "current":
            assert not REMOVED_LLAMA_FLAGS & set(argv), golden  # llama-server exits 1 on these
            if profile.speculative.method.value == "draft_model":
                # -md alone no longer enables speculation
                assert _flag_value(argv, "--spec-type") == "draft-simple", golden
                assert _flag_value(argv, "--spec-draft-n-max") == str(profile.speculative.k), golden
            if profile.speculative.method.value == "ngram":
                assert _flag_value(argv, "--spec-type") in (
                    "ngram-mod",
                    "ngram-simple",
                    "ngram-map-k",
                    "ngram-map-k4v",
                    "ngram-cache",
                ), golden
        if gen == "legacy":
            assert not [a for a in argv if a.startswith("--spec-")], golden  # old builds know none of them
            assert _flag_value(argv, "--draft-max") == str(profile.speculative.k), golden
        if profile.gpus.devices == []:
            assert _flag_value(argv, "-dev") == "none", golden
        checked += 1
    assert checked >= 4


def test_matrix_refusals_say_why():
    """A method a version cannot run is refused with the version that can, located in the profile."""
    expectations = {
        "matrix/llama31-8b-eagle3@0.6.6.shell.txt": "needs vLLM >= 0.8.5",
        "matrix/llama31-8b-eagle3@0.8.2.shell.txt": "needs vLLM >= 0.8.5",
        "matrix/llamacpp-ngram-cpu@legacy.shell.txt": "cannot run ngram",
    }
    for golden, needle in expectations.items():
        text = (GOLDEN / golden).read_text(encoding="utf-8")
        assert text.startswith("exit 1\nerror: profiles/"), golden
        assert "speculative.method: " in text and needle in text, (golden, text)
        assert len(text.strip().splitlines()) == 2, golden  # exactly one error line


def test_medusa_and_mlp_speculator_are_pinned_below_their_removal():
    from specops.backends.versions import VLLM_METHOD_UNTIL, Version

    for name in PROFILE_DATA:
        profile = _effective(name)
        until = VLLM_METHOD_UNTIL.get(profile.speculative.method.value)
        if until is not None:
            assert profile.engine.version and Version(profile.engine.version) < until, name
