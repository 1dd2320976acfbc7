"""Reading the capture files back: every record checked, a bad one located (file:line), the held-out split.

A capture folder holds JSONL files written by :mod:`specops.proxy.capture`. A line that is not JSON, a last
line cut short (no newline: a file truncated or still being written by a crashed proxy), or a record that is
not a capture record (another tool's JSONL) is a :class:`DatasetError` naming the file and line, never a
traceback and never silently skipped: training on half a dataset would look like success. A folder may hold
anything, so only regular files are read (a FIFO is never waited on), each line with a bounded read, as strict
JSON (no NaN, no number that overflows a float, nesting as deep as the parser allows) with strict types.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from specops.errors import SpecopsError
from specops.proxy.capture import FILE_PREFIX, FILE_SUFFIX, RECORD_VERSION

#: A capture line longer than this is refused (the proxy never writes one: ``max_record_bytes`` is at most 64 MiB).
MAX_LINE = 128 << 20
#: The latest capture time read (9999-12-31T23:59:59Z): later ones are no time the proxy wrote, nor one
#: ``time.localtime`` can show.
MAX_AT = 253_402_300_799


class DatasetError(SpecopsError):
    """A capture file that cannot be used; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class Example:
    """One prompt and the target's answer to it."""

    cls: str
    prompt: str
    output: str
    at: float

    @property
    def held_out(self) -> bool:
        """One example in ten, chosen by its prompt (so a prompt seen twice lands on the same side): never trained on."""
        return hashlib.blake2b(self.prompt.encode("utf-8", "replace"), digest_size=2).digest()[0] % 10 == 0


def capture_files(folder: Path) -> list[Path]:
    """The capture files of ``folder``, oldest first (a missing folder: none)."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no capture folder here (is `capture.enabled` on, and has the proxy served?)")
    return sorted(folder.glob(FILE_PREFIX + "*" + FILE_SUFFIX))


def prompt_text(record: dict) -> str:
    """The text the target continued: a completions prompt, or the chat messages one per line."""
    if "prompt" in record:
        return record["prompt"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in record["messages"]) + "assistant: "


def _check(record, where: str) -> Example:
    version = record.get("v") if isinstance(record, dict) else None
    if type(version) is not int or version != RECORD_VERSION:  # `true` is no version, though True == 1
        raise DatasetError(f'{where}: not a specops capture record (no `"v": {RECORD_VERSION}`)')
    for name, kind in (("output", str), ("class", str), ("at", (int, float))):
        if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool):
            raise DatasetError(f"{where}: field `{name}` is missing or not a {getattr(kind, '__name__', 'number')}")
    if not 0 <= record["at"] <= MAX_AT:
        raise DatasetError(f"{where}: field `at` is not a capture time (seconds since 1970, up to year 9999)")
    if isinstance(record.get("prompt"), str):
        pass
    elif isinstance(record.get("messages"), list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in record["messages"]
    ):
        pass
    else:
        raise DatasetError(f"{where}: field `prompt` (a string) or `messages` (role/content pairs) is missing")
    return Example(record["class"], prompt_text(record), record["output"], float(record["at"]))


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _open_regular(path: Path):
    """``path`` opened for reading if it is a regular file; a FIFO or a device is refused before any read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DatasetError(f"{path}: not a regular file: not a capture file")
    return os.fdopen(fd, "rb")


def read_examples(folder: Path) -> Iterator[Example]:
    """Every example of the capture folder (or one file), in order; a :class:`DatasetError` at the first bad line."""
    for path in capture_files(folder):
        with _open_regular(path) as fh:
            for number, raw in enumerate(iter(partial(fh.readline, MAX_LINE + 1), b""), start=1):
                where = f"{path}:{number}"
                if len(raw) > MAX_LINE:
                    raise DatasetError(f"{where}: a line longer than {MAX_LINE} bytes: not a capture file")
                if not raw.endswith(b"\n"):
                    raise DatasetError(f"{where}: the last record is cut short (no newline): a truncated file")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DatasetError(f"{where}: not UTF-8 text: not a capture file") from None
                try:
                    record = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
                except ValueError as exc:
                    column = getattr(exc, "colno", None)
                    at = f":{column}" if column else ""
                    raise DatasetError(
                        f"{where}{at}: not JSON ({getattr(exc, 'msg', exc)}): a corrupt record"
                    ) from None
                except RecursionError:
                    raise DatasetError(f"{where}: JSON nested too deeply: not a capture record") from None
                yield _check(record, where)


@dataclass
class ClassStats:
    records: int = 0
    held_out: int = 0
    prompt_chars: int = 0
    output_chars: int = 0


@dataclass
class Stats:
    files: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None
    classes: dict[str, ClassStats] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(c.records for c in self.classes.values())

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "records": self.records,
            "oldest": self.oldest,
            "newest": self.newest,
            "classes": {k: vars(v) for k, v in sorted(self.classes.items())},
        }


def stats(folder: Path) -> Stats:
    """What the capture folder holds, per class (every record read and checked)."""
    out = Stats()
    files = capture_files(folder)
    out.files = len(files)
    for ex in read_examples(folder):
        c = out.classes.setdefault(ex.cls, ClassStats())
        c.records += 1
        c.held_out += ex.held_out
        c.prompt_chars += len(ex.prompt)
        c.output_chars += len(ex.output)
        out.oldest = ex.at if out.oldest is None else min(out.oldest, ex.at)
        out.newest = ex.at if out.newest is None else max(out.newest, ex.at)
    out.bytes = sum(p.stat().st_size for p in files)  # each one was read as a regular file
    return out
