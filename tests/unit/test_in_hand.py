"""Messages of one take are "in hand" (broker.in_hand.IN_HAND) from the moment they leave Redis until
Celery holds them: the first task of a burst can reach the scheduler while the rest of its take is
still being handed over, and the scheduler's start-together count must see every one of them, once.
Pure bookkeeping, on a stand-in channel whose delivery reserves the task as Celery's strategy does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kombu.transport import redis as kombu_redis

from broker import atomic_take
from broker.cancel_marks import CancelReadingQoS
from broker.in_hand import IN_HAND, InHand
from broker.poison import GuardedChannel


class _Channel:
    """What the take's delivery touches of a GuardedChannel: the checks, the delivery, kombu's cycle.
    Its delivery adds the task to ``reserved`` midway (Celery's ``task_reserved``), and reads what is on
    its way just before and just after."""

    sep = "\x06\x16"

    def __init__(self, refuse: set[bytes], fail_at: int | None = None) -> None:
        self.refuse, self.fail_at = refuse, fail_at
        self.in_hand_at_delivery: list[int] = []
        self.on_their_way: list[int] = []
        self.reserved: set[str] = set()
        self.pre_taken: dict[str, Any] = {}
        self._queue_cycle = SimpleNamespace(rotate=lambda queue: None)

    def _check(self, queue: str, list_key: str, raw: bytes) -> Any:
        return None if raw in self.refuse else SimpleNamespace(tag=raw.decode(), task_id=raw.decode())

    def _deliver_checked(self, queue: str, list_key: str, taken: Any) -> None:
        if len(self.in_hand_at_delivery) == self.fail_at:
            raise RuntimeError("Celery refused the message")
        self.in_hand_at_delivery.append(IN_HAND.now().anonymous)
        self._read_on_their_way()
        self.reserved.add(taken.task_id)
        self._read_on_their_way()

    def _read_on_their_way(self) -> None:
        task_ids, anonymous = IN_HAND.beside(lambda: set(self.reserved))
        self.on_their_way.append(len(task_ids) + anonymous)


def _rows(*raws: bytes) -> list[Any]:
    """The take script's rows: message, tag (none for a refused one: nothing to forget), task ID, mark."""
    return [x for raw in raws for x in (raw, None if raw == b"bad" else raw, None, None)]


def _deliver(channel: _Channel, taken: list[tuple[str, Any, list[Any]]]) -> bool:
    with IN_HAND.taking() as take:
        assert IN_HAND.now().anonymous == 1  # the script ran: its messages left Redis, the reply is on its way
        return atomic_take._deliver_sections(channel, taken, take)


def test_a_take_is_in_hand_until_each_message_is_handed_over_and_none_is_left_after() -> None:
    channel = _Channel(refuse={b"bad"})
    assert _deliver(channel, [("q1", None, _rows(b"a", b"bad", b"b")), ("q2", None, _rows(b"c", b"d"))])
    # at each hand-over, the ones after it (not the refused one) are still in hand
    assert channel.in_hand_at_delivery == [3, 2, 1, 0]
    assert IN_HAND.now().anonymous == 0 and not IN_HAND.now().handing


def test_every_message_of_a_take_is_on_its_way_exactly_once_at_every_instant_of_its_hand_over() -> None:
    """Before Celery reserves a message and after, until its task starts, the count holds each accepted
    message of the take once: none is counted both in hand and reserved, none in neither."""
    channel = _Channel(refuse={b"bad"})
    assert _deliver(channel, [("q1", None, _rows(b"a", b"bad", b"b", b"c", b"d"))])
    assert channel.on_their_way == [4] * 8


def test_a_failed_hand_over_leaves_nothing_counted() -> None:
    channel = _Channel(refuse=set(), fail_at=1)
    with pytest.raises(RuntimeError):
        _deliver(channel, [("q1", None, _rows(b"a", b"b", b"c"))])
    assert channel.in_hand_at_delivery == [2]
    assert IN_HAND.now().anonymous == 0 and not IN_HAND.now().handing


def test_a_take_that_brought_nothing_stops_counting_and_wakes_the_listeners() -> None:
    hand = InHand()
    woken: list[int] = []
    hand.subscribe(lambda: woken.append(hand.now().anonymous))
    with hand.taking() as take:
        assert hand.now().anonymous == 1
        take.took(0)
        assert hand.now().anonymous == 0
    assert woken == [0]
    with hand.taking():  # the script raised: its exit ends the count
        pass
    assert hand.now().anonymous == 0 and woken == [0, 0]


def test_a_take_in_flight_becomes_its_messages_in_one_step() -> None:
    hand = InHand()
    with hand.taking() as take:
        take.took(3)
        assert hand.now().anonymous == 3  # not 4: the take no longer counts once its messages do
    assert hand.now().anonymous == 3
    for name in ("x", "y", "z"):
        with hand.handing_over(name):
            assert hand.now().handing == frozenset({name})
    assert hand.now().anonymous == 0 and not hand.now().handing


def test_the_count_never_goes_below_zero() -> None:
    hand = InHand()
    with hand.taking() as take:
        take.took(2)
    hand.handing(3)
    assert hand.now().anonymous == 0


class _BrpopChannel:
    """What :meth:`broker.poison.GuardedChannel._brpop_read` touches on kombu's ``BRPOP`` path (the take
    without the atomic script): the reply's parse, the checks, the unacked record, the delivery. Each
    step reads how many messages are on their way; the delivery reserves the task midway, as Celery's
    strategy does."""

    sep = "\x06\x16"
    peek_sent = False
    take_batch = False  # one message per round trip: the item BRPOP brought, and nothing popped beside it
    connection_errors = (ConnectionError,)

    def __init__(self, reply: Any, *, refuse: bool = False, record_fails: bool = False) -> None:
        self.reply, self.refuse, self.record_fails = reply, refuse, record_fails
        self.on_their_way: dict[str, list[int]] = {"parse": [], "check": [], "record": [], "deliver": []}
        self.reserved: set[str] = set()
        self.parked: list[bytes] = []
        self.qos = CancelReadingQoS.__new__(CancelReadingQoS)  # a QoS that takes the channel's own records
        self._queue_cycle = SimpleNamespace(rotate=lambda queue: None)
        self.client = SimpleNamespace(connection=None, parse_response=self._parse_response)

    def _read(self, step: str) -> None:
        task_ids, anonymous = IN_HAND.beside(lambda: set(self.reserved))
        self.on_their_way[step].append(len(task_ids) + anonymous)

    def _parse_response(self, connection: Any, command: str, **options: Any) -> Any:
        self._read("parse")  # the poller saw the reply: it is read here, its message already off its list
        return self.reply

    def _check(self, queue: str, list_key: str, raw: bytes) -> Any:
        self._read("check")
        return None if self.refuse else SimpleNamespace(tag=raw.decode(), task_id=raw.decode(), raw=raw)

    def _record(self, list_key: str, batch: list[Any], *, pop: int) -> list[bytes]:
        self._read("record")
        if self.record_fails:
            self.parked.extend(taken.raw for taken in batch)
            raise ConnectionError("Redis went away")
        return []

    def _deliver_checked(self, queue: str, list_key: str, taken: Any) -> None:
        self._read("deliver")
        self.reserved.add(taken.task_id)
        self._read("deliver")

    def _take(self, queue: str, list_key: str, item: bytes) -> None:
        GuardedChannel._take(self, queue, list_key, item)  # type: ignore[arg-type]

    def _deliver_taken(self, *args: Any) -> None:
        GuardedChannel._deliver_taken(self, *args)  # type: ignore[arg-type]


def _brpop_read(channel: _BrpopChannel) -> bool:
    return GuardedChannel._brpop_read(channel)  # type: ignore[arg-type]


def test_a_message_brpop_took_is_on_its_way_once_from_its_reply_until_celery_holds_it() -> None:
    """Without the atomic take (Redis < 6.2, an ACL without EVAL) kombu's ``BRPOP`` takes the message;
    from the moment its reply is read until Celery reserved it, it is counted once at every step (it
    was in no count between the reply and the record of its delivery)."""
    channel = _BrpopChannel([b"fleet.demo-lm", b"rid-1"])
    assert _brpop_read(channel)
    assert channel.on_their_way == {"parse": [1], "check": [1], "record": [1], "deliver": [1, 1]}
    assert IN_HAND.now().anonymous == 0 and not IN_HAND.now().handing


@pytest.mark.parametrize("fault", ["refused", "record_fails", "empty"])
def test_a_brpop_take_that_ends_without_a_hand_over_leaves_nothing_counted(fault: str) -> None:
    woken: list[int] = []
    listener = lambda: woken.append(IN_HAND.now().anonymous)  # noqa: E731
    IN_HAND.subscribe(listener)
    try:
        channel = _BrpopChannel(None if fault == "empty" else [b"fleet.demo-lm", b"rid-1"],
                                refuse=fault == "refused", record_fails=fault == "record_fails")
        if fault == "empty":
            with pytest.raises(kombu_redis.Empty):  # type: ignore[attr-defined]
                _brpop_read(channel)
        elif fault == "record_fails":
            with pytest.raises(ConnectionError):
                _brpop_read(channel)
            assert channel.parked == [b"rid-1"]
        else:
            assert _brpop_read(channel)
        assert channel.on_their_way["parse"] == [1]
        assert not channel.on_their_way["deliver"]
        assert IN_HAND.now().anonymous == 0 and not IN_HAND.now().handing
        assert woken and woken[-1] == 0  # the drop woke the scheduler's wait for company
    finally:
        IN_HAND.unsubscribe(listener)
