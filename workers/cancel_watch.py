"""Cancels heard on ``fleet:cancels``, handed to the one-step requests that wait for their batch.

A worker reads a request's cancel mark as it takes the message (:mod:`broker.cancel_marks`). A one-step
request (next-token, embedding) taken before its cancel then waits in the scheduler's batch window, up to
``max_wait_ms``; a cancel that arrives then must still stop it. Reading the marks again before each batch
would cost a Redis round trip per batch (per request when requests come one at a time), on the scheduler's
thread, which never waits on Redis. Instead the worker's cancel listener (:mod:`workers.cancel_listener`:
one ``SUBSCRIBE`` per worker, there for generations already) hands every ID it hears to
:meth:`CancelWatch.heard`, which ends the matching waiting request (:meth:`workers.scheduler.Scheduler.cancel`).
What a request pays when nobody cancels is a dict entry and a future callback, no Redis command.

No gap: a cancel heard between the take (which read no mark) and :meth:`CancelWatch.watch` is remembered
(the last ``remember`` IDs heard, each for as long as its cancel mark lives: ``forget_after_s``, the fleet's
``result_ttl_s``) and ends the request as it is watched. Past that, the ID may name a new request (an
idempotency key sent again once its result and marker expired), which no cancel names: it is not refused.
A cancel published while the listener was not subscribed (a reconnect) is read back from the marks of the
requests watched once it is subscribed again (:meth:`CancelWatch.ids`). Once a request's batch has formed, a
cancel does not stop it: its result wins.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["DEFAULT_FORGET_AFTER_S", "DEFAULT_REMEMBER", "CancelWatch"]

DEFAULT_REMEMBER = 4096
"""Request IDs heard that a :class:`CancelWatch` remembers (the oldest forgotten first)."""

DEFAULT_FORGET_AFTER_S = 3600.0
"""How long a :class:`CancelWatch` remembers an ID heard (s): ``result_ttl_s``'s default, the life of a cancel mark."""

Cancel = Callable[[], object]
"""Ends one waiting request (called once, never under the watch's lock)."""


class CancelWatch:
    """The one-step requests this worker holds, by ID, and the IDs lately heard cancelled (thread-safe)."""

    def __init__(self, remember: int = DEFAULT_REMEMBER, forget_after_s: float = DEFAULT_FORGET_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``remember``: how many IDs heard are kept for a request watched after its cancel was heard
        (its take read no mark, its cancel came before it reached :meth:`watch`); ``forget_after_s``: how long
        each is kept (s; the life of the cancel mark it stands for, ``result_ttl_s``), measured on ``clock``
        (monotonic s).

        Raises:
            ValueError: ``remember`` < 1 or ``forget_after_s`` not > 0."""
        if remember < 1:
            raise ValueError(f"remember must be >= 1, got {remember}")
        if not forget_after_s > 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        self.remember = remember
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._waiting: dict[str, Cancel] = {}
        self._heard: OrderedDict[str, float] = OrderedDict()
        """ID heard -> when (clock s), oldest first."""
        self._lock = threading.Lock()

    def _forget_old(self, now_s: float) -> None:
        """Drop the IDs heard more than ``forget_after_s`` ago, and the oldest beyond ``remember`` (caller
        holds the lock)."""
        while self._heard and (len(self._heard) > self.remember
                               or now_s - next(iter(self._heard.values())) > self.forget_after_s):
            self._heard.popitem(last=False)

    def watch(self, request_id: str, until: Future[Any], cancel: Cancel) -> None:
        """Call ``cancel()`` if ``request_id`` is heard cancelled (or was already) before ``until`` is done.

        The watch ends when ``until`` is done; a later :meth:`watch` of the same ID replaces it."""
        with self._lock:
            self._forget_old(self.clock())
            already = request_id in self._heard
            if not already:
                self._waiting[request_id] = cancel
        if already:
            cancel()
            return
        until.add_done_callback(lambda _: self._forget(request_id, cancel))

    def _forget(self, request_id: str, cancel: Cancel) -> None:
        with self._lock:
            if self._waiting.get(request_id) is cancel:
                del self._waiting[request_id]

    def heard(self, request_id: str) -> bool:
        """``request_id`` was cancelled: end its waiting request if one is watched, and remember the ID.

        Returns True when a watched request was handed the cancel."""
        with self._lock:
            now_s = self.clock()
            self._heard[request_id] = now_s
            self._heard.move_to_end(request_id)
            self._forget_old(now_s)
            cancel = self._waiting.pop(request_id, None)
        if cancel is None:
            return False
        cancel()
        return True

    def ids(self) -> list[str]:
        """The IDs watched now (whose marks a listener that was not subscribed reads back)."""
        with self._lock:
            return list(self._waiting)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
