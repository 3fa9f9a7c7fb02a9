"""Messages of one take are "in hand" (broker.in_hand.IN_HAND) until each is handed to Celery: the first
task of a burst can reach the scheduler while the rest of its take is still being handed over, and the
scheduler's start-together count must see them. Pure bookkeeping, on a stand-in channel."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from broker import atomic_take
from broker.in_hand import IN_HAND, InHand


class _Channel:
    """What the take's delivery touches of a GuardedChannel: the checks, the delivery, kombu's cycle."""

    sep = "\x06\x16"

    def __init__(self, refuse: set[bytes], fail_at: int | None = None) -> None:
        self.refuse, self.fail_at = refuse, fail_at
        self.in_hand_at_delivery: list[int] = []
        self.pre_taken: dict[str, Any] = {}
        self._queue_cycle = SimpleNamespace(rotate=lambda queue: None)

    def _check(self, queue: str, list_key: str, raw: bytes) -> Any:
        return None if raw in self.refuse else SimpleNamespace(tag=raw.decode(), task_id=None)

    def _deliver_checked(self, queue: str, list_key: str, taken: Any) -> None:
        if len(self.in_hand_at_delivery) == self.fail_at:
            raise RuntimeError("Celery refused the message")
        self.in_hand_at_delivery.append(IN_HAND.count)


def _rows(*raws: bytes) -> list[Any]:
    """The take script's rows: message, tag (none for a refused one: nothing to forget), task ID, mark."""
    return [x for raw in raws for x in (raw, None if raw == b"bad" else raw, None, None)]


def test_a_take_is_in_hand_until_each_message_is_handed_over_and_none_is_left_after() -> None:
    channel = _Channel(refuse={b"bad"})
    taken = [("q1", None, _rows(b"a", b"bad", b"b")), ("q2", None, _rows(b"c", b"d"))]
    assert atomic_take._deliver_sections(channel, taken)
    # at each hand-over, the ones after it (not the refused one) are still in hand
    assert channel.in_hand_at_delivery == [3, 2, 1, 0]
    assert IN_HAND.count == 0


def test_a_failed_hand_over_leaves_nothing_counted() -> None:
    channel = _Channel(refuse=set(), fail_at=1)
    with pytest.raises(RuntimeError):
        atomic_take._deliver_sections(channel, [("q1", None, _rows(b"a", b"b", b"c"))])
    assert channel.in_hand_at_delivery == [2] and IN_HAND.count == 0


def test_the_count_never_goes_below_zero() -> None:
    hand = InHand()
    hand.took(2)
    hand.handing(3)
    assert hand.count == 0
