"""``specops status --fleet`` over two real ``specops up`` on llama-server, scraped by a real Prometheus.

Two replicas of one deployment (one drafting with a draft model, one with n-grams), each with its own
``pod`` label as a PodMonitor would write it; clients send completions to both; the fleet view must name
each replica's method as ``specops status`` reads it from the replica itself, and add the fleet up.
"""

from __future__ import annotations

import json
import time

import pytest
from support_cli import run as run_cli
from support_prometheus import labelled_prometheus, require_prometheus, wait_until
from support_up import UpRun, http_json, llama_profile

pytestmark = [pytest.mark.engines, pytest.mark.prometheus, pytest.mark.timeout(300)]


def test_fleet_view_of_two_specops_up_on_llama_server(tmp_path, tiny_gguf_models):
    require_prometheus()
    fast = {"monitor": {"interval": 1}, "fallback": {"window": "30s", "min_draft_tokens": 1}}
    pa = llama_profile(tmp_path, tiny_gguf_models, "fleet-a", **fast)
    pb = llama_profile(tmp_path, tiny_gguf_models, "fleet-b", method="ngram", target="gguf-cycle.gguf", **fast)
    with UpRun(pa, tmp_path / "state", "fleet-a") as a, UpRun(pb, tmp_path / "state", "fleet-b") as b:
        sa, sb = a.wait_ready(timeout=120), b.wait_ready(timeout=120)
        targets = {"replica-a": sa["url"].split("//")[1], "replica-b": sb["url"].split("//")[1]}
        with labelled_prometheus(tmp_path / "prom", targets) as prom:
            # Prometheus must see the counters before they move (increase() counts nothing before a series'
            # first sample), as it does in a deployment scraped since its pods started
            wait_until(lambda: prom.value("count(specops_active_method == 1)") == 2, 60, "both replicas scraped")
            time.sleep(1.5)
            for url, prompt, n in (
                (sa["url"], "the quick brown fox", 48),
                (sb["url"], "the quick brown fox jumps over the lazy dog the quick brown fox", 200),
            ):
                for _ in range(2):
                    status, body = http_json(
                        url + "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0}
                    )
                    assert status == 200, body
            drafted = 'increase(specops_draft_tokens_seen_total{pod="replica-a"}[5m])'
            try:
                wait_until(lambda: (prom.value(drafted) or 0) > 0, 60, "replica-a's drafted tokens in Prometheus")
            except BaseException:
                print(prom.query("specops_draft_tokens_seen_total[1m]"), a.output()[-3000:], sep="\n")
                raise
            res = run_cli("status", "--fleet", prom.url, "--selector", 'namespace="llm"', "--json")
            text = run_cli("status", "--fleet", prom.url, "--selector", 'namespace="llm"')
            own = {r.name: r.status_json() for r in (a, b)}
    assert res.code == 0, res.stdout + res.stderr
    print("\n" + text.stdout)
    view = json.loads(res.stdout)
    rows = {r["replica"]: r for r in view["replicas"]}
    assert rows["replica-a"]["method"] == own["fleet-a"]["method"] == "draft_model"
    assert rows["replica-b"]["method"] == own["fleet-b"]["method"] == "ngram"
    assert all(r["up"] and r["state"] == "ready" for r in rows.values())
    ra = rows["replica-a"]
    assert ra["draft_tokens"] > 0 and 0 <= ra["acceptance"] <= 1
    f = view["fleet"]
    assert f["methods"] == {"draft_model": 1, "ngram": 1} and (f["up"], f["replicas"]) == (2, 2)
    weighted = [(r["acceptance"], r["draft_tokens"]) for r in rows.values() if r["acceptance"] is not None]
    assert f["acceptance"] == pytest.approx(sum(x * d for x, d in weighted) / sum(d for _, d in weighted))
    assert f["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] or 0 for r in rows.values()))
    assert "fleet: 2/2 up; methods draft_model ×1, ngram ×1" in text.stdout
