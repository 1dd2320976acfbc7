"""The Hugging Face Hub, as the resolver sees it: metadata and small files, never weights.

``huggingface_hub`` is imported here lazily (only when something is resolved), so ``specops validate`` and
``render`` stay fast. Every call has a short deadline and every failure becomes a :class:`HubError` with one
clear line; after the Hub is found unreachable or rate-limited no further call is made (the resolver falls
back to the lock, the local cache and the catalog). ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read when a
:class:`Hub` is made, not when huggingface_hub was imported, and the endpoint is passed explicitly.
Tokens come from ``HF_TOKEN`` / the stored login through huggingface_hub and are never printed.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import SpecopsError

DEFAULT_ENDPOINT = "https://huggingface.co"
#: What model_info asks for: enough to detect, rank and size a candidate without downloading weights.
INFO_EXPAND = ["sha", "config", "cardData", "siblings", "safetensors", "gguf", "gated", "downloads", "likes",
               "tags", "lastModified"]
LIST_EXPAND = ["config", "cardData", "downloads", "likes", "tags", "gated", "sha"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _truthy(v: str | None) -> bool:
    return (v or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def env_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache as configured now (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def default_timeout() -> float:
    try:
        return max(0.5, float(os.environ.get("SPECOPS_HUB_TIMEOUT", "5")))
    except ValueError:
        return 5.0


class HubError(SpecopsError):
    """A Hub failure, as one line. ``kind``: not_found, gated, unauthorized, rate_limited, unreachable,
    offline, revision, entry, error."""

    def __init__(self, kind: str, line: str, repo: str | None = None):
        self.kind = kind
        self.repo = repo
        super().__init__(line)

    @property
    def hub_is_down(self) -> bool:
        return self.kind in ("unreachable", "rate_limited", "offline")


@dataclass
class RepoMeta:
    """What the Hub says about one repo (the parts the resolver uses)."""

    id: str
    sha: str | None = None
    config: dict | None = None          # the Hub's summary of config.json (architectures, model_type, ...)
    card_data: dict | None = None
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    gated: Any = False
    siblings: list[str] | None = None
    safetensors: dict | None = None     # {"parameters": {"BF16": n}, "total": n}
    gguf: dict | None = None

    @property
    def files(self) -> list[str]:
        return self.siblings or []


@dataclass(frozen=True)
class FileMeta:
    path: str
    size: int | None
    blob_id: str | None
    sha256: str | None

    @property
    def digest(self) -> str | None:
        """The content identity: the LFS sha256 when stored in LFS, else the git blob id."""
        return f"sha256:{self.sha256}" if self.sha256 else (f"git:{self.blob_id}" if self.blob_id else None)


def _meta_from_info(info) -> RepoMeta:
    card = info.card_data
    if card is not None and hasattr(card, "to_dict"):
        card = card.to_dict()
    st = None
    if info.safetensors is not None:
        st = {"parameters": dict(info.safetensors.parameters or {}), "total": info.safetensors.total}
    return RepoMeta(
        id=info.id, sha=info.sha, config=info.config if isinstance(info.config, dict) else None,
        card_data=card if isinstance(card, dict) else None, tags=list(info.tags or []),
        downloads=info.downloads or 0, likes=info.likes or 0, gated=info.gated or False,
        siblings=[s.rfilename for s in info.siblings] if info.siblings is not None else None,
        safetensors=st, gguf=info.gguf if isinstance(info.gguf, dict) else None,
    )


class _Deadline(Exception):
    pass


class Hub:
    """A Hub client for one resolution: endpoint, offline mode, deadlines, cache, and a circuit breaker."""

    def __init__(self, *, endpoint: str | None = None, offline: bool | None = None, timeout: float | None = None,
                 cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None):
        self.endpoint = (endpoint or hub_endpoint()).rstrip("/")
        self.offline = env_offline() if offline is None else (offline or env_offline())
        self.timeout = timeout or default_timeout()
        self.cache_dir = Path(cache_dir) if cache_dir else hf_cache_dir()
        self.progress = progress
        self.down: HubError | None = None
        self.calls = 0
        self._api = None

    # ------------------------------------------------------------------ plumbing
    @property
    def api(self):
        if self._api is None:
            from huggingface_hub import HfApi
            self._api = HfApi(endpoint=self.endpoint)
        return self._api

    def _say(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)

    def _call(self, what: str, repo: str | None, fn: Callable[[], Any]) -> Any:
        """Run one Hub call under a deadline; translate failures to HubError and trip the breaker."""
        if self.offline:
            raise HubError("offline", f"{what}: offline (--offline or HF_HUB_OFFLINE=1): not asking the Hub", repo)
        if self.down is not None:
            raise self.down
        self.calls += 1
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        t = threading.Thread(target=run, name=f"specops-hub-{what}", daemon=True)
        t.start()
        t.join(self.timeout * 2 + 1)
        try:
            if t.is_alive():
                raise _Deadline()
            if "error" in box:
                raise box["error"]
            return box.get("value")
        except HubError:
            raise
        except BaseException as exc:
            err = translate(exc, what, repo, self.endpoint, self.timeout * 2 + 1)
            if err.hub_is_down:
                self.down = err
            raise err from None

    # ------------------------------------------------------------------ API
    def model_info(self, repo: str, revision: str | None = None) -> RepoMeta:
        info = self._call("model info", repo, lambda: self.api.model_info(
            repo, revision=revision, expand=INFO_EXPAND, timeout=self.timeout))
        return _meta_from_info(info)

    def list_models(self, *, filter: str | list[str] | None = None, search: str | None = None,
                    author: str | None = None, limit: int = 100) -> list[RepoMeta]:
        what = "search " + " ".join(f"{k}={v}" for k, v in (("filter", filter), ("search", search),
                                                              ("author", author)) if v)
        items = self._call(what, None, lambda: list(self.api.list_models(
            filter=filter, search=search, author=author, sort="downloads", limit=limit, expand=LIST_EXPAND)))
        return [_meta_from_info(i) for i in items]

    def paths_info(self, repo: str, paths: list[str], revision: str | None = None) -> dict[str, FileMeta]:
        if not paths:
            return {}
        items = self._call("file info", repo, lambda: self.api.get_paths_info(repo, paths, revision=revision))
        out = {}
        for item in items:
            if getattr(item, "blob_id", None) is None and getattr(item, "size", None) is None:
                continue  # a folder
            lfs = getattr(item, "lfs", None)
            out[item.path] = FileMeta(item.path, item.size, item.blob_id, lfs.sha256 if lfs else None)
        return out

    def download(self, repo: str, filename: str, revision: str | None = None) -> Path:
        """A small file (config.json, tokenizer files) into the HF cache; offline: from the cache only."""
        from huggingface_hub import hf_hub_download
        if self.offline or self.down is not None:
            cached = self.cached(repo, filename, revision)
            if cached is not None:
                return cached
            why = "offline" if self.offline else self.down.kind
            raise HubError("offline" if self.offline else self.down.kind,
                           f"{repo}/{filename} is not in the HF cache ({self.cache_dir}) and the Hub is not used "
                           f"({why}); fetch it once online (`specops lock` or `hf download {repo} {filename}`)", repo)
        self._say(f"downloading {repo}/{filename}")
        return Path(self._call("download", repo, lambda: hf_hub_download(
            repo, filename, revision=revision, cache_dir=str(self.cache_dir), endpoint=self.endpoint,
            etag_timeout=self.timeout)))

    # ------------------------------------------------------------------ local cache (no network)
    def _repo_dir(self, repo: str) -> Path:
        return self.cache_dir / ("models--" + repo.replace("/", "--"))

    def cached_sha(self, repo: str, revision: str | None = None) -> str | None:
        """The commit the cache holds for ``revision`` (a branch/tag ref, or a commit sha that is present)."""
        rev = revision or "main"
        d = self._repo_dir(repo)
        if len(rev) == 40 and (d / "snapshots" / rev).is_dir():
            return rev
        ref = d / "refs" / rev
        try:
            sha = ref.read_text().strip()
        except OSError:
            return None
        return sha or None

    def cached(self, repo: str, filename: str, revision: str | None = None) -> Path | None:
        sha = self.cached_sha(repo, revision)
        if sha is None:
            return None
        p = self._repo_dir(repo) / "snapshots" / sha / filename
        return p if p.is_file() else None

    def cached_files(self, repo: str, revision: str | None = None) -> list[str]:
        sha = self.cached_sha(repo, revision)
        if sha is None:
            return []
        root = self._repo_dir(repo) / "snapshots" / sha
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def translate(exc: BaseException, what: str, repo: str | None, endpoint: str, deadline: float) -> HubError:
    """One clear line for each way the Hub can fail."""
    from huggingface_hub import errors as E

    name = repo or endpoint
    if isinstance(exc, _Deadline):
        return HubError("unreachable", f"Hub at {endpoint} did not answer in time ({what}; no answer within "
                                       f"{deadline:.0f} s, SPECOPS_HUB_TIMEOUT sets the limit)", repo)
    if isinstance(exc, E.OfflineModeIsEnabled):
        return HubError("offline", f"{what}: huggingface_hub is in offline mode (HF_HUB_OFFLINE=1)", repo)
    if isinstance(exc, E.GatedRepoError):
        return HubError("gated", f"{name} is gated: accept its license on {endpoint}/{name} and set HF_TOKEN "
                                 f"(a token of an account that was granted access)", repo)
    if isinstance(exc, E.RevisionNotFoundError):
        return HubError("revision", f"{name}: revision not found on the Hub", repo)
    if isinstance(exc, E.RepositoryNotFoundError):
        return HubError("not_found", f"{name} not found on the Hub (check the id; private repos need HF_TOKEN)", repo)
    if isinstance(exc, E.EntryNotFoundError):
        return HubError("entry", f"{name}: file not found ({what})", repo)
    if isinstance(exc, E.HfHubHTTPError):
        resp = getattr(exc, "response", None)
        status = getattr(resp, "status_code", None)
        if status == 429:
            wait = resp.headers.get("Retry-After") if resp is not None else None
            return HubError("rate_limited", f"rate-limited by the Hub at {endpoint}"
                                            + (f" (retry in {wait} s)" if wait else "") + "; set HF_TOKEN for a higher limit", repo)
        if status in (401, 403):
            return HubError("unauthorized", f"{name}: not authorized ({status}); check HF_TOKEN", repo)
        if status is not None and status >= 500:
            return HubError("unreachable", f"Hub at {endpoint} failed with HTTP {status} ({what})", repo)
        return HubError("error", f"{name}: Hub answered HTTP {status} ({what})", repo)
    if isinstance(exc, E.LocalEntryNotFoundError):
        if exc.__cause__ is not None and exc.__cause__ is not exc:
            return translate(exc.__cause__, what, repo, endpoint, deadline)
        return HubError("offline", f"{name}: not in the local HF cache and the Hub is not reachable", repo)
    try:
        import httpx2 as httpx
        transport, timeouts = (httpx.TransportError,), (httpx.TimeoutException,)
    except ImportError:  # pragma: no cover - older huggingface_hub uses requests/httpx
        transport, timeouts = (), ()
    if isinstance(exc, timeouts + (TimeoutError,)):
        return HubError("unreachable", f"Hub at {endpoint} did not answer in time ({what}; "
                                       f"SPECOPS_HUB_TIMEOUT sets the limit)", repo)
    if isinstance(exc, transport + (ConnectionError, OSError)):
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return HubError("unreachable", f"Hub at {endpoint} is unreachable: {reason}", repo)
    return HubError("error", f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", repo)
