"""Multi-node groups run for real on loopback: the pods of the LeaderWorkerSet that `specops k8s render`
writes, each started from its rendered container (command, args, env; see specops.devenv.matrix_group for
the little that stands in for a pod's own network namespace and volumes).

- llama.cpp (``deploy.multi_node.mode: rpc``): two ``rpc-server`` workers and the leader's ``specops k8s
  leader`` → ``specops up``, llama-server with ``--rpc`` to the workers, a draft model speculating; 16
  clients through the leader's proxy while the watcher falls back to n-gram: no request lost; a worker
  killed under load and restarted as the kubelet would: the group serves again with no request lost (the
  time is printed, and measured in benchmarks/).
- vLLM (``mode: nnodes``): rank 0 (the leader's ``specops up``) and rank 1 (``specops k8s worker``:
  ``--headless``, following the leader's method), tensor parallel over the two processes (gloo), n-gram
  speculating, then a fallback under load that the worker follows.

One group start per engine (each start costs minutes on 2 cores).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import unavailable
from support_engines import need_llama_server, need_vllm_python
from support_load import Load
from support_ports import free_port
from support_up import http_json

from specops.devenv import engines
from specops.devenv.matrix_group import LocalGroup, render_objects, unshare_problem
from specops.errors import SpecopsError

pytestmark = [pytest.mark.engines]

VENV_BIN = Path(sys.executable).parent


def _need_namespaces() -> None:
    problem = unshare_problem()
    if problem:
        unavailable(problem)


# ------------------------------------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="module")
def rpc_group(tmp_path_factory, tiny_gguf_models):
    need_llama_server()
    _need_namespaces()
    if not engines.rpc_server_bin().exists():
        unavailable(f"no rpc-server beside {engines.llama_server_bin()}: run `specops engines setup llamacpp`")
    tmp = tmp_path_factory.mktemp("rpc-group")
    profile = tmp / "rpc-group.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "name": "rpc-group",
                "backend": "llamacpp",
                "model": {"id": str(tiny_gguf_models / "gguf-target.gguf"), "max_model_len": 1024},
                "speculative": {
                    "method": "draft_model",
                    "draft": str(tiny_gguf_models / "gguf-draft-noisy.gguf"),
                    "num_speculative_tokens": 8,
                },
                "gpus": {"gpu_layers": "all"},
                "server": {"port": free_port(), "parallel": 4},
                "fallback": {
                    "window": "4s",
                    "min_draft_tokens": 100,
                    "consecutive_windows": 2,
                    "cooldown": "10m",
                    "chain": ["ngram", "none"],
                },
                "monitor": {"interval": "500ms"},
                "supervisor": {"stop_timeout": 10},
                "engine": {"ready_timeout": "2m"},
                "deploy": {"multi_node": {"nodes": 3, "rpc_port": free_port()}, "monitor": "none"},
            },
            sort_keys=False,
        )
    )
    kinds = render_objects(profile)
    group = LocalGroup(kinds, tmp / "group", path_dirs=[VENV_BIN, engines.llama_server_bin().parent])
    group.start_all()
    try:
        yield group
    finally:
        codes = group.stop(timeout=40)
        print(f"rpc group stopped: {codes}")


@pytest.mark.timeout(420)
def test_rpc_group_speculates_on_its_workers_and_falls_back_under_load_with_none_lost(rpc_group):
    g = rpc_group
    workers = g.kinds["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    assert workers[0]["command"] == ["rpc-server"]  # the rendered worker runs as it is (with its pod's address)
    try:
        st = g.wait_for(lambda s: s.get("state") == "ready", 180, "the leader's specops up to be ready")
    except Exception:
        pytest.fail(f"the group did not become ready\n{g.logs()}\n{g.engine_log()[-4000:]}")
    assert st["method"] == "draft_model"
    assert "rpc group of 3 ready" in g.leader.log(), g.leader.log()
    argv = g.events("start")[0]["argv"]
    rpc = argv[argv.index("--rpc") + 1].split(",")
    assert rpc == [f"{g.worker_address(i)}:{g.workers[0].container['ports'][0]['containerPort']}" for i in (1, 2)]
    assert all(w.alive() for w in g.workers), g.logs()
    # each worker serves on its own address, and the leader's llama-server connected to both
    for i, w in enumerate(g.workers, start=1):
        assert f"endpoint       : 127.0.0.{i + 1}:" in w.log() and "Accepted client connection" in w.log(), w.log()

    with Load(g.url(), clients=16, max_tokens=32, request_timeout=120, max_seconds=300) as load:
        st = g.wait_for(
            lambda s: s.get("method") == "ngram" and s.get("state") == "ready", 240, "the fallback to n-gram"
        )
        load.wait_for_answers(16, timeout=120)
    assert load.crashed is None
    assert load.lost == 0 and load.counts["stream_error"] == 0, load.report()
    assert load.ok >= 32, load.report()
    switch = next(d for d in g.events("decision") if d.get("action") == "switch")
    assert switch["from"] == "draft_model" and switch["to"] == "ngram"
    assert switch["numbers"]["draft_tokens"] >= 100  # the draft speculated on the group before it fell back
    argv = g.events("start")[-1]["argv"]
    assert "--rpc" in argv and "-md" not in argv and "--model-draft" not in argv
    print(f"16 clients: {load.report()}")


@pytest.mark.timeout(300)
def test_a_worker_killed_under_load_is_restarted_and_the_group_serves_again(rpc_group):
    """The kubelet restarts a container that exits; the leader's llama-server loses its layers on that worker
    and exits, and the leader's specops restarts it against the group: serving again, no request lost (those
    that had not started are retried; a stream cut by the engine's death ends in an explicit error)."""
    g = rpc_group
    g.wait_for(lambda s: s.get("state") == "ready", 120, "a ready group")
    restarts_before = int(g.state().get("restarts") or 0)
    victim = g.workers[0]
    with Load(g.url(), clients=4, max_tokens=32, request_timeout=120, max_seconds=240) as load:
        load.wait_for_answers(4, timeout=60)
        killed = time.monotonic()
        g.kill(victim, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        g.start(victim)  # restartPolicy Always: the kubelet starts the container again
        try:
            g.wait_for(
                lambda s: int(s.get("restarts") or 0) > restarts_before and s.get("state") == "ready",
                150,
                "the leader's engine restarted against the group",
            )
        except SpecopsError as exc:
            pytest.fail(f"{exc}; load {load.report()}\n{g.logs()}\n{g.engine_log()[-4000:]}")
        recovered = time.monotonic() - killed
        ok_at_recovery = load.ok
        load.wait_for_answers(8, timeout=120)  # answered by the restarted engine
    print(f"worker killed: serving again after {recovered:.1f}s; load {load.report()}")
    assert load.crashed is None
    assert load.lost == 0, f"{load.report()}\n" + "\n".join(load.failures[:5])
    assert load.ok - ok_at_recovery >= 8, load.report()  # every answer since the recovery is whole
    assert g.leader.alive() and victim.alive(), g.logs()


# ------------------------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def nnodes_group(tmp_path_factory, tiny_models):
    python = need_vllm_python()
    _need_namespaces()
    tmp = tmp_path_factory.mktemp("nnodes-group")
    profile = tmp / "nnodes-group.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "name": "nnodes-group",
                "backend": "vllm",
                "model": {"id": str(tiny_models / "hf-cycle"), "dtype": "float32", "max_model_len": 512},
                # a draft of other random weights (acceptance ≈ 0): the watcher leaves it for n-gram
                "speculative": {
                    "method": "draft_model",
                    "draft": str(tiny_models / "hf-draft-other"),
                    "num_speculative_tokens": 3,
                },
                "gpus": {"tensor_parallel_size": 2},  # one rank per node: tensor parallel across the group
                "server": {
                    "port": free_port(),
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                    "extra_args": ["--enforce-eager"],
                },
                "fallback": {
                    "window": "6s",
                    "min_draft_tokens": 60,
                    "consecutive_windows": 2,
                    "cooldown": "10m",
                    "chain": ["ngram", "none"],
                },
                "monitor": {"interval": "1s"},
                "supervisor": {"stop_timeout": 30},
                "engine": {"ready_timeout": "6m"},
                # a group's switch restarts every rank: minutes on 2 shared cores, past the default 2 min hold
                "proxy": {"queue_timeout": "10m"},
                "deploy": {"multi_node": {"nodes": 2, "mode": "nnodes", "master_port": free_port()}, "monitor": "none"},
            },
            sort_keys=False,
        )
    )
    kinds = render_objects(profile)
    extra = {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    group = LocalGroup(kinds, tmp / "group", path_dirs=[VENV_BIN, python.parent], extra_env=extra)
    group.start_all()
    try:
        yield group
    finally:
        print(f"nnodes group stopped: {group.stop(timeout=60)}")


@pytest.mark.timeout(900)
def test_nnodes_group_speculates_and_the_worker_follows_a_fallback_under_load(nnodes_group):
    g = nnodes_group
    worker = g.kinds["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert worker["args"][:2] == ["k8s", "worker"]
    try:
        g.wait_for(lambda s: s.get("state") == "ready", 480, "the leader's specops up to be ready")
    except Exception:
        pytest.fail(f"the group did not become ready\n{g.logs()}\n{g.engine_log()[-4000:]}")
    argv = g.events("start")[0]["argv"]
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "0"
    assert argv[argv.index("--master-addr") + 1] == g.leader_address
    assert "rank 1, step 0 (draft_model)" in g.workers[0].log(limit=1 << 24), g.workers[0].log()
    with Load(g.url(), clients=16, max_tokens=24, request_timeout=300, max_seconds=600) as load:
        g.wait_for(lambda s: s.get("method") == "ngram" and s.get("state") == "ready", 600, "the fallback to n-gram")
        load.wait_for_answers(16, timeout=240)
    assert load.crashed is None
    assert load.lost == 0 and load.counts["stream_error"] == 0, load.report()
    switch = next(d for d in g.events("decision") if d.get("action") == "switch")
    assert switch["from"] == "draft_model" and switch["to"] == "ngram"
    assert switch["numbers"]["draft_tokens"] >= 60  # the draft speculated across the two nodes first
    assert "step 1 (ngram)" in g.workers[0].log(limit=1 << 24), g.workers[0].log()  # the worker followed
    status, body = http_json(g.url() + "/v1/completions", {"prompt": "a b c a b c a b", "max_tokens": 24})
    assert status == 200, body
    done = g.events("switch-complete")
    print(f"16 clients over the switch: {load.report()}; switch {done[-1] if done else None}")
