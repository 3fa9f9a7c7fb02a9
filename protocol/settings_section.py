"""The base of every settings section: unknown keys are refused and a built section never changes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """One section of :class:`protocol.settings.FleetSettings` (extra keys forbidden, frozen)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
