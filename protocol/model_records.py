"""A model's desired state as stored in Redis: the key layout (``{model}`` is the configured model key),
the records kept there (the state, its history entries, workers' refusals) and reading them back.

What each key holds, and how changes are written: :mod:`protocol.model_state`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol

import redis
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "AUTO_ROLLBACKS_KEY",
    "CHANGES_CHANNEL",
    "GUARD_LOCK_KEY",
    "GUARD_TURN_KEY",
    "HISTORY_KEY",
    "OUTCOMES_KEY",
    "RECENT_PROMPTS_KEY",
    "REFUSALS_KEY",
    "STATE_KEY",
    "Action",
    "HistoryEntry",
    "ModelState",
    "Published",
    "Refusal",
    "Role",
    "Split",
    "VersionCheck",
    "history",
    "read_state",
]

STATE_KEY = "fleet:model-state:{model}"
HISTORY_KEY = "fleet:model-history:{model}"
REFUSALS_KEY = "fleet:model-refusals:{model}"
OUTCOMES_KEY = "fleet:model-outcomes:{model}"
AUTO_ROLLBACKS_KEY = "fleet:model-auto-rollbacks:{model}"
RECENT_PROMPTS_KEY = "fleet:model-recent-prompts:{model}"
GUARD_LOCK_KEY = "fleet:model-guard-lock:{model}"
GUARD_TURN_KEY = "fleet:model-guard-turn:{model}"
"""Whose turn it is to judge the canary (see :func:`protocol.canary_guard.guard_canary`'s ``one_caller_per_s``)."""
CHANGES_CHANNEL = "fleet:model-changes"


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _sha256_hex(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise ValueError("a manifest sha256 must be 64 lower-case hex digits")
    return value


Role = Literal["stable", "canary"]
Action = Literal["pin", "canary", "promote", "rollback", "auto-rollback"]


class Split(BaseModel):
    """The versions in force: stable (None = the configured one), canary and its share (percent), and the
    sha256 of each one's manifest as it was when pinned or canaried (:func:`store.manifest.manifest_digest`).

    A digest pins the bytes, not only the name: a worker fetches the version only when the store's manifest
    still has that digest, and uses a cached copy only when it was made from that manifest (else it refuses
    the version: deleted and pushed again with other bytes, or replaced in the bucket). None (a record
    written before digests were recorded, a change made without a store, the configured version): no check.
    """

    model_config = ConfigDict(frozen=True)

    stable: str | None = None
    canary: str | None = None
    canary_weight: int = Field(default=0, ge=0, le=100)
    stable_manifest_sha256: Annotated[str, AfterValidator(_sha256_hex)] | None = None
    canary_manifest_sha256: Annotated[str, AfterValidator(_sha256_hex)] | None = None

    def manifest_sha256_of(self, version: str | None) -> str | None:
        """The manifest digest recorded for ``version`` (stable or canary); None when none is recorded."""
        if version is None:
            return None
        if version == self.stable:
            return self.stable_manifest_sha256
        if version == self.canary:
            return self.canary_manifest_sha256
        return None


class ModelState(Split):
    """The JSON at ``fleet:model-state:{model}``; ``generation`` grows by one at every change."""

    model: str
    generation: int = Field(default=0, ge=0)
    changed_by: str = ""
    changed_at_unix_s: float = 0.0

    def split(self) -> Split:
        """Only the versions and the weight (what a history entry records as from/to)."""
        return Split.model_validate(self.model_dump(include=set(Split.model_fields)))


class HistoryEntry(BaseModel):
    """One change, as RPUSHed to ``fleet:model-history:{model}``."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    at_unix_s: float
    by: str
    action: Action
    from_: Split = Field(alias="from")
    to: Split
    reason: str | None = None
    figures: dict[str, Any] | None = None
    generation: int = 0

    def to_json(self) -> str:
        """The stored JSON (``from`` spelled as such)."""
        return self.model_dump_json(by_alias=True)


class Refusal(BaseModel):
    """A worker refused to load a version (checksum mismatch, not published, load error)."""

    model_config = ConfigDict(frozen=True)

    worker: str
    version: str
    error: str
    error_type: str
    at_unix_s: float


class Published(Protocol):
    """What pin/canary check a version against: the store's ``manifest`` (raises VersionNotFound), and its
    digest (what the change records, :attr:`Split.stable_manifest_sha256`)."""

    def manifest(self, model: str, version: str) -> object: ...

    def manifest_sha256(self, model: str, version: str) -> str:
        """sha256 of the version's manifest as stored (raises VersionNotFound, ModelLoadError: invalid)."""
        ...


VersionCheck = Callable[[str, str], None]
"""``check(model, version)`` raises when ``version`` may not serve ``model``: the CLI passes
:func:`store.cards.version_check` (IncompatibleVersion: a card of another kind, vocab_size, …)."""


# ---- reading ----


def read_state(r: redis.Redis[bytes], model: str) -> ModelState | None:
    """The model's state, or None when it has none (no pin: workers serve their config)."""
    raw = r.get(STATE_KEY.format(model=model))
    return None if raw is None else ModelState.model_validate_json(raw)


def history(r: redis.Redis[bytes], model: str, last: int | None = None) -> list[HistoryEntry]:
    """The model's changes, oldest first (only the ``last`` N when given)."""
    start = -last if last else 0
    return [HistoryEntry.model_validate_json(raw) for raw in r.lrange(HISTORY_KEY.format(model=model), start, -1)]

