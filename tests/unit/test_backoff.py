"""The one backoff schedule of Redis outages (protocol.backoff): the stream readers and the publisher wait the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from producer.streams import Reconnect
from protocol.backoff import FIRST_RETRY_S, MAX_RETRY_S, Backoff
from workers.stream_outage import Outage

FAILURES_S = (10.0, 10.05, 10.15, 10.35, 10.75, 11.55, 12.55)
SCHEDULE_S = [FIRST_RETRY_S, 0.1, 0.2, 0.4, 0.8, MAX_RETRY_S, MAX_RETRY_S]


def test_waits_double_from_the_first_to_the_longest_and_start_over_after_an_answer() -> None:
    backoff = Backoff()
    assert [backoff.next_wait_s(t) for t in FAILURES_S] == pytest.approx(SCHEDULE_S)
    assert backoff.down_since_s == 10.0
    backoff.answered()
    assert backoff.down_since_s is None
    assert backoff.next_wait_s(20.0) == FIRST_RETRY_S


def test_the_reader_and_the_publisher_wait_the_same_within_the_readers_bound() -> None:
    reader, publisher = Reconnect(max_outage_s=30.0), Outage()
    counts = SimpleNamespace(published=0, dropped=0, pending=[])
    publisher_waits = []
    for now_s in FAILURES_S:
        publisher.failed(counts, ConnectionError("down"), now_s)
        publisher_waits.append(publisher.retry_at_s - now_s)
    assert [reader.failed(t) for t in FAILURES_S] == pytest.approx(publisher_waits)
    assert publisher_waits == pytest.approx(SCHEDULE_S)
    publisher.ended(counts)
    assert (publisher.down_since_s, publisher.retry_at_s) == (None, 0.0)
