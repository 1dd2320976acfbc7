"""A canary's live measure: what the canary engine and the speculating primary drafted and accepted over the same
period, from each answer's own counters (llama-server's ``timings.draft_n``/``draft_n_accepted``, vLLM's
``metrics.speculative_decoding``). Pure: no I/O, no clock.

Both sides count from the moment the canary takes requests, so they see the same traffic period; the canary gets
an even share of the requests that would have gone to the primary, so they see the same kind of traffic too.
Whether the canary is worse is not decided here: :meth:`specops.watch.decide.FallbackDecider.judge_canary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The two sides of a canary: the new draft's engine, and the primary serving the draft in service.
CANARY, CURRENT = "canary", "current"


@dataclass
class CanarySide:
    """One side's totals since the canary became ready."""

    answers: int = 0  # answers served (with or without counters)
    drafting: int = 0  # answers whose counters said they drafted
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else None

    def to_dict(self) -> dict:
        acc = self.acceptance
        return {
            "answers": self.answers,
            "drafting_answers": self.drafting,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "acceptance": round(acc, 4) if acc is not None else None,
        }


@dataclass
class CanaryTally:
    """The canary's side and the current draft's side."""

    sides: dict[str, CanarySide] = field(default_factory=lambda: {CANARY: CanarySide(), CURRENT: CanarySide()})

    def note(self, side: str, draft_tokens: int, accepted: int) -> None:
        """One answer of ``side`` with its own counters (0, 0 when it reported none)."""
        s = self.sides[side]
        s.answers += 1
        draft_tokens, accepted = max(0, int(draft_tokens)), max(0, int(accepted))
        if draft_tokens > 0 and accepted <= draft_tokens:
            s.drafting += 1
            s.draft_tokens += draft_tokens
            s.accepted += accepted

    @property
    def canary(self) -> CanarySide:
        return self.sides[CANARY]

    @property
    def current(self) -> CanarySide:
        return self.sides[CURRENT]

    def to_dict(self) -> dict:
        return {name: side.to_dict() for name, side in self.sides.items()}
