"""A real `/specops/metrics` exposition of a deployment with a twin and learned classes.

Built from the real parts `specops up` builds (the profile loader, :class:`~specops.serve.twins.TwinEngines` with its
router, routed upstreams and class windows, the watcher's metrics registry); no engine is started: a routed request
is counted as the proxy counts an answered one, and a class window is fed the counters a response reports. For the
dashboard and alert-rule tests, which must query only series that exist.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

PROFILE = """\
name: twin-metrics
backend: llamacpp
model: {id: /models/target.gguf}
speculative: {method: ngram}
fallback: {chain: [none]}
routing:
  twins: [none]
  classes: {key: header, header: X-Tenant}
"""


def twin_metrics_text() -> str:
    """The exposition after two requests of class ``code`` (one routed by the header to each engine) and a class
    window holding 100 drafted tokens, 40 accepted, decided to speculate, with an answer of 80 tokens in 2 s served
    speculating and one of 30 tokens in 1.5 s served without."""
    from multidict import CIMultiDict
    from prometheus_client import generate_latest

    from specops.config.profile import load_profile
    from specops.run.instance import EventLog
    from specops.serve.twins import TwinEngines
    from specops.watch.decide import FallbackDecider
    from specops.watch.watcher import SpecopsMetrics

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.yaml"
        path.write_text(PROFILE)
        loaded = load_profile(path)
        metrics, events = SpecopsMetrics(), EventLog(None)
        twins = TwinEngines(
            loaded.profile,
            decider=FallbackDecider.from_profile(loaded.profile, events=events, say=lambda msg: None),
            events=events,
            say=lambda msg: None,
            render_twin=lambda profile, step, port: lambda index: None,
            log_path=lambda name: Path(tmp) / f"engine.{name}.log",
            health_interval=0.25,
            launch_problem=None,
            metrics=metrics,
        )
        body = json.dumps({"prompt": "x"}).encode()
        for choice in ("on", "off"):
            headers = CIMultiDict({"X-Tenant": "code", "X-Specops-Speculation": choice})
            route = twins.upstreams.route("/v1/completions", headers, body)
            twins.upstreams.finished(route, None, True)
        now = time.monotonic()
        twins.classes.touch("code", now)
        twins.classes.note("code", now, speculative=True, draft_tokens=100, accepted=40, tokens=80, seconds=2.0)
        twins.classes.note("code", now, speculative=False, tokens=30, seconds=1.5)
        twins.classes.decide("code", True, "acceptance 0.40")
        return generate_latest(metrics.registry).decode()
