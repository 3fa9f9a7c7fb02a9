"""The admission depth cache (producer.admission.DepthCache): pure bookkeeping, an injected clock."""

from __future__ import annotations

import pytest

from producer.admission import DepthCache

Q = "fleet.m"


@pytest.mark.parametrize(
    ("ttl_s", "stored", "read_at_s", "now_s", "count", "cap", "admits"),
    [
        (0.25, 0, 10.0, 10.1, 1, 5, True),  # fresh, room left
        (0.25, 4, 10.0, 10.1, 1, 5, True),  # fresh, exactly at the cap after it
        (0.25, 5, 10.0, 10.1, 1, 5, False),  # would pass the cap: read again
        (0.25, 0, 10.0, 10.25, 1, 5, False),  # stale at ttl
        (0.25, 0, 10.0, 11.0, 1, 5, False),  # stale
        (0.0, 0, 10.0, 10.0, 1, 5, False),  # ttl 0 keeps nothing
        (0.25, 2, 10.0, 10.1, 4, 5, False),  # a chunk that does not fit
    ],
)
def test_admits_only_on_a_fresh_read_with_room(
    ttl_s: float, stored: int, read_at_s: float, now_s: float, count: int, cap: int, admits: bool
) -> None:
    cache = DepthCache(ttl_s)
    cache.store(Q, stored, read_at_s)
    assert cache.admits(Q, count, cap, now_s) is admits


def test_unknown_queue_is_read() -> None:
    assert DepthCache(1.0).admits(Q, 1, 10, 0.0) is False


def test_own_admissions_count_until_the_cap_then_a_read_is_asked_for() -> None:
    cache = DepthCache(1.0)
    cache.store(Q, 1, 0.0)
    assert [cache.admits(Q, 1, 4, 0.1) for _ in range(4)] == [True, True, True, False]
    cache.store(Q, 0, 0.2)  # workers drained it: a fresh read lets more in
    assert cache.admits(Q, 2, 4, 0.3) is True
    cache.add(Q, 2)
    assert cache.admits(Q, 1, 4, 0.3) is False


def test_queues_are_kept_apart() -> None:
    cache = DepthCache(1.0)
    cache.store(Q, 4, 0.0)
    cache.store("fleet.other", 0, 0.0)
    assert cache.admits(Q, 1, 4, 0.1) is False
    assert cache.admits("fleet.other", 1, 4, 0.1) is True
