"""One warning per Redis outage for each of a worker's background loops, and one line when Redis is back.

The heartbeat, the reconciler and the cancel listener each retry Redis about once a second. A worker started
before its Redis (day one: `fleet worker` before `fleet redis`), or living through a Redis restart, used to log
each failed try of each loop: three warnings a second, the same text over and over, burying the line that
says what to do. :class:`OutageLog` logs a loop's first failure of an outage as a warning, its repeats at
DEBUG, and its first success after the outage at INFO with how long it lasted and how many tries failed.

The time is passed in (monotonic seconds), so the class is tested without Redis, threads or sleeps.
"""

from __future__ import annotations

import logging

__all__ = ["OutageLog"]


class OutageLog:
    """The log of one loop's Redis outages (not thread-safe: one loop, one instance).

    Args:
        logger: where the lines go.
        what: the loop's failure in words, e.g. ``"heartbeat to Redis failed"``; the line is ``"<what>: <error>"``.
    """

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self._since_s: float | None = None
        self._failures = 0

    @property
    def down(self) -> bool:
        """Whether the last try failed (an outage is under way)."""
        return self._since_s is not None

    def failed(self, exc: BaseException, now_s: float) -> None:
        """A try failed at ``now_s`` (monotonic s): a warning if it is the outage's first, else a DEBUG line."""
        self._failures += 1
        if self._since_s is None:
            self._since_s = now_s
            self._log.warning("%s: %s; retrying (further failures are logged at DEBUG until Redis answers again)",
                              self._what, exc)
        else:
            self._log.debug("%s: %s; retrying (failure %d of this outage)", self._what, exc, self._failures)

    def recovered(self, now_s: float) -> None:
        """A try succeeded at ``now_s`` (monotonic s): after an outage, one INFO line with its length (s)."""
        if self._since_s is None:
            return
        self._log.info("%s: Redis answers again after %.1f s (%d failed tries)", self._what,
                       max(0.0, now_s - self._since_s), self._failures)
        self._since_s = None
        self._failures = 0
