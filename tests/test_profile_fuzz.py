"""Fuzzing the loader: whatever the YAML, ``load_profile`` raises nothing but SpecopsError subclasses.

Three generators: raw text built from YAML-significant tokens (syntax, tags, anchors, interpolation),
arbitrary nested structures dumped as YAML, and single-field mutations of a valid profile (which reach
the semantic and backend checks, and then the renderer).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specops.config.profile import Profile, load_profile
from specops.errors import ProfileError, SpecopsError
from specops.plugins import get_registry

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
ENV = {"SET": "1", "PORTVAR": "8080", "EMPTY": ""}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="specops-fuzz-") as d:
        root = Path(d)
        (root / "base.yaml").write_text("name: base\nbackend: vllm\nmodel:\n  id: a/b\n", encoding="utf-8")
        (root / "partial.yaml").write_text("speculative:\n  method: ngram\n", encoding="utf-8")
        yield root


def load_text(root: Path, text: str | bytes):
    """Load ``text`` as a profile; return the outcome, failing the test on any foreign exception."""
    path = root / "fuzz.yaml"
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    else:
        path.write_bytes(text)
    try:
        return load_profile(path, env=ENV, registry=get_registry())
    except ProfileError as exc:
        assert exc.problems, "a ProfileError must say what is wrong"
        for p in exc.problems:
            assert p.message.strip(), p
            if p.location is not None:
                assert p.location.line >= 1 and p.location.column >= 1, p
        return exc
    except SpecopsError as exc:
        return exc


TOKENS = [
    "name: ",
    "backend: ",
    "vllm",
    "llamacpp",
    "model:",
    "id: ",
    "a/b",
    "x.gguf",
    "speculative:",
    "method: ",
    "eagle3",
    "ngram",
    "draft_model",
    "mtp",
    "none",
    "auto",
    "draft: ",
    "num_speculative_tokens: ",
    "ngram:",
    "min: ",
    "max: ",
    "gpus:",
    "devices: ",
    "tensor_parallel_size: ",
    "fallback:",
    "chain: ",
    "window: ",
    "server:",
    "port: ",
    "api_key: ",
    "extends: ",
    "base.yaml",
    "partial.yaml",
    "fuzz.yaml",
    "missing.yaml",
    "${SET}",
    "${UNSET}",
    "${UNSET:-7}",
    "${PORTVAR}",
    "${EMPTY}",
    "$$",
    "${",
    "&a ",
    "*a",
    "*b",
    "<<: ",
    "!!int ",
    "!!float ",
    "!!str ",
    "!!binary ",
    "!!set ",
    "!!python/name:os.system ",
    "!custom ",
    "!!map ",
    "- ",
    "? ",
    "[",
    "]",
    "{",
    "}",
    ", ",
    ": ",
    "\n",
    "\n  ",
    "\n    ",
    "\t",
    "'",
    '"',
    "# c",
    "|",
    ">",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "0",
    "1",
    "-1",
    "4",
    "99999999999999999999",
    "1e400",
    ".nan",
    ".inf",
    "2001-01-01",
    "~",
    "null",
    "true",
    "yes",
    "30s",
    "5 minutes",
    "\ufeff",
    "é",
    "\x00",
    "\\",
    "@",
    "`",
    "!!int",
    "!!float",
    "!!bool ",
    "!!null x",
    "!!timestamp ",
    "*",
    "&",
    "!",
    "!<tag:x> ",
]


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=40))
def test_token_soup_never_crashes(workdir, tokens):
    load_text(workdir, "".join(tokens))


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(workdir, text):
    load_text(workdir, text)


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(workdir, data):
    load_text(workdir, data)


FIELD_NAMES = [
    "name",
    "backend",
    "model",
    "id",
    "speculative",
    "method",
    "draft",
    "num_speculative_tokens",
    "ngram",
    "min",
    "max",
    "type",
    "gpus",
    "devices",
    "tensor_parallel_size",
    "fallback",
    "chain",
    "window",
    "server",
    "port",
    "api_key",
    "extra_args",
    "env",
    "extends",
    "engine",
    "version",
    "monitor",
    "proxy",
    "retry",
    "per_batch_size",
    "options",
    "tensor_split",
    "gpu_layers",
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
    | st.sampled_from(
        [
            "eagle3",
            "ngram",
            "vllm",
            "llamacpp",
            "a/b",
            "x.gguf",
            "30s",
            "${SET}",
            "${UNSET}",
            "auto",
            "none",
            "all",
            "base.yaml",
            "partial.yaml",
        ]
    )
)
KEYS = st.sampled_from(FIELD_NAMES) | st.text(min_size=1, max_size=8)
STRUCTURES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5), max_leaves=25
)


@FUZZ
@given(st.dictionaries(KEYS, STRUCTURES, max_size=8))
def test_arbitrary_structures_never_crash(workdir, data):
    load_text(workdir, yaml.safe_dump(data, allow_unicode=True))


# ------------------------------------------------------------------ mutations of a valid profile

VALID = {
    "name": "fuzz",
    "backend": "vllm",
    "model": {"id": "meta-llama/Llama-3.1-8B-Instruct", "max_model_len": 8192},
    "speculative": {"method": "eagle3", "draft": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3},
    "gpus": {"devices": [0, 1], "tensor_parallel_size": 2},
    "server": {"port": 8000, "api_key": "k"},
    "fallback": {"chain": ["ngram", "none"], "window": "30s"},
}
PATHS = [
    ("backend",),
    ("model", "id"),
    ("model", "max_model_len"),
    ("model", "file"),
    ("speculative", "method"),
    ("speculative", "draft"),
    ("speculative", "num_speculative_tokens"),
    ("speculative", "ngram"),
    ("speculative", "ngram", "min"),
    ("speculative", "ngram", "type"),
    ("speculative", "per_batch_size"),
    ("speculative", "options"),
    ("speculative", "draft_tensor_parallel_size"),
    ("speculative", "draft_p_min"),
    ("gpus", "devices"),
    ("gpus", "tensor_parallel_size"),
    ("gpus", "gpu_layers"),
    ("gpus", "tensor_split"),
    ("gpus", "split_mode"),
    ("gpus", "memory_utilization"),
    ("server", "port"),
    ("server", "extra_args"),
    ("server", "env"),
    ("server", "host"),
    ("fallback", "chain"),
    ("fallback", "window"),
    ("proxy", "engine_port"),
    ("monitor", "source"),
    ("engine", "version"),
    ("extends",),
]
VALUES = (
    SCALARS
    | st.lists(SCALARS, max_size=4)
    | st.lists(st.lists(st.integers(-2, 300), max_size=4), max_size=3)
    | st.sampled_from(
        [
            "eagle",
            "medusa",
            "mlp_speculator",
            "draft_model",
            "mtp",
            "suffix",
            "ngram-mod",
            "ngram-simple",
            "promql",
            "layer",
            "0.6.6",
            "0.8.2",
            "current",
            "legacy",
            "b9300",
            ["--port", "1"],
            ["--speculative-config", "{}"],
            ["--foo=1"],
            {"method": "ngram"},
            {"disable_logprobs": False},
            {"tensor_parallel_size": 2},
            [0, 0],
            [],
            [1, 2, 3, 4],
        ]
    )
    | st.dictionaries(st.sampled_from(["HF_TOKEN", "A", "min", "max", "type", "method", "draft"]), SCALARS, max_size=3)
)


def _set(data: dict, path: tuple, value) -> dict:
    import copy

    out = copy.deepcopy(data)
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return out
    node[path[-1]] = value
    return out


@FUZZ
@given(
    st.lists(st.tuples(st.sampled_from(PATHS), VALUES), min_size=1, max_size=3),
    st.sampled_from(["0.6.6", "0.8.2", "0.10.1", "0.32.0", "0.33.0", "legacy", "spec-type", "current"]),
)
def test_mutated_profiles_load_and_render_without_crashing(workdir, mutations, version):
    data = VALID
    for path, value in mutations:
        if isinstance(value, float) and math.isnan(value) and path == ("extends",):
            continue
        data = _set(data, path, value)
    outcome = load_text(workdir, yaml.safe_dump(data, allow_unicode=True))
    if isinstance(outcome, SpecopsError):
        return
    # it loaded: the renderer must either produce a plan or refuse with a SpecopsError
    from specops.backends.render import FORMATS, format_plan, render_plan

    backend = outcome.profile.backend
    if (backend == "vllm") != (version[0].isdigit()):
        version = "0.32.0" if backend == "vllm" else "current"
    try:
        p = render_plan(outcome, get_registry(), backend_version=version, probe=False)
    except SpecopsError:
        return
    for fmt in FORMATS:
        text = format_plan(p, fmt)
        assert text.endswith("\n")
        if outcome.profile.server.api_key and len(outcome.profile.server.api_key) > 3:
            assert outcome.profile.server.api_key not in text  # secrets never printed


def test_valid_seed_profile_loads(workdir):
    """The mutation seed itself is valid, so mutations start from a profile that reaches every check."""
    outcome = load_text(workdir, yaml.safe_dump(VALID))
    assert not isinstance(outcome, SpecopsError), outcome
    assert isinstance(outcome.profile, Profile)
