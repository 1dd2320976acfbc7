"""The fleet's switch slots as Kubernetes Lease objects (``coordination.k8s.io/v1``), and choosing the gate.

Slot ``i`` of a deployment is the Lease ``specops-<name>-switch-<i>`` in the pod's namespace. A replica takes
it when it does not exist (create), when nobody holds it, when it is already ours, or when its holder has
not renewed it for ``leaseDurationSeconds`` (update, with the ``resourceVersion`` read: a 409 Conflict
means another replica won, and the next slot is tried). Expiry is judged as client-go's leader election
does: by how long *this* replica has seen the record unchanged, not by comparing clocks with the holder.

Every failure of a gate call is a :class:`GateError` (an answer that is no Lease of that name included), and
each call (:meth:`LeaseGate.try_enter`, ``renew``, ``leave``) ends within :data:`CALL_DEADLINE` seconds: the
client's timeouts bound each socket read, not an answer trickled a byte at a time, so the sockets a call uses
are shut down when its time is up (:class:`_Deadline`).

The official ``kubernetes`` client is imported only here, only when a gate is built (``specops[k8s]``):
rendering and validating never load it.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from specops.errors import SpecopsError
from specops.k8s.names import lease_names
from specops.run.switchgate import DirectoryGate, GateError, Slot

__all__ = ["LeaseGate", "gate_for", "identity", "lease_names"]

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
REQUEST_TIMEOUT = (3.0, 5.0)  # connect, read: seconds of one socket operation of an API request
#: Seconds one gate call (its requests and their retries together) may take; below the coordinator's 10 s
#: call timeout, so that its thread is free again when the coordinator gives up on it.
CALL_DEADLINE = 8.0


def identity(env: Mapping[str, str]) -> str:
    """This replica, as the others see it: the pod's name (downward API ``POD_NAME``), else the host name."""
    return env.get("POD_NAME") or env.get("HOSTNAME") or socket.gethostname()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class LeaseGate:
    """Switch slots as Leases in ``namespace``, through ``api`` (a ``kubernetes.client.CoordinationV1Api``)."""

    kind = "lease"

    def __init__(
        self,
        api: Any,
        namespace: str,
        names: list[str],
        identity: str,
        duration_s: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime.datetime] = _now,
        deadline_s: float = CALL_DEADLINE,
    ):
        self.api = api
        self.deadline_s = deadline_s
        self.namespace = namespace
        self.names = names
        self.slots = len(names)
        self.identity = identity
        self.duration_s = duration_s
        self.clock = clock
        self.now = now
        self._seen: dict[str, tuple[str, float]] = {}  # lease -> (resourceVersion, when first seen so)
        _track_sockets(api)

    # ------------------------------------------------------------------ the gate
    def try_enter(self) -> tuple[Slot | None, list[str]]:
        return self._guarded("take a switch slot", self._try_enter)

    def renew(self, slot: Slot) -> bool:
        return self._guarded(f"renew lease {slot.name}", self._renew, slot)

    def leave(self, slot: Slot) -> None:
        return self._guarded(f"release lease {slot.name}", self._leave, slot)

    def _guarded(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call`` within :attr:`deadline_s`; whatever goes wrong is a GateError that says what."""
        with _Deadline(self.deadline_s) as deadline:
            try:
                return call(*args)
            except Exception as exc:
                if deadline.expired:
                    raise GateError(f"{what}: no complete answer within {self.deadline_s:g}s") from None
                if isinstance(exc, GateError):
                    raise
                raise GateError(f"{what}: {type(exc).__name__}: {exc}"[:300]) from None

    def _try_enter(self) -> tuple[Slot | None, list[str]]:
        holders: list[str] = []
        for index, name in enumerate(self.names):
            lease = self._read(name)
            if lease is None:
                if self._create(name):
                    return Slot(index, name), holders
                holders.append("?")  # created by another replica between our read and our create
                continue
            holder = lease.spec.holder_identity if lease.spec else None
            if holder and holder != self.identity and not self._expired(name, lease):
                holders.append(holder)
                continue
            if self._take(lease):
                return Slot(index, name), holders
            holders.append("?")  # another replica updated it first (409)
        return None, holders

    def _renew(self, slot: Slot) -> bool:
        lease = self._read(slot.name)
        if lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
            return False
        lease.spec.renew_time = self.now()
        lease.spec.lease_duration_seconds = self.duration_s
        return self._replace(lease)

    def _leave(self, slot: Slot) -> None:
        for _ in range(3):  # a 409 here is our own renewal racing us: read again
            lease = self._read(slot.name)
            if lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.renew_time = self.now()
            if self._replace(lease):
                return

    def close(self) -> None:
        client = getattr(self.api, "api_client", None)
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ the protocol
    def _expired(self, name: str, lease: Any) -> bool:
        """True once the record stayed unchanged for its ``leaseDurationSeconds``, by this replica's clock."""
        version = lease.metadata.resource_version
        seen = self._seen.get(name)
        now = self.clock()
        if seen is None or seen[0] != version:
            self._seen[name] = (version, now)
            return False
        return now - seen[1] >= (lease.spec.lease_duration_seconds or self.duration_s)

    def _take(self, lease: Any) -> bool:
        from kubernetes import client

        spec = lease.spec or client.V1LeaseSpec()
        if spec.holder_identity != self.identity:
            spec.acquire_time = self.now()
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = self.duration_s
        spec.renew_time = self.now()
        lease.spec = spec
        return self._replace(lease)

    def _body(self, name: str) -> Any:
        from kubernetes import client

        now = self.now()
        return client.V1Lease(
            api_version="coordination.k8s.io/v1",
            kind="Lease",
            metadata=client.V1ObjectMeta(
                name=name, labels={"app.kubernetes.io/managed-by": "specops", "specops.dev/role": "switch-slot"}
            ),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=self.duration_s,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )

    # ------------------------------------------------------------------ the API
    def _timeout(self) -> tuple[float, float]:
        """The client's (connect, read) timeouts, no longer than what is left of the call's deadline."""
        left = max(0.05, _Deadline.left())
        return (min(REQUEST_TIMEOUT[0], left), min(REQUEST_TIMEOUT[1], left))

    def _read(self, name: str) -> Any:
        try:
            lease = self.api.read_namespaced_lease(name, self.namespace, _request_timeout=self._timeout())
        except Exception as exc:
            if _status(exc) == 404:
                return None
            raise _error(exc, f"get lease {name}") from None
        problem = _not_a_lease(lease, name)
        if problem:
            raise GateError(f"get lease {name}: the API server answered {problem}")
        return lease

    def _create(self, name: str) -> bool:
        try:
            self.api.create_namespaced_lease(self.namespace, self._body(name), _request_timeout=self._timeout())
            return True
        except Exception as exc:
            if _status(exc) == 409:
                return False
            if _status(exc) == 403:  # the rendered Role lets the pods get/update the rendered Leases, not create
                raise GateError(
                    f"lease {name} does not exist and this identity may not create it: apply the Leases "
                    "`specops k8s render` writes (lease-*.yaml)"
                ) from None
            raise _error(exc, f"create lease {name}") from None

    def _replace(self, lease: Any) -> bool:
        """PUT ``lease`` with the resourceVersion it was read with; False on a 409 Conflict (someone was first)."""
        name = lease.metadata.name
        try:
            self.api.replace_namespaced_lease(name, self.namespace, lease, _request_timeout=self._timeout())
            return True
        except Exception as exc:
            if _status(exc) in (409, 404):
                return False
            raise _error(exc, f"update lease {name}") from None

    # ------------------------------------------------------------------ from the environment
    @classmethod
    def from_environment(cls, profile_name: str, slots: int, duration_s: int, env: Mapping[str, str]) -> LeaseGate:
        """In a pod: the service account; elsewhere: ``$KUBECONFIG`` (or ~/.kube/config). SpecopsError if neither."""
        try:
            from kubernetes import client, config
        except ImportError:
            raise SpecopsError(
                "deploy.coordination lease needs the kubernetes client: pip install 'specops[k8s]'"
            ) from None
        cfg = client.Configuration()
        try:
            if env.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(
                    config_file=env.get("KUBECONFIG") or None, client_configuration=cfg, persist_config=False
                )
        except Exception as exc:  # the client raises ConfigException, TypeError, OSError... for a bad config
            raise SpecopsError(f"deploy.coordination lease: no Kubernetes API configuration: {exc}") from None
        api = client.CoordinationV1Api(client.ApiClient(cfg))
        return cls(api, namespace(env), lease_names(profile_name, slots), identity(env), duration_s)


def namespace(env: Mapping[str, str]) -> str:
    """``POD_NAMESPACE`` (downward API), else the service account's namespace, else the kubeconfig's, else default."""
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        pass
    try:
        from kubernetes import config

        _, current = config.list_kube_config_contexts(config_file=env.get("KUBECONFIG") or None)
        return (current or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig: the default namespace
        return "default"


def _not_a_lease(lease: Any, name: str) -> str:
    """What makes an answer of the API server unusable as Lease ``name`` ('' when nothing does)."""
    from kubernetes import client

    if not isinstance(lease, client.V1Lease):
        return f"{type(lease).__name__}, not a Lease"
    meta = lease.metadata
    if meta is None:
        return "a Lease without metadata"
    if meta.name != name:
        return f"a Lease named {str(meta.name)[:64]!r}"
    if not isinstance(meta.resource_version, str) or not meta.resource_version:
        return "a Lease without a resourceVersion"
    if lease.spec is not None and not isinstance(lease.spec, client.V1LeaseSpec):
        return "a Lease whose spec is no LeaseSpec"
    return ""


# ------------------------------------------------------------------------------------------- deadlines

_CURRENT = threading.local()  # the _Deadline of the gate call this thread runs, if any


class _Deadline:
    """The time one gate call may take. The client's socket timeouts bound each read, so a server that sends
    a byte every few seconds never trips them; when the time is up, a timer shuts down every socket the call
    has used (the blocked read returns at once), and a connection opened later is refused."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    @staticmethod
    def current() -> _Deadline | None:
        return getattr(_CURRENT, "deadline", None)

    @staticmethod
    def left() -> float:
        """Seconds left to the current call (a long time outside one)."""
        d = _Deadline.current()
        return max(0.0, d.end - time.monotonic()) if d is not None else 3600.0

    def __enter__(self) -> _Deadline:
        _CURRENT.deadline = self
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        _CURRENT.deadline = None
        with self._lock:
            self._sockets.clear()

    def track(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            if not self.expired:
                self._sockets.append(sock)
                return
        _shutdown(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    """Wake a read blocked on ``sock`` (the plain socket's shutdown: a TLS socket's would drop its state under
    the reading thread)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass


def _tracked(base: type) -> type:
    """``base`` (a urllib3 connection class) whose sockets the current gate call's deadline can shut down."""

    class Tracked(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            deadline = _Deadline.current()
            if deadline is not None:
                left = deadline.end - time.monotonic()
                if deadline.expired or left <= 0:
                    raise ConnectionAbortedError("the gate call's deadline passed")
                if not isinstance(self.timeout, (int, float)) or self.timeout > left:
                    self.timeout = left
            super().connect()
            if deadline is not None:
                deadline.track(self.sock)

        def request(self, *args: Any, **kwargs: Any) -> Any:
            deadline = _Deadline.current()
            if deadline is not None:
                deadline.track(self.sock)  # a pooled connection, reused (a new one is tracked by connect)
            return super().request(*args, **kwargs)

    Tracked.__name__ = Tracked.__qualname__ = f"Tracked{base.__name__}"
    return Tracked


def _track_sockets(api: Any) -> None:
    """Make the pools of ``api``'s client (a kubernetes ApiClient's urllib3 PoolManager) use tracked connections."""
    manager = getattr(getattr(getattr(api, "api_client", None), "rest_client", None), "pool_manager", None)
    classes = getattr(manager, "pool_classes_by_scheme", None)
    if not isinstance(classes, dict):
        return
    pools = {}
    for scheme, pool in classes.items():
        if getattr(pool, "specops_tracked", False):
            return
        pools[scheme] = type(
            f"Tracked{pool.__name__}", (pool,), {"ConnectionCls": _tracked(pool.ConnectionCls), "specops_tracked": True}
        )
    manager.pool_classes_by_scheme = pools  # an instance attribute: urllib3's own table stays as it is
    manager.clear()  # pools made before this (none, normally) would keep the plain connections


def _status(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _error(exc: Exception, what: str) -> GateError:
    """A GateError that says what failed, without the response's headers or body (they may be long)."""
    status = _status(exc)
    if status is not None:
        return GateError(f"{what}: HTTP {status} {getattr(exc, 'reason', '') or ''}".rstrip())
    return GateError(f"{what}: {type(exc).__name__}: {exc}"[:300])


def gate_for(profile: Any, env: Mapping[str, str], say: Callable[[str], None]) -> Any:
    """The switch gate ``profile.deploy`` asks for here, or None (coordination off).

    ``auto``: Leases in a pod (``KUBERNETES_SERVICE_HOST``), else the directory when one is set, else off."""
    d = profile.deploy
    mode = d.coordination
    if mode == "auto":
        if env.get("KUBERNETES_SERVICE_HOST"):
            try:
                return _lease_gate(profile, env, say)
            except SpecopsError as exc:  # an image without specops[k8s]: serve, and say the fleet is not gated
                say(f"warning: fleet coordination off: {exc}")
                return None
        elif d.coordination_dir:
            mode = "directory"
        else:
            return None
    if mode == "off":
        return None
    if mode == "directory":
        who = f"{identity(env)}:{os.getpid()}"
        return DirectoryGate(Path(os.path.expanduser(d.coordination_dir)), profile.name, d.max_switching, who)
    return _lease_gate(profile, env, say)


def _lease_gate(profile: Any, env: Mapping[str, str], say: Callable[[str], None]) -> LeaseGate:
    d = profile.deploy
    gate = LeaseGate.from_environment(profile.name, d.max_switching, int(d.lease_duration), env)
    say(f"fleet: at most {d.max_switching} replica(s) switch at once (Leases in namespace {gate.namespace})")
    return gate
