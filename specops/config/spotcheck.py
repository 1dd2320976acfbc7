"""The profile's ``certify`` section: live spot checks while ``specops up`` serves (opt-in).

Kept apart from :mod:`specops.config.sections` (which imports it) so that module stays small; the strict
section base comes from :mod:`specops.config.fields`. ``every`` has its own duration type: its schema's
minimum is the rate limit.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema, model_validator

from specops.config.durations import MAX_DURATION, parse_duration
from specops.config.fields import Section
from specops.urls import url_problem

#: Spot checks never run more often than this (seconds): a rate limit, whatever ``every`` says.
MIN_EVERY = 10.0
#: Environment variable names (the reference's API key is read from one, never written in the profile).
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": MIN_EVERY, "maximum": MAX_DURATION},
                {"type": "string", "pattern": r"^\s*(\d+(\.\d+)?(ms|s|m|h|d)?)+\s*$"},
            ],
            "description": "seconds, or a duration such as 30s, 10m, 1h (at least 10s, at most 7d)",
        }
    ),
]


def _reference(value: str | None) -> str | None:
    if value is not None:
        problem = url_problem(value)
        if problem:
            raise ValueError(f"not an http(s) URL: {problem}")
        if "@" in urlsplit(value).netloc:
            raise ValueError(
                "no credentials in the URL: name the environment variable holding the key in `api_key_env`"
            )
    return value


def _env_name(value: str | None) -> str | None:
    if value is not None and not _ENV_NAME.match(value):
        raise ValueError("not an environment variable name (letters, digits, `_`, not starting with a digit)")
    return value


class SpotCheck(Section):
    """Live spot checks: a few greedy answers compared, now and then, with a reference without speculation."""

    enabled: bool = Field(False, description="Run spot checks while `specops up` serves (needs `reference`).")
    reference: Annotated[str, AfterValidator(_reference)] | None = Field(
        None,
        description="Base URL of an instance of the same model serving without speculation (the chain's `none` "
        "step run as a second instance); greedy requests are replayed there and compared.",
    )
    api_key_env: Annotated[str, AfterValidator(_env_name)] | None = Field(
        None, description="Name of the environment variable holding the reference's API key (never the key itself)."
    )
    source: Literal["live", "probes", "both"] = Field(
        "live",
        description="`live`: replay a sample of the clients' own greedy, non-streamed requests and compare with "
        "the answers they got; `probes`: send built-in greedy prompts to the deployment and the reference; `both`.",
    )
    every: _Duration = Field(600.0, ge=MIN_EVERY, description="Time between checks (at least 10s).")
    sample: int = Field(2, ge=1, le=64, description="Requests compared per check.")
    max_tokens: int = Field(
        64,
        ge=1,
        le=4096,
        description="Tokens generated per replayed request at most (a longer client answer is compared on its "
        "first `max_tokens` tokens).",
    )
    max_in_flight: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Run a check only when at most this many client requests are in flight or waiting (0: idle "
        "periods only); a busy interval is skipped and recorded.",
    )
    tolerance: float = Field(
        0.0, ge=0, le=100, description="Nats, as `specops certify --tolerance` (0: token-exact comparison)."
    )
    prompts: list[str] = Field(
        default_factory=lambda: ["code", "chat"],
        description="`probes`/`both`: built-in prompt sets (code, summarize, chat, creative, extraction) and/or JSONL files.",
    )
    keep_text: bool = Field(
        False,
        description="Also write the text of each divergence (the answers' shared end and both continuations: a "
        "client's text in a live check) to `spot-divergences.jsonl` (mode 0600) in the instance's state folder. "
        "Off: status, events, metrics and logs say where (position, token ids), never what.",
    )

    @model_validator(mode="after")
    def _needs_reference(self) -> SpotCheck:
        if self.enabled and not self.reference:
            raise ValueError("spot checks need `reference`: the URL of the same model serving without speculation")
        return self


class Certify(Section):
    """What `specops up` checks about losslessness while it serves (`specops certify` checks it before)."""

    spot_check: SpotCheck = Field(default_factory=SpotCheck)
