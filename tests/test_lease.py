"""Fleet-safe switches: the Lease protocol against a fake API server that speaks the real REST protocol to the
real ``kubernetes`` client (tests/fakekube.py), the shared-directory lock, the asynchronous coordinator that
``specops up`` puts between the watcher and the supervisor, the profile fields, and the rendered RBAC."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from conftest import unavailable
from fakekube import FakeKube, parse_micro
from support_cli import ROOT, run
from support_goodput import Events
from support_procs import stop_group

from specops.config.profile import load_profile
from specops.k8s.lease import LeaseGate, gate_for, lease_names, namespace
from specops.methods import Method
from specops.run.events import EngineReady, State, StateChanged, SwitchOrder
from specops.run.switchgate import DirectoryGate, FleetCoordinator, GateError, Slot

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def kube(tmp_path):
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        unavailable("the kubernetes client is not installed (pip install -e '.[test]')")
    with FakeKube() as fake:
        fake.config = fake.kubeconfig(tmp_path / "kubeconfig", namespace="fleet")
        yield fake


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def gate(kube, who: str, slots: int = 1, duration: int = 10, clock=None) -> LeaseGate:
    env = {"KUBECONFIG": str(kube.config), "POD_NAME": who}
    g = LeaseGate.from_environment("chat.prod", slots, duration, env)
    if clock is not None:
        g.clock = clock
    return g


# ------------------------------------------------------------------------------------------- Leases


def test_the_first_replica_creates_the_slot_and_the_second_sees_it_held(kube):
    a, b = gate(kube, "pod-a"), gate(kube, "pod-b")
    assert a.namespace == "fleet" and a.names == ["specops-chat-prod-switch-0"]
    slot, holders = a.try_enter()
    assert slot == Slot(0, "specops-chat-prod-switch-0") and holders == []
    assert b.try_enter() == (None, ["pod-a"])
    obj = kube.objects[("fleet", "specops-chat-prod-switch-0")]
    assert obj["spec"]["holderIdentity"] == "pod-a" and obj["spec"]["leaseDurationSeconds"] == 10
    parse_micro(obj["spec"]["renewTime"])  # a MicroTime the API server accepted
    assert ("POST", "/apis/coordination.k8s.io/v1/namespaces/fleet/leases", 201) in kube.requests
    # a slot already ours is ours again (a take that timed out on our side but reached the server)
    assert a.try_enter()[0] == slot


def test_a_stale_update_gets_409_and_the_other_replica_wins(kube):
    a, b = gate(kube, "pod-a"), gate(kube, "pod-b")
    slot, _ = a.try_enter()
    a.leave(slot)
    assert kube.holder("specops-chat-prod-switch-0", "fleet") is None
    seen_by_b = b._read(slot.name)  # b reads the free slot ...
    assert a.try_enter()[0] == slot  # ... a takes it meanwhile ...
    assert b._take(seen_by_b) is False  # ... and b's update with the old resourceVersion is refused
    assert ("PUT", f"/apis/coordination.k8s.io/v1/namespaces/fleet/leases/{slot.name}", 409) in kube.requests
    assert kube.holder(slot.name, "fleet") == "pod-a"


def test_a_duplicate_create_gets_409_and_counts_as_held(kube):
    a, b = gate(kube, "pod-a"), gate(kube, "pod-b")
    assert b._read("specops-chat-prod-switch-0") is None  # b saw no Lease ...
    a.try_enter()  # ... a created it ...
    assert b._create("specops-chat-prod-switch-0") is False  # ... AlreadyExists
    assert ("POST", "/apis/coordination.k8s.io/v1/namespaces/fleet/leases", 409) in kube.requests


def test_racing_replicas_one_wins(kube):
    gates = [gate(kube, f"pod-{i}") for i in range(6)]
    start = threading.Barrier(len(gates))
    won: list[str] = []

    def race(g):
        start.wait()
        slot, _ = g.try_enter()
        if slot is not None:
            won.append(g.identity)

    threads = [threading.Thread(target=race, args=(g,)) for g in gates]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1, won
    assert kube.holder("specops-chat-prod-switch-0", "fleet") == won[0]
    assert kube.max_concurrent_holders() == 1


def test_a_dead_holders_slot_expires_by_the_waiters_own_clock(kube):
    clock = Clock()
    a, b = gate(kube, "pod-a", duration=10), gate(kube, "pod-b", duration=10, clock=clock)
    slot, _ = a.try_enter()
    assert b.try_enter() == (None, ["pod-a"])  # first seen now
    clock.t += 9
    assert b.try_enter()[0] is None
    assert a.renew(slot)  # the holder is alive: the record changed, b's count starts again
    clock.t += 9
    assert b.try_enter()[0] is None
    clock.t += 10  # a died: 10 s without a renewal, as b saw it
    assert b.try_enter()[0] == slot
    obj = kube.objects[("fleet", slot.name)]
    assert obj["spec"]["holderIdentity"] == "pod-b" and obj["spec"]["leaseTransitions"] == 1
    assert a.renew(slot) is False  # a, if it comes back, knows the slot is not its any more


def test_release_frees_the_slot_at_once(kube):
    a, b = gate(kube, "pod-a"), gate(kube, "pod-b")
    slot, _ = a.try_enter()
    assert b.try_enter()[0] is None
    a.leave(slot)
    assert b.try_enter()[0] == slot
    a.leave(slot)  # not a's any more: nothing happens
    assert kube.holder(slot.name, "fleet") == "pod-b"


def test_two_slots_let_two_switch(kube):
    a, b, c = (gate(kube, f"pod-{x}", slots=2) for x in "abc")
    sa, sb = a.try_enter()[0], b.try_enter()[0]
    assert {sa.index, sb.index} == {0, 1}
    assert c.try_enter() == (None, ["pod-a", "pod-b"])
    a.leave(sa)
    assert c.try_enter()[0] == sa
    assert kube.max_concurrent_holders() == 2


def test_api_errors_are_gate_errors_without_the_token(kube, tmp_path):
    g = gate(kube, "pod-a")
    kube.forbidden = True
    with pytest.raises(GateError, match="HTTP 403") as err:
        g.try_enter()
    assert kube.token not in str(err.value)
    kube.forbidden = False
    wrong = yaml.safe_load(kube.config.read_text())
    wrong["users"][0]["user"]["token"] = "not-the-token"
    (tmp_path / "wrong").write_text(yaml.safe_dump(wrong))
    g = LeaseGate.from_environment("chat.prod", 1, 10, {"KUBECONFIG": str(tmp_path / "wrong"), "POD_NAME": "x"})
    with pytest.raises(GateError, match="HTTP 401"):
        g.try_enter()


def test_the_fake_server_keeps_the_api_servers_rules(kube):
    """The fake itself: a PUT without a resourceVersion (Leases allow no unconditional update) and a PUT of a
    Lease that does not exist are refused, as kube-apiserver refuses them."""
    from kubernetes import client

    g = gate(kube, "pod-a")
    slot, _ = g.try_enter()
    lease = g._read(slot.name)
    lease.metadata.resource_version = None
    with pytest.raises(client.ApiException) as err:
        g.api.replace_namespaced_lease(slot.name, "fleet", lease)
    assert err.value.status == 422
    lease.metadata.name = "specops-other"
    with pytest.raises(client.ApiException) as err:
        g.api.replace_namespaced_lease("specops-other", "fleet", lease)
    assert err.value.status == 404


def test_namespace_and_slot_names(kube):
    assert namespace({"POD_NAMESPACE": "prod", "KUBECONFIG": str(kube.config)}) == "prod"
    assert namespace({"KUBECONFIG": str(kube.config)}) == "fleet"
    assert lease_names("Chat_Prod", 2) == ["specops-chat-prod-switch-0", "specops-chat-prod-switch-1"]


# ------------------------------------------------------------------------------------------- directory


def test_directory_slots(tmp_path):
    a = DirectoryGate(tmp_path / "slots", "chat", 1, "host-a:1")
    b = DirectoryGate(tmp_path / "slots", "chat", 1, "host-b:2")
    slot, _ = a.try_enter()
    assert slot is not None and Path(slot.name).name == "chat.switch-0.lock"
    assert oct(Path(slot.name).stat().st_mode & 0o777) == "0o600"
    assert b.try_enter() == (None, ["host-a:1"])
    assert b.renew(slot) is False and a.renew(slot) is True
    a.leave(slot)
    assert b.try_enter()[0] == slot
    b.close()
    assert a.try_enter()[0] == slot


def test_a_dead_process_frees_its_directory_slot(tmp_path):
    code = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
        "from specops.run.switchgate import DirectoryGate\n"
        f"g = DirectoryGate({str(tmp_path)!r}, 'chat', 1, 'child')\n"
        "print(g.try_enter()[0] is not None, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "True"
        me = DirectoryGate(tmp_path, "chat", 1, "me")
        assert me.try_enter() == (None, ["child"])
        child.kill()  # SIGKILL to the holder alone: it cannot release the slot itself
        child.wait(timeout=10)
        assert me.try_enter()[0] is not None
    finally:
        stop_group(child, timeout=5)
        child.stdout.close()


# ------------------------------------------------------------------------------------------- coordinator


def order(to: str = "ngram") -> SwitchOrder:
    return SwitchOrder(1, "low acceptance", {"from": "draft_model", "to": to, "rule": "threshold"})


def ready() -> EngineReady:
    return EngineReady(1, Method.NGRAM, None, 1.0)  # type: ignore[arg-type]


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def coordinator(g, executed: list, events: Events, registry=None, **kw) -> FleetCoordinator:
    def execute(o):
        executed.append(o)
        return True

    return FleetCoordinator(
        g, execute=execute, events=events, say=lambda m: None, registry=registry, retry_interval=0.05, **kw
    )


def test_one_replica_switches_while_the_other_waits_then_follows(kube):
    from prometheus_client import CollectorRegistry, generate_latest

    async def main():
        reg = CollectorRegistry()
        ea, eb = Events(), Events()
        done_a: list = []
        done_b: list = []
        a = coordinator(gate(kube, "pod-a"), done_a, ea)
        b = coordinator(gate(kube, "pod-b"), done_b, eb, registry=reg)
        assert a.want(order()) is False  # never executed synchronously: the slot is asked in a thread
        await until(lambda: done_a)
        assert a.snapshot()["fleet"]["slot"] == "specops-chat-prod-switch-0" and a.switching
        assert b.want(order()) is False
        await until(lambda: b.waiting_since is not None)
        fleet = b.snapshot()["fleet"]
        assert fleet["holders"] == ["pod-a"] and fleet["wants"] == "ngram" and fleet["slot"] is None
        assert "switch-waiting" in eb.kinds() and not done_b
        assert "specops_switch_waiting 1.0" in generate_latest(reg).decode()
        b.want(order())  # the watcher repeats its decision at its next window
        a.on_event(ready())  # a's new engine is ready: its slot goes back
        await until(lambda: done_b)
        assert b.waiting_since is None and b.slot is not None
        text = generate_latest(reg).decode()
        assert "specops_switch_waiting 0.0" in text and "specops_switch_slot_held 1.0" in text
        assert "specops_switch_slot_waits_total 1.0" in text
        slot = dict(eb.lines)["switch-slot"]
        assert slot["waited_s"] > 0
        b.on_event(StateChanged(State.READY, State.STOPPED, 1, Method.NGRAM, 0))
        await b.close()
        await a.close()
        assert "switch-released" in eb.kinds()

    asyncio.run(main())
    holders = [w["holder"] for w in kube.writes]
    assert holders[0] == "pod-a" and "pod-b" in holders
    assert kube.max_concurrent_holders() == 1


def test_a_decision_not_repeated_is_dropped(tmp_path):
    async def main():
        blocker = DirectoryGate(tmp_path, "chat", 1, "other")
        blocker.try_enter()
        events, executed = Events(), []
        c = coordinator(DirectoryGate(tmp_path, "chat", 1, "me"), executed, events, stale_after=0.3)
        c.want(order())
        await until(lambda: "switch-wait-abandoned" in events.kinds())
        blocker.close()
        await asyncio.sleep(0.2)
        assert executed == [] and c.waiting_since is None and c.slot is None
        await c.close()

    asyncio.run(main())


def test_gate_errors_keep_the_switch_waiting_and_say_why(kube):
    async def main():
        events, executed = Events(), []
        c = coordinator(gate(kube, "pod-a"), executed, events)
        kube.forbidden = True
        c.want(order())
        await until(lambda: "fleet-error" in events.kinds())
        assert "HTTP 403" in c.snapshot()["fleet"]["error"] and not executed  # fail closed: no slot, no switch
        kube.forbidden = False
        c.want(order())
        await until(lambda: executed)
        assert c.snapshot()["fleet"]["error"] is None
        await c.close()

    asyncio.run(main())


def test_a_supervisor_that_cannot_switch_gives_the_slot_back(tmp_path):
    async def main():
        events = Events()
        g = DirectoryGate(tmp_path, "chat", 1, "me")
        c = FleetCoordinator(g, execute=lambda o: False, events=events, say=lambda m: None, retry_interval=0.05)
        c.want(order())
        await until(lambda: "switch-released" in events.kinds())
        await c.close()
        assert DirectoryGate(tmp_path, "chat", 1, "other").try_enter()[0] is not None

    asyncio.run(main())


def test_the_slot_is_renewed_while_the_switch_runs(kube):
    async def main():
        events, executed = Events(), []
        c = coordinator(gate(kube, "pod-a"), executed, events, renew_interval=0.1)
        c.want(order())
        await until(lambda: executed)
        await until(lambda: sum(1 for w in kube.writes if w["verb"] == "update") >= 2)
        c.on_event(ready())
        await until(lambda: kube.holder("specops-chat-prod-switch-0", "fleet") is None)
        await c.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------- profile


def _profile(tmp_path, deploy: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: chat\nbackend: llamacpp\nmodel: {id: /m.gguf}\nspeculative: {method: ngram}\n"
        "gpus: {devices: []}\ndeploy:\n" + deploy
    )
    return path


@pytest.mark.parametrize(
    "deploy,where,message",
    [
        ("  coordination: directory\n", "deploy.coordination", "coordination_dir"),
        ("  coordination: off\n  coordination_dir: /tmp/x\n", "deploy.coordination_dir", "remove it"),
        ("  max_switching: 0\n", "deploy.max_switching", "greater than or equal to 1"),
        ("  coordination: leases\n", "deploy.coordination", "auto"),
        ("  lease_duration: 1s\n", "deploy.lease_duration", "greater than or equal to 5"),
    ],
)
def test_fleet_fields_are_validated_with_located_errors(tmp_path, deploy, where, message):
    res = run("validate", str(_profile(tmp_path, deploy)))
    out = res.stdout + res.stderr
    assert res.code == 1 and "p.yaml:" in out and where in out and message in out, out
    assert "Traceback" not in out


def test_gate_for_each_coordination(tmp_path, kube):
    def prof(deploy: str):
        return load_profile(_profile(tmp_path, deploy)).profile

    said: list[str] = []
    env = {"KUBECONFIG": str(kube.config), "POD_NAME": "p"}
    assert gate_for(prof("  max_switching: 1\n"), env, said.append) is None  # auto, not in a pod, no directory
    g = gate_for(prof(f"  coordination_dir: {tmp_path / 's'}\n"), env, said.append)
    assert isinstance(g, DirectoryGate) and g.identity.startswith("p:")
    g = gate_for(prof("  coordination: lease\n  max_switching: 2\n"), env, said.append)
    assert isinstance(g, LeaseGate) and g.slots == 2 and g.namespace == "fleet"
    assert gate_for(prof("  coordination: off\n"), env, said.append) is None
    # auto in a pod whose API configuration is missing: it serves, ungated, and says so
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert gate_for(prof("  max_switching: 1\n"), pod, said.append) is None
    assert any("fleet coordination off" in s for s in said)


def test_rendering_needs_no_kubernetes_client():
    code = "import sys, specops.k8s.manifests, specops.k8s.lease; print('kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_rendered_rbac_allows_exactly_the_slot_leases():
    res = run("k8s", "render", str(ROOT / "profiles/llamacpp-ngram-cpu.yaml"), env={"SPECOPS_API_KEY": None})
    assert res.code == 0, res.stderr
    kinds = {o["kind"]: o for o in yaml.safe_load_all(res.stdout) if o}
    names = lease_names("llamacpp-ngram-cpu", 1)
    rules = kinds["Role"]["rules"]
    assert len(rules) == 1  # no create: it cannot be limited to names; the Leases are rendered instead
    assert [o["metadata"]["name"] for o in yaml.safe_load_all(res.stdout) if o and o["kind"] == "Lease"] == names
    assert {**rules[0], "verbs": sorted(rules[0]["verbs"])} == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": names,
        "verbs": ["get", "update"],
    }
    binding = kinds["RoleBinding"]
    assert binding["roleRef"]["name"] == kinds["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": kinds["ServiceAccount"]["metadata"]["name"]}]
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_no_rbac_without_leases(tmp_path):
    src = yaml.safe_load((ROOT / "profiles/llamacpp-ngram-cpu.yaml").read_text())
    src.setdefault("deploy", {})["coordination"] = "off"
    path = tmp_path / "off.yaml"
    path.write_text(yaml.safe_dump(src))
    res = run("k8s", "render", str(path), env={"SPECOPS_API_KEY": None})
    assert res.code == 0, res.stderr
    kinds = [o["kind"] for o in yaml.safe_load_all(res.stdout) if o]
    assert "Role" not in kinds and "ServiceAccount" not in kinds
    assert "POD_NAME" not in res.stdout and "serviceAccountName" not in res.stdout


# ------------------------------------------------------------------------------------------- specops up


class StandinUp:
    """`specops up` on the stand-in engine (tests/support_standin.py) with directory coordination in ``slots``;
    ``wait`` sends traffic while it polls the state file, so that the watcher has drafts to count."""

    def __init__(self, tmp_path: Path, slots: Path, fallback: dict):
        from support_ports import free_port
        from support_up import write_profile

        self.state_dir, self.port = tmp_path / "state", free_port()
        self.doc = {
            "name": "standin",
            "backend": "llamacpp",
            "model": {"id": str(tmp_path / "target.gguf")},
            "speculative": {"method": "ngram"},  # the stand-in's ngram accepts 0.2
            "gpus": {"devices": []},
            "server": {"port": self.port},
            "fallback": fallback,
            "monitor": {"interval": 0.1, "timeout": 1},
            "supervisor": {"state_dir": str(self.state_dir), "stop_timeout": 5, "crash_loop_exits": 1},
            "deploy": {"coordination": "directory", "coordination_dir": str(slots), "lease_duration": "5s"},
        }
        (tmp_path / "target.gguf").write_bytes(b"GGUF")  # the stand-in reads no weights; the launch check wants a file
        self.path = write_profile(tmp_path / "standin.yaml", self.doc)
        self.log_path = tmp_path / "up.log"
        self.log = open(self.log_path, "w")
        script = str(Path(__file__).resolve().parent / "support_standin.py")
        self.proc = subprocess.Popen(
            [sys.executable, script, str(self.path)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def state(self) -> dict:
        import json

        try:
            return json.loads((self.state_dir / "standin" / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def events(self) -> list[dict]:
        import json

        return [json.loads(x) for x in (self.state_dir / "standin" / "events.jsonl").read_text().splitlines()]

    def wait(self, predicate, what: str, timeout: float = 30) -> dict:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if predicate(st):
                return st
            assert self.proc.poll() is None, f"specops up exited: {self.log_path.read_text()[-3000:]}"
            try:
                run_request(self.port)
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {self.state()}")

    def stop(self) -> int:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def close(self) -> None:
        """Stop ``specops up``'s group (SIGTERM, so it stops its engine too; SIGKILL after 15 s)."""
        stop_group(self.proc, timeout=15)
        self.log.close()


def test_up_waits_for_the_slot_but_a_crash_fallback_does_not(tmp_path):
    """`specops up` (the stand-in engine, directory coordination): the watcher's switch waits while another
    replica holds the slot, and says so; the engine crashing moves down the chain at once, slot or not."""
    import json
    import signal

    from support_cli import run as cli
    from support_up import http_text

    slots = tmp_path / "slots"
    other = DirectoryGate(slots, "standin", 1, "other-replica")
    assert other.try_enter()[0] is not None
    fallback = {"chain": ["none"], "window": 1, "min_draft_tokens": 20, "consecutive_windows": 2}
    up = StandinUp(tmp_path, slots, fallback)
    port, state_dir = up.port, up.state_dir
    try:
        up.wait(lambda s: s.get("state") == "ready", "ready")
        st = up.wait(lambda s: (s.get("fleet") or {}).get("waiting_since"), "the watcher's switch to wait")
        assert st["fleet"]["holders"] == ["other-replica"] and st["fleet"]["coordination"] == "directory"
        assert st["method"] == "ngram" and st["state"] == "ready"
        assert "specops_switch_waiting 1.0" in http_text(f"http://127.0.0.1:{port}/specops/metrics")
        live = json.loads(http_text(f"http://127.0.0.1:{port}/specops/status"))  # the proxy's status says it too
        assert live["fleet"]["holders"] == ["other-replica"] and live["fleet"]["wants"] == "none"
        shown = cli("status", "standin", "--state-dir", str(state_dir))
        assert shown.code == 0, shown.stderr
        assert "for a switch slot to go to none" in shown.stdout and "held by other-replica" in shown.stdout
        os.kill(st["engine_pid"], signal.SIGKILL)  # the engine dies: a crash loop at the first exit
        up.wait(lambda s: s.get("method") == "none" and s.get("state") == "ready", "the crash fallback")
        assert not [e for e in up.events() if e["event"] == "switch-slot"]  # it never took the slot ...
        assert other.try_enter()[0] is not None  # ... which the other replica still holds
        assert up.stop() == 0
    finally:
        up.close()
        other.close()


def test_a_profile_reload_waits_for_a_switch_slot(tmp_path):
    """A changed profile restarts the engine: with another replica holding the only slot, the reload waits
    (the engine keeps serving the old profile); once the slot is free it is taken, the engine restarts on the
    new profile and the slot goes back."""
    from support_up import write_profile

    slots = tmp_path / "slots"
    other = DirectoryGate(slots, "standin", 1, "other-replica")
    up = StandinUp(tmp_path, slots, {"chain": ["none"], "min_draft_tokens": 1_000_000})  # no watcher switch
    try:
        st = up.wait(lambda s: s.get("state") == "ready", "ready")
        engine_pid = st["engine_pid"]
        assert other.try_enter()[0] is not None
        up.doc["monitor"]["interval"] = 0.2  # a valid change: the reloader restarts the engine with it
        write_profile(up.path, up.doc)
        st = up.wait(lambda s: (s.get("fleet") or {}).get("wants") == "reload", "the reload to wait for the slot")
        assert st["fleet"]["holders"] == ["other-replica"] and st["engine_pid"] == engine_pid
        assert not [e for e in up.events() if e["event"] in ("reload-applied", "switch-slot")]
        other.close()  # the other replica is done: the slot is free
        st = up.wait(
            lambda s: s.get("engine_pid") not in (None, engine_pid) and s.get("state") == "ready", "the reload"
        )
        up.wait(lambda s: not (s.get("fleet") or {}).get("slot"), "the slot to go back")
        kinds = [e["event"] for e in up.events()]
        taken = kinds.index("switch-slot")
        assert [e for e in up.events() if e["event"] == "switch-slot"][0]["to"] == "reload"
        assert "switch-released" in kinds[taken:]
        assert up.stop() == 0
    finally:
        up.close()
        other.close()


def run_request(port: int) -> None:
    from support_up import http_json

    http_json(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x", "max_tokens": 20}, timeout=10)
