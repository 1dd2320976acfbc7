"""A LeaderWorkerSet group of ``specops k8s render``, run as processes on this machine (loopback only): each
pod's container command, args and environment are taken from the rendered manifests and started the way
the kubelet would. The multi-node rows of the support matrix and the multi-node engine tests run groups so.

What a pod's isolation gives it and one machine does not is stood in for, and nothing else changes:

- each pod has its own IP: the leader 127.0.0.1, worker ``i`` 127.0.0.(i+1) (all loopback); a listen
  address of ``0.0.0.0`` (every interface of the pod's own network namespace) becomes the pod's address,
  in the args and in the ConfigMap's profile (``server.host``): nothing listens beyond loopback;
- the hostnames LeaderWorkerSet gives (``LWS_LEADER_ADDRESS`` = ``<set>-<group>.<set>.<namespace>``,
  worker ``i`` ``<set>-<group>-<i>.<set>.<namespace>``) resolve through an ``/etc/hosts`` bound in a private
  mount namespace of each pod process (``unshare -rm``, then :mod:`specops.devenv.podns`);
- the volumes are folders of the group's work folder (the ConfigMap's files in its volume's folder); a
  path under a mount path, in an env value or an arg, is the same path in that folder;
- the image's PATH is given (specops' and the engine's ``bin`` folders, as the images put them on PATH).

A Secret-backed variable (``valueFrom.secretKeyRef``) is refused: a group run here has no Secrets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specops.errors import SpecopsError
from specops.run.process import group_members

NAMESPACE = "default"


def unshare_problem() -> str | None:
    """None when a private mount namespace (the pods' ``/etc/hosts``) can be made here, else why not."""
    exe = shutil.which("unshare")
    if not exe:
        return "no `unshare` program (util-linux) to give the pods their own /etc/hosts"
    done = subprocess.run([exe, "-rm", "true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"`unshare -rm` fails here ({done.stderr.strip()[-200:]}): no user namespaces for the pods' /etc/hosts"
    return None


def render_objects(profile: str | Path) -> dict[str, dict]:
    """The objects ``specops k8s render PROFILE`` writes, by kind (no Secrets: the variables the pods would
    get from them may be unset here, as in CI)."""
    from specops.k8s.layout import pod_variables
    from specops.k8s.manifests import render
    from specops.k8s.source import load_for_render
    from specops.plugins import get_registry

    loaded = load_for_render(str(profile), get_registry(), pod_variables)
    return {obj["kind"]: obj for _, obj in render(loaded).objects}


@dataclass
class Pod:
    """One pod of the group: its container as rendered, and the process that runs it now."""

    role: str  # leader | worker
    index: int  # LWS_WORKER_INDEX
    container: dict
    volumes: list[dict]
    root: Path
    ip: str
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    mounts: dict[str, Path] = field(default_factory=dict)
    starts: int = 0

    @property
    def label(self) -> str:
        return f"{self.role}-{self.index}"

    def log(self, limit: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:] if self.log_path else ""
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalGroup:
    """The pods of one group of a rendered LeaderWorkerSet as processes (see the module docstring).

    ``kinds``: :func:`render_objects`; ``work``: a folder for the pods' volumes and logs; ``path_dirs``:
    the image's PATH; ``extra_env``: variables the image would set (e.g. the CPU engine's settings).
    """

    def __init__(self, kinds: dict[str, dict], work: Path, *, path_dirs: list[Path], extra_env: dict | None = None):
        if "LeaderWorkerSet" not in kinds:
            raise SpecopsError("the profile renders no LeaderWorkerSet (deploy.multi_node.nodes is 1)")
        self.kinds = kinds
        self.lws = kinds["LeaderWorkerSet"]
        self.name = self.lws["metadata"]["name"]
        template = self.lws["spec"]["leaderWorkerTemplate"]
        self.size = int(template["size"])
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.path_dirs = [str(p) for p in path_dirs]
        self.extra_env = dict(extra_env or {})
        self.leader_address = f"{self.name}-0.{self.name}.{NAMESPACE}"
        self.hosts = self.work / "hosts"
        lines = ["127.0.0.1 localhost", f"127.0.0.1 {self.leader_address}"]
        lines += [f"127.0.0.{i + 1} {self.worker_address(i)}" for i in range(1, self.size)]
        self.hosts.write_text("\n".join(lines) + "\n")
        lead, work_spec = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
        self.pods = [Pod("leader", 0, lead["containers"][0], lead["volumes"], self.work / "pod-0", "127.0.0.1")]
        self.pods += [
            Pod(
                "worker",
                i,
                work_spec["containers"][0],
                work_spec["volumes"],
                self.work / f"pod-{i}",
                f"127.0.0.{i + 1}",
            )
            for i in range(1, self.size)
        ]
        for pod in self.pods:
            self._mount(pod)

    def worker_address(self, index: int) -> str:
        return f"{self.name}-0-{index}.{self.name}.{NAMESPACE}"

    # ------------------------------------------------------------------ what the kubelet does
    def _mount(self, pod: Pod) -> None:
        """Each volumeMount of the container becomes a folder; a ConfigMap's holds its data files."""
        volumes = {v["name"]: v for v in pod.volumes}
        for m in pod.container.get("volumeMounts") or []:
            folder = pod.root / "volumes" / m["name"]
            folder.mkdir(parents=True, exist_ok=True)
            source = volumes[m["name"]]
            if "configMap" in source:
                cm = self.kinds["ConfigMap"]
                if source["configMap"]["name"] != cm["metadata"]["name"]:
                    raise SpecopsError(f"{pod.label} mounts ConfigMap {source['configMap']['name']}, not rendered")
                for key, text in cm["data"].items():
                    (folder / key).write_text(self._own_address(text, pod) if key.endswith(".yaml") else text)
            pod.mounts[m["mountPath"]] = folder

    @staticmethod
    def _own_address(profile_text: str, pod: Pod) -> str:
        """The ConfigMap's profile listens on 0.0.0.0 (the pod's interfaces): here, on the pod's own address."""
        doc = yaml.safe_load(profile_text)
        server = doc.get("server") or {}
        if server.get("host") == "0.0.0.0":
            server["host"] = pod.ip
        return yaml.safe_dump(doc, sort_keys=False)

    def _path(self, pod: Pod, value: str) -> str:
        for mount, folder in sorted(pod.mounts.items(), key=lambda kv: -len(kv[0])):
            base = mount.rstrip("/")
            if value == base or value.startswith(base + "/"):
                return str(folder) + value[len(base) :]
        return value

    def env(self, pod: Pod) -> dict[str, str]:
        """The container's environment: the image's PATH, LeaderWorkerSet's variables, the rendered env."""
        out = {
            "PATH": os.pathsep.join([*self.path_dirs, "/usr/local/bin", "/usr/bin", "/bin"]),
            "LANG": "C.UTF-8",
            "LWS_LEADER_ADDRESS": self.leader_address,
            "LWS_GROUP_SIZE": str(self.size),
            "LWS_WORKER_INDEX": str(pod.index),
            "PYTHONUNBUFFERED": "1",
        }
        downward = {"metadata.name": f"{self.name}-0" + (f"-{pod.index}" if pod.index else ""),
                    "metadata.namespace": NAMESPACE}  # fmt: skip
        for e in pod.container.get("env") or []:
            if "value" in e:
                out[e["name"]] = self._path(pod, e["value"])
            elif "fieldRef" in (e.get("valueFrom") or {}):
                out[e["name"]] = downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise SpecopsError(f"{pod.label}: {e['name']} comes from a Secret, which a group run here lacks")
        out.update(self.extra_env)
        return out

    def argv(self, pod: Pod) -> list[str]:
        """The container's command and args, ``$(VAR)`` expanded from its env as the kubelet does."""
        env = self.env(pod)
        out = []
        for word in [*pod.container["command"], *pod.container.get("args", [])]:
            for name, value in env.items():
                word = word.replace(f"$({name})", value)
            out.append(pod.ip if word == "0.0.0.0" else self._path(pod, word))
        return out

    def start(self, pod: Pod) -> Pod:
        """Start (or restart, as the kubelet restarts a container) one pod's process."""
        pod.root.mkdir(parents=True, exist_ok=True)
        pod.starts += 1
        pod.log_path = pod.root / f"container-{pod.starts}.log"
        wrapped = ["unshare", "-rm", sys.executable, "-m", "specops.devenv.podns", str(self.hosts), "--"]
        with open(pod.log_path, "w") as log:
            pod.proc = subprocess.Popen(
                [*wrapped, *self.argv(pod)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(pod),
                cwd=pod.root,
                start_new_session=True,
            )
        return pod

    def start_all(self) -> None:
        """Workers first, then the leader (``startupPolicy: LeaderCreated`` starts them together)."""
        for pod in self.pods[1:]:
            self.start(pod)
        self.start(self.leader)

    @property
    def leader(self) -> Pod:
        return self.pods[0]

    @property
    def workers(self) -> list[Pod]:
        return self.pods[1:]

    def kill(self, pod: Pod, sig: int = signal.SIGKILL) -> None:
        """Signal the pod's processes (its container: the program and the children in its process group)."""
        if pod.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pod.proc.pid, sig)
        for pid in group_members(pod.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def stop(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every pod, wait, then SIGKILL what is left (engines the leader started included)."""
        codes: dict[str, int | None] = {}
        engine_groups = {self.state().get("engine_pid")} - {None}
        for pod in self.pods:
            if pod.alive():
                self.kill(pod, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for pod in self.pods:
            if pod.proc is None:
                continue
            try:
                codes[pod.label] = pod.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[pod.label] = None
            self.kill(pod, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.proc.wait(timeout=10)
        for pgid in engine_groups:
            for pid in group_members(int(pgid)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        return codes

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(timeout=30)

    # ------------------------------------------------------------------ the leader's specops
    def state_dir(self) -> Path:
        """Where the leader's ``specops up`` keeps its instances (``SPECOPS_STATE`` of the leader pod)."""
        return Path(self.env(self.leader)["SPECOPS_STATE"])

    def state(self) -> dict:
        """The leader's ``state.json`` ({} while there is none)."""
        for path in self.state_dir().glob("*/state.json"):
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(path.read_text())
                return doc if isinstance(doc, dict) else {}
        return {}

    def events(self, kind: str | None = None) -> list[dict]:
        out: list[dict] = []
        for path in self.state_dir().glob("*/events.jsonl"):
            with contextlib.suppress(OSError):
                for line in path.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        ev = json.loads(line)
                        if kind is None or ev.get("event") == kind:
                            out.append(ev)
        return out

    def engine_log(self) -> str:
        """The leader's engine output, as ``specops up`` keeps it in its state folder."""
        texts = []
        for path in sorted(self.state_dir().glob("*/*.log")):
            with contextlib.suppress(OSError):
                texts.append(path.read_text(errors="replace")[-20000:])
        return "\n".join(texts)

    def url(self) -> str:
        """The leader's proxy (the Service's target port), on the leader's address."""
        port = next(p["containerPort"] for p in self.leader.container["ports"] if p["name"] == "http")
        return f"http://{self.leader.ip}:{port}"

    def proxy_status(self, timeout: float = 5.0) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url()}/specops/status", timeout=timeout) as resp:  # noqa: S310
                doc = json.loads(resp.read(1 << 20))
        except (OSError, ValueError, urllib.error.URLError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def wait_for(self, predicate, timeout: float, what: str, *, interval: float = 0.5) -> dict:
        """Poll the leader's state until ``predicate(state)``; SpecopsError when the leader exits or time is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if predicate(st):
                return st
            if not self.leader.alive():
                raise SpecopsError(f"the leader exited ({self.leader.proc.returncode}) while waiting for {what}")
            time.sleep(interval)
        raise SpecopsError(f"gave up after {timeout:.0f}s waiting for {what}; state={self.state().get('state')}")

    def logs(self, limit: int = 3000) -> str:
        return "\n".join(f"--- {p.label} (start {p.starts})\n{p.log(limit)}" for p in self.pods)
