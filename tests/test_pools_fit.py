"""`validate` and `doctor` say what replaces a same-pod twin that cannot fit: the remote-twin profile lines, or the
pools `specops k8s render` runs it as (issue 40 item 4).

Real parts as in tests/test_twins_fit.py (whose profile helpers these reuse): profiles loaded by the real loader,
the CLI in subprocesses, local model files whose sizes are real (a sparse safetensors file, a header-only GGUF).
"""

from __future__ import annotations

import json

import yaml
from test_twins_fit import GIB, _cli, _llama_profile, _vllm_profile

PLAIN_OF = "specops--"  # k8s names of a local model path start so (a path is no DNS label)


def _replacement(lines: list[str]) -> dict:
    """The YAML the replacement lines show (routing's, then deploy's), parsed back."""
    at = lines.index("  routing:")
    routing = yaml.safe_load("\n".join(lines[at : at + 2]))
    at = lines.index("  deploy:")
    deploy = yaml.safe_load("\n".join(lines[at : at + 2]))
    return {**routing, **deploy}


def test_validate_shows_the_remote_twin_that_replaces_a_vllm_twin_that_cannot_fit(tmp_path):
    """vLLM, 11 GiB of weights, twice, on one 24 GiB GPU at 0.9 (10.8 GiB each): refused, and the lines that
    replace it parse as a remote twin of method none (with the profile's key variable) and as pools."""
    path = _vllm_profile(tmp_path, 11 * GIB)
    path.write_text(path.read_text().replace("gpus: {", 'server: {port: 8100, api_key: "${TWIN_KEY}"}\ngpus: {'))
    res = _cli("validate", str(path), env={"TWIN_KEY": "k"})
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [line[8:] for line in res.stdout.splitlines() if line.startswith("        ")]
    assert any("instead of a twin in the same pod" in line for line in lines), res.stdout
    shown = _replacement(lines)
    (twin,) = shown["routing"]["twins"]
    assert twin["method"] == "none" and twin["api_key_env"] == "TWIN_KEY"
    assert twin["url"].startswith(f"http://{PLAIN_OF}") and twin["url"].endswith("-plain:8100")
    assert shown["deploy"] == {"pools": {"plain": {"replicas": 1}}}
    doc = json.loads(_cli("validate", "--format", "json", str(path), env={"TWIN_KEY": "k"}).stdout)
    assert doc["profiles"][0]["twin_replacement"] == lines[: len(doc["profiles"][0]["twin_replacement"])]
    # a twin that fits gets no such lines
    path.write_text(path.read_text().replace("memory_gb: 24", "memory_gb: 48"))
    res = _cli("validate", str(path), env={"TWIN_KEY": "k"})
    assert res.returncode == 0 and "instead of a twin" not in res.stdout, res.stdout


def test_doctor_shows_the_replacement_once(tmp_path):
    twin = _llama_profile(tmp_path, twins=True, memory_gb=0.15)
    res = _cli("doctor", str(twin), "--offline")
    assert res.returncode != 0, res.stdout
    assert res.stdout.count("instead of a twin in the same pod") == 1, res.stdout
    at = res.stdout.index("instead of a twin in the same pod")
    assert "twins: [{url: http://" in res.stdout[at:] and "method: none}]" in res.stdout[at:]
    assert "pools: {plain: {replicas: 1}}" in res.stdout[at:]
