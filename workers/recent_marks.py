"""A bounded map that forgets its oldest marks only (pure: no I/O, no clock, not thread-safe).

The stream publisher remembers a few things per stream until the stream ends: that its tokens are coming
(:attr:`workers.stream_publisher.StreamPublisher` collects them every window while any is open), when its
``EXPIRE`` was last sent, which streams lost an event over the hold's bounds
(:class:`workers.stream_buffer.PendingEvents`). A stream's mark leaves when its last event passes; one whose
end never passes (none should) would stay for ever, so each map is bounded. Past the bound the mark set or
touched longest ago goes, not every mark at once: before, the sets were cleared at their cap (100,000), and
the streams open at that moment were forgotten with the stale ones (their tokens then waited for the next
wake instead of the next window).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["RecentMarks"]

V = TypeVar("V")


class RecentMarks(Generic[V]):
    """Up to ``limit`` marks ``key -> value``; marking one more forgets the oldest (counted in :attr:`forgotten`)."""

    def __init__(self, limit: int) -> None:
        """Raises ValueError: ``limit`` < 1."""
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be >= 1")
        self.limit = limit
        self.forgotten = 0
        """Marks let go to stay within :attr:`limit` since this map was made."""
        self._marks: OrderedDict[str, V] = OrderedDict()

    def mark(self, key: str, value: V) -> None:
        """Set ``key``'s mark to ``value``, newest of all; past :attr:`limit` the oldest mark is forgotten."""
        self._marks[key] = value
        self._marks.move_to_end(key)
        while len(self._marks) > self.limit:
            self._marks.popitem(last=False)
            self.forgotten += 1

    def get(self, key: str, default: V) -> V:
        """``key``'s mark, or ``default`` when it has none (reading does not make it newer)."""
        return self._marks.get(key, default)

    def discard(self, key: str) -> None:
        """Let go of ``key``'s mark (no error when it has none)."""
        self._marks.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._marks

    def __len__(self) -> int:
        return len(self._marks)
