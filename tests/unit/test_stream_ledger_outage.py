"""A stream reader's waits while Redis does not answer stay inside its silence bound (``timeout_s``): pure, on a
fake clock. Before, a reader with ``timeout_s=2`` kept trying for ``max_outage_s`` (30 s in ``FleetClient.stream``)."""

from __future__ import annotations

import math

import pytest

from producer.streams import FIRST_RETRY_S, MAX_RETRY_S, Reconnect, StreamCursor


@pytest.mark.parametrize(
    ("timeout_s", "max_outage_s", "failures_at_s", "expected"),
    [
        # the outage bound is the shorter: Redis gives out first, as before
        (600.0, 1.0, [0.0, 0.5, 1.0], [FIRST_RETRY_S, 2 * FIRST_RETRY_S, None]),
        # the silence is the shorter: the wait is cut to what is left of it, then the reader gives up
        (2.0, 30.0, [1.9, 1.99, 2.0], [pytest.approx(0.05), pytest.approx(0.01), None]),
        (1.0, math.inf, [0.0, 3.0], [FIRST_RETRY_S, None]),
        # no silence bound: only the outage bound counts
        (math.inf, 30.0, [0.0, 10.0, 29.0, 30.0], [FIRST_RETRY_S, 2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S, None]),
        (math.inf, math.inf, [0.0, *range(1, 10)], [FIRST_RETRY_S, *[min(MAX_RETRY_S, FIRST_RETRY_S * 2**i)
                                                                    for i in range(1, 10)]]),
    ],
)
def test_outage_waits_never_pass_the_silence_or_the_outage_bound(
    timeout_s: float, max_outage_s: float, failures_at_s: list[float], expected: list[float | None]
) -> None:
    cursor = StreamCursor("r", now_s=0.0, timeout_s=timeout_s, block_ms=100)
    retry = Reconnect(max_outage_s)
    assert [cursor.outage_wait_s(retry, at) for at in failures_at_s] == expected


def test_an_entry_before_the_outage_restarts_the_silence_it_is_measured_from() -> None:
    cursor = StreamCursor("r", now_s=0.0, timeout_s=2.0, block_ms=100)
    cursor.feed([(b"1-0", {b"e": b'{"type":"token","index":0,"token_id":1,"text":"a"}'})], now_s=5.0)
    retry = Reconnect(30.0)
    assert cursor.outage_wait_s(retry, 6.0) == FIRST_RETRY_S  # 1 s of silence: 1 s left
    assert cursor.outage_wait_s(retry, 7.0) is None  # 2 s since the last entry
