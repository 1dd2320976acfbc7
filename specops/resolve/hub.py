"""The Hugging Face Hub, as the resolver sees it: metadata and small files, never weights.

``huggingface_hub`` is imported here lazily (only when something is resolved), so ``specops validate`` and
``render`` stay fast. Every call has a short deadline and every failure becomes a :class:`HubError` with one
clear line; after the Hub is found unreachable or rate-limited no further call is made (the resolver falls
back to the lock, the local cache and the catalog). ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read when a
:class:`Hub` is made, not when huggingface_hub was imported, and the endpoint is passed explicitly.
Tokens come from ``HF_TOKEN`` / the stored login through huggingface_hub and are never printed.

What the Hub answers is not trusted: repo file names (siblings, paths-info) go through one validator
(:mod:`.names`) where they enter, commit shas must be hex, counts must be numbers, and a repo whose
metadata fails these checks is an ``invalid`` :class:`HubError` (its candidate is refused, with the reason).
Small files are downloaded with a size cap: :data:`MAX_JSON_BYTES` (1 MiB) for ``config.json`` and the
other JSON files specops reads. The size the Hub states (paths-info, the download's HEAD) is checked before
a byte is fetched, the transfer is cut off past the cap, and reading a file stops at the cap too.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.errors import SpecopsError
from specops.reponames import (
    UnsafeName,
    check_repo_file,
    check_repo_id,
    check_revision,
    is_commit_sha,
    is_repo_id,
    is_safe_repo_file,
)
from specops.resolve.huberrors import HubDeadline, HubError, too_large, translate

DEFAULT_ENDPOINT = "https://huggingface.co"
#: What model_info asks for: enough to detect, rank and size a candidate without downloading weights.
INFO_EXPAND = [
    "sha",
    "config",
    "cardData",
    "siblings",
    "safetensors",
    "gguf",
    "gated",
    "downloads",
    "likes",
    "tags",
    "lastModified",
]
LIST_EXPAND = ["config", "cardData", "downloads", "likes", "tags", "gated", "sha"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: The most specops downloads or reads of one small JSON file (config.json, tokenizer_config.json).
MAX_JSON_BYTES = 1 << 20
#: A repo listing more files than this is not a model repo specops will look into.
MAX_SIBLINGS = 20_000


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
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def default_timeout() -> float:
    try:
        return max(0.5, float(os.environ.get("SPECOPS_HUB_TIMEOUT", "5")))
    except ValueError:
        return 5.0


@dataclass
class RepoMeta:
    """What the Hub says about one repo (the parts the resolver uses)."""

    id: str
    sha: str | None = None
    config: dict | None = None  # the Hub's summary of config.json (architectures, model_type, ...)
    card_data: dict | None = None
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    gated: Any = False
    siblings: list[str] | None = None
    safetensors: dict | None = None  # {"parameters": {"BF16": n}, "total": n}
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


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _meta_from_info(info) -> RepoMeta:
    """A :class:`RepoMeta` from huggingface_hub's ModelInfo; raises :class:`UnsafeName` when the answer names
    an unusable repo id, commit or file (the caller turns that into an ``invalid`` HubError)."""
    check_repo_id(info.id, "repo id from the Hub")
    if info.sha is not None and not is_commit_sha(info.sha):
        raise UnsafeName(f"its commit sha is not 40 hex digits: {str(info.sha)[:60]!r}")
    card = info.card_data
    if card is not None and hasattr(card, "to_dict"):
        card = card.to_dict()
    st = None
    safetensors = getattr(info, "safetensors", None)
    if safetensors is not None:
        params = getattr(safetensors, "parameters", None)
        total = getattr(safetensors, "total", None)
        params = {str(k): v for k, v in params.items() if _count(v)} if isinstance(params, dict) else {}
        st = {"parameters": params, "total": _count(total) or None}
    siblings = None
    if info.siblings is not None:
        if not isinstance(info.siblings, (list, tuple)):
            raise UnsafeName("its file list is not a list")
        if len(info.siblings) > MAX_SIBLINGS:
            raise UnsafeName(f"it lists {len(info.siblings)} files (specops looks at repos of at most {MAX_SIBLINGS})")
        siblings = []
        for sib in info.siblings:
            name = getattr(sib, "rfilename", None)
            try:
                siblings.append(check_repo_file(name, "file name"))
            except UnsafeName as exc:
                raise UnsafeName(f"it lists an {exc}") from None
    tags = info.tags if isinstance(info.tags, (list, tuple)) else []
    gated = info.gated if isinstance(info.gated, (bool, str)) else bool(info.gated)
    return RepoMeta(
        id=info.id,
        sha=info.sha,
        config=info.config if isinstance(info.config, dict) else None,
        card_data=card if isinstance(card, dict) else None,
        tags=[t for t in tags if isinstance(t, str)],
        downloads=_count(info.downloads),
        likes=_count(info.likes),
        gated=gated or False,
        siblings=siblings,
        safetensors=st,
        gguf=info.gguf if isinstance(info.gguf, dict) else None,
    )


class FileTooLarge(Exception):
    """A download stopped because the file is larger than its cap."""

    def __init__(self, size: int | None, cap: int):
        self.size, self.cap = size, cap
        super().__init__(f"{size} bytes > {cap}" if size is not None else f"more than {cap} bytes")


def _capped_progress(cap: int):
    """A progress-bar class for ``hf_hub_download`` that stops a download past ``cap`` bytes: when the size
    the server announces is over it (before the body is read), or as soon as more bytes arrive."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class CappedProgress(hf_tqdm):
        def __init__(self, *args, **kwargs):
            total = kwargs.get("total")
            if isinstance(total, (int, float)) and total > cap:
                raise FileTooLarge(int(total), cap)
            self._seen = kwargs.get("initial") or 0
            kwargs["disable"] = True  # specops prints its own one-line progress
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            self._seen += n or 0
            if self._seen > cap:
                raise FileTooLarge(None, cap)
            return super().update(n)

    return CappedProgress


class Hub:
    """A Hub client for one resolution: endpoint, offline mode, deadlines, cache, and a circuit breaker."""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        offline: bool | None = None,
        timeout: float | None = None,
        cache_dir: str | Path | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        #: one-line notes about Hub answers that were left out (e.g. a search hit with unsafe file names)
        self.warnings: list[str] = []
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
                raise HubDeadline()
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
        info = self._call(
            "model info",
            repo,
            lambda: self.api.model_info(repo, revision=revision, expand=INFO_EXPAND, timeout=self.timeout),
        )
        try:
            return _meta_from_info(info)
        except UnsafeName as exc:
            raise HubError("invalid", f"{repo}: unusable Hub answer: {exc}", repo) from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise HubError("invalid", f"{repo}: unusable Hub answer ({type(exc).__name__})", repo) from None

    def list_models(
        self,
        *,
        filter: str | list[str] | None = None,
        search: str | None = None,
        author: str | None = None,
        limit: int = 100,
    ) -> list[RepoMeta]:
        what = "search " + " ".join(
            f"{k}={v}" for k, v in (("filter", filter), ("search", search), ("author", author)) if v
        )
        items = self._call(
            what,
            None,
            lambda: list(
                self.api.list_models(
                    filter=filter, search=search, author=author, sort="downloads", limit=limit, expand=LIST_EXPAND
                )
            ),
        )
        out = []
        for info in items:
            try:
                out.append(_meta_from_info(info))
            except (UnsafeName, TypeError, ValueError, AttributeError) as exc:
                rid = getattr(info, "id", None)
                note = f"Hub {what}: left out {rid if is_repo_id(rid) else 'a result'}: {exc}"
                if note not in self.warnings:
                    self.warnings.append(note)
        return out

    def paths_info(self, repo: str, paths: list[str], revision: str | None = None) -> dict[str, FileMeta]:
        """Size and content ids of ``paths`` (only names asked for come back, each a safe repo file name)."""
        paths = [check_repo_file(p) for p in paths]
        if not paths:
            return {}
        items = self._call("file info", repo, lambda: self.api.get_paths_info(repo, paths, revision=revision))
        wanted = set(paths)
        out = {}
        for item in items:
            path = getattr(item, "path", None)
            if path not in wanted:
                continue  # not asked for (a safe name is always one that was asked for)
            if getattr(item, "blob_id", None) is None and getattr(item, "size", None) is None:
                continue  # a folder
            lfs = getattr(item, "lfs", None)
            size = getattr(item, "size", None)
            size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
            blob = getattr(item, "blob_id", None)
            sha = getattr(lfs, "sha256", None) if lfs else None
            out[path] = FileMeta(
                path, size, blob if isinstance(blob, str) else None, sha if isinstance(sha, str) else None
            )
        return out

    def download(
        self, repo: str, filename: str, revision: str | None = None, *, max_bytes: int = MAX_JSON_BYTES
    ) -> Path:
        """A small file (config.json, tokenizer files) into the HF cache; offline: from the cache only.

        At most ``max_bytes``: a larger file is an ``invalid`` HubError, refused before its body is read when
        the server states its size, and cut off at the cap when it does not.
        """
        from huggingface_hub import hf_hub_download

        try:
            check_repo_file(filename)
            if revision is not None:
                check_revision(revision)
        except UnsafeName as exc:
            raise HubError("invalid", f"{repo}: {exc}", repo) from None
        if self.offline or self.down is not None:
            cached = self.cached(repo, filename, revision)
            if cached is not None:
                self._check_size(repo, filename, cached, max_bytes)
                return cached
            why = "offline" if self.offline else self.down.kind
            raise HubError(
                "offline" if self.offline else self.down.kind,
                f"{repo}/{filename} is not in the HF cache ({self.cache_dir}) and the Hub is not used "
                f"({why}); fetch it once online (`specops lock` or `hf download {repo} {filename}`)",
                repo,
            )
        self._say(f"downloading {repo}/{filename}")

        def fetch():
            try:
                return hf_hub_download(
                    repo,
                    filename,
                    revision=revision,
                    cache_dir=str(self.cache_dir),
                    endpoint=self.endpoint,
                    etag_timeout=self.timeout,
                    tqdm_class=_capped_progress(max_bytes),
                )
            except FileTooLarge as exc:
                raise too_large(repo, filename, exc.size, max_bytes) from None

        path = Path(self._call("download", repo, fetch))
        self._check_size(repo, filename, path, max_bytes)
        return path

    @staticmethod
    def _check_size(repo: str, filename: str, path: Path, max_bytes: int) -> None:
        try:
            size = path.stat().st_size
        except OSError:
            return
        if size > max_bytes:
            raise too_large(repo, filename, size, max_bytes)

    # ------------------------------------------------------------------ local cache (no network)
    def _repo_dir(self, repo: str) -> Path:
        check_repo_id(repo)
        return self.cache_dir / ("models--" + repo.replace("/", "--"))

    def cached_sha(self, repo: str, revision: str | None = None) -> str | None:
        """The commit the cache holds for ``revision`` (a branch/tag ref, or a commit sha that is present)."""
        rev = revision or "main"
        if not is_repo_id(repo) or not _safe_revision(rev):
            return None
        d = self._repo_dir(repo)
        if is_commit_sha(rev) and (d / "snapshots" / rev).is_dir():
            return rev
        ref = d / "refs" / rev
        try:
            sha = ref.read_text(encoding="ascii", errors="replace")[:200].strip()
        except OSError:
            return None
        return sha if is_commit_sha(sha) else None

    def cached(self, repo: str, filename: str, revision: str | None = None) -> Path | None:
        if not is_safe_repo_file(filename):
            return None
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
        names = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        return sorted(n for n in names if is_safe_repo_file(n))


def _safe_revision(rev: str) -> bool:
    try:
        check_revision(rev)
    except UnsafeName:
        return False
    return True


class BadFile(SpecopsError):
    """A small JSON file that is too large or not a JSON object (one line saying which and why)."""


def load_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES, what: str | None = None) -> dict:
    """The JSON object in ``path``, reading at most ``max_bytes``; raises :class:`BadFile` with the reason."""
    name = what or str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise BadFile(f"{name}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(data) > max_bytes:
        raise BadFile(f"{name} is larger than {max_bytes} bytes ({max_bytes // 1024} KiB): not read")
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadFile(f"{name} is not UTF-8 text") from None
    except RecursionError:
        raise BadFile(f"{name} is nested too deeply") from None
    except ValueError as exc:
        raise BadFile(f"{name} is not valid JSON ({str(exc).splitlines()[0][:100]})") from None
    if not isinstance(obj, dict):
        raise BadFile(f"{name} is not a JSON object (it is a {type(obj).__name__})")
    return obj


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict | None:
    """:func:`load_json`, or None for any problem."""
    try:
        return load_json(path, max_bytes=max_bytes)
    except BadFile:
        return None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"
