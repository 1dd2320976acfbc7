"""Reading speculative-decoding counters out of an engine's ``/metrics`` text.

Engines expose running totals; acceptance over a window comes from their differences
(:mod:`specops.watch.window`). This module only turns one exposition into one :class:`SpecCounters`:

- **vLLM V1** (``vllm:``): counters ``spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position}``, labelled
  ``model_name`` and ``engine``. Samples are keyed by their exact *sample* name (the parser names the
  family without ``_total``), summed over ``engine`` (and any other label but ``position``), filtered on
  ``model_name`` when one is given. The ``*_created`` gauges beside each counter are never read.
- **vLLM V0** (≤ 0.9): the counters of the same names are incremented by *running totals* every log
  interval, so their differences over-count by an unknown factor; the gauge
  ``vllm:spec_decode_draft_acceptance_rate`` is the lifetime ratio. Neither gives a windowed number, so the
  result is marked ``coarse`` and carries the lifetime ratio; nothing pretends it is windowed.
- **llama-server** (``llamacpp:``, ``--metrics``): the same four counters, no labels; they move only when a
  request finishes.

No speculative series at all returns ``None``: speculation is off or stats are disabled — not acceptance 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

#: Sources a SpecCounters can come from (its ``source`` field).
SOURCE_VLLM_V1 = "vllm-v1"
SOURCE_VLLM_V0 = "vllm-v0"
SOURCE_LLAMACPP = "llamacpp"
SOURCE_LLAMACPP_LOG = "llamacpp-log"


class MetricsError(ValueError):
    """The exposition text cannot be read as Prometheus metrics, or its spec-decode series contradict."""


@dataclass(frozen=True)
class SpecCounters:
    """Running totals of one engine's speculative decoding at one instant (never a rate).

    ``drafts`` is None when the engine does not count drafts (vLLM V0, the llama-server log line);
    ``per_position[i]`` is the number of tokens accepted at draft position i. ``coarse`` marks numbers
    that cannot be differenced into a windowed acceptance (vLLM V0): ``draft_tokens``/``accepted`` are then
    the engine's over-counting counters as read, and ``lifetime_acceptance`` is the engine's lifetime ratio.
    """

    draft_tokens: float
    accepted: float
    drafts: float | None = None
    per_position: tuple[float, ...] = ()
    source: str = ""
    coarse: bool = False
    lifetime_acceptance: float | None = None

    @property
    def acceptance(self) -> float | None:
        """Lifetime acceptance (accepted / drafted since the engine started); None before any draft."""
        if self.coarse:
            return self.lifetime_acceptance
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else None

    def to_dict(self) -> dict:
        return {
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "drafts": self.drafts,
            "per_position": list(self.per_position),
            "source": self.source,
            "coarse": self.coarse,
            "lifetime_acceptance": self.lifetime_acceptance,
        }


def normalize_prefix(prefix: str) -> str:
    """``"vllm"`` or ``"vllm:"`` → ``"vllm:"``."""
    prefix = prefix.strip()
    if not prefix:
        raise ValueError("a metric prefix such as 'vllm:' or 'llamacpp:' is required")
    return prefix if prefix.endswith(":") else prefix + ":"


def series_names(prefix: str) -> dict[str, str]:
    """The exact sample names specops reads, by role, for ``prefix``."""
    p = normalize_prefix(prefix) + "spec_decode_"
    return {
        "drafts": p + "num_drafts_total",
        "draft_tokens": p + "num_draft_tokens_total",
        "accepted": p + "num_accepted_tokens_total",
        "per_position": p + "num_accepted_tokens_per_pos_total",
        "emitted": p + "num_emitted_tokens_total",  # vLLM V0 only
        "lifetime_acceptance": p + "draft_acceptance_rate",  # vLLM V0 only (gauge)
    }


def _source_for(prefix: str, coarse: bool) -> str:
    if prefix == "vllm:":
        return SOURCE_VLLM_V0 if coarse else SOURCE_VLLM_V1
    if prefix == "llamacpp:":
        return SOURCE_LLAMACPP
    return prefix.rstrip(":")


def parse_spec_counters(
    text: str, prefix: str, model_name: str | None = None, openmetrics: bool = False
) -> SpecCounters | None:
    """The spec-decode counters in exposition ``text``; None when it has no spec-decode series at all.

    ``model_name`` keeps only samples whose ``model_name`` label equals it (samples without that label, as
    llama-server writes them, always count). ``openmetrics`` selects the OpenMetrics parser (for a server
    that answered ``application/openmetrics-text``). Raises :class:`MetricsError` on text that is not an
    exposition, on non-finite counter values, or when some spec-decode series are present and others
    that must accompany them are missing.
    """
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse
    else:
        parse = text_string_to_metric_families
    try:
        return spec_counters_from_families(parse(text), prefix, model_name)
    except MetricsError:
        raise
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"not a Prometheus exposition: {exc or type(exc).__name__}") from None


def spec_counters_from_families(
    families: Iterable[Any], prefix: str, model_name: str | None = None
) -> SpecCounters | None:
    """Like :func:`parse_spec_counters`, over metric families already parsed by ``prometheus_client``."""
    prefix = normalize_prefix(prefix)
    names = series_names(prefix)
    wanted = {v: k for k, v in names.items()}
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in families:
        for sample in family.samples:
            role = wanted.get(sample.name)
            if role is None:
                continue
            labels = sample.labels
            if model_name is not None and labels.get("model_name", model_name) != model_name:
                continue
            value = float(sample.value)
            if role == "lifetime_acceptance" and math.isnan(value):
                continue  # vLLM V0 writes NaN before its first draft: no ratio yet, not an error
            if not math.isfinite(value):
                raise MetricsError(f"{sample.name} has a non-finite value {sample.value!r}")
            if role == "per_position":
                try:
                    pos = int(labels.get("position", ""))
                except ValueError:
                    raise MetricsError(f"{sample.name} has no integer 'position' label: {labels}") from None
                if pos < 0:
                    raise MetricsError(f"{sample.name} has a negative position {pos}")
                per_pos[pos] = per_pos.get(pos, 0.0) + value
            elif role == "lifetime_acceptance":
                # a gauge: one value per engine; several engines cannot be combined without their
                # token counts, so keep the lowest (the conservative reading)
                sums[role] = min(sums.get(role, value), value)
            else:
                sums[role] = sums.get(role, 0.0) + value

    if not sums and not per_pos:
        return None
    coarse = "drafts" not in sums and ("lifetime_acceptance" in sums or "emitted" in sums)
    missing = [names[r] for r in ("draft_tokens", "accepted") if r not in sums]
    if missing and not (coarse and "lifetime_acceptance" in sums):
        present = sorted(names[r] for r in sums) + ([names["per_position"]] if per_pos else [])
        raise MetricsError(
            f"incomplete spec-decode series: {', '.join(present)} present but {', '.join(missing)} missing"
        )
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    lifetime = sums.get("lifetime_acceptance")
    if coarse and lifetime is not None and not 0.0 <= lifetime <= 1.0:
        raise MetricsError(f"{names['lifetime_acceptance']} = {lifetime} is not a ratio")
    return SpecCounters(
        draft_tokens=sums.get("draft_tokens", 0.0),
        accepted=sums.get("accepted", 0.0),
        drafts=sums.get("drafts"),
        per_position=positions,
        source=_source_for(prefix, coarse),
        coarse=coarse,
        lifetime_acceptance=lifetime if coarse else None,
    )
