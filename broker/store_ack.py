"""A successful request's ack, done by the script that stores its result: one round trip, one atomic step.

With ``acks_late`` Celery stores a task's result (one ``EVALSHA``, :mod:`broker.result_backend`) and
then acks its message: kombu's ``HDEL`` + ``ZREM`` of the delivery's unacked entry, one more round
trip from the task's thread (``fleet bench`` with py-spy: ~7 % of the worker's CPU on the
``fleet.infer`` path). The store script can remove that entry itself, in the same atomic step: the
result and the ack land together, so a worker that dies between the two can no longer leave a
stored SUCCESS whose message is redelivered and run again.

How the pieces meet:

1. :class:`StoreAckingQoS` (the worker's channel, :class:`broker.poison.GuardedChannel`) notes each
   delivery's tag with the names of its unacked hash and index as it takes the message
   (:meth:`StoreAcks.expect`);
2. the result backend, storing a SUCCESS for a task whose message properties carry a noted tag, runs
   the script with those two keys and the tag, and records the tag as acked (:meth:`StoreAcks.acked`);
3. Celery then acks as always; :meth:`StoreAckingQoS.ack` finds the tag recorded and only updates
   kombu's in-memory bookkeeping (the prefetch count), with no Redis command. The worker's prefetch
   (its tokens) already counts the delivery free from step 2 (:meth:`StoreAckingQoS.can_consume`): a
   request holds its token from dequeue to result write.

Only a SUCCESS is acked this way: Celery acks a failure too (``task_acks_on_failure_or_timeout``) but
may reject and requeue it instead, which the store cannot know. A tag that was not noted (another
channel, a restored message of an earlier connection), a store that did not run the script (Redis
refused the write and the result was parked) and every other state take kombu's own ack.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Container
from typing import Any

from kombu.transport import virtual

from broker.cancel_marks import CancelReadingQoS

__all__ = ["ACKS", "StoreAckingQoS", "StoreAcks", "delivery_tag_of", "unacked_entry_of"]


class StoreAcks:
    """Deliveries this worker took (tag → unacked hash and index keys) and those the store acked."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._expected: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._acked: set[str] = set()
        self._storing: set[str] = set()
        """Tags whose store script is running: their tokens count as free (the result may be published)."""
        self._lock = threading.Lock()

    def expect(self, tag: str, unacked_key: str, unacked_index_key: str) -> None:
        """Delivery ``tag`` was taken; its unacked entry lives in these two keys."""
        with self._lock:
            self._expected[tag] = (unacked_key, unacked_index_key)
            while len(self._expected) > self.limit:  # deliveries Celery never acked (restored at shutdown)
                dropped, _ = self._expected.popitem(last=False)
                self._acked.discard(dropped)
                self._storing.discard(dropped)

    def keys_for(self, tag: str) -> tuple[str, str] | None:
        """The unacked hash and index of ``tag``, when it was taken by a :class:`StoreAckingQoS`."""
        with self._lock:
            return self._expected.get(tag)

    def storing(self, tag: str) -> None:
        """The store script of ``tag``'s result is about to run: its caller may have the result before
        :meth:`acked` is called, and may queue more at once (see :meth:`storing_among`)."""
        with self._lock:
            if tag in self._expected:
                self._storing.add(tag)

    def store_failed(self, tag: str) -> None:
        """The store script of ``tag`` did not run: the delivery holds its token until Celery acks it."""
        with self._lock:
            self._storing.discard(tag)

    def acked(self, tag: str) -> None:
        """The store script removed ``tag``'s unacked entry."""
        with self._lock:
            self._storing.discard(tag)
            if tag in self._expected:
                self._acked.add(tag)

    def settle(self, tag: str) -> bool:
        """Forget ``tag``; True when the store already acked it (kombu's ack then needs no Redis command)."""
        with self._lock:
            self._expected.pop(tag, None)
            self._storing.discard(tag)
            if tag in self._acked:
                self._acked.discard(tag)
                return True
            return False

    def acked_among(self, delivered: Container[str]) -> int:
        """How many of ``delivered`` the store acked and Celery has not settled yet."""
        with self._lock:
            return sum(1 for tag in self._acked if tag in delivered)

    def storing_among(self, delivered: Container[str]) -> list[str]:
        """The tags of ``delivered`` whose store script is running (or ran, not yet noted): the take frees
        their tokens once Redis no longer holds their unacked entries (:mod:`broker.atomic_take`)."""
        with self._lock:
            return [tag for tag in self._storing if tag in delivered]

    def __len__(self) -> int:
        return len(self._expected)


ACKS = StoreAcks()
"""This worker process's deliveries."""


def delivery_tag_of(request: Any) -> str | None:
    """The delivery tag of the message behind a Celery task request (kombu puts it in the properties)."""
    properties = getattr(request, "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    return str(tag) if tag else None


def unacked_entry_of(request: Any) -> tuple[str, str] | None:
    """Where the message behind a Celery task request is held unacked: (kombu's unacked index key, its delivery
    tag), when this worker's channel noted the delivery (not with a ``global_keyprefix``); else None."""
    tag = delivery_tag_of(request)
    keys = ACKS.keys_for(tag) if tag else None
    return (keys[1], tag) if keys and tag else None


class StoreAckingQoS(CancelReadingQoS):
    """The worker's QoS: notes each delivery for the store script, and skips Redis on an ack it already did."""

    acks = ACKS

    def append(self, message: Any, delivery_tag: Any) -> None:
        super().append(message, delivery_tag)
        if not getattr(self.channel, "global_keyprefix", ""):  # the script names the keys itself
            self.acks.expect(str(delivery_tag), str(self.unacked_key), str(self.unacked_index_key))

    def _held(self) -> int:
        """Deliveries that still hold one of the worker's tokens: kombu's count less those whose result the
        store script already wrote (and acked), which Celery settles a moment later on the task's thread."""
        return len(self._delivered) - len(self._dirty) - self.acks.acked_among(self._delivered)

    def can_consume(self) -> bool:
        """kombu's prefetch check, counting a request's token free from its result write (see :meth:`_held`):
        a burst queued right after the previous one's results is taken whole, not short of those tokens."""
        pcount = self.prefetch_count
        return not pcount or self._held() < pcount

    def can_consume_max_estimate(self) -> int | None:
        """How many more messages may be taken now (None: no prefetch limit), as :meth:`can_consume` counts."""
        pcount = self.prefetch_count
        return max(pcount - self._held(), 0) if pcount else None

    def ack(self, delivery_tag: Any) -> None:
        if self.acks.settle(str(delivery_tag)):
            virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # in-memory bookkeeping only
            return
        super().ack(delivery_tag)  # type: ignore[no-untyped-call]
