"""Messages this worker process took from Redis and has not handed to Celery yet.

One take (:mod:`broker.atomic_take`, :mod:`broker.batch_take`) returns up to the worker's free tokens of
messages, and the channel then hands them to Celery one at a time on the consumer's thread. Celery
starts each one's task on a pool thread as soon as it has it, so the first task can reach the worker's
code while the rest of its take is still being handed over, and while they are in neither Celery's
reserved set nor this worker's scheduler. The scheduler's "company on its way" count
(``batching.start_together_ms``, :meth:`workers.scheduler.Scheduler.unseen`) adds :data:`IN_HAND`, so a
burst taken in one step starts together.
"""

from __future__ import annotations

import threading

__all__ = ["IN_HAND", "InHand"]


class InHand:
    """A count of taken, not yet handed messages (thread-safe)."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Messages taken and not handed to Celery yet."""
        return self._count

    def took(self, n: int) -> None:
        """``n`` messages were taken and are about to be handed over."""
        with self._lock:
            self._count += n

    def handing(self, n: int = 1) -> None:
        """``n`` of them are being handed over now (or were refused): no longer in hand."""
        with self._lock:
            self._count = max(0, self._count - n)


IN_HAND = InHand()
"""This worker process's count."""
