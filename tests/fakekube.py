"""A small Kubernetes API server for Leases that speaks the real REST protocol, for the real ``kubernetes`` client.

The client is pointed at it through a kubeconfig (:meth:`FakeKube.kubeconfig`: an ``http://127.0.0.1`` server
and a bearer token), unmodified. It implements what coordination through Leases needs, with the shapes and
status codes of kube-apiserver (pkg/registry/coordination/lease, apimachinery's Status errors):

- ``GET/POST /apis/coordination.k8s.io/v1/namespaces/{ns}/leases`` (LeaseList; create: 201, or 409
  ``AlreadyExists``);
- ``GET/PUT/DELETE .../leases/{name}``: 404 ``NotFound``; a PUT must carry the ``resourceVersion`` it read
  (Leases allow no unconditional update: 422 ``Invalid`` without one) and gets 409 ``Conflict`` when it is
  stale; a PUT never creates (404);
- every write bumps a cluster-wide ``resourceVersion``; ``acquireTime``/``renewTime`` must be RFC 3339
  MicroTimes (422 otherwise) and come back as ``2006-01-02T15:04:05.000000Z``; unknown fields are dropped;
- 401 ``Unauthorized`` without the token; ``forbidden = True`` answers 403 ``Forbidden`` (missing RBAC);
  ``forbid_create = True`` only refuses creates (a Role with get/update on named Leases and no create).

Misbehaving servers, for the client's defences: ``answer`` (a JSON value) is what a GET of a Lease gets
with 200 instead of the object (``{}``, ``{"metadata": None}``); ``trickle`` (seconds) sends every response
a byte at a time with that pause, which never trips a per-read timeout. A trickled response the client
gave up on counts in :attr:`FakeKube.trickle_cut`; a trickle stops when the server stops.

No watch. :attr:`FakeKube.writes` records every successful write (time, verb, lease, holder), so a test can
rebuild who held which slot when.
"""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

PATH = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([a-z0-9-]{1,63})/leases(?:/([^/]+))?$")
NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
SPEC_FIELDS = {
    "holderIdentity": str,
    "leaseDurationSeconds": int,
    "acquireTime": "time",
    "renewTime": "time",
    "leaseTransitions": int,
    "strategy": str,
    "preferredHolder": str,
}
MICRO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)$")


def parse_micro(text: str) -> datetime.datetime:
    """An RFC 3339 time as Go's time.Parse(RFC3339Micro) accepts it (fraction optional, Z or an offset)."""
    if not isinstance(text, str) or not MICRO.match(text):
        raise ValueError(text)
    head, _, frac_zone = text.partition(".")
    if frac_zone:
        digits = re.match(r"\d+", frac_zone).group(0)
        text = head + "." + digits[:6].ljust(6, "0") + frac_zone[len(digits) :]
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def micro(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FakeKube:
    """The server; :meth:`start` it (or use it as a context manager) and read :attr:`url`."""

    def __init__(self, token: str = "fake-kube-token-7f3a"):
        self.token = token
        self.objects: dict[tuple[str, str], dict] = {}
        self.writes: list[dict] = []
        self.requests: list[tuple[str, str, int]] = []  # (verb, path, status)
        self.forbidden = False
        self.forbid_create = False
        self.answer: Any = None  # not None: what a GET of a Lease answers with 200, instead of the object
        self.trickle: float | None = None  # seconds between the bytes of every response
        self.trickle_cut = 0  # trickled responses the client hung up on
        self.version = 100
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeKube:
        fake = self

        class Handler(_Handler):
            kube = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig (0600) whose current context is this server with its token."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }
        path.touch(mode=0o600)
        path.write_text(yaml.safe_dump(doc))
        return path

    # ------------------------------------------------------------------ what happened
    def holder(self, name: str, namespace: str = "default") -> str | None:
        obj = self.objects.get((namespace, name))
        return (obj or {}).get("spec", {}).get("holderIdentity")

    def max_concurrent_holders(self, prefix: str = "") -> int:
        """The most leases (named ``prefix``...) that had a holder at the same time, from :attr:`writes`."""
        held: dict[str, str | None] = {}
        most = 0
        for w in self.writes:
            if w["name"].startswith(prefix):
                held[w["name"]] = w["holder"]
                most = max(most, sum(1 for h in held.values() if h))
        return most

    def _write(self, verb: str, obj: dict) -> None:
        self.writes.append(
            {
                "t": time.time(),
                "verb": verb,
                "name": obj["metadata"]["name"],
                "holder": obj.get("spec", {}).get("holderIdentity"),
                "resourceVersion": obj["metadata"]["resourceVersion"],
            }
        )


def _status(code: int, reason: str, message: str, name: str | None = None) -> dict:
    doc: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if name is not None:
        doc["details"] = {"name": name, "group": "coordination.k8s.io", "kind": "leases"}
    return doc


class _Handler(BaseHTTPRequestHandler):
    kube: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # keep test output clean
        pass

    def _send(self, code: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.kube.requests.append((self.command, urlsplit(self.path).path, code))  # before the client can see it
        if self.kube.trickle is not None:
            return self._trickle(code, body)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, code: int, body: bytes) -> None:
        head = (
            f"HTTP/1.1 {code} {self.responses.get(code, ('',))[0]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        for i in range(len(head) + len(body)):
            if self.kube._server is None:  # stopped: no thread outlives the test
                break
            try:
                self.wfile.write((head + body)[i : i + 1])
                self.wfile.flush()
            except OSError:
                self.kube.trickle_cut += 1
                break
            time.sleep(self.kube.trickle)
        self.close_connection = True

    def _body(self) -> dict | None:
        n = int(self.headers.get("Content-Length") or 0)
        try:
            doc = json.loads(self.rfile.read(n) or b"null")
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def _route(self) -> tuple[str, str | None] | None:
        if self.headers.get("Authorization") != f"Bearer {self.kube.token}":
            self._body()
            self._send(401, _status(401, "Unauthorized", "Unauthorized"))
            return None
        m = PATH.match(urlsplit(self.path).path)
        if m is None:
            self._body()
            self._send(404, _status(404, "NotFound", "the server could not find the requested resource"))
            return None
        if self.kube.forbidden or (self.kube.forbid_create and self.command == "POST"):
            self._body()
            message = (
                f'leases.coordination.k8s.io is forbidden: User "system:serviceaccount:{m.group(1)}:default" '
                f'cannot {self.command.lower()} resource "leases" in API group "coordination.k8s.io" in the '
                f'namespace "{m.group(1)}"'
            )
            self._send(403, _status(403, "Forbidden", message, m.group(2)))
            return None
        return m.group(1), m.group(2)

    def _not_found(self, name: str) -> None:
        self._send(404, _status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found', name))

    def do_GET(self):
        route = self._route()
        if route is None:
            return
        ns, name = route
        with self.kube.lock:
            if name is None:
                items = [o for (n, _), o in sorted(self.kube.objects.items()) if n == ns]
                doc = {
                    "kind": "LeaseList",
                    "apiVersion": "coordination.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.kube.version)},
                    "items": items,
                }
                return self._send(200, doc)
            obj = self.kube.objects.get((ns, name))
        if self.kube.answer is not None:
            return self._send(200, self.kube.answer)
        if obj is None:
            return self._not_found(name)
        self._send(200, obj)

    def do_DELETE(self):
        route = self._route()
        if route is None:
            return
        ns, name = route
        self._body()
        with self.kube.lock:
            obj = self.kube.objects.pop((ns, name or ""), None)
        if obj is None:
            return self._not_found(name or "")
        self._send(200, {**_status(200, "", ""), "status": "Success"})

    def do_POST(self):
        route = self._route()
        if route is None:
            return
        ns, name = route
        doc = self._body()
        if name is not None:
            return self._send(405, _status(405, "MethodNotAllowed", "the server does not allow this method"))
        obj, problem = self._validate(doc, ns, None)
        if problem:
            return self._send(*problem)
        key = (ns, obj["metadata"]["name"])
        with self.kube.lock:
            if key in self.kube.objects:
                msg = f'leases.coordination.k8s.io "{key[1]}" already exists'
                return self._send(409, _status(409, "AlreadyExists", msg, key[1]))
            self.kube.version += 1
            obj["metadata"].update(
                resourceVersion=str(self.kube.version),
                uid=str(uuid.uuid4()),
                creationTimestamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            self.kube.objects[key] = obj
            self.kube._write("create", obj)
        self._send(201, obj)

    def do_PUT(self):
        route = self._route()
        if route is None:
            return
        ns, name = route
        doc = self._body()
        if name is None:
            return self._send(405, _status(405, "MethodNotAllowed", "the server does not allow this method"))
        obj, problem = self._validate(doc, ns, name)
        if problem:
            return self._send(*problem)
        sent = obj["metadata"].get("resourceVersion")
        with self.kube.lock:
            current = self.kube.objects.get((ns, name))
            if current is None:
                return self._not_found(name)
            if not sent:
                msg = f'Lease.coordination.k8s.io "{name}" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update'
                return self._send(422, _status(422, "Invalid", msg, name))
            if sent != current["metadata"]["resourceVersion"]:
                msg = (
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again"
                )
                return self._send(409, _status(409, "Conflict", msg, name))
            self.kube.version += 1
            for key in ("uid", "creationTimestamp"):
                obj["metadata"][key] = current["metadata"][key]
            obj["metadata"]["resourceVersion"] = str(self.kube.version)
            self.kube.objects[(ns, name)] = obj
            self.kube._write("update", obj)
        self._send(200, obj)

    def _validate(self, doc: dict | None, ns: str, name: str | None) -> tuple[dict, tuple | None]:
        """The object as stored (known fields only, times normalized), or (..., (code, Status))."""
        if doc is None or doc.get("kind", "Lease") != "Lease":
            return {}, (400, _status(400, "BadRequest", "the body is not a Lease object"))
        meta = doc.get("metadata") or {}
        got = meta.get("name")
        if not isinstance(got, str) or not NAME.match(got):
            return {}, (422, _status(422, "Invalid", f"metadata.name: Invalid value: {got!r}", str(got)))
        if name is not None and got != name:
            return {}, (400, _status(400, "BadRequest", "the name of the object does not match the name on the URL"))
        if meta.get("namespace", ns) != ns:
            return {}, (400, _status(400, "BadRequest", "the namespace of the object does not match the URL"))
        spec = {}
        for key, value in (doc.get("spec") or {}).items():
            kind = SPEC_FIELDS.get(key)
            if kind is None or value is None:
                continue
            if kind == "time":
                try:
                    value = micro(parse_micro(value))
                except ValueError:
                    msg = f"spec.{key}: Invalid value: {value!r}: not an RFC 3339 MicroTime"
                    return {}, (422, _status(422, "Invalid", msg, got))
            elif not isinstance(value, kind) or isinstance(value, bool):
                return {}, (422, _status(422, "Invalid", f"spec.{key}: Invalid value: {value!r}", got))
            spec[key] = value
        if spec.get("leaseDurationSeconds", 1) <= 0:
            return {}, (422, _status(422, "Invalid", "spec.leaseDurationSeconds: must be greater than 0", got))
        kept = {k: meta[k] for k in ("name", "labels", "annotations", "resourceVersion") if k in meta}
        obj = {
            "kind": "Lease",
            "apiVersion": "coordination.k8s.io/v1",
            "metadata": {**kept, "namespace": ns},
            "spec": spec,
        }
        return obj, None
