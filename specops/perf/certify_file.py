"""The certificate: ``<profile stem>.cert.json`` beside the profile (and its lock), and when it is stale.

``specops certify`` writes it; ``specops validate --require-certificate`` and ``specops up`` read it. It
records *what was certified* (the identity: profile inputs, backend and engine version, target and draft
revisions, the chat template's hash) and *what was measured* (losslessness, acceptance per position and
per prompt set, tokens/s with and without speculation). The identity is what staleness is judged on: a
certificate is stale when any identity field differs from what the profile (and its lock, the model
files, the installed engine) says now.

Nothing here starts an engine or imports an HTTP client: ``validate`` stays fast.

The JSON is deterministic for git diffs: sorted keys, two-space indent, floats rounded where written, a
trailing newline. A local model (a path, not a Hub id) has no Hub revision; its revision is a content
fingerprint (``local-sha256:…`` over the file, or over config/tokenizer files and the weights of a folder;
for files over 64 MiB, over the size and the first and last 4 MiB, marked ``sampled``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.errors import SpecopsError
from specops.methods import NEEDS_DRAFT, Method
from specops.paths import builtin_env
from specops.reponames import is_repo_id

CERT_VERSION = 1
#: Identity fields, in the order a stale certificate names them, with the profile field they concern.
IDENTITY_FIELDS = {
    "profile_sha256": (),
    "engine_version": ("engine", "version"),
    "target_revision": ("model", "id"),
    "draft_revision": ("speculative", "draft"),
    "chat_template_sha256": ("model", "id"),
}
_WHOLE_FILE_LIMIT = 64 * 1024 * 1024
_SAMPLE = 4 * 1024 * 1024
#: Files of a model folder that decide what it computes (config, tokenizer, template, weights).
_MODEL_FILE_SUFFIXES = (".json", ".jinja", ".safetensors", ".bin", ".model", ".gguf", ".txt", ".py")


def cert_path(profile_path: str | Path) -> Path:
    """``profiles/x.yaml`` → ``profiles/x.cert.json`` (beside ``x.lock.json``)."""
    p = Path(profile_path)
    return p.with_name(p.stem + ".cert.json")


# ---------------------------------------------------------------------------------------------------
# identity


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template the engine applies for the target, as far as the model files say."""

    sha256: str | None  # None: the model has no chat template (or it could not be read)
    source: str  # where it was read, or why there is none
    known: bool = True  # False: it could not be read here (a Hub model not in the local cache)

    def to_dict(self) -> dict:
        return {"sha256": self.sha256, "source": self.source, "known": self.known}


def profile_inputs(profile) -> dict:
    """What the certificate certifies of the profile: backend, engine pin, model, speculative section,
    layout, the concurrency served and extra engine arguments (no secrets: no api key, no environment).
    Paths under specops' own folders are written ``${SPECOPS_MODELS}/…`` so that a certificate made on
    one machine is current on another."""
    data = profile.model_dump(mode="json", include={"model", "speculative", "gpus"}, exclude_defaults=True)
    data["backend"] = profile.backend
    if profile.engine.version:
        data["engine_version"] = profile.engine.version
    if profile.server.parallel is not None:
        data["parallel"] = profile.server.parallel
    if profile.server.extra_args:
        data["extra_args"] = list(profile.server.extra_args)
    return _portable(data)


def _portable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str):
        for name, root in sorted(builtin_env().items(), key=lambda kv: -len(kv[1])):
            if root and (value == root or value.startswith(root.rstrip("/") + "/")):
                return "${" + name + "}" + value[len(root.rstrip("/")) :]
    return value


def digest(data: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def local_fingerprint(path: str | Path) -> str:
    """``local-sha256:…`` of a model file or folder (see the module doc); raises OSError when unreadable."""
    p = Path(path).expanduser()
    h = hashlib.sha256()
    sampled = False
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(_MODEL_FILE_SUFFIXES))
        for f in files:
            one, s = _file_digest(f)
            sampled = sampled or s
            h.update(f"{f.relative_to(p).as_posix()}\0{one}\n".encode())
    else:
        one, sampled = _file_digest(p)
        h.update(one.encode())
    return ("local-sha256-sampled:" if sampled else "local-sha256:") + h.hexdigest()[:32]


def _file_digest(path: Path) -> tuple[str, bool]:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest(), False
        h.update(str(size).encode())
        h.update(f.read(_SAMPLE))
        f.seek(size - _SAMPLE)
        h.update(f.read(_SAMPLE))
    return h.hexdigest(), True


def _revision(model_id: str | None, revision: str | None, pinned: str | None) -> str | None:
    """A model's revision: the profile's, else the lock's pin, else a local fingerprint, else None."""
    if not model_id:
        return None
    if revision:
        return revision
    if pinned:
        return pinned
    local = Path(model_id).expanduser()
    if local.exists():
        try:
            return local_fingerprint(local)
        except OSError as exc:
            raise SpecopsError(f"cannot read {model_id} to fingerprint it: {exc.strerror or exc}") from None
    if is_repo_id(model_id):
        return None  # a Hub model without a pin: the revision is whatever the Hub serves (see notes)
    return None


def _lock_pins(profile_path: str, profile) -> dict:
    """The fresh lock's pins ({} when there is no lock or it is stale)."""
    from specops.resolve.lock import lock_path, read_lock, stale_reason

    path = lock_path(profile_path)
    if not path.is_file():
        return {}
    try:
        lock = read_lock(path)
    except SpecopsError:
        return {}
    if stale_reason(lock, profile) is not None:
        return {}
    return lock


def chat_template(profile, backend) -> ChatTemplate:
    """The target's chat template as the model files (or ``--chat-template`` in extra_args) define it.

    HF models (``backend.model_format == "hf"``): ``chat_template`` of tokenizer_config.json, else
    chat_template.jinja / chat_template.json, in a local folder or the HF cache. GGUF: the
    ``tokenizer.chat_template`` metadata key of the local (or cached) file.
    """
    explicit = _template_argument(profile.server.extra_args)
    if explicit is not None:
        return explicit
    model = profile.model
    if backend.model_format == "gguf":
        return _gguf_template(model.id, model.file, model.revision)
    return _hf_template(model.id, model.revision)


def _template_argument(extra_args: list[str]) -> ChatTemplate | None:
    for i, arg in enumerate(extra_args):
        name, _, inline = arg.partition("=")
        if name in ("--chat-template", "--chat-template-file"):
            value = inline or (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            p = Path(value).expanduser()
            if p.is_file():
                return ChatTemplate(_sha(p.read_bytes()), f"{name} {value}")
            return ChatTemplate(_sha(value.encode()), f"{name} (inline or a built-in name: {value})")
    return None


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _hf_template(model_id: str, revision: str | None) -> ChatTemplate:
    local = Path(model_id).expanduser()
    if local.is_dir():
        return _template_in(lambda name: local / name, str(local))
    if not is_repo_id(model_id):
        return ChatTemplate(None, f"{model_id} is neither a local folder nor a Hub repo", known=False)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return ChatTemplate(None, "huggingface_hub is not installed: the template cannot be read", known=False)

    def cached(name: str) -> Path | None:
        found = try_to_load_from_cache(model_id, name, revision=revision)
        return Path(found) if isinstance(found, str) else None

    got = _template_in(cached, f"{model_id} (HF cache)")
    if got.sha256 is None and cached("tokenizer_config.json") is None:
        return ChatTemplate(None, f"{model_id}: tokenizer_config.json is not in the local HF cache", known=False)
    return got


def _template_in(where, label: str) -> ChatTemplate:
    """The template among tokenizer_config.json / chat_template.jinja / chat_template.json of a model."""
    cfg = where("tokenizer_config.json")
    if cfg is not None and Path(cfg).is_file():
        try:
            data = json.loads(Path(cfg).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return ChatTemplate(None, f"{cfg}: not readable JSON ({exc})", known=False)
        tpl = data.get("chat_template") if isinstance(data, dict) else None
        if tpl:
            return ChatTemplate(
                digest(tpl) if not isinstance(tpl, str) else _sha(tpl.encode()), f"{label}: tokenizer_config.json"
            )
    for name in ("chat_template.jinja", "chat_template.json"):
        f = where(name)
        if f is not None and Path(f).is_file():
            return ChatTemplate(_sha(Path(f).read_bytes()), f"{label}: {name}")
    return ChatTemplate(None, f"{label} has no chat template")


def _gguf_template(model_id: str, file: str | None, revision: str | None) -> ChatTemplate:
    path: Path | None = Path(model_id).expanduser()
    if not path.is_file():
        path = None
        if is_repo_id(model_id) and file:
            try:
                from huggingface_hub import try_to_load_from_cache

                found = try_to_load_from_cache(model_id, file, revision=revision)
                path = Path(found) if isinstance(found, str) else None
            except ImportError:
                path = None
        if path is None:
            return ChatTemplate(None, f"{model_id}: the GGUF file is not local", known=False)
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path), "r").get_field("tokenizer.chat_template")
        text = field.contents() if field is not None else None
    except Exception as exc:  # noqa: BLE001 - a file gguf cannot read has no template we can vouch for
        return ChatTemplate(None, f"{path}: cannot read GGUF metadata ({type(exc).__name__})", known=False)
    if not text:
        return ChatTemplate(None, f"{path} has no tokenizer.chat_template")
    return ChatTemplate(_sha(str(text).encode()), f"{path}: tokenizer.chat_template")


def identity(loaded, backend, engine_version: str | None) -> dict:
    """The identity fields of a certificate for ``loaded`` (resolved with its lock) and the engine version."""
    profile = loaded.profile
    pins = _lock_pins(loaded.path, profile)
    target_pin = (pins.get("target") or {}).get("revision")
    spec_pin = pins.get("speculative") or {}
    spec = profile.speculative
    method = Method(spec_pin["method"]) if spec.method is Method.AUTO and spec_pin.get("method") else spec.method
    draft = spec.draft if spec.draft != "auto" else spec_pin.get("draft")
    if method not in NEEDS_DRAFT:
        draft = None
    template = chat_template(profile, backend)
    return {
        "profile_sha256": digest(profile_inputs(profile)),
        "backend": profile.backend,
        "engine_version": engine_version,
        "target": _portable(profile.model.id),
        "target_revision": _revision(profile.model.id, profile.model.revision, target_pin),
        "method": method.value,
        "draft": _portable(draft) if draft else None,
        "draft_revision": _revision(draft, spec.draft_revision, spec_pin.get("draft_revision")) if draft else None,
        "chat_template_sha256": template.sha256,
        "chat_template_source": _portable(template.source),
        "chat_template_known": template.known,
    }


# ---------------------------------------------------------------------------------------------------
# file


def dumps(cert: dict) -> str:
    return json.dumps(_rounded(cert), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def write_cert(path: str | Path, cert: dict) -> Path:
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(dumps(cert), encoding="utf-8")
    os.replace(tmp, p)
    return p


def read_cert(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecopsError(f"{p}: cannot read the certificate: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SpecopsError(f"{p}: not a valid certificate (JSON error: {exc}); run `specops certify` again") from None
    if (
        not isinstance(data, dict)
        or data.get("certificate_version") != CERT_VERSION
        or not isinstance(data.get("identity"), dict)
    ):
        raise SpecopsError(f"{p}: not a specops certificate of version {CERT_VERSION}; run `specops certify` again")
    return data


@dataclass(frozen=True)
class Staleness:
    """One identity field that differs between the certificate and now (or could not be checked)."""

    field: str
    certified: Any
    now: Any
    checked: bool = True

    @property
    def profile_path(self) -> tuple:
        return IDENTITY_FIELDS.get(self.field, ())

    def message(self) -> str:
        name = self.field.replace("_sha256", " hash").replace("_", " ")
        if not self.checked:
            return f"{name} not checked: {self.now}"
        return f"{name} changed since certification: certified {self.certified!r}, now {self.now!r}"


def compare(cert: dict, now: dict) -> list[Staleness]:
    """The identity fields of ``cert`` that differ from ``now`` (``now`` from :func:`identity`).

    An ``engine_version`` of None in ``now`` (not pinned and no engine installed here) and a chat template
    that cannot be read here (a Hub model outside the cache) are reported as not checked, not as stale.
    """
    was = cert.get("identity") or {}
    out = []
    for name in IDENTITY_FIELDS:
        certified, current = was.get(name), now.get(name)
        if name == "engine_version" and current is None:
            out.append(
                Staleness(name, certified, "the profile pins no engine.version and no engine is installed here", False)
            )
        elif name == "chat_template_sha256" and not now.get("chat_template_known", True):
            out.append(Staleness(name, certified, now.get("chat_template_source"), False))
        elif certified != current:
            out.append(Staleness(name, certified, current))
    return out


def current_identity(loaded, registry, engine_version: str | None = None, *, probe: bool = True, step: int = 0) -> dict:
    """:func:`identity` (of chain step ``step``) with the engine version given, pinned in the profile, or
    probed from the installed engine (None when there is none)."""
    from specops.config.profile import LoadedProfile

    if step and 0 < step < len(loaded.profile.steps):
        loaded = LoadedProfile(loaded.profile.at_step(step), loaded.document, loaded.path)
    profile = loaded.profile
    backend = registry.backend(profile.backend)
    version = engine_version
    if version is None:  # the version certify and up would see: the pin, else the installed engine's
        try:
            version = backend.engine_info(profile, None, probe=probe).version
        except SpecopsError:
            version = None
    return identity(loaded, backend, version)


def certificate_report(loaded, registry, engine_version: str | None = None) -> dict:
    """Everything ``validate`` and ``up`` say about a profile's certificate.

    ``{"path", "exists", "certified", "stale": [Staleness], "unchecked": [Staleness], "cert"}``; ``cert`` is
    None when there is none. Raises :class:`SpecopsError` for a file that is not a certificate.
    """
    path = cert_path(loaded.path)
    if not path.is_file():
        return {"path": path, "exists": False, "certified": False, "stale": [], "unchecked": [], "cert": None}
    cert = read_cert(path)
    step = (cert.get("settings") or {}).get("step") or 0
    diffs = compare(cert, current_identity(loaded, registry, engine_version, step=step))
    return {
        "path": path,
        "exists": True,
        "certified": bool((cert.get("verdict") or {}).get("certified")),
        "stale": [d for d in diffs if d.checked],
        "unchecked": [d for d in diffs if not d.checked],
        "cert": cert,
    }
