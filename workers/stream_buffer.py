"""The stream publisher's bounded hold of events not yet written to Redis (pure: no I/O, no clock).

Every event a generation emits waits here until a pipeline wrote it; while Redis does not answer
(a restart, a network cut) events pile up, in order, and are written when it answers again, with
their token indexes, so readers see the stream continue where it stopped.

While Redis answers, events pass straight through (each loop writes all it took). While it does not,
the hold is bounded by events and by bytes (``max_events``, ``max_bytes``). Past a bound a token
event is refused and counted in :attr:`PendingEvents.dropped`; its stream has a gap from then on, so
its later tokens are refused too (a reader cannot hand them on past the gap: it finishes from the
stored result instead), which keeps room for other streams. The event that ends a stream (``final``
or ``error``) has a reserve as large again: it is what lets a reader finish at once, and it is small.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from workers.recent_marks import RecentMarks

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_EVENTS", "MAX_CUT_STREAMS", "HeldEvent", "PendingEvents"]

DEFAULT_MAX_EVENTS = 100_000
"""Default most events held (about a minute of 16 generations at 100 tokens/s each)."""
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
"""Default most bytes held (request IDs + encoded events)."""
MAX_CUT_STREAMS = 100_000
"""Most streams remembered as cut (an event refused, the stream not ended since); past it the one cut longest ago
is forgotten: its later tokens are held again, and its reader, past the gap, finishes from the stored result."""
_ENTRY_OVERHEAD_BYTES = 64
"""What one held event costs beyond its request ID and JSON (tuple, strings' headers), roughly."""


class HeldEvent(NamedTuple):
    """One event waiting for its ``XADD`` (a tuple: one is made per token, on the publisher's thread)."""

    request_id: str
    event: str
    """The event's JSON (:func:`protocol.streams.encode_event`, :func:`protocol.streams.encode_token`)."""
    size_bytes: int
    last: bool
    """It ends its stream (``final`` or ``error``)."""


class PendingEvents:
    """Events in the order they were published, bounded by ``max_events`` and ``max_bytes``."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError(f"max_events ({max_events}) and max_bytes ({max_bytes}) must be >= 1")
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.bytes = 0
        self.dropped = 0
        """Events refused over the bounds since this hold was made."""
        self._items: deque[HeldEvent] = deque()
        self._cut: RecentMarks[None] = RecentMarks(MAX_CUT_STREAMS)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request_id: str, event: str, *, last: bool, bounded: bool = True) -> bool:
        """Hold ``event`` (its JSON; ``last``: it ends its stream); False when it was refused (``bounded`` and
        over the bounds, or its stream already has a gap)."""
        size = len(request_id) + len(event) + _ENTRY_OVERHEAD_BYTES
        if last:
            self._cut.discard(request_id)  # the stream ends here: nothing of it follows
        elif request_id in self._cut:
            self.dropped += 1
            return False
        reserve = 2 if last else 1
        over = len(self._items) >= self.max_events * reserve or self.bytes + size > self.max_bytes * reserve
        if bounded and over:
            self.dropped += 1
            if not last:
                self._cut.mark(request_id, None)
            return False
        self._items.append(HeldEvent(request_id, event, size, last))
        self.bytes += size
        return True

    def head(self, n: int) -> list[HeldEvent]:
        """The ``n`` oldest events (fewer when fewer are held), still held."""
        return [self._items[i] for i in range(min(n, len(self._items)))]

    def pop(self, n: int) -> None:
        """Let go of the ``n`` oldest events (written, or refused by Redis for good)."""
        for _ in range(min(n, len(self._items))):
            self.bytes -= self._items.popleft().size_bytes
