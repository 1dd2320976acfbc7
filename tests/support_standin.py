"""`specops up` wired exactly as in production, with the stand-in engine (support_upstream.py) as its engine.

Run ``python tests/support_standin.py PROFILE`` to run :func:`specops.serve.up.up_blocking` for PROFILE with a
registry whose ``llamacpp`` backend renders the stand-in instead of llama-server (it keeps every other
capability of the llama.cpp backend: metrics prefix, live timings, log acceptance). Each method gets the
acceptance in :data:`ACCEPTANCE`, so a threshold fallback is quick and certain.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specops.backends.base import EngineInfo, LaunchPlan  # noqa: E402
from specops.backends.llamacpp import LlamaCppBackend  # noqa: E402
from specops.methods import Method  # noqa: E402

#: The stand-in's simulated acceptance for each method (None: no speculation).
ACCEPTANCE = {Method.NGRAM: 0.2, Method.DRAFT_MODEL: 0.9, Method.NONE: None}


class StandinBackend(LlamaCppBackend):
    def engine_info(self, profile, version=None, *, probe=True):
        return EngineInfo(backend=self.name, version=version or "standin-1", source="the test stand-in")

    def render(self, profile, engine, *, host=None, port=None):
        port = port or profile.server.port
        method = profile.speculative.method
        argv = [
            sys.executable,
            str(HERE / "support_upstream.py"),
            "--port",
            str(port),
            "--name",
            method.value,
            "--token-delay",
            "0.002",
        ]
        if ACCEPTANCE.get(method) is not None:
            argv += ["--acceptance", str(ACCEPTANCE[method])]
        return LaunchPlan(
            backend=self.name,
            engine_version=engine.version,
            method=method,
            argv=tuple(argv),
            env=(),
            host=host or "127.0.0.1",
            port=port,
            model_name="tiny-test-model",
        )


class StandinRegistry:
    def __init__(self):
        self._backend = StandinBackend()
        self.backends = {"llamacpp": self._backend}  # what validation (a profile reload's too) looks up

    def backend(self, name: str):
        return self._backend


def main(argv: list[str]) -> int:
    """``[up] PROFILE``: run through a link named ``specops`` with ``up``, it has the command line of the
    real entry script, which ``specops down`` checks before it signals."""
    from specops.config.profile import load_profile
    from specops.serve.up import UpOptions, up_blocking

    loaded = load_profile(argv[1] if argv[:1] == ["up"] else argv[0])
    return up_blocking(
        loaded, StandinRegistry(), UpOptions(offline=True, health_interval=0.05, show_engine_output=False)
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
