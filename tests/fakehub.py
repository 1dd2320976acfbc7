"""A small Hugging Face Hub that speaks the real HTTP protocol, for tests of code that uses ``huggingface_hub``.

The real client (``HfApi``, ``hf_hub_download``) is pointed at it with ``endpoint=`` or ``HF_ENDPOINT``. It
implements the parts of the Hub API that model discovery and metadata need, with the same shapes and
headers as huggingface.co (read from huggingface_hub 2.4.0's client code and the Hub API docs):

- ``GET /api/models`` with ``filter`` (tags, AND), ``search`` (substring of the id), ``author``, ``sort``,
  ``direction``, ``limit``, ``expand`` (only the listed properties come back) and ``Link: <...>; rel="next"``
  pagination;
- ``GET /api/models/{id}`` and ``/api/models/{id}/revision/{rev}`` with ``expand`` (or the default field set;
  ``blobs=true`` adds file sizes, blob ids and LFS info to ``siblings``); ``config`` is the Hub's *summary*
  of config.json (architectures, model_type, tokenizer_config, quantization_config), not the whole file;
- ``POST /api/models/{id}/paths-info/{rev}`` (form ``paths``): size, git blob ``oid`` and ``lfs`` of files;
- ``HEAD``/``GET /{id}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag`` (git blob oid) and
  ``Content-Length`` for regular files; for LFS files a 302 to a separate "CDN" origin with
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``, as the Hub does;
- errors as the Hub sends them: ``X-Error-Code: RepoNotFound`` (401 without a token, 404 with one),
  ``GatedRepo`` (401/403), ``RevisionNotFound``, ``EntryNotFound`` (404), and 429 with ``RateLimit`` headers.

Weight files can be *virtual* (a size and no content): their metadata is served, their content never is;
a GET of one answers 500 and is recorded in ``weight_downloads`` so a test can assert it never happened.

Hostile repos (:func:`seed_hostile`) stand in for a malicious or broken Hub: file names with ``..``, absolute
paths, backslashes or NUL; config.json files with wrong types, deep nesting, 60 MB of content, or a size
that the metadata understates (``FakeFile.reported_size``). The server itself never crashes on them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

#: Keys of config.json that the Hub repeats in the API's ``config`` property.
CONFIG_SUMMARY_KEYS = ("architectures", "model_type", "quantization_config", "auto_map", "task_specific_params")
#: Properties returned when no ``expand`` is given (list and info endpoints).
LIST_DEFAULT = (
    "id",
    "likes",
    "downloads",
    "tags",
    "pipeline_tag",
    "library_name",
    "createdAt",
    "private",
    "trendingScore",
)
INFO_DEFAULT = LIST_DEFAULT + (
    "author",
    "sha",
    "lastModified",
    "gated",
    "disabled",
    "cardData",
    "config",
    "siblings",
    "safetensors",
    "gguf",
    "spaces",
    "usedStorage",
)
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")


_UNPARSED = object()


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeFile:
    path: str
    content: bytes | None  # None: a virtual file (size only; never served)
    size: int
    lfs: bool
    reported_size: int | None = None  # a lying Hub: the size siblings/paths-info state (the content is served whole)
    parsed: Any = field(default=_UNPARSED, repr=False, compare=False)

    @property
    def listed_size(self) -> int:
        return self.size if self.reported_size is None else self.reported_size

    @property
    def sha256(self) -> str:
        if self.content is not None:
            return hashlib.sha256(self.content).hexdigest()
        return hashlib.sha256(f"virtual:{self.path}:{self.size}".encode()).hexdigest()

    @property
    def oid(self) -> str:
        """Git blob id: of the content, or of the LFS pointer file for LFS files."""
        if self.lfs:
            return git_blob_oid(self.pointer)
        return git_blob_oid(self.content or b"")

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n").encode()


@dataclass
class FakeRepo:
    id: str
    files: dict[str, FakeFile] = field(default_factory=dict)
    card_data: dict | None = None
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    gated: bool | str = False
    private: bool = False
    safetensors: dict | None = None
    gguf: dict | None = None
    sha: str = ""
    library_name: str | None = None
    pipeline_tag: str | None = "text-generation"
    created_at: str = "2025-01-01T00:00:00.000Z"
    last_modified: str = "2025-06-01T00:00:00.000Z"
    commits: dict[str, dict[str, FakeFile]] = field(default_factory=dict)  # every commit's files, by sha

    def files_at(self, revision: str | None) -> dict[str, FakeFile] | None:
        """Files of a revision: ``main`` (the head) or any earlier commit sha; None if unknown."""
        if revision in (None, "main", self.sha):
            return self.files
        return self.commits.get(revision)

    @property
    def author(self) -> str:
        return self.id.split("/", 1)[0]

    def config(self) -> dict | None:
        f = self.files.get("config.json")
        if f is None or f.content is None:
            return None
        if f.parsed is _UNPARSED:  # parsed once: hostile configs can be large
            try:
                f.parsed = json.loads(f.content)
            except (ValueError, RecursionError):
                f.parsed = None
        return f.parsed

    def all_tags(self) -> list[str]:
        tags = list(self.tags)
        cfg = self.config() or {}
        cfg = cfg if isinstance(cfg, dict) else {}
        if self.library_name:
            tags.append(self.library_name)
        if any(p.endswith(".safetensors") for p in self.files):
            tags.append("safetensors")
        if any(p.endswith(".gguf") for p in self.files):
            tags.append("gguf")
        if isinstance(cfg, dict) and cfg.get("model_type"):
            tags.append(str(cfg["model_type"]))
        card = self.card_data or {}
        bases = card.get("base_model") or []
        bases = [bases] if isinstance(bases, str) else list(bases)
        relation = card.get("base_model_relation") or ("quantized" if "gguf" in tags else "finetune")
        for b in bases:
            tags += [f"base_model:{b}", f"base_model:{relation}:{b}"]
        if self.pipeline_tag:
            tags.append(self.pipeline_tag)
        seen: list[str] = []
        for t in tags:
            if t not in seen:
                seen.append(t)
        return seen

    def prop(self, name: str, *, blobs: bool = False) -> Any:
        if name == "id":
            return self.id
        if name == "author":
            return self.author
        if name == "sha":
            return self.sha
        if name == "likes":
            return self.likes
        if name in ("downloads", "downloadsAllTime"):
            return self.downloads
        if name == "tags":
            return self.all_tags()
        if name == "pipeline_tag":
            return self.pipeline_tag
        if name == "library_name":
            return self.library_name
        if name == "createdAt":
            return self.created_at
        if name == "lastModified":
            return self.last_modified
        if name == "private":
            return self.private
        if name == "gated":
            return self.gated
        if name == "disabled":
            return False
        if name == "trendingScore":
            return 0
        if name == "cardData":
            return self.card_data
        if name == "config":
            cfg = self.config()
            if not isinstance(cfg, dict):
                return None
            out = {k: cfg[k] for k in CONFIG_SUMMARY_KEYS if k in cfg}
            tok = self.files.get("tokenizer_config.json")
            if tok is not None and tok.content:
                try:
                    t = json.loads(tok.content)
                    out["tokenizer_config"] = {
                        k: t[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template") if k in t
                    }
                except ValueError:
                    pass
            return out
        if name == "siblings":
            out = []
            for f in sorted(self.files.values(), key=lambda f: f.path):
                s: dict = {"rfilename": f.path}
                if blobs:
                    s["size"] = f.listed_size
                    s["blobId"] = f.oid
                    if f.lfs:
                        s["lfs"] = {"size": f.listed_size, "sha256": f.sha256, "pointerSize": len(f.pointer)}
                out.append(s)
            return out
        if name == "safetensors":
            return self.safetensors
        if name == "gguf":
            return self.gguf
        if name == "spaces":
            return []
        if name == "usedStorage":
            return sum(f.size for f in self.files.values())
        if name == "baseModels":
            card = self.card_data or {}
            bases = card.get("base_model") or []
            bases = [bases] if isinstance(bases, str) else list(bases)
            if not bases:
                return None
            return {"relation": card.get("base_model_relation", "finetune"), "models": [{"id": b} for b in bases]}
        return None

    def to_json(self, props, *, blobs: bool = False) -> dict:
        out: dict = {"_id": hashlib.md5(self.id.encode()).hexdigest()[:24], "id": self.id}
        for p in props:
            if p == "id":
                continue
            value = self.prop(p, blobs=blobs)
            if value is not None or p in ("gated",):
                out[p] = value
        if "id" in props:
            out["modelId"] = self.id
        return out


class FakeHub:
    """A local Hub on 127.0.0.1 (and a second origin standing in for the LFS CDN). Use as a context manager."""

    def __init__(self, *, token: str | None = None, page_size: int = 50):
        self.repos: dict[str, FakeRepo] = {}
        self.token = token  # the token that unlocks gated repos ("Bearer <token>")
        self.page_size = page_size
        self.requests: list[tuple[str, str]] = []  # (method, path?query)
        self.weight_downloads: list[str] = []
        self.bytes_served = 0  # body bytes written (a test bounds what a download may take)
        self.rate_limited = False  # every request answers 429
        self.latency = 0.0  # seconds to wait before answering (slow Hub)
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self.url = ""
        self.cdn_url = ""

    # ------------------------------------------------------------------ seeding
    def add_model(
        self,
        repo_id: str,
        files: dict[str, Any] | None = None,
        *,
        card_data: dict | None = None,
        tags: list[str] | None = None,
        downloads: int = 0,
        likes: int = 0,
        gated: bool | str = False,
        private: bool = False,
        safetensors: dict | None = None,
        gguf: dict | None = None,
        library_name: str | None = None,
        sha: str | None = None,
    ) -> FakeRepo:
        """Add a repo. ``files`` maps paths to content (dict → JSON, str/bytes → as is, int → a virtual file of
        that size). Files with weight suffixes, and content over 10 MB, are stored as LFS like on the Hub."""
        repo = FakeRepo(
            repo_id,
            card_data=card_data,
            tags=list(tags or []),
            downloads=downloads,
            likes=likes,
            gated=gated,
            private=private,
            safetensors=safetensors,
            gguf=gguf,
            library_name=library_name,
        )
        for path, value in (files or {}).items():
            repo.files[path] = self._file(path, value)
        if card_data is not None and "README.md" not in repo.files:
            repo.files["README.md"] = self._file("README.md", _card_text(card_data))
        if library_name is None and "config.json" in repo.files:
            repo.library_name = "transformers"
        repo.sha = sha or self._commit_sha(repo)
        repo.commits[repo.sha] = dict(repo.files)
        with self._lock:
            self.repos[repo_id] = repo
        return repo

    def update_file(self, repo_id: str, path: str, value: Any) -> str:
        """A new commit that changes one file; returns the new commit sha."""
        repo = self.repos[repo_id]
        repo.files = {**repo.files, path: self._file(path, value)}
        repo.sha = self._commit_sha(repo, salt=repo.sha)
        repo.commits[repo.sha] = dict(repo.files)
        return repo.sha

    @staticmethod
    def _file(path: str, value: Any) -> FakeFile:
        if isinstance(value, int) and not isinstance(value, bool):
            return FakeFile(path, None, value, True)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, indent=2) + "\n"
        data = value.encode() if isinstance(value, str) else bytes(value)
        return FakeFile(path, data, len(data), path.endswith(LFS_SUFFIXES) or len(data) > 10 * 1024 * 1024)

    @staticmethod
    def _commit_sha(repo: FakeRepo, salt: str = "") -> str:
        h = hashlib.sha1(salt.encode() + repo.id.encode())
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            h.update(f.path.encode() + f.oid.encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fakehub = hub

        for attr in ("url", "cdn_url"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            server.daemon_threads = True
            t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            t.start()
            self._servers.append(server)
            self._threads.append(t)
            setattr(self, attr, f"http://127.0.0.1:{server.server_address[1]}")
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def paths_requested(self, method: str | None = None) -> list[str]:
        return [p for m, p in self.requests if method is None or m == method]


def _card_text(card: dict) -> str:
    lines = ["---"]
    for k, v in card.items():
        lines.append(f"{k}: {json.dumps(v)}")
    lines += ["---", "", "A model card.", ""]
    return "\n".join(lines)


class _Handler(BaseHTTPRequestHandler):
    fakehub: FakeHub
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"

    def log_message(self, fmt, *args):  # keep test output clean
        pass

    # ------------------------------------------------------------------ plumbing
    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict | None = None,
        *,
        head: bool = False,
        content_type: str = "application/json; charset=utf-8",
    ) -> None:
        self.send_response(status)
        hdrs = {"Content-Type": content_type, "Content-Length": str(len(body))}
        hdrs.update(headers or {})
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        if not head and body:
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading (e.g. a size cap)
                self.close_connection = True
                return
            with self.fakehub._lock:
                self.fakehub.bytes_served += len(body)

    def _json(self, status: int, data: Any, headers: dict | None = None, *, head: bool = False) -> None:
        self._send(status, json.dumps(data).encode(), headers, head=head)

    def _error(self, status: int, code: str | None, message: str, *, head: bool = False) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers, head=head)

    def _authorized(self) -> bool:
        token = self.fakehub.token
        return bool(token) and self.headers.get("Authorization") == f"Bearer {token}"

    def _has_token(self) -> bool:
        return bool(self.headers.get("Authorization"))

    def _gate(self, head: bool = False) -> bool:
        """Common checks before any answer: latency, rate limit. Returns False when answered already."""
        hub = self.fakehub
        with hub._lock:
            hub.requests.append((self.command, self.path))
        if hub.latency:
            time.sleep(hub.latency)
        if hub.rate_limited:
            self._send(
                429,
                b"",
                {
                    "RateLimit": '"api";r=0;t=55',
                    "RateLimit-Policy": '"fixed window";"api";q=500;w=300',
                    "Retry-After": "55",
                    "X-Error-Message": "Too Many Requests",
                },
                head=head,
            )
            return False
        return True

    def _repo(self, repo_id: str, head: bool = False) -> FakeRepo | None:
        repo = self.fakehub.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized()):
            status = 404 if self._has_token() else 401
            self._error(status, "RepoNotFound", "Repository not found", head=head)
            return None
        return repo

    # ------------------------------------------------------------------ routes
    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    def do_POST(self):
        if not self._gate():
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        parts = urlsplit(self.path)
        segs = [unquote(s) for s in parts.path.strip("/").split("/")]
        # /api/models/{org}/{name}/paths-info/{rev}
        if len(segs) == 6 and segs[:2] == ["api", "models"] and segs[4] == "paths-info":
            repo = self._repo(f"{segs[2]}/{segs[3]}")
            if repo is None:
                return
            files = repo.files_at(segs[5])
            if files is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {segs[5]}")
            form = parse_qs(body)
            out = []
            for p in form.get("paths", []):
                f = files.get(p)
                if f is None:
                    continue
                item: dict = {"type": "file", "oid": f.oid, "size": f.listed_size, "path": f.path}
                if f.lfs:
                    item["lfs"] = {"oid": f.sha256, "size": f.listed_size, "pointerSize": len(f.pointer)}
                out.append(item)
            return self._json(200, out)
        self._error(404, None, "Not Found")

    def _route(self, head: bool) -> None:
        if not self._gate(head):
            return
        parts = urlsplit(self.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        segs = [unquote(s) for s in parts.path.strip("/").split("/")]
        if segs[:1] == ["lfs"] and len(segs) == 2:
            return self._cdn(segs[1], head)
        if segs[:2] == ["api", "models"]:
            if len(segs) == 2:
                return self._list(parts.path, query, head)
            if len(segs) == 4:
                return self._info(f"{segs[2]}/{segs[3]}", None, query, head)
            if len(segs) == 6 and segs[4] == "revision":
                return self._info(f"{segs[2]}/{segs[3]}", segs[5], query, head)
            return self._error(404, None, "Not Found", head=head)
        # /{org}/{name}/resolve/{rev}/{path...}
        if len(segs) >= 5 and segs[2] == "resolve":
            return self._resolve(f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]), head)
        self._error(404, None, "Not Found", head=head)

    @staticmethod
    def _multi(query: dict, name: str) -> list[str]:
        return query.get(name, []) + query.get(name + "[]", [])

    def _list(self, path: str, query: dict, head: bool) -> None:
        hub = self.fakehub
        filters = self._multi(query, "filter")
        expand = self._multi(query, "expand")
        search = (query.get("search") or [""])[0].lower()
        author = (query.get("author") or [""])[0].lower()
        with hub._lock:
            repos = [r for r in hub.repos.values() if not r.private]
        out = []
        for r in repos:
            tags = r.all_tags()
            if any(f not in tags for f in filters):
                continue
            if search and search not in r.id.lower():
                continue
            if author and r.author.lower() != author:
                continue
            out.append(r)
        sort = (query.get("sort") or ["trendingScore"])[0]
        num = lambda v: v if isinstance(v, (int, float)) else 0  # noqa: E731 - hostile repos may hold junk
        key = {
            "downloads": lambda r: num(r.downloads),
            "likes": lambda r: num(r.likes),
            "lastModified": lambda r: r.last_modified,
            "createdAt": lambda r: r.created_at,
        }.get(sort, lambda r: 0)
        out.sort(key=lambda r: r.id)
        out.sort(key=key, reverse=(query.get("direction") or ["-1"])[0] == "-1")
        limit = int((query.get("limit") or [str(hub.page_size)])[0])
        page = min(limit, hub.page_size)
        offset = int((query.get("cursor") or ["0"])[0])
        chunk = out[offset : offset + page]
        headers = {}
        if offset + page < len(out):
            q = {k: v for k, v in query.items() if k != "cursor"}
            q["cursor"] = [str(offset + page)]
            nxt = f"{hub.url}{path}?{urlencode(q, doseq=True)}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        props = expand or list(LIST_DEFAULT)
        self._json(200, [r.to_json(props) for r in chunk], headers, head=head)

    def _info(self, repo_id: str, revision: str | None, query: dict, head: bool) -> None:
        repo = self._repo(repo_id, head)
        if repo is None:
            return
        files = repo.files_at(revision)
        if files is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        if files is not repo.files:  # an earlier commit: answer with its files and sha
            repo = FakeRepo(**{**repo.__dict__, "files": files, "sha": revision})
        expand = self._multi(query, "expand")
        blobs = (query.get("blobs") or ["false"])[0].lower() == "true"
        if expand and blobs:
            return self._error(400, None, "expand cannot be combined with blobs", head=head)
        props = expand or list(INFO_DEFAULT)
        self._json(200, repo.to_json(props, blobs=blobs), head=head)

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        hub = self.fakehub
        repo = self._repo(repo_id, head)
        if repo is None:
            return
        if repo.gated and not self._authorized():
            status = 403 if self._has_token() else 401
            msg = (
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated "
                f"to access it. Please log in."
            )
            return self._error(status, "GatedRepo", msg, head=head)
        files = repo.files_at(revision)
        if files is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        f = files.get(path)
        if f is None:
            return self._error(404, "EntryNotFound", f'{path} does not exist on "{revision}"', head=head)
        commit = repo.sha if revision in ("main", repo.sha) else revision
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            location = f"{hub.cdn_url}/lfs/{f.sha256}?repo={quote(repo_id, safe='')}&file={quote(path, safe='')}"
            return self._send(
                302,
                b"",
                {
                    **common,
                    "Location": location,
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(f.size),
                    "ETag": f'"{f.oid}"',
                },
                head=head,
            )
        self._send(
            200, f.content or b"", {**common, "ETag": f'"{f.oid}"'}, head=head, content_type="text/plain; charset=utf-8"
        )

    def _cdn(self, sha256: str, head: bool) -> None:
        hub = self.fakehub
        for repo in hub.repos.values():
            for f in [f for files in repo.commits.values() for f in files.values()]:
                if f.sha256 == sha256:
                    if f.content is None:
                        with hub._lock:
                            hub.weight_downloads.append(f"{repo.id}/{f.path}")
                        return self._send(
                            500, b"virtual file: weights are never served", head=head, content_type="text/plain"
                        )
                    return self._send(
                        200, f.content, {"ETag": f'"{sha256}"'}, head=head, content_type="application/octet-stream"
                    )
        self._send(404, b"", head=head)


# ---------------------------------------------------------------------------------------------------
# Seed data: config.json files shaped like the real ones (values as published on the Hub).

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA32_1B = {
    **LLAMA31_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
EAGLE3_LLAMA31_8B = {  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
}
EAGLE_LLAMA31_8B = {  # EAGLE-1: a plain one-layer Llama config, no marker
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 1,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "float16",
    "vocab_size": 128256,
}


def speculators_eagle3(
    verifier: str,
    *,
    hidden: int = 4096,
    vocab: int = 128256,
    context: int = 131072,
    verifier_arch: str = "LlamaForCausalLM",
    aux: list[int] | None = None,
) -> dict:
    """A config.json in the speculators format (RedHatAI/*-speculator.eagle3)."""
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": 32000,
        "has_no_defaults_at_init": False,
        "norm_before_residual": True,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}
            ],
            "verifier": {"architectures": [verifier_arch], "name_or_path": verifier},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0.dev13",
        "target_hidden_size": None,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": {
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "intermediate_size": 14336,
            "max_position_embeddings": context,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 1,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "vocab_size": vocab,
        },
        "transformers_version": "4.55.2",
    }
    if aux is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux
    return cfg


QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
}
QWEN25_05B = {
    **QWEN25,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
QWEN25_7B = {
    **QWEN25,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
QWEN3_8B = {
    **QWEN3,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
QWEN3_06B = {
    **QWEN3,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
QWEN3_4B = {
    **QWEN3,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
VICUNA_7B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}
MEDUSA_VICUNA_7B = {"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "vocab_size": 129280,
    "n_routed_experts": 256,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "vocab_size": 32768,
}

LLAMA3_TOKENIZER = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"<|begin_of_text|>": 128000}}})
QWEN_TOKENIZER = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"<|endoftext|>": 151643}}})


def seed_llama31(hub: FakeHub) -> None:
    """Llama-3.1-8B-Instruct with its published drafts (EAGLE-1, EAGLE-3, speculators, Llama-3.2-1B)."""
    hub.add_model(
        "meta-llama/Llama-3.1-8B-Instruct",
        {
            "config.json": LLAMA31_8B,
            "tokenizer.json": LLAMA3_TOKENIZER,
            "model-00001-of-00004.safetensors": 4_976_698_672,
            "model-00002-of-00004.safetensors": 4_999_802_720,
            "model-00003-of-00004.safetensors": 4_915_916_176,
            "model-00004-of-00004.safetensors": 1_168_138_808,
        },
        card_data={"base_model": "meta-llama/Llama-3.1-8B", "license": "llama3.1"},
        safetensors={"parameters": {"BF16": 8030261248}, "total": 8030261248},
        downloads=5_000_000,
        likes=4000,
    )
    hub.add_model(
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        {"config.json": EAGLE3_LLAMA31_8B, "pytorch_model.bin": 850_000_000},
        card_data={"base_model": "meta-llama/Llama-3.1-8B-Instruct", "license": "apache-2.0"},
        downloads=90_000,
        likes=40,
    )
    hub.add_model(
        "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
        {"config.json": EAGLE_LLAMA31_8B, "pytorch_model.bin": 500_000_000},
        card_data={"license": "apache-2.0"},
        downloads=20_000,
        likes=10,
    )
    hub.add_model(
        "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
        {"config.json": speculators_eagle3("meta-llama/Llama-3.1-8B-Instruct"), "model.safetensors": 1_900_000_000},
        card_data={
            "base_model": "meta-llama/Llama-3.1-8B-Instruct",
            "library_name": "speculators",
            "tags": ["speculators", "eagle3"],
        },
        downloads=30_000,
        likes=12,
    )
    hub.add_model(
        "meta-llama/Llama-3.2-1B-Instruct",
        {"config.json": LLAMA32_1B, "tokenizer.json": LLAMA3_TOKENIZER, "model.safetensors": 2_471_645_608},
        card_data={"base_model": "meta-llama/Llama-3.2-1B"},
        safetensors={"parameters": {"BF16": 1235814400}, "total": 1235814400},
        downloads=3_000_000,
        likes=900,
    )


# ---------------------------------------------------------------------------------------------------
# Hostile repos: what a malicious or broken Hub could answer. Each is tagged with a base_model so that
# discovery finds it for its target, and named so that its method is detected from the name.

#: File names that must never be picked, pinned, rendered or joined under the HF cache.
UNSAFE_GGUF_NAMES = (
    "../../../../tmp/x-Q4_K_M.gguf",
    "/tmp/x-Q4_K_M.gguf",
    "sub\\..\\x-Q4_K_M.gguf",
    "x\x00-Q4_K_M.gguf",
    "sub//x-Q4_K_M.gguf",
    "./x-Q4_K_M.gguf",
)
BIG_CONFIG_BYTES = 60 * 1024 * 1024


def big_config(size: int = BIG_CONFIG_BYTES) -> bytes:
    """A config.json of ``size`` bytes that would look like a usable EAGLE-3 head if it were read."""
    head = json.dumps({**EAGLE3_LLAMA31_8B, "padding": ""})[:-2]
    return (head + "x" * (size - len(head) - 2) + '"}').encode()


def seed_hostile(hub: FakeHub, target: str = "meta-llama/Llama-3.1-8B-Instruct") -> dict[str, str]:
    """Hostile EAGLE-3 heads for ``target`` (vLLM), each tagged with it; returns {repo: what is wrong}."""
    head = {**EAGLE3_LLAMA31_8B}
    repos = {
        "evil/arch-int-eagle3": ({**head, "architectures": 5}, "architectures must be a list of strings"),
        "evil/arch-list-eagle3": (
            {**head, "architectures": [1, {"x": 2}, None]},
            "architectures must be a list of strings",
        ),
        "evil/nested-junk-eagle3": (
            {
                **speculators_eagle3(target),
                "speculators_config": {"algorithm": "eagle3", "verifier": 5},
                "transformer_layer_config": [1, 2],
                "eagle_config": "x",
                "vocab_size": {"a": [1]},
            },
            "must be",
        ),
        "evil/deep-eagle3": (
            '{"architectures": ["LlamaForCausalLMEagle3"], "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "nested too deeply",
        ),
        "evil/not-object-eagle3": ("[1, 2, 3]", "not a JSON object"),
        "evil/nan-eagle3": (
            '{"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": NaN, "hidden_size": 4096}',
            "vocab_size must be a whole number",
        ),
        "evil/huge-config-eagle3": (big_config(), "bytes on the Hub"),
    }
    for repo, (config, _) in repos.items():
        hub.add_model(
            repo,
            {"config.json": config, "model.safetensors": 400_000_000},
            card_data={"base_model": target},
            downloads=10_000_000,
        )
    # a Hub that understates the size: paths-info says 900 bytes, the download is 2 MiB
    liar = hub.add_model(
        "evil/liar-eagle3",
        {"config.json": big_config(2 * 1024 * 1024), "model.safetensors": 400_000_000},
        card_data={"base_model": target},
        downloads=10_000_000,
    )
    liar.files["config.json"].reported_size = 900
    repos["evil/liar-eagle3"] = (None, "specops reads at most")
    return {repo: why for repo, (_, why) in repos.items()}


def seed_unsafe_gguf(hub: FakeHub, name: str, repo: str = "evil/Qwen2.5-0.5B-Instruct-GGUF") -> str:
    """A GGUF repo whose only Q4_K_M file has the unsafe ``name``."""
    hub.add_model(
        repo,
        {name: 491_400_064, "README.md": "gguf"},
        card_data={"base_model": "Qwen/Qwen2.5-0.5B-Instruct"},
        gguf={"total": 494_032_768, "architecture": "qwen2", "context_length": 32768},
    )
    return repo


# ---------------------------------------------------------------------------------------------------
# pytest fixture: a started FakeHub with the environment of a clean machine pointed at it.

try:
    import pytest
except ImportError:  # pragma: no cover - fakehub is usable without pytest
    pytest = None

#: The token the fake Hub accepts for gated and private repos (never a real token).
TEST_TOKEN = "hf_fakehub_test_token_0123456789"

if pytest is not None:

    @pytest.fixture
    def fake_hub(monkeypatch, tmp_path):
        """A FakeHub on 127.0.0.1; HF_ENDPOINT points at it, HF_HOME is empty, no token, online."""
        hub = FakeHub(token=TEST_TOKEN).start()
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        for var in (
            "HF_HUB_CACHE",
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "SPECOPS_CATALOG",
        ):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("SPECOPS_HUB_TIMEOUT", "3")
        # huggingface_hub reads HF_HUB_OFFLINE once, when its constants module is first loaded (lazily, on
        # first use): a test that ran with HF_HUB_OFFLINE=1 before that would leave it offline for good
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        try:
            yield hub
        finally:
            hub.stop()
