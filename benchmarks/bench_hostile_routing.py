"""Hostile clients against per-request routing (the round-three review, issue 37 items 1, 3 and 10): what they
cost a bystander, and what they write into the learned class table.

`specops up` runs as in production on the stand-in engine (tests/support_hostile_routing.py: ngram primary, a
`none` twin, an API key, classes keyed on `X-Task`, the rule `system: "You are a (.*) assistant"`,
`client_choice: forbid`). Then, from this process over loopback:

- 100 keyless ``GET /health`` with distinct ``X-Task`` values after one authenticated class (``legit-code``):
  whether it is still there, the attacker's classes and metrics labels, the classes forgotten;
- a system prompt of ``You are a `` repeated to 100 KB and to 300 KB, on a keyless ``GET /health`` and on an
  authenticated chat request: how long another client's ``GET /health`` sent meanwhile waits;
- once the default route has fallen back to the twin, 20 requests each with a fresh class key: how many the
  speculating engine served.

    .venv/bin/python benchmarks/bench_hostile_routing.py
    .venv/bin/python benchmarks/bench_hostile_routing.py --json out.json   # also write the figures, commit, machine

Before the fix: run it from a copy of an older tree (``git archive REV | tar -x -C /tmp/old``, then copy this file
and tests/support_hostile_routing.py in and run it there with ``PYTHONPATH=/tmp/old``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import write_report  # noqa: E402
from support_hostile_routing import (  # noqa: E402 - tests/ is put on sys.path above
    AUTH,
    HostileUp,
    attacked,
    chat,
    exchange,
    get_text,
    raw_request,
    system_body,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--json", metavar="PATH", help="also write the figures, the work tree's commit and the machine here"
    )
    args = ap.parse_args()
    load_before = os.getloadavg()
    figures: dict = {"flood": {}, "system_prompt": [], "fresh_keys": {}}
    up = HostileUp(Path(tempfile.mkdtemp(prefix="bench-hostile-routing-")))
    try:
        up.wait(lambda s: len(s.get("engines", [])) == 2 and all(e["live"] for e in s["engines"]), "two engines")
        assert chat(up.port, "legit-code")[0] == 200

        async def flood() -> list[int]:
            headers = "X-Task: attacker-{}-/home/alice/secret-token-abc\r\n"
            return [
                (await exchange(up.port, raw_request("GET", "/health", headers=headers.format(i))))[0]
                for i in range(100)
            ]

        answered = asyncio.run(flood()).count(200)
        routing = json.loads(get_text(up.port, "/specops/status"))["routing"]
        classes = [row["class"] for row in routing["classes"]]
        labels = set(re.findall(r'cls="([^"]*)"', get_text(up.port, "/specops/metrics")))
        figures["flood"] = {
            "requests": 100,
            "answered_200": answered,
            "legit_kept": "legit-code" in classes,
            "attacker_classes": sum("attacker" in c for c in classes),
            "classes_forgotten": routing.get("classes_forgotten"),
            "class_labels": len(labels),
            "attacker_labels": sum("attacker" in c for c in labels),
        }
        print(
            f"100 keyless GET /health, distinct X-Task: {answered} answered 200; legit-code kept: "
            f"{'legit-code' in classes}; attacker classes {sum('attacker' in c for c in classes)}, forgotten "
            f"{routing.get('classes_forgotten')}; class labels {len(labels)}, of them the attacker's "
            f"{sum('attacker' in c for c in labels)}"
        )
        for size in (100_000, 300_000):
            body = system_body(size)
            for what, attack in (
                ("keyless GET /health", raw_request("GET", "/health", body, "X-Task: probe\r\n")),
                ("chat with the key", raw_request("POST", "/v1/chat/completions", body, AUTH + "X-Task: probe\r\n")),
            ):
                waited, status = asyncio.run(attacked(up.port, attack, timeout=600))
                figures["system_prompt"].append(
                    {
                        "bytes": size,
                        "attack": what,
                        "status": status,
                        "bystander_waited_ms": None if math.isinf(waited) else waited,
                    }
                )
                print(
                    f"{size // 1000} KB system prompt, {what} (answered {status}): a bystander's /health waited {waited:.1f} ms",
                    flush=True,
                )
        for _ in range(3):  # the primary drafts (0.2 accepted): the default route falls back to the twin
            chat(up.port, "chat")
        up.wait(
            lambda s: any(e.get("current") and e["method"] == "none" for e in s.get("engines", [])), "the route change"
        )
        t0 = time.perf_counter()
        served = [chat(up.port, f"fresh-{i}")[1] for i in range(20)]
        figures["fresh_keys"] = {
            "requests": 20,
            "served_ngram": served.count("ngram"),
            "served_none": served.count("none"),
            "seconds": time.perf_counter() - t0,
        }
        print(
            f"20 fresh class keys after the fallback to none: {served.count('ngram')} served by ngram, {served.count('none')} by none ({time.perf_counter() - t0:.1f} s)"
        )
    finally:
        up.stop()
    if args.json:
        write_report(args.json, ROOT, load_before, **figures)


if __name__ == "__main__":
    main()
