"""The building blocks of the profile's sections: the strict section base, the duration type, number bounds.

Apart from :mod:`specops.config.sections` so that the sections kept in their own modules
(:mod:`specops.config.deploy`, :mod:`specops.config.spotcheck`) share them without importing each other.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema

from specops.config.durations import MAX_DURATION, parse_duration

Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": MAX_DURATION},
                {"type": "string", "pattern": r"^\s*(\d+(\.\d+)?(ms|s|m|h|d)?)+\s*$"},
            ],
            "description": "seconds, or a duration such as 500ms, 30s, 10m, 1h30m (at most 7d)",
        }
    ),
]

# Upper bounds of numbers: generous for any real deployment, small enough that nothing downstream
# overflows or renders nonsense (a k of 10**9, a GPU index of 2**40).
MAX_K = 64  # draft tokens per step
MAX_NGRAM = 1024  # n-gram sizes
MAX_CONTEXT = 1 << 24  # tokens of context (16 Mi)
MAX_PARALLEL = 1024  # tensor/pipeline parallel sizes
MAX_GPU_INDEX = 1023
MAX_SEQUENCES = 65536  # concurrent sequences, batch sizes
MAX_LAYERS = 100_000
MAX_COUNT = 1_000_000_000  # token counts
MAX_SHARE = 1_000_000.0  # tensor_split shares, GiB per GPU


class Section(BaseModel):
    """Base for every profile section: unknown keys are errors (a typo must never be ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
