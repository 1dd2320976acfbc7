"""`specops up` wired as in production, with stand-in engines whose acceptance is the draft's: for canary tests.

Like support_standin.py, but a ``draft_model`` step's simulated acceptance is read from its draft file's name
(``draft-0.9.gguf`` accepts 0.9 of its draft tokens; ``draft-broken.gguf`` exits before it is ready), and each
engine answers with the draft's file name as ``system_fingerprint``, so a test sees which draft served a request.
Run ``python tests/support_canary.py up PROFILE`` through a link named ``specops`` (``specops down`` checks the
command line).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from support_standin import ACCEPTANCE, StandinBackend  # noqa: E402

from specops.backends.base import LaunchPlan  # noqa: E402
from specops.methods import Method  # noqa: E402

_ACCEPTANCE_IN_NAME = re.compile(r"-(\d(?:\.\d+)?)\.gguf$")


def acceptance_of(profile) -> tuple[str, float | None]:
    """(the engine's name, its simulated acceptance) for a profile's primary step."""
    spec = profile.speculative
    if spec.method is Method.DRAFT_MODEL and spec.draft:
        m = _ACCEPTANCE_IN_NAME.search(spec.draft)
        return Path(spec.draft).name, float(m.group(1)) if m else 0.5
    return spec.method.value, ACCEPTANCE.get(spec.method)


class CanaryBackend(StandinBackend):
    def render(self, profile, engine, *, host=None, port=None):
        port = port or profile.server.port
        name, acceptance = acceptance_of(profile)
        argv = [sys.executable, str(HERE / "support_upstream.py"), "--port", str(port), "--name", name]
        argv += ["--token-delay", "0.002"]
        if acceptance is not None:
            argv += ["--acceptance", str(acceptance)]
        if "broken" in name:  # an engine that exits before it is ready (a draft it cannot load)
            argv = [sys.executable, "-c", "import sys; print('cannot load the draft'); sys.exit(3)"]
        return LaunchPlan(
            backend=self.name,
            engine_version=engine.version,
            method=profile.speculative.method,
            argv=tuple(argv),
            env=(),
            host=host or "127.0.0.1",
            port=port,
            model_name="tiny-test-model",
        )


class CanaryRegistry:
    def __init__(self):
        self._backend = CanaryBackend()
        self.backends = {"llamacpp": self._backend}

    def backend(self, name: str):
        return self._backend


def main(argv: list[str]) -> int:
    from specops.config.profile import load_profile
    from specops.serve.up import UpOptions, up_blocking

    loaded = load_profile(argv[1] if argv[:1] == ["up"] else argv[0], registry=CanaryRegistry())
    return up_blocking(
        loaded, CanaryRegistry(), UpOptions(offline=True, health_interval=0.05, show_engine_output=False)
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
