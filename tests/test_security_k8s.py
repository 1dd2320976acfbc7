"""Security review, Kubernetes: the Lease gate against a misbehaving API server (the fake in tests/fakekube.py,
spoken to by the real ``kubernetes`` client), and what the rendered manifests allow."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
from conftest import unavailable
from fakekube import FakeKube

from specops.k8s.lease import LeaseGate
from specops.methods import Method
from specops.run.events import SwitchOrder
from specops.run.switchgate import FleetCoordinator, GateError, Slot

pytestmark = pytest.mark.timeout(60)

SLOT = "specops-chat-prod-switch-0"


@pytest.fixture
def kube(tmp_path):
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        unavailable("the kubernetes client is not installed (pip install -e '.[test]')")
    with FakeKube() as fake:
        fake.config = fake.kubeconfig(tmp_path / "kubeconfig", namespace="fleet")
        yield fake


def gate(kube, who: str = "pod-a") -> LeaseGate:
    return LeaseGate.from_environment("chat.prod", 1, 10, {"KUBECONFIG": str(kube.config), "POD_NAME": who})


# ------------------------------------------------------------------------------------------- item 8: Leases


@pytest.mark.parametrize("answer", [{}, {"metadata": None}, {"metadata": {"name": SLOT}}])
def test_a_200_that_is_no_lease_is_a_gate_error(kube, answer):
    g = gate(kube)
    slot, _ = g.try_enter()
    kube.answer = answer
    for call in (g.try_enter, lambda: g.renew(slot), lambda: g.leave(slot)):
        with pytest.raises(GateError, match=f"lease {SLOT}"):
            call()
    kube.answer = None
    assert g.renew(slot) is True  # the same gate works once the server answers Leases again


def test_the_coordinator_waits_and_says_why_when_the_api_answers_no_lease(kube):
    """Before: the slot task died on an AttributeError ("Task exception was never retrieved") and the status
    kept whatever error it had; now it is a fleet error, and it clears when the server answers properly."""
    executed: list = []
    events: list[str] = []

    class Events:
        def emit(self, kind, **fields):
            events.append(kind)

    def execute(order):
        executed.append(order)
        return True

    async def until(predicate):
        for _ in range(500):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("timed out")

    async def main():
        c = FleetCoordinator(gate(kube), execute=execute, events=Events(), say=lambda m: None, retry_interval=0.05)
        kube.answer = {"metadata": None}
        order = SwitchOrder(1, "low acceptance", {"from": "draft_model", "to": "ngram", "rule": "threshold"})
        c.want(order)
        await until(lambda: "fleet-error" in events)
        assert "without metadata" in c.snapshot()["fleet"]["error"] and not executed
        assert c._acquiring is not None and not c._acquiring.done()  # still asking, not dead
        kube.answer = None
        await until(lambda: executed)
        assert c.snapshot()["fleet"]["error"] is None
        await c.close()

    with warnings.catch_warnings(record=True):
        asyncio.run(main())
    gc.collect()
    assert executed and executed[0].decision["to"] == Method.NGRAM.value


def test_an_api_server_that_trickles_bytes_meets_the_call_deadline(kube):
    """A byte every 0.2 s never trips the client's 5 s read timeout; the call's own deadline cuts it."""
    g = gate(kube)
    slot, _ = g.try_enter()
    g.deadline_s = 1.0
    kube.trickle = 0.2
    with pytest.raises(GateError, match=r"no complete answer within 1s"):
        g.renew(slot)
    with pytest.raises(GateError, match=r"within 1s"):
        g.try_enter()
    kube.trickle = None
    assert g.renew(slot) is True  # the client recovers: the cut connections are not reused
    kube.stop()
    assert kube.trickle_cut >= 1  # the client hung up on the trickled answers (the server did not finish them)


def test_a_lease_that_may_not_be_created_says_to_apply_the_rendered_leases(kube):
    kube.forbid_create = True
    with pytest.raises(GateError, match=r"may not create it: apply the Leases"):
        gate(kube).try_enter()
    # a Lease that exists (rendered and applied) is taken with get and update alone
    kube.objects[("fleet", SLOT)] = {
        "kind": "Lease",
        "apiVersion": "coordination.k8s.io/v1",
        "metadata": {
            "name": SLOT,
            "namespace": "fleet",
            "resourceVersion": "5",
            "uid": "u",
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {},
    }
    assert gate(kube).try_enter() == (Slot(0, SLOT), [])
    assert kube.holder(SLOT, "fleet") == "pod-a"
    assert not [r for r in kube.requests if r[0] == "POST" and r[2] == 201]
