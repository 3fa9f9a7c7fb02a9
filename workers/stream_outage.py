"""When the stream publisher writes again while Redis does not answer, and what it logs about the outage.

A write that fails starts an outage (:class:`Outage`): the held events are tried again
:data:`FIRST_RETRY_S` later, then at waits doubling up to :data:`MAX_RETRY_S` (the fleet's one backoff
schedule, :mod:`protocol.backoff`, as the stream readers'); the first failure and the first write that
succeeds after it are each logged once (``fleet.streams``), the latter with how long Redis did not
answer (s) and the events written and dropped meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sized
from typing import Protocol

from protocol.backoff import FIRST_RETRY_S, MAX_RETRY_S, Backoff

__all__ = ["FIRST_RETRY_S", "MAX_RETRY_S", "Outage", "PublisherCounts"]

log = logging.getLogger("fleet.streams")


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


class Outage(Backoff):
    """When to write again while Redis does not answer, and what to log at its start and end."""

    def __init__(self) -> None:
        super().__init__()
        self.retry_at_s = 0.0
        self.published_before = 0
        self.dropped_before = 0

    def failed(self, publisher: PublisherCounts, exc: BaseException, now_s: float) -> None:
        if self.down_since_s is None:
            self.published_before, self.dropped_before = publisher.published, publisher.dropped
            log.warning("stream publisher: Redis does not answer (%s); holding %d events until it does",
                        exc, len(publisher.pending))
        self.retry_at_s = now_s + self.next_wait_s(now_s)

    def ended(self, publisher: PublisherCounts) -> None:
        if self.down_since_s is None:
            return
        log.warning("stream publisher: Redis answers again after %.1f s; wrote %d held events, %d dropped",
                    time.monotonic() - self.down_since_s, publisher.published - self.published_before,
                    publisher.dropped - self.dropped_before)
        self.answered()
        self.retry_at_s = 0.0
