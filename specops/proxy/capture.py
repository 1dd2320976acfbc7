"""What the proxy keeps of the traffic for ``specops adapt``: prompts and the target's answers, on disk.

Enabled by the profile's ``capture:`` section (:mod:`specops.config.capture`). The proxy asks
:meth:`Capture.tap` before it sends a request (the sampling decision: only a sampled request pays for
anything, a streamed answer is copied only then) and hands the finished exchange to :meth:`Capture.offer`;
the JSON parse, the redaction plugins and the write run later, on the next loop turn (``call_soon``), after
the answer went to the client. The spot-check sampler (:mod:`specops.proxy.sample`) works the same way.

- Kept: the request's path, its class (``routing.classes``, else ``-``), the prompt (completions) or the
  messages (chat), the target's answer text, whether it streamed, the time. Never a header, so never the
  ``Authorization`` value or any key; the request's other fields are not kept either.
- Bounded: a request whose body or answer exceeds ``max_record_bytes`` is not kept; files rotate at
  ``max_file_bytes``; the folder holds at most ``max_bytes`` (oldest files deleted first) and nothing older
  than ``max_age``. The folder is 0700, every file 0600, opened without following links.
- ``exclude_classes``: a request of such a class is not kept; the ``capture_redact`` plugin hook edits or
  drops each record before it is written (a plugin that fails drops it).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from specops.errors import SpecopsError

#: Paths whose prompts and answers are kept.
PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Format version of a capture record (the ``v`` field).
RECORD_VERSION = 1
FILE_PREFIX = "capture-"
FILE_SUFFIX = ".jsonl"
NO_CLASS = "-"


class Tap:
    """One sampled request on its way: its body, its class, and its streamed answer as it passes."""

    __slots__ = ("body", "chunks", "cls", "limit", "over", "path", "size")

    def __init__(self, path: str, body: bytes, cls: str, limit: int):
        self.path, self.body, self.cls, self.limit = path, body, cls, limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.over = False

    def feed(self, chunk: bytes) -> None:
        """A chunk of a streamed answer (called by the forwarder); past the record limit nothing is kept."""
        if self.over:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.over = True
            self.chunks.clear()
        else:
            self.chunks.append(chunk)


def capture_dir(profile) -> Path:
    """Where ``profile`` keeps its capture files: ``capture.path``, else ``<state folder>/<name>/capture``."""
    if profile.capture.path:
        return Path(profile.capture.path).expanduser()
    from specops.run.instance import InstancePaths

    return InstancePaths.for_profile(profile.name, profile.supervisor.state_dir).root / "capture"


def _text(content) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None


def _answer_text(obj, chat: bool, streamed: bool) -> str | None:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if chat:
        part = choice.get("delta" if streamed else "message")
        return _text(part.get("content")) if isinstance(part, dict) else None
    return choice.get("text") if isinstance(choice.get("text"), str) else None


def answer_text(path: str, answer: bytes, streamed: bool) -> str | None:
    """The target's answer text from a completions or chat answer, whole or SSE (None: not usable).

    A stream counts only when it ended with ``data: [DONE]`` (a broken one is incomplete); only choice 0 is
    read (``n`` > 1 is not kept).
    """
    chat = path == "/v1/chat/completions"
    if not streamed:
        try:
            obj = json.loads(answer)
        except ValueError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("choices"), list) and len(obj["choices"]) != 1:
            return None
        return _answer_text(obj, chat, False)
    parts, done = [], False
    for line in answer.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) and choices[0].get("index", 0):
            return None  # n > 1
        piece = _answer_text(obj, chat, True)
        if piece:
            parts.append(piece)
    return "".join(parts) if done else None


def make_record(tap: Tap, answer: bytes, streamed: bool, now: float) -> dict | None:
    """The record to write for one exchange, or None when it is not a usable prompt/answer pair."""
    try:
        req = json.loads(tap.body)
    except ValueError:
        return None
    if not isinstance(req, dict) or req.get("n", 1) not in (None, 1):
        return None
    output = answer_text(tap.path, answer, streamed)
    if output is None:
        return None
    record: dict = {"v": RECORD_VERSION, "at": round(now, 3), "path": tap.path, "class": tap.cls}
    if tap.path == "/v1/chat/completions":
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        kept = []
        for m in messages:
            text = _text(m.get("content")) if isinstance(m, dict) else None
            if text is None or not isinstance(m.get("role"), str):
                return None
            kept.append({"role": m["role"], "content": text})
        record["messages"] = kept
    else:
        prompt = req.get("prompt")
        if not isinstance(prompt, str):
            return None
        record["prompt"] = prompt
    record["output"] = output
    record["stream"] = streamed
    return record


def redactors(plugins=None) -> list:
    """The ``capture_redact`` implementations of ``plugins`` (default: the installed ones), in order, each a
    callable record -> [record] (``[]``: dropped), raising SpecopsError when the plugin fails."""
    if plugins is None:
        from specops.plugins import loaded_plugins

        plugins = loaded_plugins()
    return [
        (lambda record, _p=p: plugins.call_one("capture_redact", _p, record=record))
        for p in plugins.implementers("capture_redact")
    ]


class CaptureFiles:
    """The capture folder: appends records to the current file; rotates, and deletes by size and age."""

    def __init__(self, folder: Path, max_bytes: int, max_file_bytes: int, max_age: float):
        from specops.paths import private_dir

        self.folder = private_dir(Path(folder))
        self.max_bytes, self.max_file_bytes, self.max_age = max_bytes, max_file_bytes, max_age
        self._fd: int | None = None
        self._current: Path | None = None
        self._current_size = 0
        self._opened_at = 0.0
        self._files: list[tuple[Path, int]] = []  # closed files, oldest first: (path, size)
        for p in sorted(self.folder.glob(FILE_PREFIX + "*" + FILE_SUFFIX)):
            try:
                self._files.append((p, p.stat().st_size))
            except OSError:
                continue
        self.prune(time.time())

    @property
    def total(self) -> int:
        return sum(size for _, size in self._files) + self._current_size

    def prune(self, now: float, room: int = 0) -> None:
        """Delete the closed files older than ``max_age``, then the oldest until ``room`` more bytes fit."""
        keep = []
        for p, size in self._files:
            try:
                old = p.stat().st_mtime < now - self.max_age
            except OSError:
                continue
            if old:
                _unlink(p)
            else:
                keep.append((p, size))
        self._files = keep
        while self._files and self.total + room > self.max_bytes:
            _unlink(self._files.pop(0)[0])

    def _rotate(self, now: float) -> None:
        self.close()
        name = f"{FILE_PREFIX}{time.time_ns():020d}{FILE_SUFFIX}"
        path = self.folder / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        self._fd = os.open(path, flags, 0o600)
        self._current, self._current_size, self._opened_at = path, 0, now

    def write(self, line: bytes, now: float) -> bool:
        """Append one line (False: it does not fit within ``max_bytes`` even after deleting old files)."""
        if (
            self._fd is None
            or self._current_size + len(line) > self.max_file_bytes
            or now - self._opened_at > self.max_age / 8
        ):
            self._rotate(now)
        self.prune(now, len(line))
        if self.total + len(line) > self.max_bytes:
            return False
        os.write(self._fd, line)
        self._current_size += len(line)
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            if self._current_size:
                self._files.append((self._current, self._current_size))
            else:
                _unlink(self._current)
            self._fd, self._current, self._current_size = None, None, 0


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@dataclass
class CaptureSettings:
    sample: float
    max_record_bytes: int
    exclude_classes: frozenset


class Capture:
    """The proxy's side of ``capture:``: which requests to keep (:meth:`tap`) and keeping them (:meth:`offer`)."""

    def __init__(self, files: CaptureFiles, settings: CaptureSettings, redactors=(), rng: random.Random | None = None):
        self.files, self.settings, self.redactors = files, settings, list(redactors)
        self._random = (rng or random.Random()).random
        self.counts = dict.fromkeys(
            ("kept", "not_sampled", "excluded", "too_large", "unusable", "redacted_out", "redact_failed", "full"), 0
        )

    @classmethod
    def for_profile(cls, profile) -> Capture:
        c = profile.capture
        try:
            files = CaptureFiles(capture_dir(profile), c.max_bytes, c.max_file_bytes, c.max_age)
        except OSError as exc:
            raise SpecopsError(f"capture: cannot use {capture_dir(profile)}: {exc.strerror or exc}") from None
        return cls(files, CaptureSettings(c.sample, c.max_record_bytes, frozenset(c.exclude_classes)), redactors())

    def tap(self, method: str, raw_path: str, body: bytes, cls: str | None) -> Tap | None:
        """Before the request is sent: a :class:`Tap` when it is to be kept, else None (nothing more is done)."""
        path = raw_path.partition("?")[0]
        if method != "POST" or path not in PATHS:
            return None
        if self._random() >= self.settings.sample:
            self.counts["not_sampled"] += 1
            return None
        cls = cls or NO_CLASS
        if cls in self.settings.exclude_classes:
            self.counts["excluded"] += 1
            return None
        limit = self.settings.max_record_bytes
        if len(body) > limit:
            self.counts["too_large"] += 1
            return None
        return Tap(path, body, cls, limit)

    def offer(self, tap: Tap, status: int, whole: bytes | None) -> None:
        """After the answer went out: ``whole`` is a non-streamed answer's body (None: it streamed through
        ``tap``). The parse and the write run on the next loop turn."""
        if status != 200:
            self.counts["unusable"] += 1
            return
        if whole is None and tap.over or whole is not None and len(whole) > tap.limit:
            self.counts["too_large"] += 1
            return
        try:
            asyncio.get_running_loop().call_soon(self._keep, tap, whole)
        except RuntimeError:  # no loop (a direct call): keep now
            self._keep(tap, whole)

    def _keep(self, tap: Tap, whole: bytes | None) -> None:
        now = time.time()
        answer = b"".join(tap.chunks) if whole is None else whole
        streamed = whole is None and answer.lstrip()[:5] == b"data:"  # a large JSON answer is streamed too
        record = make_record(tap, answer, streamed, now)
        if record is None:
            self.counts["unusable"] += 1
            return
        for redact in self.redactors:
            try:
                results = redact(record)
            except SpecopsError:
                self.counts["redact_failed"] += 1
                return
            record = results[0] if results else None  # pluggy leaves a None result out: dropped
            if not isinstance(record, dict):
                self.counts["redacted_out"] += 1
                return
        try:
            line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        except (TypeError, ValueError):
            self.counts["redact_failed"] += 1
            return
        try:
            ok = self.files.write(line, now)
        except OSError:
            ok = False
        self.counts["kept" if ok else "full"] += 1

    def snapshot(self) -> dict:
        return {**self.counts, "bytes": self.files.total}

    def close(self) -> None:
        self.files.close()
