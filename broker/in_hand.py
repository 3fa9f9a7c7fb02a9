"""Messages this worker process took from Redis and Celery does not hold yet.

One take (:mod:`broker.atomic_take`, :mod:`broker.batch_take`) returns up to the worker's free tokens of
messages, and the channel then hands them to Celery one at a time on the consumer's thread. Celery
starts each one's task on a pool thread as soon as it has it, so the first task can reach the worker's
code while the rest of its take is still being handed over, and while they are in neither Celery's
reserved set nor this worker's scheduler. The scheduler's "company on its way" count
(``batching.start_together_ms``, :meth:`workers.scheduler.Scheduler.unseen`) reads :data:`IN_HAND`, so a
burst taken in one step starts together.

A message is counted from the moment it leaves Redis until Celery holds it, with no gap:

- **a take in flight** (:meth:`InHand.taking`): the take script ran in Redis, so its messages are no
  longer on their lists, and its reply is on its way to this process: counted as one message on its
  way until the reply is read;
- **taken** (:meth:`Take.took`): read, not yet handed over;
- **being handed over** (:meth:`InHand.handing_over`): from just before Celery's delivery call to its
  return, by task ID. Celery adds the task to its reserved set inside that call, so for a while the
  message is in both; the reader unites the two sets of IDs, so it never counts a message twice, and
  never loses one between them.

Each time the count drops, :meth:`InHand.subscribe`'s callbacks run (the scheduler re-reads it: a
take that brought nothing ends a wait for company at once).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["IN_HAND", "InHand", "InHandNow", "Take"]


@dataclass(frozen=True)
class InHandNow:
    """One consistent reading of :class:`InHand`."""

    anonymous: int
    """Messages on their way whose task IDs are not known here: takes in flight (one each) and taken,
    not yet handed messages."""
    handing: frozenset[str]
    """Task IDs whose delivery call to Celery is under way (maybe already in Celery's reserved set)."""


class InHand:
    """Taken messages not yet held by Celery (thread-safe)."""

    def __init__(self) -> None:
        self._taken = 0
        self._taking = 0
        self._handing: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def now(self) -> InHandNow:
        """Everything on its way, read at one instant."""
        with self._lock:
            return InHandNow(self._taken + self._taking, frozenset(self._handing))

    def beside(self, held: Callable[[], set[str]]) -> tuple[set[str], int]:
        """What is on its way, beside the task IDs Celery holds (``held()``, read after this hand): the
        IDs of both (a message being handed over may be in both: counted once) and the count of messages
        whose IDs are not known here. A message handed over after this hand's reading is in ``held()``
        by the time it is read, so none falls between the two."""
        now = self.now()
        return held() | now.handing, now.anonymous

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (no lock held) whenever the count drops; it must be cheap and not raise."""
        self._listeners.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        """Stop calling ``callback`` (a stopped scheduler)."""
        if callback in self._listeners:
            self._listeners.remove(callback)

    @contextmanager
    def taking(self) -> Iterator[Take]:
        """A take whose messages have left (or may have left) Redis and whose reply is not read yet; the
        block calls :meth:`Take.took` with what it brought, which ends the take's "in flight" count and
        starts its messages' in one step."""
        take = Take(self)
        with self._lock:
            self._taking += 1
        try:
            yield take
        finally:
            self._brought(take, 0)  # a take that raised, or brought nothing: no longer in flight
            self._dropped()

    def _brought(self, take: Take, n: int) -> None:
        """``take`` brought ``n`` more messages; it is no longer in flight (once, whoever calls first)."""
        with self._lock:
            self._taken += n
            if not take.done:
                self._taking -= 1
                take.done = True

    def handing(self, n: int = 1) -> None:
        """``n`` taken messages leave the worker's hand without a hand-over (refused by the checks, or the
        delivery failed before them)."""
        with self._lock:
            self._taken = max(0, self._taken - n)
        self._dropped()

    @contextmanager
    def handing_over(self, task_id: str | None) -> Iterator[None]:
        """One taken message (counted by :meth:`Take.took`) is handed to Celery in this block: it leaves
        the taken count now and counts by ``task_id`` (its Celery task; None for a message without one,
        which Celery never starts) until the block ends."""
        with self._lock:
            self._taken = max(0, self._taken - 1)
            if task_id is not None:
                self._handing[task_id] += 1
        try:
            yield
        finally:
            if task_id is not None:
                with self._lock:
                    self._handing[task_id] -= 1
                    if self._handing[task_id] <= 0:
                        del self._handing[task_id]
            self._dropped()

    def _dropped(self) -> None:
        for callback in list(self._listeners):
            callback()


class Take:
    """One take in flight (:meth:`InHand.taking`)."""

    def __init__(self, hand: InHand) -> None:
        self._hand = hand
        self.done = False

    def took(self, n: int) -> None:
        """The take brought ``n`` messages, about to be handed over: they are counted as taken from this
        instant, and the take no longer counts as in flight."""
        self._hand._brought(self, n)


IN_HAND = InHand()
"""This worker process's count."""
