"""Which rule decides a deployment's fallback, and why that one, in one line.

Acceptance alone says nothing about what a draft costs: on Gemma 3 270M (llama-server, 2 CPU cores) n-gram drafts
accepted at 1.000 ran at 0.91x of no speculation and drafts accepted at 0.62 at 0.32x, both above the 0.6 rule, while
short cheap drafts can pay at 0.45. So where specops can know the speed, the default (``fallback.mode`` unset)
decides on tokens/s:

1. ``goodput`` when a goodput surface is measured (``fallback.goodput.surface``: tokens/s per method and load);
2. else ``model`` when a verification-cost curve is stored for this engine, model and machine (the speedup predicted
   on that curve from the live mean acceptance and draft lengths: only as right as the curve, which is a lower bound
   of the cost where the output layer is a large share of the model);
3. else ``threshold``: acceptance < ``min_acceptance``, the only rule left when nothing better is known.

A mode set in the profile is kept as written. ``specops up``'s log, ``specops status``, ``validate`` and ``doctor``
print :meth:`Rule.line` (:func:`rule_for`); the policy decides with :attr:`Rule.mode` and predicts on
:attr:`Rule.curve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specops.speedup import VerifyCost

THRESHOLD, MODEL, GOODPUT = "threshold", "model", "goodput"
#: Why no curve is known, when the caller has nothing more precise to say.
NO_CURVE = (
    "no verification-cost curve stored for this engine, model and machine (`specops bench PROFILE --probe-verify`)"
)


def curve_name(curve: VerifyCost | None) -> str:
    """How a decision names the verification cost it used: the curve's file, or ``flat: no curve``."""
    return "flat: no curve (c_verify = 1)" if curve is None else f"curve {curve.source}"


@dataclass(frozen=True)
class Rule:
    """The rule that decides (``mode``: threshold, model or goodput), why that one, and what it decides with."""

    mode: str
    why: str
    explicit: bool = True
    #: the verification-cost curve that mode model, and request classes in modes model and goodput, predict on
    #: (None: mode model assumes c_verify = 1; classes in mode goodput are judged on their acceptance)
    curve: VerifyCost | None = None
    min_acceptance: float = 0.6

    @property
    def decides_on(self) -> str:
        if self.mode == GOODPUT:
            return "tokens/s (mode goodput: measured per method and load)"
        if self.mode == MODEL:
            return f"predicted tokens/s (mode model: speedup < 1, {curve_name(self.curve)})"
        return f"acceptance (mode threshold: < {self.min_acceptance:g})"

    def line(self) -> str:
        """``fallback decides on <what>: <why>`` (one line)."""
        return f"fallback decides on {self.decides_on}: {self.why}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "explicit": self.explicit,
            "why": self.why,
            "verify_cost": curve_name(self.curve),
            "line": self.line(),
        }


def rule_for(fallback: Any, curve: VerifyCost | None = None, no_curve: str = NO_CURVE) -> Rule:
    """The rule of a profile's ``fallback`` section (:class:`specops.config.profile.Fallback`), given the curve stored
    for its engine, model and machine (``no_curve``: why there is none, e.g. no engine version to look one up for)."""
    mode, surface = fallback.mode, fallback.goodput.surface
    floor = fallback.min_acceptance
    if mode is not None:  # validated by the profile's schema: threshold, model or goodput
        why = f"fallback.mode: {mode} is set in the profile"
        if mode == MODEL and curve is None:
            why += f"; {no_curve}"
        return Rule(mode, why, True, None if mode == THRESHOLD else curve, floor)
    if surface:
        why = f"fallback.mode unset, and a goodput surface is measured (fallback.goodput.surface: {surface})"
        return Rule(GOODPUT, why, False, curve, floor)
    if curve is not None:
        why = "fallback.mode unset, no goodput surface, and a verification-cost curve is stored for this engine, model "
        why += "and machine"
        return Rule(MODEL, why, False, curve, floor)
    why = f"fallback.mode unset and nothing better is known: no goodput surface (`specops tune`), {no_curve}"
    return Rule(THRESHOLD, why, False, None, floor)
