"""When the stream publisher writes again while Redis does not answer, and what it logs about the outage.

A write that fails starts an outage (:class:`Outage`): the held events are tried again
:data:`FIRST_RETRY_S` later, then at waits doubling up to :data:`MAX_RETRY_S`; the first failure and the
first write that succeeds after it are each logged once (``fleet.streams``), the latter with how long
Redis did not answer (s) and the events written and dropped meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sized
from typing import Protocol

__all__ = ["FIRST_RETRY_S", "MAX_RETRY_S", "Outage", "PublisherCounts"]

log = logging.getLogger("fleet.streams")

FIRST_RETRY_S = 0.05
"""First wait before writing again after Redis did not answer (s); doubles up to :data:`MAX_RETRY_S`."""
MAX_RETRY_S = 1.0
"""Longest wait between two writes while Redis does not answer (s)."""


class PublisherCounts(Protocol):
    """What an outage's log lines read of the publisher (:class:`workers.stream_publisher.StreamPublisher`)."""

    @property
    def published(self) -> int:
        """Events written."""

    @property
    def dropped(self) -> int:
        """Events never written."""

    @property
    def pending(self) -> Sized:
        """Events held."""


class Outage:
    """When to write again while Redis does not answer, and what to log at its start and end."""

    def __init__(self) -> None:
        self.down_since_s: float | None = None
        self.retry_at_s = 0.0
        self.delay_s = FIRST_RETRY_S
        self.published_before = 0
        self.dropped_before = 0

    def failed(self, publisher: PublisherCounts, exc: BaseException, now_s: float) -> None:
        if self.down_since_s is None:
            self.down_since_s, self.delay_s = now_s, FIRST_RETRY_S
            self.published_before, self.dropped_before = publisher.published, publisher.dropped
            log.warning("stream publisher: Redis does not answer (%s); holding %d events until it does",
                        exc, len(publisher.pending))
        else:
            self.delay_s = min(MAX_RETRY_S, self.delay_s * 2)
        self.retry_at_s = now_s + self.delay_s

    def ended(self, publisher: PublisherCounts) -> None:
        if self.down_since_s is None:
            return
        log.warning("stream publisher: Redis answers again after %.1f s; wrote %d held events, %d dropped",
                    time.monotonic() - self.down_since_s, publisher.published - self.published_before,
                    publisher.dropped - self.dropped_before)
        self.down_since_s, self.retry_at_s = None, 0.0
