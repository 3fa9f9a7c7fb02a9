"""How long to wait between tries while Redis does not answer: the fleet's one backoff schedule.

The first failure of an outage waits :data:`FIRST_RETRY_S`; each failure after it waits twice the
wait before, up to :data:`MAX_RETRY_S` (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, ... s). An answer ends
the outage; the next failure starts a new one at :data:`FIRST_RETRY_S`. Pure: times come in as
arguments (``time.monotonic()`` seconds).

Used by the stream readers (:class:`producer.streams.Reconnect`, which also gives up after a bound)
and the stream publisher (:class:`workers.stream_outage.Outage`, which also logs the outage).
"""

from __future__ import annotations

__all__ = ["FIRST_RETRY_S", "MAX_RETRY_S", "Backoff"]

FIRST_RETRY_S = 0.05
"""First wait before trying Redis again after it did not answer (s); doubles up to :data:`MAX_RETRY_S`."""
MAX_RETRY_S = 1.0
"""Longest wait between two tries while Redis does not answer (s)."""


class Backoff:
    """The waits of one caller's outages: when the current one started, and the latest wait."""

    def __init__(self) -> None:
        self.down_since_s: float | None = None
        """When the current outage's first failure happened (s, monotonic); None while Redis answers."""
        self.delay_s = FIRST_RETRY_S
        """The wait after the latest failure (s)."""

    def next_wait_s(self, now_s: float) -> float:
        """A try failed at ``now_s``: the wait (s) before the next one; the first failure starts an outage."""
        if self.down_since_s is None:
            self.down_since_s, self.delay_s = now_s, FIRST_RETRY_S
        else:
            self.delay_s = min(MAX_RETRY_S, self.delay_s * 2)
        return self.delay_s

    def answered(self) -> None:
        """Redis answered: the next failure starts a new outage."""
        self.down_since_s = None
