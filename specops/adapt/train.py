"""``specops adapt train``: a new draft for the profile from the captured traffic, in the engine's own format.

llama.cpp: a llama-architecture GGUF draft, started from the target's own first layers (by default; or the
current draft, or random weights: :func:`initial_draft`), trained on the captured prompts and the target's
answers, written with the target's tokenizer so llama-server takes it as ``-md``. The training runs in a
subprocess with torch (the vLLM venv's interpreter, or ``--python``): :mod:`specops.adapt.train_worker`.
This module reads and writes GGUF (the ``gguf`` package, numpy), plans, estimates memory and reports
progress; it never imports torch.

Held-out examples (one in ten, by prompt: :attr:`specops.adapt.dataset.Example.held_out`) are never trained
on: they are written to ``heldout.jsonl`` for ``specops adapt promote`` to measure on.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specops.adapt.dataset import read_examples
from specops.errors import SpecopsError

#: A run is refused when its estimate exceeds this share of the memory available now.
MEMORY_SHARE = 0.8
_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class TrainOptions:
    steps: int = 300
    lr: float = 1e-3
    batch: int = 8
    seq: int = 256
    seed: int = 0
    layers: int = 1  # of the target, when the draft starts from it
    init: str = "auto"  # auto (= target) | target | draft | scratch
    checkpoint_every: int = 50
    threads: int | None = None
    only_class: str | None = None
    min_agreement: float = 0.9  # of the captured answer tokens the target must choose again (0: no check)

    def loop(self) -> dict:
        """The fields of a worker's job that drive its training loop (the vLLM workers read them by these names)."""
        return {"steps": self.steps, "lr": self.lr, "batch": self.batch, "seq": self.seq, "seed": self.seed,
                "checkpoint_every": self.checkpoint_every, "threads": self.threads}  # fmt: skip


@dataclass
class TrainOutcome:
    draft: Path
    folder: Path
    result: dict
    train_examples: int
    heldout_examples: int
    init_from: str
    memory_bytes: int


# ------------------------------------------------------------------------------------------- GGUF


def _field(reader, name: str, default=None):
    f = reader.fields.get(name)
    return default if f is None else f.contents()


def read_gguf(path: Path) -> tuple[dict, dict, dict]:
    """(dims, float32 tensors, vocab) of a llama-architecture GGUF; SpecopsError naming the file otherwise."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise SpecopsError(f"{path}: not a readable GGUF file: {exc}") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SpecopsError(
            f"{path}: architecture {arch!r}: `specops adapt train` writes llama-architecture drafts only"
        )
    dims = {
        "hidden": int(_field(reader, "llama.embedding_length")),
        "layers": int(_field(reader, "llama.block_count")),
        "ffn": int(_field(reader, "llama.feed_forward_length")),
        "heads": int(_field(reader, "llama.attention.head_count")),
        "heads_kv": int(_field(reader, "llama.attention.head_count_kv", _field(reader, "llama.attention.head_count"))),
        "eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_base": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "ctx": int(_field(reader, "llama.context_length", 2048)),
    }
    tensors = {}
    for t in reader.tensors:
        data = (
            t.data
            if t.tensor_type in (gguf.GGMLQuantizationType.F32,)
            else gguf.quants.dequantize(t.data, t.tensor_type)
        )
        tensors[t.name] = np.asarray(data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
    model = _field(reader, "tokenizer.ggml.model")
    vocab = {
        "model": model,
        "tokens": _field(reader, "tokenizer.ggml.tokens", []),
        "scores": _field(reader, "tokenizer.ggml.scores", []),
        "types": _field(reader, "tokenizer.ggml.token_type", []),
        "bos": _field(reader, "tokenizer.ggml.bos_token_id"),
        "unk": _field(reader, "tokenizer.ggml.unknown_token_id", 0),
        "space_prefix": _field(reader, "tokenizer.ggml.add_space_prefix", True),
        "kv": {name: (f.types, f.contents()) for name, f in reader.fields.items() if name.startswith("tokenizer.")},
    }
    return dims, tensors, vocab


def write_gguf(path: Path, tensors: dict, dims: dict, vocab: dict, name: str) -> None:
    """A float32 llama GGUF with ``dims`` and the target's tokenizer keys copied as they are."""
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(dims["ctx"])
    w.add_embedding_length(dims["hidden"])
    w.add_block_count(dims["layers"])
    w.add_feed_forward_length(dims["ffn"])
    w.add_head_count(dims["heads"])
    w.add_head_count_kv(dims["heads_kv"])
    w.add_layer_norm_rms_eps(dims["eps"])
    w.add_rope_dimension_count(dims["hidden"] // dims["heads"])
    w.add_rope_freq_base(dims["rope_base"])
    w.add_vocab_size(len(vocab["tokens"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, (types, value) in vocab["kv"].items():
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, list(value), types[0], sub_type=types[-1])
        else:
            w.add_key_value(key, value, types[0])
    for tname in sorted(tensors, key=_tensor_order):
        w.add_tensor(tname, np.ascontiguousarray(tensors[tname], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def _tensor_order(name: str):
    if name.startswith("blk."):
        i = int(name.split(".")[1])
        return (1, i, name)
    return (0 if name == "token_embd.weight" else 2, 0, name)


def initial_draft(target: Path, draft: Path | None, opts: TrainOptions) -> tuple[dict, dict, dict, str]:
    """(dims, tensors, vocab, where from) of the draft before training.

    ``auto`` (the default) and ``target``: the target's own first ``--layers`` (its embeddings, first blocks,
    norm and head, as the layer-skip draft is made): it starts out computing most of what the target computes,
    so distillation only has to close the gap, which a draft from scratch rarely does on the traffic one
    captures. ``draft``: fine-tune the current draft (a llama GGUF with the target's vocabulary). ``scratch``:
    random weights in the target's shape with ``--layers`` blocks (the reference point, or where the target's
    blocks are not llama's: what ``auto`` falls back to then).
    """
    t_dims, t_tensors, vocab = read_gguf(target)
    if vocab["model"] != "llama":
        raise SpecopsError(
            f"{target}: tokenizer {vocab['model']!r}: `specops adapt train` reads SPM (`llama`) vocabularies only"
        )
    if opts.init == "draft":
        if draft is None or draft.suffix != ".gguf" or not draft.is_file():
            raise SpecopsError("--init draft: the profile names no local GGUF draft")
        d_dims, d_tensors, d_vocab = read_gguf(draft)
        if d_vocab["tokens"] != vocab["tokens"]:
            raise SpecopsError(f"{draft}: its vocabulary is not the target's: cannot fine-tune it")
        return d_dims, d_tensors, vocab, f"the current draft {draft.name}"
    n = max(1, min(opts.layers, t_dims["layers"]))
    keep = {k: v for k, v in t_tensors.items() if not k.startswith("blk.") or int(k.split(".")[1]) < n}
    missing = [f"blk.0.{p}.weight" for p in _LAYER if f"blk.0.{p}.weight" not in keep]
    if opts.init == "scratch" or (missing and opts.init == "auto"):
        return (
            {**t_dims, "layers": n},
            scratch_tensors(t_dims, len(vocab["tokens"]), n, opts.seed),
            vocab,
            (f"random weights ({n} layer(s), the target's shape)"),
        )
    if missing:
        raise SpecopsError(
            f"{target}: no {', '.join(missing)}: not a llama layout specops can start a draft from "
            "(--init scratch trains one from random weights)"
        )
    return {**t_dims, "layers": n}, keep, vocab, f"the target's first {n} layer(s)"


def scratch_tensors(dims: dict, n_vocab: int, layers: int, seed: int) -> dict:
    """Random llama weights (scaled by fan-in, norms at one) in the target's shape, ``layers`` blocks."""
    rng = np.random.default_rng(seed)
    E, FF = dims["hidden"], dims["ffn"]
    kv = E // dims["heads"] * dims["heads_kv"]

    def w(*shape, fan):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan)).astype(np.float32)

    t = {
        "token_embd.weight": (rng.standard_normal((n_vocab, E), dtype=np.float32)).astype(np.float32),
        "output_norm.weight": np.ones(E, np.float32),
        "output.weight": w(n_vocab, E, fan=E),
    }
    for i in range(layers):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = np.ones(E, np.float32)
        t[b + "ffn_norm.weight"] = np.ones(E, np.float32)
        t[b + "attn_q.weight"] = w(E, E, fan=E)
        t[b + "attn_k.weight"] = w(kv, E, fan=E)
        t[b + "attn_v.weight"] = w(kv, E, fan=E)
        t[b + "attn_output.weight"] = w(E, E, fan=E)
        t[b + "ffn_gate.weight"] = w(FF, E, fan=E)
        t[b + "ffn_up.weight"] = w(FF, E, fan=E)
        t[b + "ffn_down.weight"] = w(E, FF, fan=FF)
    return t


# ------------------------------------------------------------------------------------------- memory


def memory_estimate(dims: dict, n_vocab: int, opts: TrainOptions) -> int:
    """Bytes the training needs at most: weights, gradients and two AdamW moments (float32), and activations."""
    E, L, FF = dims["hidden"], dims["layers"], dims["ffn"]
    params = 2 * n_vocab * E + L * (4 * E * E + 3 * E * FF + 2 * E) + E
    B, T = opts.batch, opts.seq
    activations = B * T * (L * (12 * E + 3 * FF + 2 * dims["heads"] * T) + 4 * n_vocab)
    return 4 * (4 * params + 2 * activations) + (256 << 20)  # + the interpreter and torch


def prepare_run(out: Path, train: list, held: list, need: int, opts: TrainOptions) -> tuple[Path, str]:
    """Refuse a run that would not fit in memory (``need`` bytes), before anything is written; then the private
    run folder with the examples to train on and the held-out ones. → the folder and the examples' text."""
    from specops.paths import private_dir

    have = available_memory()
    if have is not None and need > MEMORY_SHARE * have:
        raise SpecopsError(
            f"the training would need about {need / 2**30:.1f} GiB and {have / 2**30:.1f} GiB is available: "
            f"lower --batch ({opts.batch}) or --seq ({opts.seq}), or train where more memory is free"
        )
    out = private_dir(out)
    examples_text = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in train)
    _write(out / "examples.jsonl", examples_text)
    _write(out / "heldout.jsonl", "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in held))
    return out, examples_text


def split_examples(capture: Path, only_class: str | None) -> tuple[list[dict], list[dict]]:
    """The captured examples to train on and the held-out ones (one in ten, by prompt), of ``only_class`` when
    given; SpecopsError when none is left to train on."""
    train, held = [], []
    for ex in read_examples(capture):
        if only_class is not None and ex.cls != only_class:
            continue
        (held if ex.held_out else train).append({"prompt": ex.prompt, "output": ex.output, "class": ex.cls})
    if not train:
        raise SpecopsError(
            f"{capture}: no captured example to train on" + (f" of class {only_class!r}" if only_class else "")
        )
    return train, held


def run_job(
    python: Path, out: Path, job: dict, examples_text: str, weights: Path, info: dict, module: str, on_progress
) -> dict:
    """Write ``job`` into ``out`` under an id of what it trains on (the examples, its settings but ``threads`` and
    ``steps``, and the sizes and times of the ``*.safetensors`` in ``weights``: a run of the same id resumes), run
    the worker ``module`` on it, and keep its result with ``info`` in ``train-info.json``."""
    files = sorted(p.name + str(p.stat().st_size) + str(p.stat().st_mtime_ns) for p in weights.glob("*.safetensors"))
    job["id"] = _digest(examples_text.encode(), {k: v for k, v in job.items() if k not in ("threads", "steps")}, files)
    _write(out / "job.json", json.dumps(job))
    result = run_worker(python, out, on_progress, module=module)
    _write(out / "train-info.json", json.dumps({**info, **result}, indent=1))
    return result


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------------------- the run


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def train_llamacpp(
    target: Path,
    draft: Path | None,
    capture: Path,
    out: Path,
    opts: TrainOptions,
    *,
    python: Path,
    on_progress: Callable[[dict], None] = lambda d: None,
) -> TrainOutcome:
    """Train a GGUF draft into ``out`` (resuming a run of the same job there). See the module docstring."""

    train, held = split_examples(capture, opts.only_class)
    dims, tensors, vocab, init_from = initial_draft(target, draft, opts)
    need = memory_estimate(dims, len(vocab["tokens"]), opts)
    out, examples_text = prepare_run(out, train, held, need, opts)
    np.savez(out / "init.npz", **tensors)
    t_dims, t_tensors, _ = read_gguf(target)
    np.savez(out / "teacher.npz", **t_tensors)
    del t_tensors
    job = {
        "kind": "llama-draft",
        "init": str(out / "init.npz"),
        "examples": str(out / "examples.jsonl"),
        "dims": dims,
        "teacher": str(out / "teacher.npz"),
        "teacher_dims": t_dims,
        "vocab": {k: v for k, v in vocab.items() if k != "kv"},
        "steps": opts.steps,
        "lr": opts.lr,
        "batch": opts.batch,
        "seq": opts.seq,
        "seed": opts.seed,
        "checkpoint_every": opts.checkpoint_every,
        "threads": opts.threads,
        "min_agreement": opts.min_agreement,
    }
    job["id"] = _digest(
        examples_text.encode(),
        {k: v for k, v in job.items() if k not in ("threads", "min_agreement")},
        [tensors[k].tobytes()[:4096] for k in sorted(tensors)],
    )
    _write(out / "job.json", json.dumps(job))
    result = run_worker(python, out, on_progress)
    path = out / "draft.gguf"
    trained = np.load(out / "draft.npz")
    write_gguf(path, {k: trained[k] for k in trained.files}, dims, vocab, "specops-adapt-draft")
    info = {
        "target": str(target),
        "init_from": init_from,
        "train_examples": len(train),
        "heldout_examples": len(held),
        "memory_estimate": need,
        **result,
    }
    _write(out / "train-info.json", json.dumps(info, indent=1))
    return TrainOutcome(path, out, result, len(train), len(held), init_from, need)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def run_worker(
    python: Path, out: Path, on_progress: Callable[[dict], None], module: str = "specops.adapt.train_worker"
) -> dict:
    """Run the training worker ``module`` on ``out/job.json`` in ``python`` (the engine's venv, which has torch),
    passing its progress events on; its result. Its stderr goes to ``out/train.log`` (0600)."""
    import specops

    source = str(Path(specops.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": source, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    log = out / "train.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        proc = subprocess.Popen(
            [str(python), "-m", module, str(out / "job.json")],
            stdout=subprocess.PIPE,
            stderr=fd,
            text=True,
            cwd=out,
            env=env,
        )
    except OSError as exc:
        os.close(fd)
        raise SpecopsError(f"cannot start the training interpreter {python}: {exc.strerror or exc}") from None
    os.close(fd)
    last: dict = {}
    try:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            last = event
            on_progress(event)
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise SpecopsError(
            f"training interrupted; run the same command again to resume from {out / 'checkpoint.pt'}"
        ) from None
    if code != 0 or not last.get("done"):
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        why = last.get("error") or " | ".join(tail) or f"exit status {code}"
        raise SpecopsError(f"training failed ({python}): {why} (log: {log})")
    return json.loads((out / "result.json").read_text(encoding="utf-8"))


def progress_line(event: dict, started: float) -> str | None:
    """One line for a worker event: step, loss, ETA."""
    if "resumed" in event:
        return f"resuming after step {event['resumed']}"
    if "heldout_agreement" in event:
        return f"step {event['step']}/{event['of']}: held-out agreement {event['heldout_agreement']:.3f}"
    if "step" in event:
        eta = event.get("eta_s")
        left = f", ETA {int(eta // 60)}:{int(eta % 60):02d}" if eta is not None else ""
        width, done = 24, event["step"] / max(1, event["of"])
        bar = "#" * int(width * done) + "-" * (width - int(width * done))
        return f"[{bar}] step {event['step']}/{event['of']} loss {event['loss']:.3f}{left} ({time.monotonic() - started:.0f}s)"
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `specops adapt train`")
