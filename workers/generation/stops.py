"""Stop strings over text that grows token by token (pure).

A stream must never show text past a stop string, and a stop string can arrive split over several
tokens, so text that could still become the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StopScan", "scan_stops"]


@dataclass(frozen=True)
class StopScan:
    """Where the text may be shown up to, and whether a stop string matched."""

    match_at: int | None
    """Index of the first stop string's start in the text, or None."""
    safe_end: int
    """Text before this index can be shown (the final text when ``match_at`` is set)."""


def scan_stops(text: str, stops: Sequence[str], searched_from: int = 0) -> StopScan:
    """Look for ``stops`` in ``text`` (only matches ending after ``searched_from`` are new).

    ``searched_from`` lets callers rescan only the tail: a match must overlap text added since
    the last call, so the search starts ``max(len(stop)) - 1`` characters before it.
    """
    if not stops:
        return StopScan(None, len(text))
    longest = max(len(s) for s in stops)
    start = max(0, searched_from - longest + 1)
    first: int | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at != -1 and (first is None or at < first):
            first = at
    if first is not None:
        return StopScan(first, first)
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return StopScan(None, len(text) - hold)
