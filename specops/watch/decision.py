"""What the fallback policy decides with and what it answers: its knobs (:class:`PolicyConfig`), its verdict
(:class:`Decision`, :class:`Action`) and the numbers a verdict carries. Pure data and arithmetic; the rules that
choose between them are in :mod:`specops.watch.policy`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from specops.config.profile import ChainStep
from specops.methods import DEFAULT_K, Method
from specops.speedup import (
    DEFAULT_DRAFT_COST,
    VerifyCost,
    alpha_from_acceptance_rate,
    expected_speedup,
    expected_tokens_per_step,
    speedup_from_length,
)
from specops.watch.goodput import GoodputConfig
from specops.watch.rule import curve_name
from specops.watch.window import WindowStats


class Action(str, Enum):
    """What a decision says to do; ``.value`` is the word in events, JSON and metrics labels."""

    KEEP = "keep"  # stay on the current method
    SWITCH = "switch"  # move to another step of the chain
    RETRY = "retry"  # go back to the primary method after a back-off
    HOLD = "hold"  # the evidence says switch, but nothing may be done (watch-only, chain end, flap guard)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


KEEP, SWITCH, RETRY, HOLD = Action.KEEP, Action.SWITCH, Action.RETRY, Action.HOLD


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs of the policy (from the profile's ``fallback`` section), in seconds."""

    enabled: bool = True
    mode: str = "threshold"  # "threshold" | "model" | "goodput": the mode that decides (see specops.watch.rule)
    min_acceptance: float = 0.6
    window_s: float = 60.0
    min_draft_tokens: int = 200
    consecutive_windows: int = 2
    cooldown_s: float = 600.0
    max_switches_per_hour: int = 4
    draft_cost_ratio: float | None = None  # model mode; None: DEFAULT_DRAFT_COST
    retry_enabled: bool = False
    retry_after_s: float = 1800.0
    retry_max_after_s: float = 8 * 3600.0
    act_on_coarse: bool = False  # decide on vLLM V0's lifetime ratio too
    goodput: GoodputConfig = field(default_factory=GoodputConfig)  # mode goodput

    def __post_init__(self) -> None:
        if self.mode not in ("threshold", "model", "goodput"):
            raise ValueError(f"mode must be 'threshold', 'model' or 'goodput', not {self.mode!r}")
        if self.consecutive_windows < 1 or self.max_switches_per_hour < 1 or self.min_draft_tokens < 0:
            raise ValueError("consecutive_windows and max_switches_per_hour must be >= 1, min_draft_tokens >= 0")
        if not self.window_s > 0:
            raise ValueError("window_s must be > 0")

    @property
    def cost(self) -> float:
        return DEFAULT_DRAFT_COST if self.draft_cost_ratio is None else self.draft_cost_ratio

    @classmethod
    def from_fallback(cls, fb: Any, mode: str | None = None) -> PolicyConfig:
        """From a :class:`specops.config.profile.Fallback` section; ``mode``: the one that decides (its ``mode``
        unset: the one :func:`specops.watch.rule.rule_for` chose), else the section's, else threshold."""
        return cls(
            enabled=fb.enabled,
            mode=mode or fb.mode or "threshold",
            min_acceptance=fb.min_acceptance,
            window_s=fb.window,
            min_draft_tokens=fb.min_draft_tokens,
            consecutive_windows=fb.consecutive_windows,
            cooldown_s=fb.cooldown,
            max_switches_per_hour=fb.max_switches_per_hour,
            draft_cost_ratio=fb.draft_cost_ratio,
            retry_enabled=fb.retry.enabled,
            retry_after_s=fb.retry.after,
            retry_max_after_s=max(fb.retry.max_after, fb.retry.after),
            goodput=GoodputConfig.from_fallback(fb),
        )

    @classmethod
    def from_profile(cls, profile: Any, mode: str | None = None) -> PolicyConfig:
        return cls.from_fallback(profile.fallback, mode)


def step_k(step: ChainStep) -> int:
    """Draft tokens per step configured for ``step`` (explicit, else the method's default; 0 for none)."""
    return step.num_speculative_tokens or DEFAULT_K.get(step.method, 0)


@dataclass(frozen=True)
class Decision:
    """One verdict of the policy: what to do, the rule that says so, why in words, and the numbers."""

    action: Action
    rule: str
    reason: str
    at: float
    from_index: int
    from_step: ChainStep
    to_index: int | None = None
    to_step: ChainStep | None = None
    numbers: Mapping[str, Any] = field(default_factory=dict)
    warning: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            object.__setattr__(self, "action", Action(self.action))

    @property
    def from_method(self) -> Method:
        return self.from_step.method

    @property
    def to_method(self) -> Method | None:
        return self.to_step.method if self.to_step is not None else None

    @property
    def acts(self) -> bool:
        """True when the supervisor must change the method (switch or retry)."""
        return self.action in (SWITCH, RETRY)

    @property
    def notable(self) -> bool:
        """Worth an event-log line: anything but a plain keep, or a keep that carries a warning."""
        return self.action != KEEP or self.warning is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "rule": self.rule,
            "reason": self.reason,
            "at": self.at,
            "from": self.from_method.value,
            "from_index": self.from_index,
            "to": self.to_method.value if self.to_method is not None else None,
            "to_index": self.to_index,
            "numbers": dict(self.numbers),
            "warning": self.warning,
        }


def window_numbers(stats: WindowStats, config: PolicyConfig) -> dict[str, Any]:
    """The measured numbers of an ``ok`` window."""
    return {
        "acceptance": stats.acceptance,
        "min_acceptance": config.min_acceptance,
        "draft_tokens": stats.draft_tokens,
        "accepted": stats.accepted,
        "drafts": stats.drafts,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "window_start": stats.start,
        "window_end": stats.end,
        "window_s": stats.window_s,
        "resets": stats.resets,
        "coarse": stats.coarse,
    }


def verdict_numbers(
    stats: WindowStats,
    acceptance: float,
    config: PolicyConfig,
    step: ChainStep,
    curve: VerifyCost | None = None,
    engine_k: int | None = None,
) -> dict[str, Any]:
    """The numbers of a window that gets a verdict on ``step``, with the model's predicted speedup: from the
    window's measured mean draft length (else the longest draft the engine runs, ``engine_k``, else the profile's
    k) and mean acceptance length (else τ from the acceptance rate), on the verification-cost ``curve`` (None:
    c_verify = 1). ``verify_cost`` names which."""
    c = config.cost
    k_meas = stats.mean_draft_length
    if k_meas is not None:
        k, k_basis = k_meas, "measured mean draft length (drafted / drafts)"
    elif engine_k:
        k, k_basis = float(engine_k), "the engine's longest draft (the window counts no drafts)"
    else:
        k, k_basis = float(step_k(step)), "the profile's k (the window counts no drafts)"
    k_int = max(1, round(k))
    alpha = alpha_from_acceptance_rate(min(max(acceptance, 0.0), 1.0), k_int)
    if stats.mean_acceptance_length is not None:
        tau, how = stats.mean_acceptance_length, "measured mean acceptance length"
        speedup = speedup_from_length(tau, k, c, curve)
    else:
        tau, how = expected_tokens_per_step(alpha, k_int), "α from the acceptance rate"
        speedup = expected_speedup(alpha, k_int, c, curve)
    return {
        **window_numbers(stats, config),
        "alpha": alpha,
        "k": k,
        "k_measured": k_meas is not None,
        "k_basis": k_basis,
        "draft_cost_ratio": c,
        "tokens_per_step": tau,
        "predicted_speedup": speedup,
        "speedup_basis": how,
        "verify_cost": curve_name(curve),
    }
