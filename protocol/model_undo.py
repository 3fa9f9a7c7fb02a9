"""The rollback stack: the stable versions a model's rollbacks return to, kept apart from its capped history.

``fleet:model-undo:{model}`` (:data:`UNDO_KEY`) holds one JSON :class:`UndoStack`, rewritten in the same
transaction as the state and its history entry (:mod:`protocol.model_changes`). Every pin or promote that
changes the stable version pushes the one it replaced; every rollback that changes it pops one; canaries
(set, dropped, rolled back automatically) leave it alone. So rollback walks back through every pin and
promote however many changes came since, not only those still in the history, which keeps the last
:data:`~protocol.model_changes.HISTORY_KEEP` entries (before, the stack was rebuilt from that history:
past it, a rollback found nothing to undo and was refused while older versions were still owed).

The stack itself keeps the :data:`UNDO_KEEP` most recent versions; a rollback past them is refused with
that limit named. A model changed before this key existed (no stack stored) starts from the stack its
history gives; when that history may have been trimmed, running out of it is refused naming the history's
limit. Pure except :func:`read_undo`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import StateChangeRefused
from protocol.model_records import Action, HistoryEntry, Split

__all__ = ["UNDO_KEEP", "UNDO_KEY", "UndoStack", "next_undo", "read_undo", "undo_of_history"]

UNDO_KEY = "fleet:model-undo:{model}"
UNDO_KEEP = 1000
"""Stable versions a model's rollback stack keeps (the oldest are dropped, and counted)."""


class UndoStack(BaseModel):
    """The versions rollbacks return to, most recent last (None = the configured version)."""

    model_config = ConfigDict(frozen=True)

    versions: tuple[str | None, ...] = ()
    manifest_sha256s: tuple[str | None, ...] = Field(
        default=(), description="The manifest digest each of the last versions was pinned with, aligned on the "
        "right with ``versions`` (a stack stored before digests were kept has fewer: the older have none)."
    )
    dropped: int = Field(default=0, ge=0, description="Oldest versions dropped past UNDO_KEEP.")
    from_trimmed_history: bool = Field(
        default=False, description="Rebuilt from a history that may have lost its oldest entries (no stack stored)."
    )

    def manifest_sha256_at(self, index: int) -> str | None:
        """The digest ``versions[index]`` was pinned with (a negative index counts from the top); None unknown."""
        shift = len(self.versions) - len(self.manifest_sha256s)
        at = index % len(self.versions) - shift if self.versions else -1
        return self.manifest_sha256s[at] if 0 <= at < len(self.manifest_sha256s) else None

    def refusal(self, model: str, history_keep: int) -> StateChangeRefused:
        """Why a rollback with no canary finds nothing on this (empty) stack to return to."""
        pin_one = f"pin the version you want instead (`fleet models pin {model} VERSION`)"
        if self.dropped:
            return StateChangeRefused(
                f"{model} has no canary, and every stable version its rollback stack keeps (the last {UNDO_KEEP:,}) "
                f"was rolled back to already; {self.dropped:,} older ones were not kept: {pin_one}",
                "rollback", UNDO_KEEP,
            )  # fmt: skip
        if self.from_trimmed_history:
            return StateChangeRefused(
                f"{model} has no canary and no pin or promote to undo in its history, which keeps the last "
                f"{history_keep:,} changes only (older ones are unknown): {pin_one}",
                "rollback", history_keep,
            )  # fmt: skip
        return StateChangeRefused(f"{model} has no canary and no pin or promote to undo", "canary", None)


def next_undo(stack: UndoStack, action: Action, before: Split, after: Split) -> UndoStack:
    """The stack after a change ``action`` took the split from ``before`` to ``after``."""
    if before.stable == after.stable:
        return stack
    if action in ("pin", "promote"):
        versions = (*stack.versions, before.stable)
        digests = (*stack.manifest_sha256s, before.stable_manifest_sha256)
        over = max(0, len(versions) - UNDO_KEEP)
        return stack.model_copy(update={"versions": versions[over:], "dropped": stack.dropped + over,
                                        "manifest_sha256s": digests[-len(versions[over:]):]})
    if action == "rollback" and stack.versions:
        kept = len(stack.versions) - 1
        return stack.model_copy(update={"versions": stack.versions[:-1],
                                        "manifest_sha256s": stack.manifest_sha256s[:-1][-kept:] if kept else ()})
    return stack


def undo_of_history(entries: list[HistoryEntry], *, may_be_trimmed: bool) -> UndoStack:
    """The stack ``entries`` (oldest first) give, for a model whose stack was never stored."""
    stack = UndoStack(from_trimmed_history=may_be_trimmed)
    for entry in entries:
        stack = next_undo(stack, entry.action, entry.from_, entry.to)
    return stack


def read_undo(client: Any, model: str) -> UndoStack | None:
    """The model's stored stack (on a redis-py client or a WATCHing pipeline); None when none was stored."""
    raw = client.get(UNDO_KEY.format(model=model))
    return None if raw is None else UndoStack.model_validate_json(raw)
