"""Real code-completion prompts for the adapted-draft benchmark on Qwen2.5-Coder, and a client that sends them.

``write`` cuts prompts from the Python standard library of the interpreter that runs it: each function of
eight lines or more, from its ``def`` to a point 30-60 % into its body, the way the built-in ``code`` set
starts a completion. Modules are split before prompts are cut, so no held-out prompt comes from a file a
training prompt came from: ``train.jsonl`` (captured, trained on) and ``heldout.jsonl`` (benched only), in
the JSON Lines format ``specops bench -p`` reads.

``--style instruct`` writes requests in words instead: "Write a Python function ``name(args)`` that ..." with
the first sentence of the function's docstring, in Qwen2.5's chat template (the model's own turn markers, as its
``tokenizer_config.json`` renders one user turn), so the answer is new code the prompt does not contain: the
workload where prompt lookup has little to copy.

``send`` posts every prompt of a file to a proxy (``specops up`` with ``capture:`` on) as greedy completions,
``-c`` at a time: the capture is what ``specops adapt train`` learns from.

    .venv/bin/python benchmarks/real/adapt_prompts.py write OUT --train 160 --heldout 24
    .venv/bin/python benchmarks/real/adapt_prompts.py write OUT --style instruct --max-tokens 96
    .venv/bin/python benchmarks/real/adapt_prompts.py write MORE --style instruct --per-module 100 --train 800 \
        --skip OUT/train.jsonl           # more training prompts from the same modules, none captured before
    .venv/bin/python benchmarks/real/adapt_prompts.py send OUT/train.jsonl --url http://127.0.0.1:8080 -c 8
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import sysconfig
import time
from pathlib import Path


def functions(path: Path) -> list[list[str]]:
    """The source lines of every function in ``path`` with 8 to 60 lines, dedented to its ``def``."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            body = lines[node.lineno - 1 : node.end_lineno]
            if 8 <= len(body) <= 60 and all(ln.isascii() for ln in body):
                indent = len(body[0]) - len(body[0].lstrip())
                out.append([ln[indent:] if ln[:indent].strip() == "" else ln for ln in body])
    return out


QWEN_TURN = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def instruction(body: list[str]) -> str | None:
    """A request in words for the function ``body``: its signature and its docstring's first sentence."""
    try:
        node = ast.parse("\n".join(body)).body[0]
    except (SyntaxError, IndexError):
        return None
    doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if not doc:
        return None
    summary = " ".join(doc.split("\n\n")[0].split())
    if not 20 <= len(summary) <= 300:
        return None
    args = ast.unparse(node.args)
    return QWEN_TURN.format(f"Write a Python function `{node.name}({args})`. {summary}")


def cut(body: list[str], rng: random.Random) -> str:
    """The function from its ``def`` to 30-60 % of its lines (at least three), ending with a newline."""
    n = max(3, int(len(body) * rng.uniform(0.3, 0.6)))
    return "\n".join(body[:n]) + "\n"


def write(
    out: Path,
    n_train: int,
    n_heldout: int,
    max_tokens: int,
    seed: int,
    style: str = "complete",
    per_module: int = 3,
    skip: Path | None = None,
) -> None:
    """Training and held-out prompts; ``skip`` names a prompt file whose prompts are left out (a capture's)."""
    skipped = set()
    if skip is not None:
        skipped = {json.loads(ln)["prompt"] for ln in skip.read_text(encoding="utf-8").splitlines() if ln.strip()}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    rng = random.Random(seed)
    rng.shuffle(modules)
    held_modules = set(modules[: len(modules) // 5])
    pools: dict[str, list[str]] = {"train": [], "heldout": []}
    for mod in modules:
        fns = functions(mod)
        rng.shuffle(fns)
        if style == "instruct":
            made = [t for t in map(instruction, fns) if t][:per_module]
        else:
            made = [cut(f, rng) for f in fns[:per_module]]
        pools["heldout" if mod in held_modules else "train"] += [p for p in made if p not in skipped]
    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("heldout", n_heldout)):
        pool = pools[name]
        rng.shuffle(pool)
        label = f"stdlib-{name}" if style == "complete" else f"stdlib-{style}-{name}"
        rows = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "set": label} for p in pool[:n]]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{out / f'{name}.jsonl'}: {len(rows)} prompts")


async def send(path: Path, url: str, concurrency: int) -> None:
    import aiohttp

    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    queue: asyncio.Queue = asyncio.Queue()
    for row in rows:
        queue.put_nowait(row)
    done, t0 = 0, time.monotonic()

    async def worker(session) -> None:
        nonlocal done
        while not queue.empty():
            row = queue.get_nowait()
            body = {"prompt": row["prompt"], "max_tokens": row["max_tokens"], "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    print("status", resp.status, flush=True)
            done += 1
            if done % 10 == 0:
                print(f"{done}/{len(rows)} in {time.monotonic() - t0:.0f} s", flush=True)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    print(f"{done} sent in {time.monotonic() - t0:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    w.add_argument("--train", type=int, default=160)
    w.add_argument("--heldout", type=int, default=24)
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--seed", type=int, default=39)
    w.add_argument("--style", choices=("complete", "instruct"), default="complete")
    w.add_argument("--per-module", type=int, default=3, help="functions taken from each module (default 3)")
    w.add_argument("--skip", type=Path, help="a prompt file whose prompts are left out (what was captured before)")
    s = sub.add_parser("send")
    s.add_argument("file", type=Path)
    s.add_argument("--url", default="http://127.0.0.1:8080")
    s.add_argument("-c", type=int, default=4)
    args = ap.parse_args()
    if args.cmd == "write":
        write(args.out, args.train, args.heldout, args.max_tokens, args.seed, args.style, args.per_module, args.skip)
    else:
        asyncio.run(send(args.file, args.url, args.c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
