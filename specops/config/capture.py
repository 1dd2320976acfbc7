"""The profile's ``capture`` section: what the proxy keeps of the traffic to train a draft on (opt-in).

``specops adapt train`` learns a draft from the prompts the deployment serves and the target's own answers
to them; the proxy writes a bounded, private sample of them (:mod:`specops.proxy.capture`). Kept apart from
:mod:`specops.config.sections` (which imports it) so that module stays small.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from specops.config.fields import Duration, Section

_MIB = 1 << 20


def _class_names(value: list[str]) -> list[str]:
    for name in value:
        if not name or len(name) > 128:
            raise ValueError("a class name is 1 to 128 characters")
    return value


class Capture(Section):
    """Prompts and the target's answers kept on disk for `specops adapt` (never a header or a key)."""

    enabled: bool = Field(
        False, description="Keep a sample of the traffic for `specops adapt train` (needs the proxy)."
    )
    path: str | None = Field(
        None,
        description="Folder of the capture files (made 0700; files 0600). Unset: `capture/` in the instance's "
        "state folder.",
    )
    sample: float = Field(
        0.1, gt=0, le=1, description="Share of eligible requests kept (completions and chat, answered 200)."
    )
    max_bytes: int = Field(
        256 * _MIB, ge=64 * 1024, le=1 << 40, description="Bytes of capture files at most; the oldest go first."
    )
    max_file_bytes: int = Field(
        16 * _MIB, ge=16 * 1024, le=1 << 36, description="A capture file is closed (rotated) at this size."
    )
    max_age: Duration = Field(
        7 * 86400.0, gt=0, description="Records older than this are deleted (a file goes once its newest is)."
    )
    max_record_bytes: int = Field(
        256 * 1024,
        ge=1024,
        le=64 * _MIB,
        description="A request whose body or answer is larger is not kept (nor copied while it streams).",
    )
    exclude_classes: Annotated[list[str], AfterValidator(_class_names)] = Field(
        default_factory=list,
        description="Request classes (`routing.classes`) never kept; a request of no class is `-`.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Capture:
        if self.max_file_bytes > self.max_bytes:
            raise ValueError("`max_file_bytes` must be at most `max_bytes` (a file is the unit that is deleted)")
        if self.max_record_bytes > self.max_file_bytes:
            raise ValueError("`max_record_bytes` must be at most `max_file_bytes`")
        return self
