"""Hostile files that specops reads (safe to expose, round three): each one through the real CLI, in a subprocess
whose address space is capped, with its time and peak memory measured.

- a GGUF whose declared arrays are huge (a million empty tokens, a 30 MB byte array, a count past the file's
  end): ``specops init`` and ``validate --resolve`` read only the metadata they need, in bounded time and memory;
- the goodput surface (``fallback.goodput.surface``) as a link to /dev/zero, a FIFO, or deeply nested JSON;
- ``adapt capture-stats --from`` on deep nesting, NaN, 1e999, a FIFO, or ``"v": true``;
- a prompt holding U+2028 written to ``adapt train``'s held-out file is read back by ``adapt promote``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SPECOPS = Path(sys.executable).with_name("specops")
#: The address space a hostile-file run may use: a real run needs a few hundred MB; the old GGUF reader took 6 GB.
ADDRESS_SPACE = 1536 << 20
#: What a bounded run may take: seconds of wall time (a shared 2-core machine) and MiB of peak resident memory.
MAX_SECONDS = 20
MAX_RSS_MIB = 400


@dataclass
class Bounded:
    code: int
    output: str
    seconds: float
    rss_mib: float
    timed_out: bool


#: Runs ``argv[2:]`` in a child and writes that child's exit code and peak RSS (KiB) to ``argv[1]``. The peak is
#: measured from this small interpreter, not from the test worker: Linux carries the high-water RSS of the process
#: that forks across ``exec`` (``signal->maxrss``), so a child forked straight from a 400 MB pytest worker would
#: report the worker's memory as its own.
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def run_bounded(*args, timeout: float = 60, env: dict | None = None, cwd: Path | None = None) -> Bounded:
    """``specops ARGS`` in a subprocess under :data:`ADDRESS_SPACE` (offline unless ``env`` says otherwise; a
    value of None unsets a variable); its wall time and peak RSS (``wait4`` in :data:`LAUNCHER`)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    full = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}
    stem = (cwd or Path(os.environ.get("TMPDIR", "/tmp"))) / f"bounded-{os.getpid()}-{time.monotonic_ns()}"
    log, measured = stem.with_suffix(".log"), stem.with_suffix(".rss")
    start = time.monotonic()
    timed_out = False
    with open(log, "w+", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(measured), str(SPECOPS), *map(str, args)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full,
            cwd=cwd,
            start_new_session=True,  # a timeout kills the launcher and specops together
            preexec_fn=cap,  # noqa: PLW1509 - setrlimit only, before exec
        )
        while proc.poll() is None:
            if time.monotonic() - start > timeout and not timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
                timed_out = True
            time.sleep(0.02)
        out.seek(0)
        text = out.read()
    log.unlink()
    code, rss_kib = (int(v) for v in measured.read_text().split()) if measured.exists() else (proc.returncode, 0)
    measured.unlink(missing_ok=True)
    return Bounded(code, text, time.monotonic() - start, rss_kib / 1024, timed_out)


def assert_bounded(r: Bounded) -> None:
    assert not r.timed_out, f"still running after the timeout:\n{r.output[-2000:]}"
    assert r.seconds < MAX_SECONDS and r.rss_mib < MAX_RSS_MIB, (r.seconds, r.rss_mib, r.output[-2000:])
    assert "Traceback" not in r.output, r.output[-3000:]


# ------------------------------------------------------------------------------------------ hostile GGUF files


def _gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf(path: Path, keys: int, *pieces: bytes, tail: bytes = b"") -> Path:
    """A GGUF v3 file with no tensors: the header declaring ``keys`` key/value pairs, then ``pieces``."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, keys) + b"".join(pieces) + tail)
    return path


def _text_kv(key: str, value: str) -> bytes:
    return _gguf_string(key.encode()) + struct.pack("<I", 8) + _gguf_string(value.encode())


def _array_head(key: str, elem_type: int, count: int) -> bytes:
    return _gguf_string(key.encode()) + struct.pack("<IIQ", 9, elem_type, count)


def empty_tokens(path: Path, count: int) -> Path:
    """A llama vocab of ``count`` empty token texts (8 bytes each: the length 0)."""
    head = _text_kv("general.architecture", "llama") + _text_kv("tokenizer.ggml.model", "llama")
    return _gguf(path, 3, head, _array_head("tokenizer.ggml.tokens", 8, count), tail=bytes(8 * count))


def byte_array(path: Path, count: int) -> Path:
    """An unused uint8 array of ``count`` elements."""
    head = _text_kv("general.architecture", "llama")
    return _gguf(path, 2, head, _array_head("tokenizer.ggml.token_type", 0, count), tail=b"\x01" * count)


HOSTILE_GGUF = {
    "1M-empty-tokens-8MB": lambda p: empty_tokens(p, 1_000_000),
    "4M-empty-tokens-32MB": lambda p: empty_tokens(p, 4_000_000),
    "uint8-array-30MB": lambda p: byte_array(p, 30_000_000),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", sorted(HOSTILE_GGUF))
def test_a_hostile_gguf_takes_bounded_time_and_memory_in_init_and_validate(tmp_path, kind):
    """The old reader built every array element: 26 s and 1.6 GB for the 8 MB file, over 120 s and 5.6 GB for
    the 30 MB one. Now init and validate --resolve read the few keys the checks use and skip the rest."""
    model = HOSTILE_GGUF[kind](tmp_path / f"{kind}.gguf")
    init = run_bounded(
        "init", model, "--backend", "llamacpp", "--non-interactive", "--offline", "-o", tmp_path / "init.yaml"
    )
    assert init.code == 0, init.output[-3000:]
    assert_bounded(init)
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"name: hostile\nbackend: llamacpp\nmodel: {{id: {model}}}\n"
        f"speculative: {{method: draft_model, draft: {model}}}\n"
    )
    validate = run_bounded("validate", "--resolve", profile)
    assert validate.code == 0 and f"ok      {profile}" in validate.output, validate.output[-3000:]
    assert_bounded(validate)


@pytest.mark.parametrize(
    "pieces,why",
    [
        ((_array_head("tokenizer.ggml.tokens", 8, 1 << 62),), "a declared size runs past the end of the file"),
        ((_array_head("tokenizer.ggml.token_type", 0, 1 << 40),), "a declared size runs past the end of the file"),
        ((_gguf_string(b"general.architecture") + struct.pack("<IQ", 8, 1 << 50),), "a declared size runs past"),
        ((_array_head("x", 9, 4),), "an array of value type 9 (only arrays of numbers or strings are read)"),
        ((), "it declares 4611686018427387904 metadata keys"),
    ],
)
def test_a_gguf_whose_declared_sizes_exceed_the_file_is_refused_with_the_reason(tmp_path, pieces, why):
    model = _gguf(tmp_path / "m.gguf", 1 << 62 if not pieces else 1, *pieces, tail=bytes(64))
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"name: h\nbackend: llamacpp\nmodel: {{id: {model}}}\nspeculative: {{method: draft_model, draft: {model}}}\n"
    )
    r = run_bounded("resolve", profile, env={"HF_HUB_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert f"note     {model}: cannot read GGUF metadata (GGUFError: {why}" in r.output, r.output[-3000:]
    assert_bounded(r)


# ------------------------------------------------------------------------------------------ the goodput surface

GOODPUT_PROFILE = (
    "name: g\nbackend: llamacpp\nmodel: {id: /m/t.gguf}\n"
    "speculative: {method: draft_model, draft: /m/d.gguf, num_speculative_tokens: 4}\n"
    "fallback:\n  mode: goodput\n  goodput:\n    surface: surface.tune.json\n"
)


def _hostile_surface(path: Path, kind: str) -> None:
    if kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # nobody ever writes: a plain open() waits forever
    else:
        path.write_text("[" * 100_000)


@pytest.mark.parametrize(
    "kind,why",
    [
        ("link-to-dev-zero", "not a regular file: {surface}"),
        ("fifo", "not a regular file: {surface}"),
        ("deep-nesting", "{surface} is not a tune record: JSON nested too deeply"),
    ],
)
def test_a_hostile_goodput_surface_is_a_located_error(tmp_path, kind, why):
    """`specops watch PROFILE` reads the surface the way `up` does (the policy's profile_surface): the old read
    took 2.7 GB before a MemoryError, waited forever on the FIFO, and raised RecursionError."""
    profile = tmp_path / "p.yaml"
    profile.write_text(GOODPUT_PROFILE)
    surface = tmp_path / "surface.tune.json"
    _hostile_surface(surface, kind)
    r = run_bounded("watch", profile, "--once", timeout=30)
    assert r.code == 1, r.output[-3000:]
    message = why.format(surface=surface)
    assert f"{profile}:8:14: fallback.goodput.surface: {message} (relative to {tmp_path})" in r.output, r.output
    assert_bounded(r)


# ------------------------------------------------------------------------------------------ adapt's files


def _capture_record(prompt: str, **fields) -> bytes:
    record = {"v": 1, "at": 1767225600.0, "path": "/v1/completions", "class": "-", "prompt": prompt, "output": "ok"}
    return json.dumps({**record, **fields}).encode() + b"\n"


CAPTURE_PROFILE = "name: c\nbackend: llamacpp\nmodel: {id: /m/t.gguf}\nspeculative: {method: ngram}\n"


@pytest.mark.parametrize(
    "second_line,says",
    [
        (b"[" * 100_000 + b"\n", "{file}:2: JSON nested too deeply: not a capture record"),
        (_capture_record("p").replace(b"1767225600.0", b"NaN"), "{file}:2: not JSON (NaN is not a JSON number)"),
        (
            _capture_record("p").replace(b"1767225600.0", b"1e999"),
            "{file}:2: not JSON (the number 1e999 is out of range)",
        ),
        (_capture_record("p", at=1e300), "{file}:2: field `at` is not a capture time"),
        (_capture_record("p", at=10**400), "{file}:2: field `at` is not a capture time"),
        (_capture_record("p", v=True), '{file}:2: not a specops capture record (no `"v": 1`)'),
        (_capture_record("p", v=1.0), '{file}:2: not a specops capture record (no `"v": 1`)'),
    ],
    ids=["deep-nesting", "nan", "1e999", "year-10^292", "huge-int", "v-true", "v-float"],
)
def test_capture_stats_refuses_a_hostile_capture_line_at_its_file_and_line(tmp_path, second_line, says):
    folder = tmp_path / "cap"
    folder.mkdir()
    bad = folder / "capture-00000000000000000001.jsonl"
    bad.write_bytes(_capture_record("fine") + second_line)
    profile = tmp_path / "p.yaml"
    profile.write_text(CAPTURE_PROFILE)
    r = run_bounded("adapt", "capture-stats", profile, "--from", folder, timeout=30)
    assert r.code == 1 and f"error: {says.format(file=bad)}" in r.output, r.output[-3000:]
    assert_bounded(r)


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_capture_stats_never_waits_on_a_fifo_or_reads_a_device(tmp_path, kind):
    folder = tmp_path / "cap"
    folder.mkdir()
    (folder / "capture-00000000000000000001.jsonl").write_bytes(_capture_record("fine"))
    hostile = folder / "capture-00000000000000000002.jsonl"
    if kind == "fifo":
        os.mkfifo(hostile)
    else:
        hostile.symlink_to("/dev/zero")
    profile = tmp_path / "p.yaml"
    profile.write_text(CAPTURE_PROFILE)
    r = run_bounded("adapt", "capture-stats", profile, "--from", folder, timeout=30)
    assert r.code == 1 and f"error: {hostile}: not a regular file: not a capture file" in r.output, r.output[-3000:]
    assert_bounded(r)


@pytest.mark.timeout(180)
def test_a_held_out_prompt_with_a_line_separator_is_read_back_by_promote(tmp_path):
    """`adapt train` writes heldout.jsonl as JSON lines with ensure_ascii=False, so U+2028 stays raw in a line;
    `adapt promote` split it there (str.splitlines) and refused the file it had just been given."""
    from specops.adapt.dataset import Example
    from specops.devenv.testmodels import ensure_tiny_models
    from specops.proxy.capture import Capture, CaptureFiles, CaptureSettings

    target = ensure_tiny_models(["gguf"])["gguf-target.gguf"]
    prompts = [f"first line {i}\u2028second line\u0085third" for i in range(40)]
    assert any(Example("-", p, "", 0).held_out for p in prompts) and not all(
        Example("-", p, "", 0).held_out for p in prompts
    )
    folder = tmp_path / "cap"
    cap = Capture(CaptureFiles(folder, 1 << 20, 1 << 18, 3600), CaptureSettings(1.0, 4096, frozenset()))
    answer = json.dumps({"choices": [{"text": "four"}]}).encode()
    for prompt in prompts:  # through the proxy's own capture, as traffic would be
        cap.offer(cap.tap("POST", "/v1/completions", json.dumps({"prompt": prompt}).encode(), None), 200, answer)
    cap.close()
    profile = tmp_path / "p.yaml"
    profile.write_text(f"name: a\nbackend: llamacpp\nmodel: {{id: {target}}}\nspeculative: {{method: ngram}}\n")
    work = tmp_path / "work"
    # the worker interpreter is /bin/false: the run folder is written, then the training itself fails
    train = run_bounded("adapt", "train", profile, "--from", folder, "--out", work, "--python", "/bin/false")
    assert train.code == 1 and "Traceback" not in train.output, train.output[-3000:]
    heldout = work / "heldout.jsonl"
    assert "\u2028" in heldout.read_text(encoding="utf-8")
    promote = run_bounded("adapt", "promote", profile, target, "--heldout", heldout)
    assert "not a held-out example" not in promote.output, promote.output[-3000:]
    # read back whole: promote went on to the profile, which has no draft to compare with
    assert promote.code == 1 and "speculative.draft is not set: nothing to compare the new draft with" in promote.output
